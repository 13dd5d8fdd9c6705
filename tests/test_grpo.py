"""Flow-GRPO: PPO loss and Gaussian KL against independent computations, and a deterministic learning check."""

import numpy as np
import pytest
import torch

import common
from algos import grpo
from conftest import run_script


def test_ppo_loss_matches_explicit_loop_and_gradient():
    logp = torch.tensor([0.01, -0.02, 0.0005, 0.003], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5, -1.0], dtype=torch.float64)
    lo, hi = 1e-3, 2e-3
    loss, ratio, approx_kl, clipfrac = grpo.ppo_loss(logp, old, adv, lo, hi)
    ref, clipped, grads = [], [], []
    for lp, a in zip(logp.detach().numpy(), adv.numpy()):
        r = np.exp(lp)
        unclipped, clip_term = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
        ref.append(max(unclipped, clip_term))
        clipped.append(r < 1 - lo or r > 1 + hi)
        # gradient flows only when the unclipped term is the max (the clipped one is constant in r)
        grads.append(-a * r / 4 if unclipped >= clip_term else 0.0)
    assert loss.item() == pytest.approx(np.mean(ref))
    assert clipfrac.item() == pytest.approx(np.mean(clipped))
    assert approx_kl.item() == pytest.approx(0.5 * np.mean(logp.detach().numpy() ** 2))
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), grads, atol=1e-12)


def test_gaussian_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mean, mean_ref = torch.randn(3, 4, 5, 5, generator=g), torch.randn(3, 4, 5, 5, generator=g)
    std = torch.tensor(0.3)
    ours = grpo.gaussian_kl(mean, mean_ref, std)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mean, std), torch.distributions.Normal(mean_ref, std))
    torch.testing.assert_close(ours, ref.mean(dim=(1, 2, 3)))


def test_policy_gradient_raises_log_prob_of_positive_samples():
    """One SGD step on the PPO loss moves each sample's SDE log-prob in the direction of its advantage."""
    g = torch.Generator().manual_seed(0)
    x, x_next = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    v = torch.zeros(2, 4, 8, 8, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])

    def logp(vel):
        return common.sde_step(x, vel, 0.8, 0.6, "Flow-SDE", 0.7, x_next=x_next)[1]

    old = logp(v).detach()
    loss, *_ = grpo.ppo_loss(logp(v), old, adv, 0.2, 0.2)
    loss.backward()
    with torch.no_grad():
        new = logp(v - 0.1 * v.grad)
    assert new[0] > old[0] and new[1] < old[1]


@pytest.mark.parametrize("reward", ["jpeg_compressibility", "jpeg_incompressibility"])
def test_grpo_learns_both_directions(reward, tmp_path):
    """Deterministic: 12 epochs on two prompts raise the held-out reward in either direction of the JPEG task."""
    (tmp_path / "p.txt").write_text("a red circle\na blue square and a yellow triangle\n")
    flags = (f"--reward {reward} --train-prompts {tmp_path / 'p.txt'} --test-prompts {tmp_path / 'p.txt'} --num-prompts 2 "
             "--group-size 8 --micro-batch 8 --num-steps 6 --num-epochs 12 --eval-every 6 --grad-steps-per-epoch 2 "
             f"--num-sde-steps 4 --output-dir {tmp_path / 'runs'}")  # fmt: skip
    run_script(["algos/grpo.py", *flags.split()])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (tmp_path / "runs").iterdir()
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    curve = [e.value for e in acc.Scalars(f"eval/{reward}")]
    assert len(curve) == 3
    assert curve[-1] - curve[0] > 0.04, curve  # fixed eval noise: a no-op update gives exactly 0
