"""Flow-GRPO: PPO loss and Gaussian KL against independent computations, and a deterministic learning check."""

import numpy as np
import pytest
import torch
from conftest import run_in_process, run_script, scalars

import common
from algos import grpo, grpo_variants


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


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["jpeg_compressibility", "jpeg_incompressibility"])
def test_grpo_learns_both_directions(reward, tmp_path):
    """Deterministic: 12 epochs on two prompts raise the held-out reward in either direction of the JPEG task."""
    (tmp_path / "p.txt").write_text("a red circle\na blue square and a yellow triangle\n")
    flags = (
        f"--reward {reward} --train-prompts {tmp_path / 'p.txt'} --test-prompts {tmp_path / 'p.txt'} --num-prompts 2 "
        "--group-size 8 --micro-batch 8 --num-steps 6 --num-epochs 12 --eval-every 6 --grad-steps-per-epoch 2 "
        f"--num-sde-steps 4 --learning-rate 1.5e-3 --output-dir {tmp_path / 'runs'}"
    )
    run_script(["algos/grpo.py", *flags.split()])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (tmp_path / "runs").iterdir()
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    curve = [e.value for e in acc.Scalars(f"eval/{reward}")]
    assert len(curve) == 3
    assert curve[-1] - curve[0] > 0.04, curve  # fixed eval noise: a no-op update gives exactly 0


def test_official_kl_form_is_flow_grpos_formula():
    """flow_grpo: ||mu - mu_ref||^2 mean / (2 sigma_t^2), sigma_t = eta sqrt(s / (1 - s)) without sqrt(|dt|); the
    exact form divides by sigma_t^2 |dt| and so is 1/|dt| times larger."""
    g = torch.Generator().manual_seed(0)
    x, v, v_ref = (torch.randn(2, 4, 6, 6, generator=g) for _ in range(3))
    s, s_next, eta = 0.75, 0.6, 0.8
    _, _, mean, std = common.sde_step(x, v, s, s_next, "Flow-SDE", eta)
    _, _, mean_ref, _ = common.sde_step(x, v_ref, s, s_next, "Flow-SDE", eta)
    sigma_t = eta * np.sqrt(s / (1 - s))
    ref = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * sigma_t**2)
    torch.testing.assert_close(grpo.step_kl(mean, mean_ref, std, s_next - s, "official"), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        grpo.step_kl(mean, mean_ref, std, s_next - s, "exact"), ref / (s - s_next), atol=1e-6, rtol=1e-5
    )


def test_official_kl_form_under_cps_is_flow_grpos_formula():
    """flow_grpo's CPS branch (sd3_sde_with_logprob.py, sde_type "cps") returns std_dev_t = sigma_next sin(eta pi / 2),
    the step's own std, and train_sd3.py divides by 2 std_dev_t^2: no |dt| factor, so official = exact here. Computed
    in numpy from x, v, v_ref alone (x0 = x - s v, x1 = x + (1 - s) v, mu = (1 - s') x0 + sqrt(s'^2 - std^2) x1)."""
    g = torch.Generator().manual_seed(2)
    x, v, v_ref = (torch.randn(2, 4, 6, 6, generator=g, dtype=torch.float64) for _ in range(3))
    s, s_next, eta = 0.5, 0.4, 0.7
    _, _, mean, std = common.sde_step(x, v, s, s_next, "CPS", eta)
    _, _, mean_ref, _ = common.sde_step(x, v_ref, s, s_next, "CPS", eta)
    xn, vn, vrn = x.numpy(), v.numpy(), v_ref.numpy()
    std_dev_t = s_next * np.sin(eta * np.pi / 2)

    def cps_mean(vel):
        return (1 - s_next) * (xn - s * vel) + np.sqrt(s_next**2 - std_dev_t**2) * (xn + (1 - s) * vel)

    ref = ((cps_mean(vn) - cps_mean(vrn)) ** 2).mean(axis=(1, 2, 3)) / (2 * std_dev_t**2)
    ours = grpo.step_kl(mean, mean_ref, std, s_next - s, "official", "CPS")
    np.testing.assert_allclose(ours.numpy(), ref, rtol=1e-5)
    np.testing.assert_allclose(grpo.step_kl(mean, mean_ref, std, s_next - s, "exact", "CPS").numpy(), ref, rtol=1e-5)


def test_guard_log_ratio_is_noise_dot_mean_shift():
    """RatioNorm, computed independently: for x' = mu_old + std z the normalised log-ratio is mean(z (mu - mu_old)), so
    it is centred at 0 over z (the plain log-ratio is biased below 0 by ||mu - mu_old||^2 / (2 std^2))."""
    g = torch.Generator().manual_seed(1)
    x, v_old, v, z = (torch.randn(3, 4, 6, 6, generator=g) for _ in range(4))
    s, s_next, eta = 0.8, 0.65, 0.7
    x_next, old_logp, old_mean, std = common.sde_step(x, v_old, s, s_next, "Flow-SDE", eta, noise=z)
    _, logp, mean, _ = common.sde_step(x, v, s, s_next, "Flow-SDE", eta, x_next=x_next)
    ours = grpo_variants.guard_log_ratio(logp, old_logp, mean, old_mean, std)
    torch.testing.assert_close(ours, (z * (mean - old_mean)).mean(dim=(1, 2, 3)), atol=1e-5, rtol=1e-4)
    plain = logp - old_logp  # its expectation over z is -KL < 0; RatioNorm's is exactly 0 (linear in z)
    bias = ((mean - old_mean) ** 2).mean(dim=(1, 2, 3)) / (2 * std**2)
    torch.testing.assert_close(plain, ours / std - bias, atol=1e-4, rtol=1e-4)


def test_zero_adv_filter_averages_over_the_kept_samples_of_each_step():
    adv = torch.tensor([0.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, -2.0, 1.0])  # 3 optimizer steps of 4
    w = grpo.zero_adv_weights(adv, 3)
    terms = torch.arange(12.0) + 1
    per_step = (w * terms).view(3, 4).mean(1)  # what the loop computes: the step's mean of weighted terms
    expected = [np.mean([2.0, 3.0]), 0.0, np.mean([9.0, 11.0, 12.0])]  # the mean over the nonzero-advantage samples
    torch.testing.assert_close(per_step, torch.tensor(expected, dtype=torch.float32))
    assert (w[adv == 0] == 0).all()


def test_contiguous_window_is_a_random_run_inside_the_window():
    window = [0, 1, 2, 3, 4]
    gen = torch.Generator().manual_seed(0)
    draws = [grpo.sde_window_steps(window, 3, "contiguous", gen) for _ in range(200)]
    assert all(d == list(range(d[0], d[0] + 3)) for d in draws)
    assert {d[0] for d in draws} == {0, 1, 2}  # every start that keeps the run inside the window
    subset = grpo.sde_window_steps(window, 3, "subset", torch.Generator().manual_seed(0))
    assert subset == sorted(window[i] for i in torch.randperm(5, generator=torch.Generator().manual_seed(0))[:3])


@pytest.mark.slow
def test_paper_options_run_end_to_end(tmp_path, capsys):
    """GRPO-Guard + official KL + contiguous window + zero-advantage filter on CPS with the surrogate log-prob is
    refused (Guard needs Gaussian log-probs); each combination that is allowed trains one epoch."""
    (tmp_path / "p.txt").write_text("a red circle\na blue square\n")
    base = [
        "--train-prompts",
        tmp_path / "p.txt",
        "--test-prompts",
        tmp_path / "p.txt",
        *"--num-prompts 2 --group-size 4 "
        "--micro-batch 4 --num-steps 4 --num-epochs 1 --grad-steps-per-epoch 1 --eval-every 5".split(),
        "--output-dir",
        tmp_path / "runs",
    ]
    rc = run_in_process(grpo_variants, [*base, "--grpo-guard", "--log-prob-form", "mse"])
    assert rc == 2 and capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --grpo-guard")
    for script, flags in (
        (
            "grpo_variants",
            "--grpo-guard --kl-beta 0.04 --kl-form official --window-mode contiguous --num-sde-steps 2 --zero-adv-filter",
        ),
        ("grpo", "--dynamics CPS --log-prob-form mse --num-sde-steps 1 --sde-window 0 3"),
        ("grpo_variants", "--kl-mask 1e-5 --num-inner-epochs 2 --num-sde-steps 2 --win-rate-reward"),  # DPPO: the means
    ):
        out = run_script([f"algos/{script}.py", *base, *flags.split()], check=False)
        assert out.returncode == 0 and "final eval" in out.stdout, out.stderr[-2000:]


def test_sliding_window_moves_every_tau_epochs_and_rolls_back():
    """MixGRPO's progressive window, simulated independently as its official scheduler does it (a counter of
    iterations in the group; every tau of them the start moves s steps; past the last start that keeps w steps inside
    the window it rolls back to the first)."""
    window, w, tau, s = [1, 2, 3, 4, 5, 6, 7, 8], 4, 3, 2
    start, in_group, expected = 0, 0, []
    for _ in range(60):
        expected.append(window[start : start + w])
        in_group += 1
        if in_group == tau:
            in_group, start = 0, start + s
            if start + w > len(window):
                start = 0
    gen = torch.Generator().manual_seed(0)
    ours = [grpo_variants.sde_window_steps(window, w, "sliding", gen, epoch, (tau, s)) for epoch in range(60)]
    assert ours == expected
    assert {tuple(x) for x in ours} == {(1, 2, 3, 4), (3, 4, 5, 6), (5, 6, 7, 8)}
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(0).get_state())  # draws nothing: resume-exact


def test_sliding_window_rollout_is_ode_outside_the_window(random_pipeline_dir):
    """MixGRPO's mixed rollout: two different noise streams give the same trajectory up to the window (ODE before it),
    branch inside it, and carry log-probs only there (ODE after it: the deterministic steps have log-prob 0)."""
    import models

    pipe = models.load_pipeline(random_pipeline_dir, torch.device("cpu"))
    cond = common.PromptEncoder(pipe).cond(["a red circle", "a blue square"], negative=False)
    steps = grpo_variants.sde_window_steps(list(range(1, 9)), 3, "sliding", torch.Generator(), epoch=7, shift=(2, 1))
    assert steps == [4, 5, 6]
    noise = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(3))

    def rollout(seed):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(2)]
        kw = dict(
            num_steps=10, noise=noise, dynamics="Flow-SDE", eta=0.7, keep_trajectory=True, latent_shape=pipe.latent_shape
        )
        return common.sample(pipe.transformer, pipe.scheduler, cond, sde_steps=steps, generator=gens, **kw)

    a, b = rollout(10), rollout(20)
    torch.testing.assert_close(a.trajectory[:, : steps[0] + 1], b.trajectory[:, : steps[0] + 1], atol=0, rtol=0)
    assert not torch.allclose(a.trajectory[:, steps[0] + 1], b.trajectory[:, steps[0] + 1])
    outside = [i for i in range(10) if i not in steps]
    assert (a.log_probs[:, outside] == 0).all() and (a.log_probs[:, steps] != 0).all()
    assert a.sde_mask.nonzero().view(-1).tolist() == steps


def test_noise_weighted_ppo_loss_matches_numpy():
    """TempFlow-GRPO: each step's PPO terms times c s_t, s_t = eta sqrt(sigma / (1 - sigma)) sqrt(|dt|) computed here in
    numpy from the sigmas alone (Flow-SDE); the KL is not weighted. The early (noisier) step weighs more, by s / s'."""
    g = torch.Generator().manual_seed(5)
    logp = (1e-3 * torch.randn(4, generator=g, dtype=torch.float64)).requires_grad_()
    old, adv = torch.zeros(4, dtype=torch.float64), torch.tensor([1.0, -2.0, 0.5, -1.0], dtype=torch.float64)
    eta, c, x, v = 0.7, 2.25, torch.zeros(4, 2, 3, 3), torch.zeros(4, 2, 3, 3)
    losses = {}
    for s, s_next in ((0.9, 0.8), (0.3, 0.2)):
        std = common.sde_step(x, v, s, s_next, "Flow-SDE", eta)[3]
        w = grpo_variants.noise_weights(std, 4, c)
        loss = grpo.ppo_loss(logp, old, adv, 1e-3, 1e-3, w.double())[0]
        std_np = eta * np.sqrt(s / (1 - s)) * np.sqrt(s - s_next)
        ref = [
            c * std_np * max(-a * np.exp(lp), -a * min(max(np.exp(lp), 1 - 1e-3), 1 + 1e-3))
            for lp, a in zip(logp.detach().numpy(), adv.numpy())
        ]
        assert loss.item() == pytest.approx(np.mean(ref), rel=1e-5)
        losses[s] = (loss.item(), std_np)
    (early, s_early), (late, s_late) = losses[0.9], losses[0.3]
    assert s_early > s_late and early / late == pytest.approx(s_early / s_late, rel=1e-5)
    per_sample = grpo_variants.noise_weights(torch.tensor([0.1, 0.2]).view(2, 1, 1, 1), 2, 2.0)  # CPS-style per-sample stds
    torch.testing.assert_close(per_sample, torch.tensor([0.2, 0.4]))


def test_official_noise_weight_averages_one_over_sd35_trained_steps():
    """TempFlow-GRPO's official 2.25 (scripts/train_sd3_pr.py) is 1 / the mean step std s = eta sqrt(sigma / (1 - sigma))
    sqrt(|dt|) over the 9 steps it trains of SD3.5's 10-step scheduler schedule (shift 3, eta 0.7; at sigma = 1 the
    denominator's sigma is the second sigma, as its sde_step_with_logprob): s computed in numpy from diffusers' own
    sigmas; the weights c s then average 1 over those steps."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    sig = sched.sigmas.double().numpy()
    eta, cap = 0.7, sig[1]
    s_np = np.array([eta * np.sqrt(a / (1 - min(a, cap))) * np.sqrt(a - b) for a, b in zip(sig[:9], sig[1:10])])
    assert 1 / s_np.mean() == pytest.approx(2.25, abs=5e-3)
    x = torch.zeros(1, 1, 1, 1)
    stds = [
        common.sde_step(x, x, float(sig[i]), float(sig[i + 1]), "Flow-SDE", eta, sigma_cap=float(cap))[3] for i in range(9)
    ]
    np.testing.assert_allclose([float(s.reshape(-1)[0]) for s in stds], s_np, rtol=1e-5)
    weights = torch.cat([grpo_variants.noise_weights(s, 1, 2.25) for s in stds])
    assert weights.mean().item() == pytest.approx(1.0, abs=5e-3)
    assert weights[0] > 1 > weights[-1]  # the early, noisy steps weigh more


@pytest.mark.slow
def test_sliding_window_and_noise_weight_train_end_to_end(tmp_path):
    """MixGRPO's window moves in the training loop (tau = 1: one step later each epoch, rolling back), with TempFlow's
    noise weights on; the logged mean trained step is the window of each epoch."""
    (tmp_path / "p.txt").write_text("a red circle\na blue square\n")
    flags = (
        f"--train-prompts {tmp_path / 'p.txt'} --test-prompts {tmp_path / 'p.txt'} --num-prompts 2 --group-size 4 "
        "--micro-batch 4 --num-steps 5 --num-epochs 4 --grad-steps-per-epoch 1 --eval-every 5 "
        f"--window-mode sliding --window-shift 1 1 --num-sde-steps 2 --noise-weight 2.25 --output-dir {tmp_path / 'runs'}"
    )
    run_script(["algos/grpo_variants.py", *flags.split()])
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert scalars(run_dir)["charts/sde_steps_mean"] == [1.5, 2.5, 1.5, 2.5]  # window 1..3: runs [1, 2], [2, 3]


def test_kl_mask_loss_matches_an_explicit_loop_and_gradient():
    """Flow-DPPO, written out per sample in numpy: D = mean (mu - mu_old)^2 / (2 s^2) from the two Gaussian steps' means;
    dropped iff D >= tau and (r > 1, A > 0 or r < 1, A < 0); loss = mean of -A r over the kept; the gradient flows
    through every kept term, whatever its ratio (no clip), and through no dropped one."""
    g = torch.Generator().manual_seed(7)
    x, v_old, z = (torch.randn(6, 2, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    s, s_next, eta = 0.7, 0.55, 0.7
    x_next, old_logp, old_mean, std = common.sde_step(x, v_old, s, s_next, "Flow-SDE", eta, noise=z)
    # the new mean moves by alpha s z (along the rollout's own noise): log r ~ alpha - alpha^2 / 2, D ~ alpha^2 / 2
    alpha = torch.tensor([0.0, 0.5, 0.5, -0.5, -0.5, 0.01], dtype=torch.float64).view(6, 1, 1, 1)
    dmean_dv = common.sde_step(x, v_old + 1, s, s_next, "Flow-SDE", eta)[2] - old_mean  # the mean is linear in v
    v = (v_old + alpha * std * z / dmean_dv).requires_grad_()
    _, logp, mean, _ = common.sde_step(x, v, s, s_next, "Flow-SDE", eta, x_next=x_next)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -2.0], dtype=torch.float64)  # away: 1 (r > 1, A > 0), 3 (r < 1, A < 0)
    tau = 1e-3
    loss, ratio, _, maskfrac = grpo_variants.kl_mask_loss(logp, old_logp, mean, old_mean, std, adv, tau)

    mu, mu_old, sd = mean.detach().numpy(), old_mean.numpy(), float(std)
    r = np.exp((logp - old_logp).detach().numpy())
    terms, dropped = [], []
    for i in range(6):
        d = np.mean((mu[i] - mu_old[i]) ** 2) / (2 * sd**2)
        a = adv[i].item()
        drop = d >= tau and ((r[i] > 1 and a > 0) or (r[i] < 1 and a < 0))
        dropped.append(drop)
        terms.append(0.0 if drop else -a * r[i])
    assert loss.item() == pytest.approx(np.mean(terms), rel=1e-10)
    assert maskfrac.item() == pytest.approx(np.mean(dropped))
    assert dropped == [False, True, False, True, False, False]  # 2 and 4 step back towards the rollout: kept
    # a kept sample has a gradient (sample 0 too: it sits at the rollout policy), a dropped one has none
    loss.backward()
    assert [bool((v.grad[i] == 0).all()) for i in range(6)] == dropped
    # where PPO's clip (1e-3) would stop a kept sample outside [1 - eps, 1 + eps], the mask lets it through
    assert abs(r[5] - 1) > 1e-3 and np.mean((mu[5] - mu_old[5]) ** 2) / (2 * sd**2) < tau


def test_group_win_rates_match_a_pairwise_loop():
    """Pref-GRPO: win rate of image i = (wins + ties / 2) / (K - 1) over the other images of its group, a plain loop."""
    rewards = torch.tensor([0.3, 0.9, 0.3, 0.1, 5.0, -1.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    k = 4
    ref = []
    for g in range(3):
        group = rewards[g * k : (g + 1) * k].tolist()
        for i, ri in enumerate(group):
            score = sum(1.0 if ri > rj else 0.5 if ri == rj else 0.0 for j, rj in enumerate(group) if j != i)
            ref.append(score / (k - 1))
    ours = grpo_variants.group_win_rates(rewards, k)
    np.testing.assert_allclose(ours.numpy(), ref, rtol=1e-7)
    assert ref[:4] == [0.5, 1.0, 0.5, 0.0] and ref[8:] == [0.5] * 4
    # only the order counts: a group with an outlier gets the advantages of any group ordered like it, and a flat group
    # (all ties) gets advantage 0
    same_order = torch.tensor([0.3, 0.31, 0.3, 0.29, 5.0, -1.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    adv = grpo.group_advantages(grpo_variants.group_win_rates(rewards, k), k)
    torch.testing.assert_close(adv, grpo.group_advantages(grpo_variants.group_win_rates(same_order, k), k))
    assert not torch.allclose(grpo.group_advantages(rewards, k), grpo.group_advantages(same_order, k))
    assert (adv[8:] == 0).all()


@pytest.mark.slow
def test_the_variants_file_without_a_switch_is_plain_flow_grpo(tmp_path):
    """algos/grpo_variants.py with none of its papers' switches trains what algos/grpo.py trains, weight for weight
    (the variants are changes to Flow-GRPO, not another Flow-GRPO), on a run with the KL, the zero-advantage filter and
    two inner epochs on."""
    from safetensors.torch import load_file

    (tmp_path / "p.txt").write_text("a red circle\na blue square\n")
    flags = (
        f"--train-prompts {tmp_path / 'p.txt'} --test-prompts {tmp_path / 'p.txt'} --num-prompts 2 --group-size 4 "
        "--micro-batch 4 --num-steps 4 --num-epochs 2 --grad-steps-per-epoch 1 --eval-every 5 --num-sde-steps 2 "
        "--kl-beta 0.04 --zero-adv-filter --num-inner-epochs 2 --window-mode contiguous"
    ).split()
    weights = []
    for script in ("grpo", "grpo_variants"):
        run_script([f"algos/{script}.py", *flags, "--output-dir", tmp_path / script])
        (run_dir,) = (tmp_path / script).iterdir()
        weights.append(load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


@pytest.mark.parametrize(
    "flag, value, refused",
    [("grpo_guard", False, False), ("grpo_guard", True, True), ("window_mode", "sliding", True), ("kl_mask", 1e-5, True)],
)
def test_a_checkpoint_from_before_the_variants_moved_resumes_only_if_it_used_none(tmp_path, capsys, flag, value, refused):
    """A grpo.py checkpoint made when the variants' flags were grpo.py's: resumed where they did nothing (they are
    dropped), refused by name where the run used one (it is not plain Flow-GRPO), nothing written."""
    (tmp_path / "p.txt").write_text("a red circle\na blue square\n")
    base = (
        f"--train-prompts {tmp_path / 'p.txt'} --test-prompts {tmp_path / 'p.txt'} --num-prompts 2 --group-size 4 "
        f"--micro-batch 4 --num-steps 4 --grad-steps-per-epoch 1 --eval-every 5 --num-sde-steps 1 --output-dir {tmp_path}"
    ).split()
    assert run_in_process(grpo, [*base, "--num-epochs", "1"]) == 0
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    path = (run_dir / "checkpoints" / "last" / "state.pt").resolve()
    state = torch.load(path, weights_only=True)
    old = {"window_shift": [25, 1], "grpo_guard": False, "guard_reweight": True, "noise_weight": 0.0, "kl_mask": 0.0}
    state["args"].update({**old, "win_rate_reward": False, flag: value})
    torch.save(state, path)
    capsys.readouterr()
    rc = run_in_process(grpo, ["--resume", str(run_dir), "--num-epochs", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    if refused:
        assert rc == 2 and len(err) == 1 and f"--{flag.replace('_', '-')}" in err[0] and "grpo_variants.py" in err[0]
    else:
        assert rc == 0, err
