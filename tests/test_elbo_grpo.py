"""ELBO-GRPO: the ELBO estimate and the clipped ratio surrogate against explicit numpy / per-sample loops, the shared
(t, eps) draws, the ratio of exactly 1 before the first update, and a short run that must learn."""

import math

import numpy as np
import pytest
import torch
from conftest import run_script, scalars

import common
from algos import elbo_grpo


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _elbo_reference(v, u, t, weighting):
    """One sample's ELBO estimate written out in numpy (docs/elbo_grpo.md Eq. 2-3; the Rethinking code's
    `compute_elbo`, its adaptive form computed through x0_hat = x_t - t v as there)."""
    err = v - u
    if weighting == "uniform":
        return -np.mean(err**2)
    if weighting == "t":
        return -np.mean((t * err) ** 2)
    if weighting == "exact":
        return -(1 - t) / (t + 1e-3) * np.mean(err**2)
    x0 = np.linspace(-1, 1, v.size).reshape(v.shape)  # any x0: x0_hat - x0 does not depend on it
    eps = u + x0
    xt = (1 - t) * x0 + t * eps
    x0_hat = xt - t * v
    return -np.mean((x0_hat - x0) ** 2) / max(np.mean(np.abs(x0_hat - x0)), 1e-5)


@pytest.mark.parametrize("weighting", ["adaptive", "uniform", "t", "exact"])
def test_elbo_matches_per_sample_formula(weighting):
    v, u = _rand(5, 3, 4, 4, seed=1), _rand(5, 3, 4, 4, seed=2)
    t = torch.tensor([1.0, 0.9, 0.5, 0.2, 0.05], dtype=torch.float64)
    got = elbo_grpo.elbo(v, u, t, weighting)
    expected = [_elbo_reference(v[i].numpy(), u[i].numpy(), t[i].item(), weighting) for i in range(5)]
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    # a float t is the same as a [B] tensor of it; float32 inputs are computed in float64
    same_t = elbo_grpo.elbo(v.float(), u.float(), 0.5, weighting)
    assert same_t.dtype == torch.float64
    np.testing.assert_allclose(same_t[2].item(), expected[2], rtol=1e-6)
    # the ELBO is highest (0) when v predicts the target exactly
    assert elbo_grpo.elbo(u, u, t, weighting).abs().max().item() < 1e-12


def test_adaptive_weight_is_held_constant_in_the_gradient():
    """ "adaptive" divides by the mean |x0 error| without differentiating through it (`with torch.no_grad()` in the
    Rethinking code): d/dv of -mean((t e)^2) / c is -2 t^2 e / (n c), c the detached scale."""
    v, u = _rand(2, 6, seed=3).requires_grad_(True), _rand(2, 6, seed=4)
    t = torch.tensor([0.8, 0.3], dtype=torch.float64)
    elbo_grpo.elbo(v, u, t, "adaptive").sum().backward()
    err = (v - u).detach()
    c = (t[:, None] * err).abs().mean(1, keepdim=True)
    torch.testing.assert_close(v.grad, -2 * t[:, None] ** 2 * err / (6 * c))


def test_unknown_weighting_is_a_user_error():
    with pytest.raises(common.UserError, match="unknown ELBO weighting"):
        elbo_grpo.elbo(_rand(1, 2), _rand(1, 2), 0.5, "sigma")


def test_clipped_surrogate_on_elbo_ratios_matches_a_loop():
    """The loss of one draw: ratio exp(ELBO_theta - ELBO_old) of two velocity fields at the same (t, eps), clipped as
    PPO (Eq. 4-5), against a per-sample loop over numpy values, value and gradient."""
    u = _rand(6, 8, seed=5)
    v_old = u + 0.3 * _rand(6, 8, seed=6)
    v = v_old + torch.tensor([0.5, -0.5, 0.5, -0.5, 0.01, -0.01], dtype=torch.float64)[:, None] * _rand(6, 8, seed=7)
    v = v.requires_grad_(True)
    t = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.6, 0.4], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    eps_lo, eps_hi = 0.02, 0.01
    new, old = elbo_grpo.elbo(v, u, t, "uniform"), elbo_grpo.elbo(v_old, u, t, "uniform")
    loss, ratio, approx_kl, clipfrac = elbo_grpo.ppo_loss(new, old, adv, eps_lo, eps_hi)
    ref, clipped, ref_grad = 0.0, 0, []
    for i in range(6):
        e_new = -np.mean((v[i].detach().numpy() - u[i].numpy()) ** 2)
        e_old = -np.mean((v_old[i].numpy() - u[i].numpy()) ** 2)
        r, a = math.exp(e_new - e_old), adv[i].item()
        clip_r = min(max(r, 1 - eps_lo), 1 + eps_hi)
        ref += max(-a * r, -a * clip_r) / 6
        clipped += not (1 - eps_lo <= r <= 1 + eps_hi)
        # d loss / d v_i = -A r d ELBO / d v_i / 6 where the unclipped branch is active, else 0
        active = -a * r >= -a * clip_r
        d_elbo = -2 * (v[i].detach().numpy() - u[i].numpy()) / 8
        ref_grad.append(-a * r * d_elbo / 6 if active else np.zeros(8))
    assert loss.item() == pytest.approx(ref, rel=1e-12)
    assert 0 < clipped < 6 and clipfrac.item() == pytest.approx(clipped / 6)
    assert approx_kl.item() == pytest.approx(0.5 * np.mean((new - old).detach().numpy() ** 2))
    loss.backward()
    np.testing.assert_allclose(v.grad.numpy(), np.stack(ref_grad), rtol=1e-10, atol=1e-15)


def test_ratio_is_exactly_one_when_new_equals_old_and_the_gradient_is_advantage_weighted_elbo():
    v, u = _rand(4, 3, 5, seed=9).requires_grad_(True), _rand(4, 3, 5, seed=10)
    t = torch.tensor([0.9, 0.5, 0.5, 0.2], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.25, 0.0], dtype=torch.float64)
    new = elbo_grpo.elbo(v, u, t, "adaptive")
    loss, ratio, approx_kl, clipfrac = elbo_grpo.ppo_loss(new, new.detach(), adv, 1e-3, 1e-3)
    assert torch.all(ratio == 1) and approx_kl.item() == 0 and clipfrac.item() == 0
    (g,) = torch.autograd.grad(loss, v)
    v2 = v.detach().clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(-(adv * elbo_grpo.elbo(v2, u, t, "adaptive")).mean(), v2)
    torch.testing.assert_close(g, g_ref)


def test_velocity_kl():
    v, w = _rand(3, 2, 2, seed=11), _rand(3, 2, 2, seed=12)
    expected = [np.mean((v[i].numpy() - w[i].numpy()) ** 2) for i in range(3)]
    assert elbo_grpo.velocity_kl(v, w).tolist() == pytest.approx(expected)


def test_timestep_draws_are_stratified_and_shared_by_a_key():
    keys = torch.tensor([0, 0, 0, 1, 1, 1])  # two groups of three images
    idx = elbo_grpo.timestep_indices(10, 4, keys, seed=1, epoch=3)
    assert idx.shape == (6, 4)
    assert torch.equal(idx[0], idx[1]) and torch.equal(idx[0], idx[2]) and torch.equal(idx[3], idx[5])
    for row in idx.tolist():  # one index per stratum [0, 2.5), [2.5, 5), [5, 7.5), [7.5, 10), floored
        assert all(lo <= i < hi for i, lo, hi in zip(row, (0, 2, 5, 7), (3, 5, 8, 10)))
    # the same key draws the same wherever it sits; another epoch draws anew
    assert torch.equal(elbo_grpo.timestep_indices(10, 4, torch.tensor([1]), 1, 3)[0], idx[3])
    draws = {tuple(elbo_grpo.timestep_indices(10, 4, torch.tensor([k]), 1, e)[0].tolist()) for k in range(4) for e in range(4)}
    assert len(draws) > 8


def _run(tmp_path, flags):
    run_script(["algos/elbo_grpo.py", "--output-dir", tmp_path / "runs", *flags.split()])
    (run_dir,) = (tmp_path / "runs").iterdir()
    return scalars(run_dir)


@pytest.mark.slow
def test_old_elbos_come_from_the_rollout_weights_at_the_same_draws(tmp_path):
    """One optimizer step per epoch: the new ELBO is computed at the very (t, eps) of the old one with the same weights,
    so the ratio is exactly 1 (nothing clipped). With two, the second step's draws see the moved policy against the
    precomputed old ELBOs: ratio != 1 and a tiny clip range bites."""
    (tmp_path / "test.txt").write_text("a red circle\n")
    tiny = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --num-train-timesteps 2 --num-epochs 1"
    tiny += f" --eval-every 1 --test-prompts {tmp_path / 'test.txt'} --learning-rate 1e-2 --kl-beta 0.01"
    one = _run(tmp_path / "one", f"{tiny} --grad-steps-per-epoch 1 --clip-low 1e-9 --clip-high 1e-9")
    assert one["charts/ratio_mean"] == [1.0] and one["losses/approx_kl"] == [0.0] and one["losses/clipfrac"] == [0.0]
    assert one["losses/kl_ref"][0] == 0.0  # the policy starts at the base
    two = _run(tmp_path / "two", f"{tiny} --grad-steps-per-epoch 2 --clip-low 1e-9 --clip-high 1e-9")
    assert two["losses/approx_kl"][0] > 0 and 0.25 <= two["losses/clipfrac"][0] <= 0.5
    for name in ("policy_loss", "kl_ref", "grad_norm", "approx_kl", "clipfrac"):
        assert f"losses/{name}" in two
    assert {"charts/reward_mean", "charts/reward_std", "eval/shapes_clean"} <= set(two)


# seed 1 gave +0.17 and +0.63 at lr 1e-4 (AWM's margins). The test pins 1e-4: it checks the loss's direction in 8
# epochs, and the every-weight default of 3e-5 (chosen on the testbeds' longer runs) gains only +0.14 on
# incompressibility in that budget, too near eval noise to tell a sign
MARGINS = {"jpeg_compressibility": 0.08, "jpeg_incompressibility": 0.25}


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["jpeg_compressibility", "jpeg_incompressibility"])
def test_elbo_grpo_learns_in_both_directions(reward, tmp_path):
    """Opposite rewards from the same start: each must rise on its own prompts well beyond eval noise (a flipped loss
    sign makes both fall). Deterministic on CPU given the seed."""
    (tmp_path / "p.txt").write_text("a red circle\na blue square\n")
    (tmp_path / "eval.txt").write_text("a red circle\na blue square\n" * 2)  # x 2 repeats = 8 eval images, fixed noise
    flags = f"--reward {reward} --train-prompts {tmp_path / 'p.txt'} --test-prompts {tmp_path / 'eval.txt'} --num-prompts 2"
    flags += " --group-size 8 --micro-batch 8 --num-steps 6 --num-epochs 8 --eval-every 4 --num-train-timesteps 4"
    flags += " --learning-rate 1e-4"
    scalars = _run(tmp_path, flags)
    before, after = scalars[f"eval/{reward}"][0], scalars[f"eval/{reward}"][-1]
    assert after - before > MARGINS[reward], scalars[f"eval/{reward}"]
    train = scalars["charts/reward_mean"]
    assert np.mean(train[-2:]) > np.mean(train[:2]), train
