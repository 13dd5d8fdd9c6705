"""common.py against independent computations: the diffusers pipeline, torch.distributions, numpy."""

import copy
import json
import math
import os

import numpy as np
import pytest
import torch
from conftest import kernel_environ, ode_sample, run_script

import common
import models
from harness import checkpoints, distributed, evaluation, logs, prompt_files, run


@pytest.fixture(scope="module")
def pipe(random_pipeline_dir):
    return models.load_pipeline(random_pipeline_dir, torch.device("cpu"))


PROMPTS = ["a red circle", "a blue square and a red circle", "a square"]


@pytest.mark.parametrize("guidance_scale", [1.0, 4.5])
def test_ode_sampler_matches_diffusers_pipeline(pipe, guidance_scale):
    steps = 6
    noise = torch.randn(len(PROMPTS), 4, 16, 16, generator=torch.Generator().manual_seed(0))
    out, _ = ode_sample(pipe, PROMPTS, noise, steps, guidance_scale)
    ours = common.decode(pipe, out.latents)
    ref = pipe(
        prompt=PROMPTS,
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        height=64,
        width=64,
        sigmas=np.linspace(1.0, 1.0 / steps, steps).tolist(),
        max_sequence_length=1,
        output_type="pt",
    ).images
    assert ours.shape == ref.shape == (3, 3, 64, 64)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def stock_images(pipeline, noise, steps: int):
    """The stock pipeline's `__call__` on the tiny model (CFG 1, 64 px, no T5) from the given initial noise."""
    return pipeline(
        prompt=PROMPTS,
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=1.0,
        height=64,
        width=64,
        max_sequence_length=1,
        output_type="pt",
    ).images


def test_scheduler_schedule_is_the_stock_sd3_pipelines(pipe):
    """`schedule="scheduler"` samples what StableDiffusion3Pipeline does when given no sigmas (flow_grpo & co)."""
    steps = 6
    noise = torch.randn(len(PROMPTS), 4, 16, 16, generator=torch.Generator().manual_seed(0))
    enc = common.PromptEncoder(pipe)
    out = common.sample(
        pipe.transformer, pipe.scheduler, enc.cond(PROMPTS), num_steps=steps, noise=noise, schedule="scheduler"
    )
    ref = stock_images(pipe, noise, steps)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas.float(), atol=1e-6, rtol=0)  # the schedule it set
    assert out.sigmas[-2] < 0.01  # ends near the data, unlike the shifted linspace's 1/N
    torch.testing.assert_close(common.decode(pipe, out.latents), ref, atol=1e-5, rtol=1e-5)


def test_sigma_schedules_match_diffusers_and_flow_grpos_numbers():
    """ "scheduler" = diffusers' own `set_timesteps(N)` (what flow_grpo, DiffusionNFT and AWM sample with), also written
    out in numpy: t from 1 to the shifted 1/1000, shifted again; "pipeline" = the shifted linspace(1, 1/N). SD3.5's shift
    3 at 10 steps: the last steps are 0.278 -> 0.009 (scheduler) and 0.429 -> 0.25 (pipeline); 40 steps end at 0.009."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    def shift(s):
        return 3 * s / (1 + 2 * s)

    for steps in (10, 14, 40):
        ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
        ours = common.sigma_schedule(ref, steps, schedule="scheduler")
        ref.set_timesteps(steps)
        torch.testing.assert_close(ours, ref.sigmas.float(), atol=0, rtol=0)
        t = np.linspace(1.0, shift(1 / 1000), steps)
        np.testing.assert_allclose(ours.numpy(), np.append(shift(t), 0.0), atol=1e-6)
        pipeline = common.sigma_schedule(FlowMatchEulerDiscreteScheduler(shift=3.0), steps)
        np.testing.assert_allclose(pipeline.numpy(), np.append(shift(np.linspace(1.0, 1 / steps, steps)), 0.0), atol=1e-6)
    s10 = common.sigma_schedule(FlowMatchEulerDiscreteScheduler(shift=3.0), 10, schedule="scheduler")
    np.testing.assert_allclose(s10[-3:-1].numpy(), [0.278, 0.009], atol=1e-3)
    p10 = common.sigma_schedule(FlowMatchEulerDiscreteScheduler(shift=3.0), 10)
    np.testing.assert_allclose(p10[-3:-1].numpy(), [0.429, 0.25], atol=1e-3)


def test_sigma_schedule_is_shifted_linspace(pipe):
    s = common.sigma_schedule(pipe.scheduler, 10)
    base = np.linspace(1.0, 0.1, 10)
    expected = np.append(3 * base / (1 + 2 * base), 0.0)  # shift 3: the SD3.5 schedule of the Flow-Factory spec
    np.testing.assert_allclose(s.numpy(), expected, atol=1e-6)
    assert abs(s[1].item() - 0.9643) < 1e-4


def _paper_mean(dynamics, x, v, sigma, sigma_next, eta):
    """Means written directly from the papers (not through x0_hat / eps_hat)."""
    dt = sigma_next - sigma
    if dynamics == "Flow-SDE":  # Flow-GRPO's SDE, sigma_t = eta sqrt(t / (1 - t))
        s2 = eta**2 * sigma / (1 - sigma)
        return x + (v + s2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt
    if dynamics == "Dance-SDE":
        x0 = x - sigma * v
        return x + (v + 0.5 * eta**2 * (x - (1 - sigma) * x0) / sigma**2) * dt
    x0, eps = x - sigma * v, x + (1 - sigma) * v  # CPS: (1 - s') x0 + sqrt(s'^2 - std^2) eps
    std = sigma_next * math.sin(eta * math.pi / 2)
    return (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - std**2) * eps


def _paper_std(dynamics, sigma, sigma_next, eta):
    if dynamics == "Flow-SDE":
        return eta * math.sqrt(sigma / (1 - sigma)) * math.sqrt(sigma - sigma_next)
    if dynamics == "Dance-SDE":
        return eta * math.sqrt(sigma - sigma_next)
    return sigma_next * math.sin(eta * math.pi / 2)


@pytest.mark.parametrize("dynamics", ["Flow-SDE", "Dance-SDE", "CPS"])
def test_sde_step_log_prob_matches_torch_normal(dynamics):
    g = torch.Generator().manual_seed(1)
    x, v, z = (torch.randn(4, 4, 8, 8, generator=g) for _ in range(3))
    sigma, sigma_next, eta = 0.75, 0.6, 0.7
    x_next, logp, mean, std = common.sde_step(x, v, sigma, sigma_next, dynamics, eta, noise=z)
    ref_mean = _paper_mean(dynamics, x, v, sigma, sigma_next, eta)
    ref_std = _paper_std(dynamics, sigma, sigma_next, eta)
    torch.testing.assert_close(mean, ref_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_next, ref_mean + ref_std * z, atol=1e-5, rtol=1e-5)
    ref_logp = torch.distributions.Normal(ref_mean, ref_std).log_prob(x_next).mean(dim=(1, 2, 3))
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    # scoring a given x_next (the training path) gives the same number, and per-sample sigmas broadcast
    _, logp2, _, _ = common.sde_step(x, v, torch.full((4,), sigma), torch.full((4,), sigma_next), dynamics, eta, x_next=x_next)
    torch.testing.assert_close(logp2, ref_logp, atol=1e-5, rtol=1e-5)


def test_sde_step_masks_log_probs_per_row():
    """A row whose step is deterministic (CPS with sigma_next = 0) gets log-prob 0; the other rows keep theirs."""
    g = torch.Generator().manual_seed(2)
    x, v, x_next = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
    sigma, sigma_next = torch.tensor([0.8, 0.5, 0.6]), torch.tensor([0.6, 0.0, 0.3])
    _, logp, mean, std = common.sde_step(x, v, sigma, sigma_next, "CPS", 0.7, x_next=x_next)
    assert logp[1] == 0
    for i in (0, 2):
        ref = torch.distributions.Normal(mean[i], std[i]).log_prob(x_next[i]).mean()
        torch.testing.assert_close(logp[i], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(logp).all()


def test_sde_step_default_first_step_std_is_the_references():
    """Flow-SDE at sigma = 1: flow_grpo's std is eta sqrt(1 / (1 - sigmas[1])) sqrt(|dt|) (sigma_max = sigmas[1]);
    the default (no cap) gives exactly that, the old default cap 0.99 gave 1.89x it on SD3.5's 10-step schedule."""
    s1, eta = 3 * 0.9 / (1 + 2 * 0.9), 0.7  # SD3.5's second sigma at 10 steps (shift 3)
    x = v = torch.zeros(1, 4, 2, 2)
    ref = eta * math.sqrt(1 / (1 - s1)) * math.sqrt(1 - s1)
    assert common.sde_step(x, v, 1.0, s1, "Flow-SDE", eta)[3].item() == pytest.approx(ref, rel=1e-5)
    assert common.sde_step(x, v, 1.0, s1, "Flow-SDE", eta, sigma_cap=s1)[3].item() == pytest.approx(ref, rel=1e-5)
    ratio = common.sde_step(x, v, 1.0, s1, "Flow-SDE", eta, sigma_cap=0.99)[3].item() / ref
    assert ratio == pytest.approx(1.89, abs=0.005)
    # below sigma = 1 nothing is capped
    assert common.sde_step(x, v, 0.9, 0.8, "Flow-SDE", eta)[3].item() == pytest.approx(
        _paper_std("Flow-SDE", 0.9, 0.8, eta), rel=1e-5
    )


def test_mse_log_prob_is_the_cps_surrogate():
    """log_prob_form="mse": -mean (x' - mu)^2; its log-ratios are the Gaussian ones times 2 std^2."""
    g = torch.Generator().manual_seed(5)
    x, v, v2, z = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(4))
    x_next, _, mean, std = common.sde_step(x, v, 0.7, 0.5, "CPS", 0.8, noise=z)
    _, mse, _, _ = common.sde_step(x, v, 0.7, 0.5, "CPS", 0.8, x_next=x_next, log_prob_form="mse")
    torch.testing.assert_close(mse, -((x_next - mean) ** 2).mean(dim=(1, 2, 3)))
    _, mse2, _, _ = common.sde_step(x, v2, 0.7, 0.5, "CPS", 0.8, x_next=x_next, log_prob_form="mse")
    _, gauss, _, _ = common.sde_step(x, v, 0.7, 0.5, "CPS", 0.8, x_next=x_next)
    _, gauss2, _, _ = common.sde_step(x, v2, 0.7, 0.5, "CPS", 0.8, x_next=x_next)
    torch.testing.assert_close(mse2 - mse, (gauss2 - gauss) * 2 * std**2, atol=1e-5, rtol=1e-5)
    with pytest.raises(common.UserError):
        common.sde_step(x, v, 0.7, 0.5, "CPS", 0.8, x_next=x_next, log_prob_form="nope")


def test_rollout_log_probs_are_reproduced_by_rescoring(pipe):
    """GRPO's old log-probs come from the rollout; re-scoring the stored trajectory must give them back exactly."""
    enc = common.PromptEncoder(pipe)
    cond = enc.cond(PROMPTS)
    out = common.sample(
        pipe.transformer,
        pipe.scheduler,
        cond,
        num_steps=5,
        guidance_scale=3.0,
        dynamics="Flow-SDE",
        eta=0.8,
        sde_steps=[1, 3],
        generator=torch.Generator().manual_seed(3),
        keep_trajectory=True,
    )
    assert out.sde_mask.tolist() == [False, True, False, True, False]
    assert (out.log_probs[:, [0, 2, 4]] == 0).all() and (out.log_probs[:, [1, 3]] != 0).all()
    for i in (1, 3):
        x = out.trajectory[:, i]
        with torch.no_grad():
            v = common.velocity(pipe.transformer, x, out.sigmas[i], cond, 3.0)
        _, logp, _, _ = common.sde_step(
            x,
            v,
            out.sigmas[i],
            out.sigmas[i + 1],
            "Flow-SDE",
            0.8,
            x_next=out.trajectory[:, i + 1],
            sigma_cap=float(out.sigmas[1]),
        )
        torch.testing.assert_close(logp, out.log_probs[:, i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.trajectory[:, -1], out.latents)


@pytest.mark.parametrize("dynamics", ["CPS", "Flow-SDE", "Dance-SDE"])
def test_zero_noise_level_equals_ode(pipe, dynamics):
    enc = common.PromptEncoder(pipe)
    cond = enc.cond(PROMPTS, negative=False)
    kw = dict(num_steps=4, noise=torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(4)))
    ode = common.sample(pipe.transformer, pipe.scheduler, cond, dynamics="ODE", **kw)
    sde = common.sample(pipe.transformer, pipe.scheduler, cond, dynamics=dynamics, eta=0.0, **kw)
    torch.testing.assert_close(sde.latents, ode.latents, atol=1e-6, rtol=1e-6)


def test_sampler_is_deterministic_given_a_generator(pipe):
    enc = common.PromptEncoder(pipe)
    cond = enc.cond(PROMPTS, negative=False)

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        return common.sample(pipe.transformer, pipe.scheduler, cond, num_steps=4, dynamics="Dance-SDE", generator=gen).latents

    torch.testing.assert_close(run(5), run(5), atol=0, rtol=0)
    assert not torch.allclose(run(5), run(6))


def test_group_prompts_layout_and_determinism():
    prompts = [f"p{i}" for i in range(5)]
    a = common.group_prompts(prompts, 7, 3, torch.Generator().manual_seed(0))
    b = common.group_prompts(prompts, 7, 3, torch.Generator().manual_seed(0))
    assert a == b and len(a) == 21
    groups = [a[i : i + 3] for i in range(0, 21, 3)]
    assert all(len(set(g)) == 1 for g in groups)
    assert len({g[0] for g in groups[:5]}) == 5  # a full pass over the prompts before any repeats


def test_checkpoint_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    path = tmp_path / "ck" / "last"
    snapshot = [p.detach().clone().to(torch.bfloat16) for p in named.values()]
    state = {
        "params": checkpoints.trainable_state(named),
        "opt": opt.state_dict(),
        "step": 3,
        "epoch": 3,
        "rng": checkpoints.rng_state(),
        "snapshots": {"ema": snapshot, "none": []},
        "eval_ema": snapshot,
    }
    checkpoints.save_checkpoint(path, state)
    expected_draws = (torch.rand(3), np.random.rand(3), __import__("random").random())
    ref_weights = {n: p.detach().clone() for n, p in named.items()}
    ref_opt = copy.deepcopy(opt.state_dict())  # state_dict() holds live tensors
    # wreck everything, then restore
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    state = checkpoints.load_checkpoint(path)
    checkpoints.load_trainable_state(named, state["params"])
    opt.load_state_dict(state["opt"])
    checkpoints.set_rng_state(state["rng"])
    for n, p in named.items():
        assert torch.equal(p, ref_weights[n])
    for k, s in opt.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s[name], ref_opt["state"][k][name])
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert np.array_equal(np.random.rand(3), expected_draws[1])
    assert __import__("random").random() == expected_draws[2]
    assert state["step"] == 3 and not list(path.parent.glob(".tmp*"))
    # any dict/list of tensors, whatever its name, is stored as safetensors, bit for bit; the rest loads without pickle
    for saved in (state["snapshots"]["ema"], state["eval_ema"]):
        assert all(torch.equal(x, y) and x.dtype == torch.bfloat16 for x, y in zip(saved, snapshot))
    assert state["snapshots"]["none"] == []
    from safetensors.torch import load_file

    assert set(load_file(path / "weights.safetensors")) >= {f"params/{n}" for n in named} | {"eval_ema/0", "snapshots/ema/1"}
    assert "params" not in torch.load(path / "state.pt", weights_only=True)


def test_eval_ema_follows_the_weights_with_warm_up_and_swaps_back():
    params = [torch.zeros(3), torch.ones(2)]
    ema = models.EvalEMA(params, 0.9)
    ref = [p.clone() for p in params]
    for step in range(1, 30):
        with torch.no_grad():
            for p in params:
                p.add_(0.1 * step)
        ema.update(step)
        d = min(0.9, (1 + step) / (10 + step))  # flow_grpo's warm-up
        ref = [d * r + (1 - d) * p for r, p in zip(ref, params)]
    for e, r in zip(ema.shadow, ref):
        torch.testing.assert_close(e, r)
    trained = [p.clone() for p in params]
    with ema.swapped():
        assert all(torch.equal(p, r) for p, r in zip(params, ema.shadow))
    assert all(torch.equal(p, t) for p, t in zip(params, trained))
    saved = ema.state()
    fresh = models.EvalEMA(params, 0.9)
    fresh.load(saved)
    assert all(torch.equal(x, y) for x, y in zip(fresh.shadow, ema.shadow))
    fresh.load(None)  # a checkpoint written with the EMA off: restart from the weights
    assert all(torch.equal(x, p) for x, p in zip(fresh.shadow, params))
    off = models.EvalEMA(params, 0.0)
    off.update(1)
    assert off.state() is None and not off.shadow
    with pytest.raises(common.UserError):
        models.EvalEMA(params, 1.0)


def test_eval_ema_interval_and_repeats_follow_flow_grpos_call_pattern():
    """flow_grpo/ema.py with update_step_interval 8, called as its train_sd3.py does: after every micro-batch with the
    current global_step (A micro-batches per optimizer step, the step counter bumped at the last one), written out
    here as that loop; cleanflow updates once per optimizer step with interval 8 and repeats A."""
    A, interval, decay = 3, 8, 0.9
    params = [torch.zeros(4)]
    ours = models.EvalEMA(params, decay, interval, A)
    ref, global_step = params[0].clone(), 0
    for step in range(1, 38):  # ends before step 39, whose updates (39 + 1 = 40 = 5 x 8) flow_grpo spreads into step 40
        for mb in range(A):
            if mb == A - 1:  # the optimizer step happens at the last micro-batch
                with torch.no_grad():
                    params[0].add_(torch.arange(4.0) + step)
                global_step += 1
                ours.update(global_step)
            if (global_step + 1) % interval == 0:  # flow_grpo's ema.step(parameters, global_step)
                d = min((1 + global_step) / (10 + global_step), decay)
                ref = ref + (1 - d) * (params[0] - ref)
    torch.testing.assert_close(ours.shadow[0], ref)
    assert not torch.equal(ref, params[0])
    with pytest.raises(common.UserError):
        models.EvalEMA(params, 0.9, 0)


def test_missing_model_path_is_one_clear_line(tmp_path):
    with pytest.raises(common.UserError) as e:
        models.load_pipeline(str(tmp_path / "nope"), torch.device("cpu"))
    assert "nope" in str(e.value) and "\n" not in str(e.value)


def test_unknown_dynamics_is_one_clear_line(pipe):
    enc = common.PromptEncoder(pipe)
    cond = enc.cond(PROMPTS, negative=False)
    with pytest.raises(common.UserError, match="unknown dynamics 'SDE'.*ODE, Flow-SDE, Dance-SDE, CPS"):
        common.sample(pipe.transformer, pipe.scheduler, cond, num_steps=2, dynamics="SDE")


def test_load_prompts_txt_jsonl_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("a red circle\n\n two squares \n")
    assert prompt_files.load_prompts(tmp_path / "a.txt") == ["a red circle", "two squares"]
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "a square", "x": 1}) + "\n")
    assert prompt_files.load_prompts(tmp_path / "b.jsonl") == ["a square"]
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(common.UserError, match="no prompts"):
        prompt_files.load_prompts(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt field"}\n')
    with pytest.raises(common.UserError, match="bad.jsonl:1"):
        prompt_files.load_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(common.UserError, match="not found"):
        prompt_files.load_prompts(tmp_path / "missing.txt")
    for value, shown in [(None, "null"), (["a", "b"], r'\["a", "b"\]'), (3, "3"), ({"a": 1}, r'\{"a": 1\}')]:
        (tmp_path / "typed.jsonl").write_text(json.dumps({"prompt": "a square"}) + "\n" + json.dumps({"prompt": value}))
        with pytest.raises(common.UserError, match=f"typed.jsonl:2: 'prompt' is '{shown}', expected a string"):
            prompt_files.load_prompts(tmp_path / "typed.jsonl")
    for name, line in [("bom.txt", "a red circle"), ("bom.jsonl", json.dumps({"prompt": "a red circle"}))]:
        (tmp_path / name).write_bytes(("\ufeff" + line + "\n").encode())  # a UTF-8 byte-order mark, as Notepad writes
        assert prompt_files.load_prompts(tmp_path / name) == ["a red circle"]


def test_lora_starts_at_base_and_reference_disables_it(pipe):
    transformer = copy.deepcopy(pipe.transformer)
    params = models.add_lora(transformer, rank=4, alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    assert params and all(p.requires_grad and p.dtype == torch.float32 for p in params)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    enc = common.PromptEncoder(pipe)
    cond = enc.cond(PROMPTS[:2], negative=False)
    with torch.no_grad():
        base = common.velocity(pipe.transformer, x, 0.5, cond)
        torch.testing.assert_close(common.velocity(transformer, x, 0.5, cond), base)  # LoRA B = 0 at init
        for p in params:
            p.add_(0.05)
        assert not torch.allclose(common.velocity(transformer, x, 0.5, cond), base)
        with models.reference_model(transformer):
            torch.testing.assert_close(common.velocity(transformer, x, 0.5, cond), base)


def test_checkpoints_keep_the_last_n(tmp_path):
    path = tmp_path / "checkpoints" / "last.pt"
    for epoch in range(1, 6):
        checkpoints.save_checkpoint(path, {"epoch": epoch, "w": torch.full((3,), float(epoch))}, keep=2)
    assert sorted(p.name for p in path.parent.iterdir()) == ["epoch_000004", "epoch_000005", "last"]
    assert checkpoints.load_checkpoint(path.parent / "last")["epoch"] == 5
    assert torch.equal(checkpoints.load_checkpoint(path.parent / "epoch_000004")["w"], torch.full((3,), 4.0))
    checkpoints.save_checkpoint(path, {"epoch": 5, "w": torch.zeros(3)}, keep=0)  # the same epoch again replaces it
    assert sorted(p.name for p in path.parent.iterdir()) == ["epoch_000005", "last"]
    assert torch.equal(checkpoints.load_checkpoint(path.parent / "last")["w"], torch.zeros(3))
    (tmp_path / "args.json").write_text("{}")  # tmp_path is now a run folder
    checkpoints.save_checkpoint(path, {"epoch": 6, "w": torch.ones(3)}, keep=3)
    (path.parent / "last").unlink()  # no `last` (a filesystem without symlinks): the newest epoch folder
    assert checkpoints.load_checkpoint(tmp_path)["epoch"] == 6


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, "truncated", "pickle"])
def test_corrupt_checkpoint_is_one_line(tmp_path, content):
    path = tmp_path / "checkpoints" / "last"
    checkpoints.save_checkpoint(path, {"epoch": 1, "w": torch.ones(3), "opt": {"lr": 0.1}})
    state_file = path / "state.pt"
    if content == "truncated":
        state_file.write_bytes(state_file.read_bytes()[:100])
    elif content == "pickle":  # code that unpickling would run: refused by weights_only
        torch.save({"format": checkpoints.CHECKPOINT_FORMAT, "x": logs.Timer()}, state_file)
    else:
        state_file.write_bytes(content)
    with pytest.raises(common.UserError, match="cannot be read") as e:
        checkpoints.load_checkpoint(path)
    assert "\n" not in str(e.value)
    checkpoints.save_checkpoint(path, {"epoch": 1, "w": torch.ones(3)})
    (path.resolve() / "weights.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(common.UserError, match="weights.safetensors cannot be read"):
        checkpoints.load_checkpoint(path)


FILL_DISK = """
import resource, signal, sys, torch
sys.path.insert(0, {repo!r})
from harness import checkpoints
import common
from harness import run
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing the process
checkpoints.save_checkpoint({path!r}, {{"epoch": 1, "w": torch.ones(10)}})
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # a file-size limit: what a full disk looks like to a write
run.run_main(lambda args: checkpoints.save_checkpoint({path!r}, {{"epoch": 2, "w": torch.ones(1_000_000)}}), None, argv=[])
"""


@pytest.mark.slow
def test_checkpoint_write_failure_is_one_line_and_leaves_no_temp_files(tmp_path):
    from conftest import run_script

    path = tmp_path / "checkpoints" / "last"
    script = tmp_path / "fill_disk.py"
    script.write_text(FILL_DISK.format(repo=str(common.REPO), path=str(path)))
    out = run_script([script], check=False, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: could not write the checkpoint") and "epoch_000002" in line
    assert sorted(p.name for p in path.parent.iterdir()) == ["epoch_000001", "last"]  # no temp files, the old one intact
    assert checkpoints.load_checkpoint(path)["epoch"] == 1


KEEP_SAVING = """
import sys, torch
sys.path.insert(0, {repo!r})
from harness import checkpoints
# 16 MB: a write takes long enough to be killed in the middle
big = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))
for epoch in range(1, 10**6):
    checkpoints.save_checkpoint({path!r}, {{"epoch": epoch, "w": big + epoch, "meta": {{"epoch": epoch}}}}, keep=2)
"""


@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_leaves_a_loadable_checkpoint(tmp_path):
    """SIGKILL at arbitrary moments of a write loop: `last` always points at a complete checkpoint (temp folder, rename,
    then an atomically replaced symlink)."""
    import signal
    import time

    from conftest import kill_group, start_script

    path = tmp_path / "checkpoints" / "last"
    script = tmp_path / "keep_saving.py"
    script.write_text(KEEP_SAVING.format(repo=str(common.REPO), path=str(path)))
    big, temps = None, 0
    # at least four kills; more (up to 16) until one has landed inside a write, which depends on the machine's load
    for attempt, delay in enumerate((0.05, 0.13, 0.21, 0.37) * 4):
        if attempt >= 4 and temps:
            break
        before = os.readlink(path) if path.is_symlink() else None
        proc = start_script([script])
        try:
            while not path.is_symlink() or os.readlink(path) == before:  # until this process has saved once
                assert proc.poll() is None
                time.sleep(0.01)
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            kill_group(proc)
        for ckpt in [path, *path.parent.glob("epoch_*")]:  # every checkpoint is whole and from one single save
            state = checkpoints.load_checkpoint(ckpt)
            big = state["w"] - state["epoch"] if big is None else big
            torch.testing.assert_close(state["w"] - state["epoch"], big)
            assert state["meta"]["epoch"] == state["epoch"]
        assert len(list(path.parent.glob("epoch_*"))) <= 3  # the newest 2, plus at most one not yet pruned
        temps += len(list(path.parent.glob(".tmp-*")))
    # the kills did land inside writes: their temp folders are left behind (removed when a run resumes)
    assert temps


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_gradient_checkpointing_keeps_loss_and_lora_gradients(random_pipeline_dir, flux_pipeline_dirs, family):
    pipe = models.load_pipeline(random_pipeline_dir if family == "sd3" else flux_pipeline_dirs["dev"], torch.device("cpu"))
    torch.manual_seed(0)
    params = models.add_lora(pipe.transformer, rank=4, alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    with torch.no_grad():
        for p in params:  # LoRA B starts at 0: move it so every LoRA weight gets a gradient
            p.add_(0.05)
    enc = common.PromptEncoder(pipe)
    cond_neg = enc.cond(PROMPTS)
    x = torch.randn(len(PROMPTS), *pipe.latent_shape, generator=torch.Generator().manual_seed(0))

    def loss_and_grads():  # guidance 3.5: SD3's two-pass CFG, FLUX's guidance embedding
        loss = common.velocity(pipe.transformer, x, 0.6, cond_neg, 3.5).pow(2).mean()
        grads = torch.autograd.grad(loss, params)
        return loss.detach(), grads

    loss, grads = loss_and_grads()
    models.enable_gradient_checkpointing(pipe.transformer)
    assert pipe.transformer.gradient_checkpointing
    loss_ckpt, grads_ckpt = loss_and_grads()
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    assert all(g.abs().sum() > 0 for g in grads)
    for g, g_ckpt in zip(grads, grads_ckpt):
        torch.testing.assert_close(g_ckpt, g, rtol=1e-6, atol=1e-7)


def test_offload_moves_text_encoders_to_cpu_and_keeps_the_embeddings(random_pipeline_dir):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on a CPU-only machine nothing moves
    pipe = models.load_pipeline(random_pipeline_dir, device)
    fresh = common.PromptEncoder(pipe)(PROMPTS)
    enc = common.PromptEncoder(pipe, negative_prompt="a square")
    enc.precompute(PROMPTS[:2], batch=1)
    assert set(enc.cache) == {"a square", *PROMPTS[:2]}  # the negative prompt too
    enc.offload()
    assert all(next(m.parameters()).device.type == "cpu" for m in enc.text_encoders())
    assert pipe.transformer.device == device
    embeds, pooled = enc(PROMPTS)  # two cached, one encoded on the CPU after the offload
    assert embeds.device == pooled.device == device
    # batch size 1 vs 3 (and CPU vs GPU) changes the text encoders' float rounding, nothing more
    torch.testing.assert_close((embeds, pooled), fresh, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("total, grad_steps, world, micro", [(64, 2, 1, 16), (64, 2, 2, 8), (1152, 2, 8, 24), (48, 1, 4, 4)])
def test_rank_layout_gives_every_optimizer_step_the_same_samples_on_any_rank_count(total, grad_steps, world, micro):
    """Written independently of rank_indices: optimizer step s of one process is samples [s T/G, (s+1) T/G); with W
    ranks its samples are the union of each rank's s-th chunk, and every rank micro-batch is a single-process one."""
    per = distributed.batch_layout(total, grad_steps, world, micro)
    ranks = [distributed.rank_indices(total, grad_steps, world, r).tolist() for r in range(world)]
    assert sorted(sum(ranks, [])) == list(range(total))  # a partition of the epoch
    for s in range(grad_steps):
        step = sorted(i for idx in ranks for i in idx[s * per : (s + 1) * per])
        assert step == list(range(s * total // grad_steps, (s + 1) * total // grad_steps))
    single_micro = {tuple(range(k, k + micro)) for k in range(0, total, micro)}
    for idx in ranks:
        assert all(tuple(idx[k : k + micro]) in single_micro for k in range(0, len(idx), micro))


def test_batch_layout_rejects_what_does_not_divide():
    with pytest.raises(common.UserError, match=r"grad_steps_per_epoch x world size \(3 x 2\)"):
        distributed.batch_layout(64, 3, 2, 8)
    with pytest.raises(common.UserError, match=r"micro_batch \(6\) must divide the per-rank images per optimizer step \(16\)"):
        distributed.batch_layout(64, 2, 2, 6)


def test_keyed_noise_depends_on_the_key_not_on_the_batch():
    """A sample's rollout noise is the same whichever other samples share its batch (what makes N ranks == 1)."""
    rows = common.randn((3, 2, 4), common.keyed_generators(1, 5, "rollout", indices=[7, 3, 9]))
    alone = common.randn((1, 2, 4), common.keyed_generators(1, 5, "rollout", indices=[3]))
    torch.testing.assert_close(rows[1:2], alone, rtol=0, atol=0)
    other_epoch = common.randn((1, 2, 4), common.keyed_generators(1, 6, "rollout", indices=[3]))
    other_purpose = common.randn((1, 2, 4), common.keyed_generators(1, 5, "train", indices=[3]))
    assert not torch.equal(alone, other_epoch) and not torch.equal(alone, other_purpose)
    with pytest.raises(ValueError):
        common.randn((2, 4), common.keyed_generators(1, 5, "x", indices=[1, 2, 3]))


def test_sde_rollout_of_a_sample_does_not_depend_on_its_batch(pipe):
    """sample() with one generator per sample: each row's initial and step noise follow only its own key."""
    enc = common.PromptEncoder(pipe)
    cond = enc.cond(PROMPTS, negative=False)
    kw = dict(num_steps=4, dynamics="Flow-SDE", eta=0.7, latent_shape=pipe.latent_shape)
    full = common.sample(
        pipe.transformer,
        pipe.scheduler,
        cond,
        generator=common.keyed_generators(0, 0, "rollout", indices=[0, 1, 2]),
        **kw,
    )
    last = common.sample(
        pipe.transformer,
        pipe.scheduler,
        cond[2:],
        generator=common.keyed_generators(0, 0, "rollout", indices=[2]),
        **kw,
    )
    torch.testing.assert_close(full.latents[2:], last.latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full.log_probs[2:], last.log_probs, rtol=1e-5, atol=1e-5)


def test_cond_slices_every_field_and_carries_the_negative(pipe):
    enc = common.PromptEncoder(pipe)
    cond, plain = enc.cond(PROMPTS), enc.cond(PROMPTS, negative=False)
    embeds, pooled = enc(PROMPTS)
    neg_embeds, neg_pooled = enc.negative(len(PROMPTS))
    part = cond[1:]
    for got, full in zip((part.embeds, part.pooled, *part.neg), (embeds, pooled, neg_embeds, neg_pooled)):
        torch.testing.assert_close(got, full[1:], rtol=0, atol=0)
    assert plain.neg is None and plain[torch.tensor([0, 2])].neg is None and plain[torch.tensor([0, 2])].embeds.shape[0] == 2


def toy_reward(images, prompts):
    """A reward that depends on every pixel and on the prompt, so a misplaced image or prompt changes it."""
    return {"toy": images.mean((1, 2, 3)) + torch.tensor([len(p) for p in prompts], dtype=torch.float32)}


def test_chunked_sampling_and_overlapped_scoring_equal_one_batch(pipe):
    """sample(chunk=, on_chunk=Scorer) returns the rollout of one batch (to float rounding: CPU kernels may pick another
    blocking for another batch size; on tiny-shapes 4 x 16 vs 64 is bit-identical), and the Scorer's images and rewards
    are those of the rollout's latents, whether scored in a worker thread per chunk or after sampling."""
    prompts = PROMPTS + ["two circles"]
    cond = common.PromptEncoder(pipe).cond(prompts)
    kw = dict(
        num_steps=4,
        guidance_scale=2.0,
        dynamics="Flow-SDE",
        eta=0.7,
        latent_shape=pipe.latent_shape,
        keep_trajectory=True,
        keep_means=True,
    )

    def gens():
        return common.keyed_generators(0, 0, "rollout", indices=range(len(prompts)))

    full = common.sample(pipe.transformer, pipe.scheduler, cond, generator=gens(), **kw)
    results = {}
    # the worker thread on chunks of 3 (then 1); the same chunks scored after sampling (--no-overlap-reward); one chunk
    for chunk, overlap in ((3, True), (3, False), (None, True)):
        scorer = common.Scorer(pipe, toy_reward, prompts, chunk, overlap=overlap)
        assert (scorer.pool is not None) == (overlap and chunk is not None)
        out = common.sample(pipe.transformer, pipe.scheduler, cond, generator=gens(), chunk=chunk, on_chunk=scorer, **kw)
        for name in ("latents", "sigmas", "trajectory", "log_probs", "sde_mask", "means"):
            torch.testing.assert_close(getattr(out, name), getattr(full, name), rtol=1e-5, atol=1e-5, msg=name)
        images, scores = scorer.result()
        # the reward of the Scorer's own chunks, each decoded alone as it decodes them (equal by construction); under
        # avx2 the reward of a batch of 4 differed from 3 + 1, and even the reward of images.split(3) from it
        size = chunk or len(prompts)
        decoded = [common.decode(pipe, z) for z in out.latents.split(size)]
        assert torch.equal(images, torch.cat(decoded)) and sum(scorer.seconds) > 0
        texts = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        assert torch.equal(scores["toy"], torch.cat([toy_reward(i, p)["toy"] for i, p in zip(decoded, texts)]))
        results[chunk, overlap] = (out, images, scores["toy"])
    assert torch.equal(out.latents, full.latents)  # chunk None is the path without a Scorer
    (a, a_images, a_toy), (b, b_images, b_toy) = results[3, True], results[3, False]
    assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("latents", "trajectory", "log_probs", "means"))
    assert torch.equal(a_images, b_images) and torch.equal(a_toy, b_toy)
    with pytest.raises(ValueError, match="one generator per sample"):  # one stream cannot be cut into chunks
        common.sample(pipe.transformer, pipe.scheduler, cond, generator=torch.Generator(), chunk=2, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["avx2", "default"])
def test_chunked_sampling_equals_one_batch_under_other_kernels(kernel):
    """The test above, in a pytest process of its own under forced avx2 or default kernels (torch picks its kernels
    once per process; conftest's KERNELS), whose rounding differs from this CPU's."""
    test = "tests/test_common.py::test_chunked_sampling_and_overlapped_scoring_equal_one_batch"
    out = run_script(["-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=kernel_environ(kernel), check=False)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:]


def test_a_slow_reward_is_helped_by_the_main_thread_in_order(pipe, monkeypatch):
    """When the reward is slower than sampling, result() decodes the chunks the worker has not started in the main
    thread; the worker still calls the reward once at a time, in sample order, and the numbers do not change."""
    import threading
    import time

    prompts = PROMPTS + ["two circles"]
    calls = []

    def slow(images, prompts_):
        calls.append((prompts_[0], threading.current_thread().name))
        time.sleep(0.2)
        return toy_reward(images, prompts_)

    cond = common.PromptEncoder(pipe).cond(prompts)
    decoded_in, decode = [], common.decode
    monkeypatch.setattr(common, "decode", lambda *a: decoded_in.append(threading.current_thread().name) or decode(*a))
    gens = common.keyed_generators(0, 0, "rollout", indices=range(4))
    scorer = common.Scorer(pipe, slow, prompts, 1)
    rollout = common.sample(pipe.transformer, pipe.scheduler, cond, num_steps=2, generator=gens, chunk=1, on_chunk=scorer)
    images, scores = scorer.result()
    assert "MainThread" in decoded_in and decoded_in[0].startswith("reward")  # the first chunk: in the worker
    assert [c[0] for c in calls] == prompts and all(c[1].startswith("reward") for c in calls)
    assert torch.equal(images, torch.cat([common.decode(pipe, z) for z in rollout.latents.split(1)]))
    assert torch.equal(scores["toy"], toy_reward(images, prompts)["toy"])


def test_a_thread_safe_slow_reward_also_runs_in_the_main_thread(pipe):
    """A reward marked `thread_safe` (OCR, shapes): once sampling is over the main thread scores the second half of the
    waiting chunks itself, beside the worker; images and scores are still those of the rollout, in sample order."""
    import threading
    import time

    prompts = PROMPTS + ["two circles", "a red circle", "two squares", "a blue square"]
    calls = []

    def slow(images, prompts_):
        calls.append((prompts_[0], threading.current_thread().name))
        time.sleep(0.3)
        return toy_reward(images, prompts_)

    slow.thread_safe = True
    cond = common.PromptEncoder(pipe).cond(prompts)
    scorer = common.Scorer(pipe, slow, prompts, 1)
    gens = common.keyed_generators(0, 0, "rollout", indices=range(len(prompts)))
    rollout = common.sample(pipe.transformer, pipe.scheduler, cond, num_steps=2, generator=gens, chunk=1, on_chunk=scorer)
    images, scores = scorer.result()
    threads = {name for _, name in calls}
    assert "MainThread" in threads and any(t.startswith("reward") for t in threads), calls
    assert sorted(c[0] for c in calls) == sorted(prompts)  # every chunk scored exactly once
    assert torch.equal(images, torch.cat([common.decode(pipe, z) for z in rollout.latents.split(1)]))
    assert torch.equal(scores["toy"], toy_reward(images, prompts)["toy"])
    from rewards import load_rewards

    assert load_rewards("shapes_clean", torch.device("cpu")).thread_safe


@pytest.mark.parametrize("overlap", [True, False])
def test_a_reward_error_in_the_worker_reaches_the_caller(pipe, overlap):
    """A reward that fails on the first chunk: the same exception is raised in the sampling thread (at the next chunk
    or at result()), so run_main still reports a UserError as one line; the worker thread is shut down."""

    def bad(images, prompts):
        raise common.UserError("reward 'bad' returned NaN")

    cond = common.PromptEncoder(pipe).cond(PROMPTS)
    scorer = common.Scorer(pipe, bad, PROMPTS, 1 if overlap else None)
    with pytest.raises(common.UserError, match="returned NaN"):
        common.sample(
            pipe.transformer,
            pipe.scheduler,
            cond,
            num_steps=2,
            generator=common.keyed_generators(0, 0, "rollout", indices=range(3)),
            latent_shape=pipe.latent_shape,
            chunk=scorer.chunk,
            on_chunk=scorer,
        )
        scorer.result()
    assert scorer.pool is None or scorer.pool._shutdown


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_velocity_loss_and_gradients(random_pipeline_dir):
    """--compile (regional torch.compile of the transformer blocks): the training forward's velocity, the loss and the
    LoRA gradients match eager to float rounding; parameter names (what checkpoints store) are unchanged."""
    reason = models.compile_unavailable("cpu")
    if reason:
        pytest.skip(reason)
    results = []
    for compiled in (False, True):
        pipe = models.load_pipeline(random_pipeline_dir, torch.device("cpu"))
        torch.manual_seed(0)
        params = models.add_lora(pipe.transformer, 4, 4.0, ("to_q", "to_k", "to_v", "to_out.0"))
        with torch.no_grad():  # a trained-looking adapter, so the LoRA path carries signal and every gradient is nonzero
            for p in params:
                p.normal_(0, 0.05)
        names = [n for n, p in pipe.transformer.named_parameters() if p.requires_grad]
        if compiled:
            assert models.compile_transformer(pipe.transformer) == len(pipe.transformer.transformer_blocks)
        cond = common.PromptEncoder(pipe).cond(PROMPTS, negative=False)
        x = torch.randn(len(PROMPTS), *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
        v = common.velocity(pipe.transformer, x, torch.tensor([0.9, 0.5, 0.2]), cond)
        loss = (v - x).pow(2).mean()
        loss.backward()
        results.append((names, v.detach(), loss.detach(), [p.grad for p in params]))
    (names_e, v_e, loss_e, grads_e), (names_c, v_c, loss_c, grads_c) = results
    assert names_e == names_c
    torch.testing.assert_close(v_c, v_e, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for g_e, g_c in zip(grads_e, grads_c):
        assert g_e.abs().sum() > 0
        torch.testing.assert_close(g_c, g_e, rtol=1e-3, atol=1e-5)


def test_compile_without_a_compiler_is_one_clear_line(monkeypatch):
    import torch._inductor.config as inductor

    from algos import nft

    monkeypatch.setattr(inductor.cpp, "cxx", ("/nonexistent/g++",))
    assert "no C++ compiler" in models.compile_unavailable("cpu")
    with pytest.raises(common.UserError, match=r"--compile: no C\+\+ compiler .*run without --compile"):
        run.check_args(nft.Args(compile=True, device="cpu"))


def test_dpm_solver_eval_matches_the_stock_pipeline_with_diffusers_dpm_scheduler(pipe):
    """`solver="dpm"`: StableDiffusion3Pipeline with diffusers' DPMSolverMultistepScheduler (flow sigmas, the pipeline's
    shift, 2nd order), the same initial noise; and it differs from the Euler sampler at the same step count."""
    from diffusers import DPMSolverMultistepScheduler

    steps, shift = 6, pipe.scheduler.config["shift"]
    noise = torch.randn(len(PROMPTS), 4, 16, 16, generator=torch.Generator().manual_seed(0))
    enc = common.PromptEncoder(pipe)
    latents = evaluation.dpm_solver_sample(pipe.transformer, pipe.scheduler, enc.cond(PROMPTS), noise, num_steps=steps)
    dpm = DPMSolverMultistepScheduler(
        flow_shift=shift, use_flow_sigmas=True, prediction_type="flow_prediction", solver_order=2, final_sigmas_type="zero"
    )
    stock = type(pipe.pipe)(**{**pipe.pipe.components, "scheduler": dpm})
    ref = stock_images(stock, noise, steps)
    torch.testing.assert_close(common.decode(pipe, latents), ref, atol=1e-5, rtol=1e-5)
    euler = common.sample(pipe.transformer, pipe.scheduler, enc.cond(PROMPTS), num_steps=steps, noise=noise).latents
    assert (euler - latents).abs().max() > 1e-3


def test_a_non_finite_gradient_skips_the_update_and_five_in_a_row_stop_the_run(capsys):
    saved = []
    finite_grads = run.FiniteGradients()  # the loop owns its count: a new run (or a resume) starts from 0
    assert finite_grads(torch.tensor(3.0))
    for bad in range(1, run.MAX_BAD_STEPS):
        assert not finite_grads(torch.tensor(float("nan")), lambda: saved.append(1))
        assert f"update skipped ({bad} in a row)" in "".join(capsys.readouterr())
    assert finite_grads(torch.tensor(0.5)) and finite_grads.bad_steps == 0  # a finite one resets the count
    for _ in range(run.MAX_BAD_STEPS - 1):
        finite_grads(torch.tensor(float("inf")), lambda: saved.append(1))
    assert not saved
    assert run.FiniteGradients()(torch.tensor(float("inf"))) is False  # another loop's guard counts on its own
    with pytest.raises(common.UserError, match="5 non-finite updates in a row"):
        finite_grads(torch.tensor(float("inf")), lambda: saved.append(1))
    assert saved == [1]  # the checkpoint is written before the run stops


def test_all_reduce_grads_is_the_identity_on_one_process():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, -2.0, 3.0])
    distributed.all_reduce_grads([p, q])  # q has no gradient: left alone
    assert p.grad.tolist() == [1.0, -2.0, 3.0] and q.grad is None


def test_graceful_stop_gives_back_the_signal_handlers_it_replaced():
    """A run's GracefulStop takes SIGINT and SIGTERM (a first Ctrl-C finishes the epoch) and its `exit()`, the scripts'
    last line, puts back what was there: `main(args)` called from Python leaves Ctrl-C working. A SIGTERM still ends
    in exit code 143."""
    import signal

    from harness import run

    def mine(signum, frame):
        pass

    before = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = run.GracefulStop()
        assert signal.getsignal(signal.SIGINT) == stop._handle and signal.getsignal(signal.SIGTERM) == stop._handle
        stop.exit()
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
        stop = run.GracefulStop()
        stop._handle(signal.SIGTERM, None)  # a scheduler's SIGTERM: the epoch finishes, then exit() says 143
        with pytest.raises(SystemExit) as e:
            stop.exit()
        assert e.value.code == 143 and signal.getsignal(signal.SIGTERM) is mine
    finally:
        for s, h in before.items():
            signal.signal(s, h)
