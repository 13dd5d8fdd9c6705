"""Every algorithm script run for real, tiny: a smoke run, and an exact resume after an interruption."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --save-every 1"
# per-algorithm flags that keep the smoke run small
EXTRA = {
    "awm": "--grad-steps-per-epoch 2 --num-train-timesteps 2 --kl-beta 0.01 --ema-kl-beta 0.1 --off-policy --ema-decay-ramp 0.2",
    "crd": "--grad-steps-per-epoch 1 --num-train-timesteps 2 --gradient-checkpointing --offload-text-encoders",
    "grpo": "--grad-steps-per-epoch 1 --num-sde-steps 1 --eval-ema-decay 0.9 --eval-num-steps 3",  # + the papers' eval protocol
    "dgpo": "--grad-steps-per-epoch 2 --num-train-timesteps 2 --switch-ema-ref 1 --ema-ref-ramp-rate 0.1",
    "nft": "--num-train-timesteps 2 --kl-beta 0.01 --decay-ramp 0.3",
}


def run(algo, flags, tmp_path, check=True):
    cmd = f"{sys.executable} algos/{algo}.py {TINY} {EXTRA[algo]} --test-prompts {tmp_path / 'test.txt'} --eval-every 1 {flags}"
    out = subprocess.run(cmd, shell=True, cwd=REPO, capture_output=True, text=True, timeout=300)
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return out


@pytest.fixture
def prompts(tmp_path):
    (tmp_path / "test.txt").write_text("a red circle\ntwo squares\n")
    return tmp_path


@pytest.mark.parametrize("algo", sorted(EXTRA))
def test_smoke_and_exact_resume(algo, prompts):
    """A 3-epoch run writes its artifacts; 2 epochs + stop + `--resume` for the third ends bit-identical (CPU)."""
    out = run(algo, f"--num-epochs 3 --output-dir {prompts / 'a'}", prompts)
    assert "final eval" in out.stdout
    (a_dir,) = (prompts / "a").iterdir()
    assert json.loads((a_dir / "args.json").read_text())["num_epochs"] == 3
    assert list(a_dir.glob("events.out.tfevents.*"))
    a = torch.load(a_dir / "checkpoints" / "last.pt", weights_only=False)
    assert a["epoch"] == 3 and a["images_seen"] == 24

    run(algo, f"--num-epochs 2 --output-dir {prompts / 'b'}", prompts)
    (b_dir,) = (prompts / "b").iterdir()
    run(algo, f"--num-epochs 3 --resume {b_dir}", prompts)
    b = torch.load(b_dir / "checkpoints" / "last.pt", weights_only=False)
    assert a["step"] == b["step"] and a["images_seen"] == b["images_seen"]
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), name
    for key, tensors in a.get("snapshots", {}).items():
        for x, y in zip(tensors, b["snapshots"][key]):
            assert torch.equal(x, y), key
    assert (a["eval_ema"] is None) == (b["eval_ema"] is None) == (algo != "grpo")  # grpo runs with --eval-ema-decay: its EMA resumes exactly too
    for x, y in zip(a["eval_ema"] or [], b["eval_ema"] or []):
        assert torch.equal(x, y)


@pytest.mark.parametrize("algo", sorted(EXTRA))
def test_bad_flags_give_one_line(algo, prompts):
    out = run(algo, "--num-epochs 1 --micro-batch 3", prompts, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: micro_batch (3)")
    out = run(algo, "--num-epochs 1 --reward nosuchreward", prompts, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "shapes" in out.stderr


def _wait_for_checkpoint(proc, path, min_epoch, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if path.exists():
            try:
                if torch.load(path, weights_only=False)["epoch"] >= min_epoch:
                    return
            except Exception:  # noqa: BLE001 - renamed in between; try again
                pass
        if proc.poll() is not None:
            raise AssertionError(f"run ended before epoch {min_epoch}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError("no checkpoint in time")


def test_killed_or_interrupted_runs_resume_exactly(prompts):
    """SIGKILL between epochs, and Ctrl-C (finish the epoch, save, exit 0): both resume to the uninterrupted result."""
    import signal

    algo, flags = "crd", "--num-epochs 4 --eval-every 10"
    run(algo, f"{flags} --output-dir {prompts / 'a'}", prompts)
    (a_dir,) = (prompts / "a").iterdir()
    a = torch.load(a_dir / "checkpoints" / "last.pt", weights_only=False)
    for name, sig in (("kill", signal.SIGKILL), ("int", signal.SIGINT)):
        out_dir = prompts / name
        cmd = f"{sys.executable} algos/{algo}.py {TINY} {EXTRA[algo]} --test-prompts {prompts / 'test.txt'} {flags} --output-dir {out_dir}"
        proc = subprocess.Popen(cmd.split(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # wait for the first run directory, then for a checkpoint written at an epoch boundary
        while not out_dir.exists() or not list(out_dir.iterdir()):
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.2)
        (run_dir,) = out_dir.iterdir()
        _wait_for_checkpoint(proc, run_dir / "checkpoints" / "last.pt", 1)
        proc.send_signal(sig)
        stdout, _ = proc.communicate(timeout=240)
        if sig == signal.SIGINT:
            assert proc.returncode == 0 and "continue with --resume" in stdout
        assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["epoch"] < 4
        run(algo, f"{flags} --resume {run_dir}", prompts)
        b = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
        assert b["epoch"] == 4 and b["step"] == a["step"]
        for key, value in a["params"].items():
            assert torch.equal(value, b["params"][key]), (name, key)


def _params(run_parent: Path) -> dict:
    (run_dir,) = run_parent.iterdir()
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)


@pytest.mark.parametrize("algo", sorted(EXTRA))
def test_two_ranks_match_one_process(algo, prompts):
    """torchrun with 2 gloo ranks computes what one process computes for the same global batch: every draw is keyed
    by the global sample index, each rank takes a slice of every optimizer step, gradients are averaged."""
    flags = "--num-epochs 2 --eval-every 10 --grad-steps-per-epoch 1"
    run(algo, f"{flags} --output-dir {prompts / 'one'}", prompts)
    cmd = (f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 algos/{algo}.py {TINY} {EXTRA[algo]} "
           f"--test-prompts {prompts / 'test.txt'} {flags} --output-dir {prompts / 'two'}")  # fmt: skip
    out = subprocess.run(cmd, shell=True, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("final eval") == 1  # only rank 0 evaluates, prints and writes
    (two_dir,) = (prompts / "two").iterdir()
    assert len(list(two_dir.glob("events.out.tfevents.*"))) == 1
    a, b = _params(prompts / "one"), _params(prompts / "two")
    assert a["step"] == b["step"] == 2
    # LoRA B starts at 0, so its norm is the size of the update; summation order may differ across ranks
    keys = [k for k in a["params"] if "lora_B" in k]
    diff = sum((a["params"][k] - b["params"][k]).pow(2).sum() for k in keys).sqrt()
    update = sum(a["params"][k].pow(2).sum() for k in keys).sqrt()
    assert update > 0 and diff / update < 1e-2, (diff / update).item()


BAD_INPUTS = {  # flags -> the start of the one error line
    "--train-prompts {tmp}/empty.txt": "error: prompt file",
    "--train-prompts {tmp}/bad.jsonl": "error: {tmp}/bad.jsonl:1: expected a JSON object",
    "--train-prompts {tmp}/missing.txt": "error: prompt file",
    "--model {tmp}/no-model": "error: model",
    "--group-size 1": "error: group_size must be >= 2",
    "--grad-steps-per-epoch 3": "error: grad_steps_per_epoch x world size (3 x 1)",
    "--reward shapes:heavy": "error: bad weight 'heavy'",
    "--reward ocr": "error: the ocr reward needs the text to write in double quotes",  # shapes prompts, no quotes
}


@pytest.mark.parametrize("flags", sorted(BAD_INPUTS))
def test_bad_input_gives_one_line_and_exit_2(flags, prompts):
    (prompts / "empty.txt").write_text("\n\n")
    (prompts / "bad.jsonl").write_text('{"text": "a red circle"}\n')
    out = run("nft", f"--num-epochs 1 --output-dir {prompts / 'runs'} " + flags.format(tmp=prompts), prompts, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(BAD_INPUTS[flags].format(tmp=prompts)), out.stderr[-500:]
    assert not (prompts / "runs").exists()  # failed before anything was written


def test_bad_cli_choice_exits_2(prompts):
    out = run("nft", "--dynamics Foo", prompts, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "invalid choice 'Foo'" in out.stderr


BAD_REWARD = """
import sys, torch
sys.path[:0] = ["{repo}", "{repo}/algos"]
import rewards, nft, tyro, common
rewards.REWARDS["bad"] = lambda device: (lambda images, prompts: {bad})
common.run_main(nft.main, tyro.cli(nft.Args))
"""


@pytest.mark.parametrize("bad, message", [
    ("torch.full((len(prompts),), float('nan'))", "error: reward 'bad' returned NaN or inf for 4 of 4 images"),
    ("torch.zeros(len(prompts), 2)", "error: reward 'bad' returned (4, 2), expected a tensor of shape (4,)"),
])  # fmt: skip
def test_bad_reward_output_stops_with_one_line(bad, message, prompts):
    script = prompts / "bad_reward.py"
    script.write_text(BAD_REWARD.format(bad=bad, repo=REPO))
    cmd = f"{sys.executable} {script} {TINY} {EXTRA['nft']} --test-prompts {prompts / 'test.txt'} --reward bad --output-dir {prompts / 'runs'}"
    out = subprocess.run(cmd, shell=True, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == message


def test_nan_loss_skips_then_aborts_with_checkpoint(prompts):
    """A learning rate that blows the weights up: non-finite updates are skipped with a warning, five in a row abort
    with one line and a checkpoint; the earlier checkpoints are kept."""
    out = run("crd", f"--num-epochs 8 --learning-rate 1e30 --eval-every 100 --output-dir {prompts / 'runs'}", prompts, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "warning: non-finite gradient" in out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: 5 non-finite updates in a row; checkpoint saved")
    (run_dir,) = (prompts / "runs").iterdir()
    assert (run_dir / "checkpoints" / "last.pt").exists() and list((run_dir / "checkpoints").glob("epoch_*.pt"))
