"""AWM: loss pieces against explicit numpy / per-sample loops, the two-pass ratio, and a short run that must learn."""

import math

import numpy as np
import pytest
import torch
from conftest import run_script, scalars

from algos import awm


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _weighted_reference(mse, s, weighting, p):
    """The paper's weightings, written out for one sample (Flow-Factory spec section 5)."""
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -mse * s
    if weighting == "t2":
        return -mse * s * s
    if weighting == "huber":
        return -(math.sqrt(mse + 1e-10) - 1e-5) * s
    return -((mse + 1e-10) ** p - (1e-10) ** p) * s / p


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "huber", "ghuber"])
def test_pseudo_log_prob_matches_per_sample_formula(weighting):
    v, u = _rand(5, 2, 3, 3, seed=1), _rand(5, 2, 3, 3, seed=2)
    sigmas = torch.tensor([1.0, 0.9, 0.5, 0.25, 0.1], dtype=torch.float64)
    lp = awm.pseudo_log_prob(v, u, sigmas, weighting, power=0.3)
    lp_scalar_sigma = awm.pseudo_log_prob(v, u, 0.5, weighting, power=0.3)
    for i in range(5):
        mse = float(np.mean((v[i].numpy() - u[i].numpy()) ** 2))
        assert lp[i].item() == pytest.approx(_weighted_reference(mse, sigmas[i].item(), weighting, 0.3), rel=1e-12)
        assert lp_scalar_sigma[i].item() == pytest.approx(_weighted_reference(mse, 0.5, weighting, 0.3), rel=1e-12)
    assert lp.dtype == torch.float64


def test_pseudo_log_prob_float32_inputs_are_computed_in_float64():
    v, u = _rand(3, 4, seed=3).float(), _rand(3, 4, seed=4).float()
    lp = awm.pseudo_log_prob(v, u, 0.7, "ghuber")
    assert lp.dtype == torch.float64
    mse = ((v.double() - u.double()) ** 2).mean(1)
    torch.testing.assert_close(lp, -((mse + 1e-10) ** 0.25 - 1e-10**0.25) * 0.7 / 0.25)


def test_ghuber_and_huber_are_zero_at_zero_error_and_huber_is_ghuber_half():
    u = _rand(2, 8, seed=5)
    for w in ("huber", "ghuber"):
        assert awm.pseudo_log_prob(u.clone(), u, 0.6, w).abs().max().item() < 1e-12
    v = _rand(2, 8, seed=6)
    # huber = ghuber with p = 1/2, times p (ghuber divides by p)
    torch.testing.assert_close(awm.pseudo_log_prob(v, u, 0.6, "huber"), 0.5 * awm.pseudo_log_prob(v, u, 0.6, "ghuber", 0.5))


def test_pseudo_log_prob_gradient_matches_analytic():
    """d lp / d v for ghuber: -sigma mse^(p-1) * 2 (v - u) / n (chain rule through mse = mean (v - u)^2)."""
    v, u = _rand(3, 2, 4, seed=7).requires_grad_(True), _rand(3, 2, 4, seed=8)
    s, p = 0.8, 0.25
    awm.pseudo_log_prob(v, u, s, "ghuber", p).sum().backward()
    e = (v - u).detach()
    mse = e.pow(2).flatten(1).mean(1)
    expected = -s * (mse + 1e-10).pow(p - 1).view(-1, 1, 1) * 2 * e / e[0].numel()
    torch.testing.assert_close(v.grad, expected)


def test_unknown_weighting_is_a_user_error():
    with pytest.raises(Exception, match="unknown weighting"):
        awm.pseudo_log_prob(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, "elbo")


def test_scale_advantages_clips_then_rescales():
    a = awm.scale_advantages(torch.tensor([-9.0, -5.0, -1.0, 0.0, 2.5, 7.0]), 5.0, 1.0)
    assert a.tolist() == pytest.approx([-1.0, -1.0, -0.2, 0.0, 0.5, 1.0])
    assert awm.scale_advantages(torch.tensor([3.0]), 1.0, 2.0).tolist() == [2.0]


def test_ppo_loss_matches_loop_and_gradient_respects_clip():
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0, -2.0, -0.5], dtype=torch.float64)
    delta = torch.tensor([0.3, -0.3, 0.3, -0.3, 0.01, -0.01], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    lp = (old + delta).requires_grad_(True)
    eps_lo, eps_hi = 0.2, 0.1
    loss, ratio, approx_kl, clipfrac = awm.ppo_loss(lp, old, adv, eps_lo, eps_hi)
    ref, ref_grad, clipped = 0.0, [], 0
    for i in range(6):
        r = math.exp(delta[i].item())
        a = adv[i].item()
        unclipped, clip_r = -a * r, min(max(r, 1 - eps_lo), 1 + eps_hi)
        ref += max(unclipped, -a * clip_r) / 6
        clipped += not (1 - eps_lo <= r <= 1 + eps_hi)
        # the gradient flows only when the unclipped branch is the max (or the clip is inactive)
        ref_grad.append(-a * r / 6 if unclipped >= -a * clip_r else 0.0)
    assert loss.item() == pytest.approx(ref)
    assert clipfrac.item() == pytest.approx(clipped / 6)
    assert approx_kl.item() == pytest.approx(0.5 * np.mean(delta.numpy() ** 2))
    torch.testing.assert_close(ratio, torch.exp(delta))
    loss.backward()
    assert lp.grad.tolist() == pytest.approx(ref_grad)
    # samples 0 (A > 0, r > 1 + eps) and 3 (A < 0, r < 1 - eps) are clipped and get no gradient; 1 and 2 still do
    assert lp.grad[0].item() == 0 and lp.grad[3].item() == 0 and lp.grad[1].item() != 0 and lp.grad[2].item() != 0


def test_on_policy_gradient_is_advantage_weighted_flow_matching():
    """With old = current (ratio 1), grad of the PPO loss == grad of mean_i A_i sigma l_i: AWM's weighted FM loss."""
    v, u = _rand(4, 3, 5, seed=9).requires_grad_(True), _rand(4, 3, 5, seed=10)
    adv = torch.tensor([1.0, -0.5, 0.25, 0.0], dtype=torch.float64)
    s = 0.6
    lp = awm.pseudo_log_prob(v, u, s, "t")
    loss, ratio, _, _ = awm.ppo_loss(lp, lp.detach(), adv, 1e-4, 1e-4)
    assert torch.all(ratio == 1)
    (g,) = torch.autograd.grad(loss, v)
    v2 = v.detach().clone().requires_grad_(True)
    mse = torch.stack([((v2[i] - u[i]) ** 2).mean() for i in range(4)])
    (g_ref,) = torch.autograd.grad((adv * mse * s).mean(), v2)
    torch.testing.assert_close(g, g_ref)


def test_velocity_kl_and_ema():
    v, w = _rand(3, 2, 2, seed=11), _rand(3, 2, 2, seed=12)
    expected = [np.mean((v[i].numpy() - w[i].numpy()) ** 2) for i in range(3)]
    assert awm.velocity_kl(v, w).tolist() == pytest.approx(expected)
    assert awm.get_decay(0, 0.0, 0, 0.001, 0.3) == 0.0
    assert awm.get_decay(100, 0.0, 0, 0.001, 0.3) == pytest.approx(0.1)
    assert awm.get_decay(10_000, 0.0, 0, 0.001, 0.3) == 0.3
    p = [torch.tensor([1.0, 2.0])]
    for d, expected in ((0.0, [1.0, 2.0]), (1.0, [0.0, 0.0]), (0.25, [0.75, 1.5])):
        e = [torch.zeros(2)]
        awm.update_ema(e, p, d)
        assert e[0].tolist() == pytest.approx(expected)


def _run(tmp_path, flags):
    run_script(["algos/awm.py", "--output-dir", tmp_path / "runs", *flags.split()])
    (run_dir,) = (tmp_path / "runs").iterdir()
    return scalars(run_dir)


@pytest.mark.slow
def test_old_log_probs_are_precomputed_under_the_sampling_policy(tmp_path):
    """Two-pass: one optimizer step per epoch gives ratio == 1 exactly; with two, the second step's micro-batches see
    the moved policy against the precomputed old log-likelihoods, so ratio != 1 and a tiny clip range bites."""
    (tmp_path / "test.txt").write_text("a red circle\n")
    tiny = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --num-train-timesteps 2 --num-epochs 1"
    tiny += f" --eval-every 1 --test-prompts {tmp_path / 'test.txt'} --learning-rate 1e-2"
    one = _run(tmp_path / "one", f"{tiny} --grad-steps-per-epoch 1 --clip-low 1e-6 --clip-high 1e-6")
    assert one["charts/ratio_mean"] == [1.0] and one["losses/approx_kl"] == [0.0] and one["losses/clipfrac"] == [0.0]
    two = _run(tmp_path / "two", f"{tiny} --grad-steps-per-epoch 2 --clip-low 1e-6 --clip-high 1e-6")
    assert two["losses/approx_kl"][0] > 0 and 0.2 < two["losses/clipfrac"][0] <= 0.5


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["jpeg_compressibility", "jpeg_incompressibility"])
def test_awm_learns_in_both_directions(reward, tmp_path):
    """Opposite rewards from the same start: each must rise on its own prompts well beyond eval noise (a flipped loss
    sign makes both fall). Deterministic on CPU given the seed."""
    (tmp_path / "p.txt").write_text("a red circle\na blue square\n")
    (tmp_path / "eval.txt").write_text("a red circle\na blue square\n" * 2)  # x 2 repeats = 8 eval images, fixed noise
    flags = f"--reward {reward} --train-prompts {tmp_path / 'p.txt'} --test-prompts {tmp_path / 'eval.txt'} --num-prompts 2"
    flags += " --group-size 8 --micro-batch 8 --num-steps 6 --num-epochs 8 --eval-every 4 --num-train-timesteps 4"
    flags += " --kl-beta 0.01"  # the default when the margins below were measured
    scalars = _run(tmp_path, flags)
    before, after = scalars[f"eval/{reward}"][0], scalars[f"eval/{reward}"][-1]
    margin = {"jpeg_compressibility": 0.08, "jpeg_incompressibility": 0.25}[reward]  # seeds 1-3 gave +0.15..0.17, +0.45..0.72
    assert after - before > margin, scalars[f"eval/{reward}"]
