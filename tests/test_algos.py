"""Every algorithm script run for real, tiny: a smoke run, and an exact resume after an interruption."""

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import kill_group, run_script, start_script

import common

REPO = Path(__file__).resolve().parents[1]
TINY = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --save-every 1".split()
# per-algorithm flags that keep the smoke run small
EXTRA = {
    "awm": "--grad-steps-per-epoch 2 --num-train-timesteps 2 --kl-beta 0.01 --ema-kl-beta 0.1 --off-policy "
    "--ema-decay-ramp 0.2",
    "crd": "--grad-steps-per-epoch 1 --num-train-timesteps 2 --gradient-checkpointing --offload-text-encoders",
    # + the papers' eval protocol
    "grpo": "--grad-steps-per-epoch 1 --num-sde-steps 1 --eval-ema-decay 0.9 --eval-num-steps 3",
    "dgpo": "--grad-steps-per-epoch 2 --num-train-timesteps 2 --switch-ema-ref 1 --ema-ref-decay-ramp 0.1",
    "nft": "--num-train-timesteps 2 --kl-beta 0.01 --old-decay-ramp 0.3",
}
# 3 train prompts, 2 per epoch: prompts repeat across epochs, so an embedding cached in an earlier epoch is reused --
# after a resume too (the cache then starts empty: embeddings must not depend on which prompts were new together)
TRAIN = "a blue square\nthree circles\na red square\n"  # none of them a test prompt: eval does not encode them


def run(algo, flags, tmp_path, check=True):
    argv = [
        f"algos/{algo}.py",
        *TINY,
        *EXTRA[algo].split(),
        "--train-prompts",
        tmp_path / "train.txt",
        "--test-prompts",
        tmp_path / "test.txt",
        "--eval-every",
        "1",
        *flags.split(),
    ]
    return run_script(argv, check=check)


@pytest.fixture
def prompts(tmp_path):
    (tmp_path / "test.txt").write_text("a red circle\ntwo squares\n")
    (tmp_path / "train.txt").write_text(TRAIN)
    return tmp_path


def assert_same_state(a, b, label=""):
    assert a["epoch"] == b["epoch"] and a["step"] == b["step"] and a["images_seen"] == b["images_seen"], label
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), (label, name)
    for key, tensors in a["snapshots"].items():
        for x, y in zip(tensors, b["snapshots"][key]):
            assert torch.equal(x, y), (label, key)
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(x[k], y[k]) for k in x), label
    assert (a["eval_ema"] is None) == (b["eval_ema"] is None) == ("--eval-ema-decay" not in EXTRA.get(label, "")), label
    for x, y in zip(a["eval_ema"] or [], b["eval_ema"] or []):  # the eval EMA (grpo runs with one) resumes exactly too
        assert torch.equal(x, y), label


@pytest.mark.parametrize("algo", sorted(EXTRA))
def test_smoke_and_exact_resume(algo, prompts):
    """A 3-epoch run writes its artifacts; 1 epoch + `--resume` for two more ends bit-identical (CPU), with prompts
    that repeat across epochs."""
    out = run(algo, f"--num-epochs 3 --output-dir {prompts / 'a'}", prompts)
    assert "final eval" in out.stdout
    (a_dir,) = (prompts / "a").iterdir()
    assert json.loads((a_dir / "args.json").read_text())["num_epochs"] == 3
    assert list(a_dir.glob("events.out.tfevents.*"))
    saved = sorted(p.name for p in (a_dir / "checkpoints").iterdir())
    assert saved == ["epoch_000001", "epoch_000002", "epoch_000003", "last"]
    # no pickle: the trainable state is safetensors, the rest loads with weights_only=True
    assert torch.load(a_dir / "checkpoints" / "last" / "state.pt", weights_only=True)["epoch"] == 3
    a = common.load_checkpoint(a_dir)
    assert a["epoch"] == 3 and a["images_seen"] == 24

    run(algo, f"--num-epochs 1 --output-dir {prompts / 'b'}", prompts)
    (b_dir,) = (prompts / "b").iterdir()
    args_before = (b_dir / "args.json").read_bytes()
    # only the resume path and the new length: the run's other flags come from the checkpoint
    run_script([f"algos/{algo}.py", "--resume", b_dir, "--num-epochs", "3"])
    assert_same_state(a, common.load_checkpoint(b_dir), algo)
    assert (b_dir / "args.json").read_bytes() == args_before  # the run's record is appended to, never rewritten
    (record,) = [json.loads(line) for line in (b_dir / "resumes.jsonl").read_text().splitlines()]
    assert record["epoch"] == 1 and record["overrides"] == {"num_epochs": {"saved": 1, "now": 3}}


def _wait_for_checkpoint(proc, run_parent: Path, min_epoch, timeout=240):
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


def test_killed_or_interrupted_runs_resume_exactly(prompts):
    """SIGKILL between epochs, and Ctrl-C (finish the epoch, save, exit 0): both resume to the uninterrupted result,
    with prompts repeating across epochs; a temp folder left by a kill mid-save is removed on resume."""
    algo, flags = "crd", "--num-epochs 4 --eval-every 10"
    run(algo, f"{flags} --output-dir {prompts / 'a'}", prompts)
    a = common.load_checkpoint(next((prompts / "a").iterdir()))
    for name, sig in (("kill", signal.SIGKILL), ("int", signal.SIGINT)):
        argv = [
            f"algos/{algo}.py",
            *TINY,
            *EXTRA[algo].split(),
            "--train-prompts",
            prompts / "train.txt",
            "--test-prompts",
            prompts / "test.txt",
            *flags.split(),
            "--output-dir",
            prompts / name,
        ]
        proc = start_script(argv)
        try:
            run_dir = _wait_for_checkpoint(proc, prompts / name, 1)
            proc.send_signal(sig)
            stdout, _ = proc.communicate(timeout=240)
        finally:
            kill_group(proc)
        if sig == signal.SIGINT:
            assert proc.returncode == 0 and "continue with --resume" in stdout
        assert common.load_checkpoint(run_dir)["epoch"] < 4
        (run_dir / "checkpoints" / ".tmp-epoch_000009.123").mkdir()  # what a kill in the middle of a save leaves
        run_script([f"algos/{algo}.py", "--resume", run_dir])
        assert not list((run_dir / "checkpoints").glob(".tmp-*"))
        assert_same_state(a, common.load_checkpoint(run_dir), name)


@pytest.mark.parametrize("algo", sorted(EXTRA))
def test_two_ranks_match_one_process(algo, prompts):
    """torchrun with 2 gloo ranks computes bit for bit what one process computes for the same global batch: every draw
    is keyed by the global sample index, each rank takes a slice of every optimizer step, prompts are encoded alone,
    gradients are averaged. One backward per rank and optimizer step (one trained timestep, one micro-batch per rank):
    with more, one process sums the gradients as ((g1 + g2) + g3) + g4 and two ranks as (g1 + g2) + (g3 + g4), which
    differ in rounding (measured with two timesteps: 4e-6 to 7e-6 relative after two steps; README)."""
    flags = "--num-epochs 2 --eval-every 10 --grad-steps-per-epoch 1" + ("" if algo == "grpo" else " --num-train-timesteps 1")
    run(algo, f"{flags} --output-dir {prompts / 'one'}", prompts)
    argv = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        f"algos/{algo}.py",
        *TINY,
        *EXTRA[algo].split(),
        "--train-prompts",
        prompts / "train.txt",
        "--test-prompts",
        prompts / "test.txt",
        *flags.split(),
        "--output-dir",
        prompts / "two",
    ]
    out = run_script(argv)
    assert out.stdout.count("final eval") == 1  # only rank 0 evaluates, prints and writes
    (two_dir,) = (prompts / "two").iterdir()
    assert len(list(two_dir.glob("events.out.tfevents.*"))) == 1
    a, b = common.load_checkpoint(next((prompts / "one").iterdir())), common.load_checkpoint(two_dir)
    assert a["step"] == 2 and any(v.abs().sum() > 0 for k, v in a["params"].items() if "lora_B" in k)  # it did move
    assert_same_state(a, b, algo)


BAD_REWARD = """
import sys, torch
sys.path[:0] = ["{repo}", "{repo}/algos"]
import rewards, nft, tyro, common
rewards.REWARDS["bad"] = lambda device: (lambda images, prompts: {bad})
common.run_main(nft.main, tyro.cli(nft.Args))
"""


@pytest.mark.parametrize(
    "bad, message",
    [
        ("torch.full((len(prompts),), float('nan'))", "error: reward 'bad' returned NaN or inf for 4 of 4 images"),
        ("torch.zeros(len(prompts), 2)", "error: reward 'bad' returned (4, 2), expected a tensor of shape (4,)"),
    ],
)
def test_bad_reward_output_stops_with_one_line(bad, message, prompts):
    script = prompts / "bad_reward.py"
    script.write_text(BAD_REWARD.format(bad=bad, repo=REPO))
    out = run_script(
        [
            script,
            *TINY,
            *EXTRA["nft"].split(),
            "--test-prompts",
            prompts / "test.txt",
            "--reward",
            "bad",
            "--output-dir",
            prompts / "runs",
        ],
        check=False,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == message


def test_nan_loss_skips_then_aborts_with_checkpoint(prompts):
    """A learning rate that blows the weights up: non-finite updates are skipped with a warning, five in a row abort
    with one line and a checkpoint; the earlier checkpoints are kept."""
    out = run(
        "crd", f"--num-epochs 8 --learning-rate 1e30 --eval-every 100 --output-dir {prompts / 'runs'}", prompts, check=False
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "warning: non-finite gradient" in out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: 5 non-finite updates in a row; checkpoint saved")
    (run_dir,) = (prompts / "runs").iterdir()
    assert (run_dir / "checkpoints" / "last" / "state.pt").exists() and len(
        list((run_dir / "checkpoints").glob("epoch_*"))
    ) >= 2
