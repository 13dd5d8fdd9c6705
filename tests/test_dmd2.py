"""DMD2: the x0 prediction and re-noising against their definitions, the distribution-matching gradient against a numpy
formula and against a Gaussian world whose scores are known in closed form (a generator following it reaches the real
distribution), the stop-gradient loss handing autograd exactly that gradient, the fake score's loss, and a 2-step
generator learning on the tiny model."""

import numpy as np
import pytest
import torch
from conftest import run_script, scalars

from algos import dmd2


def test_predicted_x0_inverts_the_forward_process():
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    sigma = torch.tensor([0.1, 0.5, 0.9])
    xt = dmd2.renoise(x0, eps, sigma)
    torch.testing.assert_close(xt[1], 0.5 * x0[1] + 0.5 * eps[1])
    torch.testing.assert_close(dmd2.predicted_x0(xt, sigma.view(-1, 1, 1, 1), eps - x0), x0)  # the true velocity


def test_dmd_gradient_matches_numpy_and_vanishes_when_the_scores_agree():
    rng = np.random.default_rng(0)
    x0, real, fake = (rng.normal(size=(2, 3, 4)) for _ in range(3))
    out = dmd2.dmd_gradient(*(torch.tensor(a) for a in (x0, real, fake))).numpy()
    for i in range(2):
        np.testing.assert_allclose(out[i], (fake[i] - real[i]) / np.abs(x0[i] - real[i]).mean(), rtol=1e-12)
    assert dmd2.dmd_gradient(torch.tensor(x0), torch.tensor(real), torch.tensor(real)).abs().max() == 0


def test_dmd_loss_hands_autograd_the_gradient():
    x0 = torch.randn(2, 3, 4, requires_grad=True)
    grad = torch.randn(2, 3, 4)
    dmd2.dmd_loss(x0, grad).backward()
    torch.testing.assert_close(x0.grad, grad / x0.numel())


def test_fake_score_loss_is_the_flow_matching_loss():
    rng = np.random.default_rng(1)
    v, x0, eps = (rng.normal(size=(2, 5)) for _ in range(3))
    out = dmd2.fake_score_loss(*(torch.tensor(a) for a in (v, x0, eps)))
    assert out.item() == pytest.approx(np.mean((v - (eps - x0)) ** 2), rel=1e-12)


def test_following_the_gradient_moves_the_generator_onto_the_real_distribution():
    """A Gaussian world: real data N(m_real, I), generator samples m + z. Under x_t = (1 - s) x0 + s eps the posterior
    mean of x0 is known in closed form for either distribution, standing in for the real and the (perfectly fitted)
    fake score; SGD on m along `dmd_loss` of `dmd_gradient` must carry m to m_real from either side."""

    def posterior_mean(xt, s, mean):  # E[x0 | x_t] for x0 ~ N(mean, 1)
        a = 1 - s
        return mean + a / (a**2 + s**2) * (xt - a * mean)

    g = torch.Generator().manual_seed(0)
    for start, m_real in ((3.0, 0.5), (-2.0, 1.0)):
        m = torch.tensor(start, requires_grad=True)
        opt = torch.optim.SGD([m], lr=0.5)
        for _ in range(300):
            x0 = m + torch.randn(64, 32, generator=g)  # 64 samples of 32 elements (the weight is a mean over them)
            s = 0.02 + 0.96 * torch.rand(64, 1, generator=g)
            xt = (1 - s) * x0.detach() + s * torch.randn(64, 32, generator=g)
            grad = dmd2.dmd_gradient(x0.detach(), posterior_mean(xt, s, m_real), posterior_mean(xt, s, m.detach()))
            opt.zero_grad()
            dmd2.dmd_loss(x0, grad).backward()  # d/dm = the mean gradient over the samples
            opt.step()
        assert abs(m.item() - m_real) < 0.1, (start, m_real, m.item())


@pytest.mark.slow
def test_a_two_step_generator_learns_on_the_tiny_model(tmp_path):
    """DMD2 on tiny-shapes at 2 steps, towards the base at CFG 4.5, 256 images: the held-out shapes score of the 2-step
    samples (30 prompts x 8 fixed noises) rises over the base's at 2 steps, and the fake score fits (its loss falls)."""
    out = tmp_path / "runs"
    flags = "--num-prompts 4 --group-size 4 --micro-batch 8 --grad-steps-per-epoch 2 --num-epochs 16 --eval-every 16"
    run_script(["algos/dmd2.py", *flags.split(), "--eval-noises", "8", "--output-dir", out])  # 2 steps: cheap to eval
    (run_dir,) = out.iterdir()
    s = scalars(run_dir)
    first, last = s["eval/shapes"][0], s["eval/shapes"][-1]
    assert last > first + 0.04, s["eval/shapes"]  # measured +0.061 (0.377 -> 0.438)
    fake = s["losses/fake_loss"]
    assert np.mean(fake[-3:]) < np.mean(fake[:3]), fake
