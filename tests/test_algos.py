"""Every algorithm script run for real, tiny: a smoke run, an exact resume after a stop, a kill or a Ctrl-C, and 2 ranks
against one process, all compared with one uninterrupted reference run per algorithm."""

import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import HANG_S, TORCHRUN, kernel_environ, kill_group, run_in_process, run_script, start_script
from safetensors.torch import load_file

import common
from harness.checkpoints import load_checkpoint

REPO = Path(__file__).resolve().parents[1]

# A LoRA, the path of every real model (tests/test_full_finetune.py trains every weight, the tiny models' default).
TINY = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --save-every 1 --eval-every 1 --no-full-finetune".split()
# Per-algorithm flags that keep a run small: the one place to edit them. One reference run per algorithm with these
# flags serves the smoke, resume, kill/interrupt and 2-rank tests, so they also keep each optimizer step to one
# backward per rank on 2 ranks (one trained timestep, one micro-batch per rank; see test_two_ranks_match_one_process).
# AWM takes two optimizer steps per epoch (micro-batches of 2) so that a resume where step != epoch is covered too.
FLAGS = {
    "awm": "--micro-batch 2 --grad-steps-per-epoch 2 --num-train-timesteps 1 --kl-beta 0.01 --ema-kl-beta 0.1 --off-policy "
    "--ema-decay-ramp 0.2",
    "crd": "--grad-steps-per-epoch 1 --num-train-timesteps 1 --gradient-checkpointing --offload-text-encoders",
    # + the papers' eval protocol
    "grpo": "--grad-steps-per-epoch 1 --num-sde-steps 1 --eval-ema-decay 0.9 --eval-num-steps 3",
    # MixGRPO's window moves each epoch (a resume must continue it) and TempFlow's weights scale the loss
    "grpo_variants": "--grad-steps-per-epoch 1 --num-sde-steps 1 --window-mode sliding --window-shift 1 1 --noise-weight 2.25",
    "dgpo": "--grad-steps-per-epoch 1 --num-train-timesteps 1 --off-policy-after 1 --ema-ref-decay-ramp 0.1",
    # the reference renewed each step: a snapshot that a resume and the ranks must carry
    "dpo": "--grad-steps-per-epoch 1 --num-train-timesteps 1 --pairs-per-group all --ref-update-every 1",
    "elbo_grpo": "--grad-steps-per-epoch 1 --num-train-timesteps 1 --kl-beta 0.01",
    "nft": "--grad-steps-per-epoch 1 --num-train-timesteps 1 --kl-beta 0.01 --old-decay-ramp 0.3",
    # the fake score trains twice per generator step: its weights and moments must resume and match on 2 ranks too
    "dmd2": "--grad-steps-per-epoch 1 --fake-updates 2",
    # two teachers (each group of a batch routed to one, on either rank), CRD-trained exports of tiny-shapes
    "opd": "--grad-steps-per-epoch 1 --num-train-timesteps 1 --teachers "
    + " ".join(f"assets/opd/teachers/{d}" for d in ("attr", "rest")),
    # RL on the committed 2-step DMD2 export: three networks (generator, fake score, surrogate reward) resume together
    "tdm_r1": "--grad-steps-per-epoch 1 --num-steps 2 --full-finetune --group-size 4 --micro-batch 4 "
    "--generator benchmark/results/convergence/few_step/dmd2__s1",
}
EPOCHS = 3  # of the reference run
# 3 train prompts, 2 per epoch: prompts repeat across epochs, so an embedding cached in an earlier epoch is reused --
# after a resume too (the cache then starts empty: embeddings must not depend on which prompts were new together)
TRAIN = "a blue square\nthree circles\na red square\n"  # none of them a test prompt: eval does not encode them


def write_prompts(folder: Path) -> Path:
    (folder / "test.txt").write_text("a red circle\ntwo squares\n")
    (folder / "train.txt").write_text(TRAIN)
    return folder


def script_argv(algo, prompt_dir, output_dir, *flags):
    """`algos/<algo>.py` with the tiny flags, this algorithm's FLAGS, the prompt files and then `flags` (tyro: the
    last value of a flag wins)."""
    return [
        f"algos/{algo}.py",
        *TINY,
        *FLAGS[algo].split(),
        "--train-prompts",
        prompt_dir / "train.txt",
        "--test-prompts",
        prompt_dir / "test.txt",
        *map(str, flags),
        "--output-dir",
        output_dir,
    ]


def run(algo, flags, prompt_dir, output_dir, check=True, kernel="native"):
    return run_script(script_argv(algo, prompt_dir, output_dir, *flags.split()), check=check, env=kernel_environ(kernel))


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path)


@pytest.fixture(scope="module")
def shared_prompts(tmp_path_factory):
    """The prompt files of the reference runs and of every run compared with one (read only)."""
    return write_prompts(tmp_path_factory.mktemp("prompts"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shared_prompts):
    """(algo, kernel) -> its uninterrupted EPOCHS-epoch run (folder and stdout) under the kernel (conftest's KERNELS),
    run once per module on first use. Tests only read it: the smoke test checks its artifacts; the resume,
    kill/interrupt and 2-rank tests compare their final state with its checkpoints (training does not depend on
    --num-epochs, which only bounds the loop)."""
    runs, failed = {}, {}

    def get(algo, kernel="native"):
        key = algo, kernel
        if key in failed:  # one failing run, reported once by the test that ran it, not run again by every user
            pytest.fail(f"the {algo} reference run ({kernel} kernels) failed: {failed[key]}")
        if key not in runs:
            out = tmp_path_factory.mktemp(f"reference-{algo}")
            try:
                proc = run(algo, f"--num-epochs {EPOCHS}", shared_prompts, out, kernel=kernel)
            except BaseException as e:
                failed[key] = f"{type(e).__name__} in an earlier test"
                raise
            (run_dir,) = out.iterdir()
            runs[key] = SimpleNamespace(dir=run_dir, stdout=proc.stdout)
        return runs[key]

    return get


def trained(algo, ckpt) -> bool:
    """A run's weights moved from where they started: a LoRA's B from 0, or every weight (tdm_r1's FLAGS) from the
    export it started from."""
    if "--full-finetune" in FLAGS[algo]:
        start = load_file(REPO / FLAGS[algo].split("--generator ")[1] / "transformer" / "diffusion_pytorch_model.safetensors")
        return any(not torch.equal(v, start[k]) for k, v in ckpt["params"].items())
    return any(v.abs().sum() > 0 for k, v in ckpt["params"].items() if "lora_B" in k)


def assert_same_state(a, b, label=""):
    assert a["epoch"] == b["epoch"] and a["step"] == b["step"] and a["images_seen"] == b["images_seen"], label
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), (label, name)
    for key, tensors in a["snapshots"].items():
        for x, y in zip(tensors, b["snapshots"][key]):
            assert torch.equal(x, y), (label, key)
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(x[k], y[k]) for k in x), label
    assert (a["eval_ema"] is None) == (b["eval_ema"] is None) == ("--eval-ema-decay" not in FLAGS.get(label, "")), label
    for x, y in zip(a["eval_ema"] or [], b["eval_ema"] or []):  # the eval EMA (grpo runs with one) resumes exactly too
        assert torch.equal(x, y), label


# crd in the fast tests, every script in the slow ones (the same shell, another loss)
@pytest.mark.parametrize("algo", [a if a == "crd" else pytest.param(a, marks=pytest.mark.slow) for a in sorted(FLAGS)])
def test_smoke_and_exact_resume(algo, reference, shared_prompts, tmp_path):
    """A 3-epoch run writes its artifacts; 1 epoch + `--resume` for two more ends bit-identical (CPU), with prompts
    that repeat across epochs."""
    ref = reference(algo)
    assert "final eval" in ref.stdout
    a_dir = ref.dir
    assert json.loads((a_dir / "args.json").read_text())["num_epochs"] == 3
    assert list(a_dir.glob("events.out.tfevents.*"))
    saved = sorted(p.name for p in (a_dir / "checkpoints").iterdir())
    assert saved == ["epoch_000001", "epoch_000002", "epoch_000003", "last"]
    # no pickle: the trainable state is safetensors, the rest loads with weights_only=True
    assert torch.load(a_dir / "checkpoints" / "last" / "state.pt", weights_only=True)["epoch"] == 3
    a = load_checkpoint(a_dir)
    assert a["epoch"] == 3 and a["images_seen"] == 24

    run(algo, "--num-epochs 1", shared_prompts, tmp_path / "b")
    (b_dir,) = (tmp_path / "b").iterdir()
    args_before = (b_dir / "args.json").read_bytes()
    # only the resume path and the new length: the run's other flags come from the checkpoint
    run_script([f"algos/{algo}.py", "--resume", b_dir, "--num-epochs", "3"], env=kernel_environ("native"))
    assert_same_state(a, load_checkpoint(b_dir), algo)
    assert (b_dir / "args.json").read_bytes() == args_before  # the run's record is appended to, never rewritten
    (record,) = [json.loads(line) for line in (b_dir / "resumes.jsonl").read_text().splitlines()]
    assert record["epoch"] == 1 and record["overrides"] == {"num_epochs": {"saved": 1, "now": 3}}


def _wait_for_checkpoint(proc, run_parent: Path, min_epoch, timeout=HANG_S):
    t0 = time.time()
    while time.time() - t0 < timeout:
        for state in run_parent.glob("*/checkpoints/last/state.pt"):
            try:
                if torch.load(state, weights_only=True)["epoch"] >= min_epoch:
                    return state.parents[2]
            except Exception:  # noqa: BLE001 - `last` moved on in between; try again
                pass
        if proc.poll() is not None:
            raise AssertionError(f"run ended before epoch {min_epoch}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError("no checkpoint in time")


@pytest.mark.slow
def test_killed_or_interrupted_runs_resume_exactly(reference, shared_prompts, tmp_path):
    """SIGKILL between epochs, and Ctrl-C (finish the epoch, save, exit 0): both resume to the uninterrupted result,
    with prompts repeating across epochs; a temp folder left by a kill mid-save is removed on resume."""
    algo = "crd"
    a = load_checkpoint(reference(algo).dir)
    for name, sig in (("kill", signal.SIGKILL), ("int", signal.SIGINT)):
        proc = start_script(
            script_argv(algo, shared_prompts, tmp_path / name, "--num-epochs", EPOCHS), env=kernel_environ("native")
        )
        try:
            run_dir = _wait_for_checkpoint(proc, tmp_path / name, 1)
            proc.send_signal(sig)
            stdout, _ = proc.communicate(timeout=HANG_S)
        finally:
            kill_group(proc)
        if sig == signal.SIGINT:
            assert proc.returncode == 0 and "continue with --resume" in stdout
        assert load_checkpoint(run_dir)["epoch"] < EPOCHS
        (run_dir / "checkpoints" / ".tmp-epoch_000009.123").mkdir()  # what a kill in the middle of a save leaves
        run_script([f"algos/{algo}.py", "--resume", run_dir], env=kernel_environ("native"))
        assert not list((run_dir / "checkpoints").glob(".tmp-*"))
        assert_same_state(a, load_checkpoint(run_dir), name)


@pytest.mark.slow
@pytest.mark.parametrize("algo, kernel", [*((a, "native") for a in sorted(FLAGS)), ("crd", "avx2"), ("crd", "default")])
def test_two_ranks_match_one_process(algo, kernel, reference, shared_prompts, tmp_path):
    """torchrun with 2 gloo ranks computes bit for bit what one process computes for the same global batch: every draw
    is keyed by the global sample index, each rank takes a slice of every optimizer step, prompts are encoded alone,
    gradients are averaged. One backward per rank and optimizer step (one trained timestep, one micro-batch per rank):
    with more, one process sums the gradients as ((g1 + g2) + g3) + g4 and two ranks as (g1 + g2) + (g3 + g4), which
    differ in rounding (measured with two timesteps: 4e-6 to 7e-6 relative after two steps; README). The one process
    is the reference run, compared at its epoch-2 checkpoint. CRD (its default clip is active here) also under the
    avx2 and default kernels, whose rounding differs from this CPU's (conftest's KERNELS)."""
    a = load_checkpoint(reference(algo, kernel).dir / "checkpoints" / "epoch_000002")
    two = script_argv(algo, shared_prompts, tmp_path / "two", "--num-epochs", 2)
    # torchrun itself for CRD on this CPU's kernels; the other launches run its ranks as fork-server children
    out = run_script([*TORCHRUN, *two], env=kernel_environ(kernel), real_torchrun=(algo, kernel) == ("crd", "native"))
    assert out.stdout.count("final eval") == 1  # only rank 0 evaluates, prints and writes
    (two_dir,) = (tmp_path / "two").iterdir()
    assert len(list(two_dir.glob("events.out.tfevents.*"))) == 1
    b = load_checkpoint(two_dir)
    assert a["epoch"] == 2 and a["step"] == 2 * a["args"]["grad_steps_per_epoch"]
    assert trained(algo, a)
    assert_same_state(a, b, algo)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda n: torch.full((n,), float("nan")), "error: reward 'bad' returned NaN or inf for 4 of 4 images"),
        (lambda n: torch.zeros(n, 2), "error: reward 'bad' returned (4, 2), expected a tensor of shape (4,)"),
    ],
    ids=["nan", "shape"],
)
def test_bad_reward_output_stops_with_one_line(bad, message, prompts, monkeypatch, capsys):
    """In-process, as `python algos/nft.py` runs (`run_main` on tyro's Args), with a registered reward that
    returns `bad(len(prompts))`."""
    import rewards
    from algos import nft

    monkeypatch.setitem(rewards.REWARDS, "bad", lambda device: lambda images, prompts: bad(len(prompts)))
    argv = [*TINY, *FLAGS["nft"].split(), "--test-prompts", prompts / "test.txt", "--reward", "bad"]
    rc = run_in_process(nft, [*argv, "--output-dir", prompts / "runs"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == message


@pytest.mark.slow
def test_nan_loss_skips_then_aborts_with_checkpoint(prompts):
    """A learning rate that blows the weights up: non-finite updates are skipped with a warning, five in a row abort
    with one line and a checkpoint; the earlier checkpoints are kept."""
    out = run("crd", "--num-epochs 8 --learning-rate 1e30 --eval-every 100", prompts, prompts / "runs", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "warning: non-finite gradient" in out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: 5 non-finite updates in a row; checkpoint saved")
    (run_dir,) = (prompts / "runs").iterdir()
    assert (run_dir / "checkpoints" / "last" / "state.pt").exists() and len(
        list((run_dir / "checkpoints").glob("epoch_*"))
    ) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "nft"])
def test_overlapped_and_sequential_reward_call_the_model_on_identical_chunks(algo, prompts, monkeypatch):
    """Why the two paths agree bit for bit on any CPU: the transformer, the VAE and the reward see the same batches (a
    kernel's rounding may depend on the batch size, never on the thread that calls it). In-process, recording every
    call's batch; the test below compares the results of the two paths, which on some CPUs only this makes equal."""
    import importlib

    module = importlib.import_module(f"algos.{algo}")
    calls, velocity, decode = [], common.velocity, common.decode

    def recording_velocity(transformer, x, *a, **k):
        calls.append(("transformer", len(x)))
        return velocity(transformer, x, *a, **k)

    def recording_decode(pipe, z, *a):
        calls.append(("vae", len(z)))
        return decode(pipe, z, *a)

    monkeypatch.setattr(common, "velocity", recording_velocity)
    monkeypatch.setattr(common, "decode", recording_decode)
    seen = {}
    for flag in ("--overlap-reward", "--no-overlap-reward"):
        calls.clear()
        flags = [*TINY, "--num-prompts", "4", *FLAGS[algo].split(), "--num-epochs", "1", "--eval-every", "10", flag]
        argv = [*flags, "--test-prompts", prompts / "test.txt", "--output-dir", prompts / flag.strip("-")]
        assert run_in_process(module, argv) == 0
        seen[flag] = sorted(calls)  # the worker thread's calls interleave with the sampler's
    assert seen["--overlap-reward"] == seen["--no-overlap-reward"]
    assert ("transformer", 4) in seen["--overlap-reward"] and ("transformer", 16) not in seen["--overlap-reward"]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "nft"])
def test_overlapped_reward_equals_sequential(algo, prompts):
    """--overlap-reward (the default: each micro-batch decoded and scored in a worker thread while the next is sampled)
    and --no-overlap-reward give the same epoch bit for bit: rewards, advantages (through the update), losses, weights."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    states, logged = [], []
    for flag in ("--overlap-reward", "--no-overlap-reward"):
        out_dir = prompts / flag.strip("-")
        run(algo, f"--num-epochs 1 --eval-every 10 {flag}", prompts, out_dir)
        (run_dir,) = out_dir.iterdir()
        states.append(load_checkpoint(run_dir))
        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        tags = [t for t in acc.Tags()["scalars"] if t.startswith(("charts/reward", "charts/shapes", "losses/", "eval/"))]
        logged.append({t: [e.value for e in acc.Scalars(t)] for t in tags if "per_sec" not in t})
    assert_same_state(*states, algo)
    assert "losses/policy_loss" in logged[0] and "charts/reward_mean" in logged[0]
    assert logged[0] == logged[1]
