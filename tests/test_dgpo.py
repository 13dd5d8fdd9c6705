"""DGPO: loss pieces against explicit per-group loops and autograd of the paper's loss, and the script learning."""

import glob
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_script

import common
from algos import dgpo

# measured (6 epochs, CFG 1): compressibility -0.739 -> -0.523 (+0.22), incompressibility 0.739 -> 0.785 (+0.05); with
# fixed eval noise a no-op update gives exactly 0 and a wrong sign a loss in one of the two directions
MIN_GAIN = {"jpeg_compressibility": 0.1, "jpeg_incompressibility": 0.02}


def test_dsm_error_matches_numpy():
    g = torch.Generator().manual_seed(0)
    v, u = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    out = dgpo.dsm_error(v, u)
    for i in range(3):
        assert out[i].item() == pytest.approx(np.mean((v[i].numpy() - u[i].numpy()) ** 2), rel=1e-6)


def test_clip_dsm_ratio_masks_by_advantage_sign_and_stops_gradient():
    dsm = torch.tensor([1.00, 1.00, 1.00, 1.00, 1.00, 1.00], dtype=torch.float64, requires_grad=True)
    dsm_old = torch.tensor([1.05, 0.95, 1.05, 0.95, 1.005, 0.995], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    out, ratio, clipped = dgpo.clip_dsm_ratio(dsm, dsm_old, adv, 0.01)
    expected_mask = []
    for i in range(6):
        r = np.exp(dsm_old[i].item() - dsm[i].item())
        assert ratio[i].item() == pytest.approx(r)
        # A > 0 pushes dsm down, i.e. the ratio up: clip above 1 + eps; A <= 0 the reverse
        expected_mask.append(r > 1.01 if adv[i] > 0 else r < 0.99)
    assert clipped.tolist() == expected_mask == [True, False, False, True, False, False]
    torch.testing.assert_close(out, dsm.detach())  # values unchanged
    out.sum().backward()
    assert dsm.grad.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # clipped samples get no gradient


def _paper_loss(dsm, dsm_ref, adv, k, beta):
    """Eq. (17) with w = |A|, written out: per group, -log sigmoid(-beta/K (sum_{G+} |A| d - sum_{G-} |A| d)),
    d = dsm - dsm_ref, averaged over groups. Explicit loop, the positive/negative split done by hand."""
    losses = []
    for g in range(len(dsm) // k):
        pos, neg = 0.0, 0.0
        for i in range(g * k, (g + 1) * k):
            d = dsm[i] - dsm_ref[i]
            if adv[i] > 0:
                pos = pos + adv[i].abs() * d
            else:
                neg = neg + adv[i].abs() * d
        losses.append(-torch.log(torch.sigmoid(-beta / k * (pos - neg))))
    return torch.stack(losses).mean()


def _batch(seed=0, groups=3, k=4):
    g = torch.Generator().manual_seed(seed)
    dsm = (0.5 + 0.1 * torch.rand(groups * k, generator=g, dtype=torch.float64)).requires_grad_(True)
    dsm_ref = 0.5 + 0.1 * torch.rand(groups * k, generator=g, dtype=torch.float64)
    r = torch.rand(groups, k, generator=g, dtype=torch.float64)
    adv = ((r - r.mean(1, keepdim=True)) / r.std(1, unbiased=False, keepdim=True)).view(-1)  # sum_i A_i = 0 per group
    return dsm, dsm_ref, adv


def test_group_logits_match_explicit_loop():
    dsm, dsm_ref, adv = _batch()
    z = dgpo.group_logits(dsm, dsm_ref, adv, 4, 10.0)
    for g in range(3):
        expected = sum(10.0 / 4 * adv[i].item() * (dsm[i].item() - dsm_ref[i].item()) for i in range(4 * g, 4 * g + 4))
        assert z[g].item() == pytest.approx(expected)
    assert not z.requires_grad


def test_dgpo_loss_has_the_gradient_of_the_paper_loss():
    """The surrogate mean_i sigmoid(z_g) A_i dsm_i (weight detached) has gradient (1/beta) d/d dsm of the mean over
    groups of -log sigmoid(-z_g), the loss of Eq. (17), at any point (not only where theta = ref)."""
    beta, k = 30.0, 4
    dsm, dsm_ref, adv = _batch(seed=1)
    dsm_ref = dsm_ref + 0.1 * torch.linspace(-1, 1, 12, dtype=torch.float64)  # z far from 0: weights != 1/2
    loss, z = dgpo.dgpo_loss(dsm, dsm_ref, adv, k, beta)
    (grad,) = torch.autograd.grad(loss, dsm)
    (paper_grad,) = torch.autograd.grad(_paper_loss(dsm, dsm_ref, adv, k, beta), dsm)
    torch.testing.assert_close(grad, paper_grad / beta)
    assert (torch.sigmoid(z) - 0.5).abs().max() > 0.1
    # the weight is detached: d loss / d dsm_i = sigmoid(z_g) A_i / B exactly, no term through the weight
    torch.testing.assert_close(grad, torch.sigmoid(z).repeat_interleave(k) * adv / len(dsm))
    # sign: gradient descent lowers the error of above-average images and raises that of below-average ones
    assert torch.equal(torch.sign(grad), torch.sign(adv))


def test_group_weight_cancels_per_prompt_constants():
    """log Z(c) cancels: since sum_i A_i = 0 within a group, adding a per-group constant to every error (what a
    prompt-dependent partition function contributes) leaves the group logit unchanged."""
    dsm, dsm_ref, adv = _batch(seed=2)
    shifted = dsm.detach() + torch.tensor([0.3, -1.0, 7.0], dtype=torch.float64).repeat_interleave(4)
    torch.testing.assert_close(
        dgpo.group_logits(shifted, dsm_ref, adv, 4, 100.0), dgpo.group_logits(dsm, dsm_ref, adv, 4, 100.0)
    )


def test_group_noise_shared_within_groups_only():
    eps = dgpo.group_noise([torch.Generator().manual_seed(g) for g in range(3)], 4, (2, 5, 5))
    assert eps.shape == (12, 2, 5, 5)
    for g in range(3):
        for i in range(4 * g, 4 * g + 4):
            assert torch.equal(eps[i], eps[4 * g])
    assert not torch.equal(eps[0], eps[4]) and not torch.equal(eps[4], eps[8])
    for g in range(3):
        torch.testing.assert_close(eps[4 * g], torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(g)))


def test_ema_ref_decay_and_update():
    assert dgpo.get_decay(0, 0.0, 0, 1e-3, 0.3) == 0.0
    assert dgpo.get_decay(100, 0.0, 0, 1e-3, 0.3) == pytest.approx(0.1)
    assert dgpo.get_decay(10_000, 0.0, 0, 1e-3, 0.3) == 0.3
    for d, expected in ((0.0, [1.0, 2.0]), (1.0, [5.0, 5.0]), (0.3, [0.3 * 5 + 0.7 * 1, 0.3 * 5 + 0.7 * 2])):
        ema = [torch.tensor([5.0, 5.0])]
        dgpo.update_ema(ema, [torch.tensor([1.0, 2.0])], d)
        assert ema[0].tolist() == pytest.approx(expected)


def _eval_curve(run_dir: Path, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(glob.glob(str(run_dir / "events.out.tfevents.*"))[0], size_guidance={"scalars": 0})
    ea.Reload()
    return [e.value for e in ea.Scalars(tag)]


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["jpeg_compressibility", "jpeg_incompressibility"])
def test_dgpo_learns_both_directions(reward, tmp_path):
    """Deterministic on CPU: a few epochs of DGPO raise the held-out reward well past run-to-run noise in either
    direction of the JPEG task, so an update that does nothing or has the wrong sign fails one of the two."""
    (tmp_path / "test.txt").write_text("a red circle\ntwo blue squares\na green triangle above a yellow circle\n")
    cmd = (
        f"algos/dgpo.py --reward {reward} --num-epochs 6 --eval-every 6 --save-every 100 --guidance-scale 1 "
        f"--num-prompts 4 --group-size 8 --micro-batch 16 --grad-steps-per-epoch 2 --num-train-timesteps 2 "
        f"--kl-beta 0.02 --kl-cfg 1 "  # the paper's KL: the tiny-shapes default (0.5 to the CFG-4.5 base) anchors it harder
        f"--test-prompts {tmp_path / 'test.txt'} --output-dir {tmp_path / 'runs'}"
    )
    run_script(cmd.split())
    (run_dir,) = (tmp_path / "runs").iterdir()
    curve = _eval_curve(run_dir, f"eval/{reward}")
    assert len(curve) == 2
    assert curve[1] - curve[0] > MIN_GAIN[reward], curve


def test_training_timesteps_are_distinct_and_uniform_like_random_sample():
    """DGPO draws T distinct indices of the window (random.sample): 4 of 7 never repeats one (a stratified draw over 7
    can), and each index is drawn with probability 4/7."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(7)
    for _ in range(7000):
        idx = dgpo.draw_timesteps(7, 4, g)
        assert len(set(idx)) == 4 and all(0 <= i < 7 for i in idx)
        counts[idx] += 1
    torch.testing.assert_close(counts / 7000, torch.full((7,), 4 / 7), atol=0.03, rtol=0)
    with pytest.raises(common.UserError, match="only 3 schedule indices"):
        dgpo.draw_timesteps(3, 4, g)
