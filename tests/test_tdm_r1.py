"""TDM-R1: the surrogate's group preference against a numpy loop (and DGPO's own loss), the pulls' gradients against
their definitions, a surrogate that learns to prefer a group's better samples, the generator loading, and RL on a
2-step model raising its training reward."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_script, scalars

import common
from algos import dgpo, tdm_r1

REPO = Path(__file__).resolve().parents[1]
GENERATOR = REPO / "benchmark" / "results" / "convergence" / "few_step" / "dmd2__s1"  # dmd2.py's 2-step export


def test_surrogate_loss_matches_a_numpy_loop_and_dgpo():
    rng = np.random.default_rng(0)
    err, err_ref, adv = rng.uniform(0.5, 1.5, 8), rng.uniform(0.5, 1.5, 8), rng.normal(size=8)
    beta, k = 10.0, 4
    t = [torch.tensor(a) for a in (err, err_ref, adv)]
    out = tdm_r1.surrogate_loss(*t, k, beta)[0].item()
    expected = 0.0
    for g in range(2):
        idx = range(g * k, (g + 1) * k)
        z = beta / k * sum(adv[i] * (err[i] - err_ref[i]) for i in idx)
        expected += sum(1 / (1 + math.exp(-z)) * adv[i] * err[i] for i in idx)
    assert out == pytest.approx(expected / 8, rel=1e-12)
    assert out == pytest.approx(dgpo.dgpo_loss(*t, k, beta)[0].item(), rel=1e-12)


def test_pull_moves_x0_along_delta_scaled_by_its_weight():
    x0 = torch.randn(2, 3, 4, requires_grad=True)
    delta, weight = torch.randn(2, 3, 4), torch.tensor([0.5, 2.0])
    tdm_r1.pull(x0, delta, weight).backward()
    torch.testing.assert_close(x0.grad, -delta / weight.view(-1, 1, 1) / x0.numel())
    assert tdm_r1.normaliser(torch.ones(1, 4), torch.zeros(1, 4)).item() == 1.0


def test_fm_error_and_group_advantages():
    rng = np.random.default_rng(1)
    v, x0, eps = (rng.normal(size=(2, 5)) for _ in range(3))
    out = tdm_r1.fm_error(*(torch.tensor(a) for a in (v, x0, eps)))
    np.testing.assert_allclose(out.numpy(), np.mean((v - (eps - x0)) ** 2, axis=1), rtol=1e-12)
    adv = tdm_r1.group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, "group")
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0


def test_the_surrogate_learns_to_prefer_the_better_sample():
    """One parameter per sample for its denoising error: descending the surrogate loss lowers the error of the
    positive-advantage sample and raises the negative one's relative to the reference, until the group weight
    sigmoid(z) falls (the preference is learned)."""
    err_ref = torch.tensor([1.0, 1.0])
    adv = torch.tensor([1.0, -1.0])
    err = err_ref.clone().requires_grad_(True)
    opt = torch.optim.SGD([err], lr=0.1)
    for _ in range(100):
        opt.zero_grad()
        tdm_r1.surrogate_loss(err, err_ref, adv, 2, 10.0)[0].backward()
        opt.step()
    assert err[0] < 1.0 < err[1]
    z = (adv * 10.0 * (err.detach() - err_ref) / 2).sum()
    assert torch.sigmoid(z) < 0.1


def test_a_generator_without_an_export_or_at_other_steps_is_one_error(tmp_path):
    with pytest.raises(common.UserError, match="no transformer/ export in it"):
        tdm_r1.load_generator(str(tmp_path), {}, tdm_r1.Args(full_finetune=True))
    with pytest.raises(common.UserError, match="no lora/ export in it .* pass --full-finetune"):
        tdm_r1.load_generator(str(GENERATOR), {}, tdm_r1.Args(full_finetune=False))
    with pytest.raises(common.UserError, match="samples at 2 steps; pass --num-steps 2"):
        tdm_r1.load_generator(str(GENERATOR), {}, tdm_r1.Args(full_finetune=True, num_steps=4))


@pytest.mark.slow
def test_a_lora_generator_loads_as_the_stock_pipeline_loads_it(tmp_path):
    """A LoRA few-step model (a 1-epoch dmd2.py run) loaded into the LoRA that tdm_r1.py trains gives the velocity of
    the stock pipeline with the export's `load_lora_weights`; a LoRA of another rank is one UserError."""
    import models

    out = tmp_path / "runs"
    flags = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-epochs 1 --eval-every 10 --no-full-finetune --lora-rank 4"
    run_script(["algos/dmd2.py", *flags.split(), "--output-dir", out])
    (run_dir,) = out.iterdir()
    args = tdm_r1.Args(full_finetune=False, lora_rank=4)
    pipe = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"))
    params = models.trainable_params(pipe.transformer, args)
    named = {n: p for n, p in pipe.transformer.named_parameters() if p.requires_grad}
    tdm_r1.load_generator(str(run_dir), named, args)
    stock = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"))
    stock.pipe.load_lora_weights(str(run_dir / "lora"))
    cond = common.PromptEncoder(stock).cond(["a red circle", "two squares"])
    x = torch.randn(2, *stock.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = (common.velocity(t, x, 0.6, cond) for t in (pipe.transformer, stock.transformer))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert any(p.abs().sum() > 0 for n, p in named.items() if "lora_B" in n) and len(params) == len(named)
    with pytest.raises(common.UserError, match="has --lora-rank 4: pass the same"):
        tdm_r1.load_generator(str(run_dir), named, tdm_r1.Args(full_finetune=False, lora_rank=8))


@pytest.mark.slow
def test_rl_on_the_two_step_model_trains_its_surrogate_and_raises_its_reward(tmp_path):
    """TDM-R1 from the committed 2-step DMD2 export, 16 epochs: the surrogate comes to prefer each group's better
    samples (its mean group logit z, 0 while it equals the base, turns negative), and the held-out shapes_clean of the
    2-step samples (fixed noises) rises. The rise alone does not show the reward pull at work: continuing DMD2 without
    it (--rl-weight 0) rises as much at this length (docs/tdm_r1.md); the surrogate's z does."""
    out = tmp_path / "runs"
    flags = "--num-prompts 4 --group-size 4 --micro-batch 8 --grad-steps-per-epoch 1 --num-epochs 16 --eval-every 16"
    run_script(["algos/tdm_r1.py", *flags.split(), "--eval-noises", "8", "--generator", GENERATOR, "--output-dir", out])
    (run_dir,) = out.iterdir()
    s = scalars(run_dir)
    z = s["losses/surrogate_z"]
    assert abs(z[0]) < 0.05 and np.mean(z[-4:]) < -0.1, z
    assert s["eval/shapes_clean"][-1] > s["eval/shapes_clean"][0] + 0.02, s["eval/shapes_clean"]
