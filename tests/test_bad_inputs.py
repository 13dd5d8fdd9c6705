"""Every bad input ends as one line on stderr and exit code 2, before the model loads where it can be known, and
writes nothing: no run folder appears, an existing run stays byte for byte as it was.

The scripts run in-process (`common.run_main` on tyro-parsed flags, as `python algos/<algo>.py` does), so the whole
table takes seconds; only what needs a process of its own (a signal) runs as a subprocess."""

import fcntl
import shutil
import sys
from pathlib import Path

import pytest
import torch
import tyro
from conftest import run_script

import common
from algos import awm, crd, dgpo, grpo, nft

ALGOS = {"awm": awm, "crd": crd, "dgpo": dgpo, "grpo": grpo, "nft": nft}
TINY = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --num-epochs 1 --grad-steps-per-epoch 1".split()
LONG = "a red circle " + "and " * 2500  # 10,000 characters the reward cannot parse

# flags -> a piece of the one error line; {tmp} is the test's folder. Shared checks: run for all five scripts.
SHARED = {
    "--num-prompts 0": "--num-prompts 0: must be > 0",
    "--micro-batch 0": "--micro-batch 0: must be > 0",
    "--grad-steps-per-epoch 0": "--grad-steps-per-epoch 0: must be > 0",
    "--learning-rate=-1": "--learning-rate -1.0: must be >= 0",
    "--learning-rate nan": "--learning-rate nan: must be a finite number",
    "--num-steps 0": "--num-steps 0: must be > 0",
    "--eta=-1": "--eta -1.0: must be >= 0",
    "--num-epochs=-1": "--num-epochs -1: must be > 0",
    "--save-every 0": "--save-every 0: must be > 0",
    "--eval-every 0": "--eval-every 0: must be > 0",
    "--keep-checkpoints=-1": "--keep-checkpoints -1: must be >= 0",
    "--lora-rank 0": "--lora-rank 0: must be > 0",
    "--max-grad-norm 0": "--max-grad-norm 0.0: must be > 0",
    "--device cuda:99": "--device cuda:99",
    "--device gpu": "--device 'gpu' is not a torch device",
    "--output-dir {tmp}/a-file/runs": "cannot create a run folder there",
    "--reward shapes:nan": "bad weight 'nan' for reward 'shapes'",
    "--reward shapes:inf": "bad weight 'inf' for reward 'shapes'",
    "--reward nosuchreward": "unknown reward 'nosuchreward'",
    "--reward ocr": "the ocr reward needs the text to write in double quotes",
    "--train-prompts {tmp}/latin1.txt": "is not UTF-8 text",
    "--train-prompts {tmp}/long.txt": "the shapes reward cannot score the prompt 'a red circle and and",
    "--resolution 50": "resolution 50 must be a multiple of 8",
    "--model {tmp}/no-model": "no such pipeline folder",
    "--group-size 1": "group_size must be >= 2",
    "--grad-steps-per-epoch 3": "grad_steps_per_epoch x world size (3 x 1)",
    "--eval-num-steps 0": "--eval-num-steps 0: must be > 0",
    "--eval-guidance-scale 0.5": "--eval-guidance-scale 0.5: must be >= 1",
    "--eval-ema-decay 1": "--eval-ema-decay 1.0: must be in [0, 1)",
    "--push-to-hub not/a/repo": "is not a hub repo id",
    "--reward shapes_clean:2,shapes:nan": "bad weight 'nan' for reward 'shapes'",
}
# single-script checks (and shared ones run once: they cost a model load or are covered by the table above)
SPECIFIC = [
    ("grpo", "--dynamics ODE", "Flow-GRPO needs per-step log-probs"),
    ("grpo", "--num-sde-steps 9", "num_sde_steps (9) must be between 1 and the SDE window size"),
    ("grpo", "--dynamics CPS --eta 2", "CPS needs eta in [0, 1]"),
    ("nft", "--nft-beta 0", "nft_beta (0.0) must be > 0"),
    ("nft", "--old-decay-max 2", "--old-decay-max 2.0: must be in [0, 1]"),
    ("crd", "--micro-batch 2", "must hold whole groups"),
    ("crd", "--sampling-decay-ramp -0.1", "--sampling-decay-ramp -0.1: must be >= 0"),
    ("dgpo", "--ema-ref-decay-start 1.5", "--ema-ref-decay-start 1.5: must be in [0, 1]"),
    ("dgpo", "--micro-batch 2", "must hold whole groups"),
    ("nft", "--micro-batch 3", "micro_batch (3) must divide"),
    ("nft", "--lora-targets nosuchmodule", "--lora-targets nosuchmodule: no LoRA could be attached"),
    ("nft", "--lora-alpha 0", "--lora-alpha 0.0: must be > 0"),
    ("nft", "--train-prompts {tmp}/empty.txt", "has no prompts"),
    ("nft", "--train-prompts {tmp}/bad.jsonl", "bad.jsonl:1: expected a JSON object"),
    ("nft", "--train-prompts {tmp}/missing.txt", "not found"),
    ("nft", "--train-prompts {tmp}", "is a folder"),
    ("nft", "--train-prompts /dev/null", "is not a regular file"),
    ("nft", "--test-prompts {tmp}", "is a folder"),
    ("nft", "--test-prompts {tmp}/missing.txt", "not found"),
    ("nft", "--reward shapes:heavy", "bad weight 'heavy'"),
    ("awm", "--num-train-timesteps 0", "--num-train-timesteps 0: must be > 0"),
]
CASES = [(algo, flags, msg) for flags, msg in SHARED.items() for algo in ALGOS] + SPECIFIC


@pytest.fixture
def files(tmp_path):
    (tmp_path / "test.txt").write_text("a red circle\ntwo squares\n")
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "latin1.txt").write_bytes("a red circle\ntwo squares caf\xe9\n".encode("latin-1"))
    (tmp_path / "long.txt").write_text(f"a red circle\n{LONG}\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a red circle"}\n')
    return tmp_path


def call(algo: str, argv: list, capsys) -> tuple:
    """`python algos/<algo>.py *argv` in-process -> (exit code, stderr); fails if the script does not exit."""
    mod = ALGOS[algo]
    args = tyro.cli(mod.Args, args=argv)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        common.run_main(mod.main, args, argv=argv)
    return e.value.code, capsys.readouterr().err


def assert_one_line(rc, err, expected):
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.strip() and "Loading " not in x]  # from_pretrained's progress bars
    assert line.startswith("error: ") and expected in line, line
    assert len(line) < 1000  # a 10,000-character prompt is cut
    return line


@pytest.mark.parametrize("algo, flags, expected", CASES, ids=[f"{a}:{f}" for a, f, _ in CASES])
def test_bad_input_one_line_exit_2_nothing_written(algo, flags, expected, files, capsys):
    argv = [
        *TINY,
        "--test-prompts",
        str(files / "test.txt"),
        "--output-dir",
        str(files / "runs"),
        *flags.format(tmp=files).split(),
    ]
    rc, err = call(algo, argv, capsys)
    assert_one_line(rc, err, expected.format(tmp=files))
    assert not (files / "runs").exists() and not (files / "a-file").is_dir()


# ----------------------------------------------------------------------------------------------------------------
# resume: the run's flags come from its checkpoint; a bad resume changes nothing
# ----------------------------------------------------------------------------------------------------------------
def snapshot(folder: Path) -> dict:
    """Every file's bytes (and every symlink's target) under `folder`."""
    return {
        str(p.relative_to(folder)): (p.readlink() if p.is_symlink() else p.read_bytes() if p.is_file() else None)
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="module")
def nft_run(tmp_path_factory):
    """One finished 1-epoch nft run, made in-process; tests copy it before they may touch it."""
    tmp = tmp_path_factory.mktemp("nftrun")
    (tmp / "test.txt").write_text("a red circle\ntwo squares\n")
    argv = [
        *TINY,
        "--num-train-timesteps",
        "1",
        "--eval-every",
        "5",
        "--test-prompts",
        str(tmp / "test.txt"),
        "--output-dir",
        str(tmp / "runs"),
    ]
    common.run_main(nft.main, tyro.cli(nft.Args, args=argv), argv=argv)
    (run_dir,) = (tmp / "runs").iterdir()
    return run_dir


@pytest.fixture
def run_copy(nft_run, tmp_path):
    dst = tmp_path / "runs" / nft_run.name
    shutil.copytree(nft_run, dst, symlinks=True)
    return dst


def _truncate(run):
    state = (run / "checkpoints" / "last" / "state.pt").resolve()
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])


RESUME_CASES = {  # (script, extra flags, what to do to the run first) -> a piece of the one line
    "changed flag": ("nft", "--learning-rate 0.1", None, "--learning-rate is 0.003 in the run being resumed, 0.1 given"),
    "flag given at its default": ("nft", "--num-prompts 8", None, "--num-prompts is 2 in the run being resumed, 8 given"),
    "changed bool flag": ("nft", "--no-torch-deterministic", None, "--torch-deterministic is True in the run being resumed"),
    "changed model": ("nft", "--model assets/tiny-text", None, "--model is"),
    "wrong script": ("grpo", "", None, "was written by nft.py; resume it with algos/nft.py, not grpo.py"),
    "already finished": ("nft", "--num-epochs 1", None, "is at epoch 1; pass --num-epochs > 1"),
    "truncated state": ("nft", "", _truncate, "cannot be read"),
    "empty weights": (
        "nft",
        "",
        lambda run: (run / "checkpoints" / "last" / "weights.safetensors").resolve().write_bytes(b""),
        "weights.safetensors cannot be read",
    ),
    "missing state": (
        "nft",
        "",
        lambda run: (run / "checkpoints" / "last" / "state.pt").resolve().unlink(),
        "state.pt is missing",
    ),
    "no checkpoint": ("nft", "", lambda run: shutil.rmtree(run / "checkpoints"), "the run folder has no checkpoint"),
    "old pickle": (
        "nft",
        "",
        lambda run: torch.save({"epoch": 1}, run / "last.pt"),
        "a pickled checkpoint of an older cleanflow",
    ),
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_bad_resume_one_line_run_unchanged(case, run_copy, capsys):
    algo, flags, damage, expected = RESUME_CASES[case]
    target = run_copy
    if damage is not None:
        damage(run_copy)
        if case == "old pickle":
            target = run_copy / "last.pt"
    before = snapshot(run_copy)
    rc, err = call(algo, ["--resume", str(target), "--num-epochs", "2", *flags.split()], capsys)
    assert_one_line(rc, err, expected)
    assert snapshot(run_copy) == before


def test_copied_out_checkpoint_is_refused(run_copy, tmp_path, capsys):
    """A checkpoint folder copied out of its run (/x/a/b/e) must not make /x/a the run folder."""
    loose = tmp_path / "x" / "a" / "b" / "e"
    shutil.copytree((run_copy / "checkpoints" / "last").resolve(), loose)
    (tmp_path / "x" / "a" / "args.json").write_text("{}")
    before = snapshot(tmp_path / "x")
    rc, err = call("nft", ["--resume", str(loose), "--num-epochs", "2"], capsys)
    assert_one_line(rc, err, "this checkpoint is not inside a run folder")
    assert snapshot(tmp_path / "x") == before


def test_second_writer_is_refused(run_copy, capsys):
    """While a process holds the run (its .lock), a resume of it stops with one line and writes nothing."""
    with open(run_copy / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: conflicts as another process would
        before = snapshot(run_copy)
        rc, err = call("nft", ["--resume", str(run_copy), "--num-epochs", "2"], capsys)
        assert_one_line(rc, err, "is in use by another process")
        assert snapshot(run_copy) == before
    assert not common._LOCKS  # run_main let go of what it held


def test_resume_restores_the_saved_flags(run_copy, capsys):
    """Only --resume (here one checkpoint folder of the run) and --num-epochs given: the run continues with its own flags
    (not the defaults), and the resume
    is appended to resumes.jsonl while args.json stays as the run began."""
    args_json = (run_copy / "args.json").read_bytes()
    argv = ["--resume", str(run_copy / "checkpoints" / "epoch_000001"), "--num-epochs", "2"]  # one checkpoint of the run
    args = tyro.cli(nft.Args, args=argv)
    common.run_main(nft.main, args, argv=argv)
    assert args.num_prompts == 2 and args.num_steps == 4 and args.num_train_timesteps == 1 and args.eval_every == 5
    assert common.load_checkpoint(run_copy)["epoch"] == 2
    assert (run_copy / "args.json").read_bytes() == args_json
    assert len((run_copy / "resumes.jsonl").read_text().splitlines()) == 1


def test_fresh_run_names_are_unique(files):
    """Two runs of the same reward, exp and seed started in the same second get different folders."""
    names = set()
    for _ in range(2):
        args = nft.Args(output_dir=str(files / "runs"), test_prompts=str(files / "test.txt"))
        names.add(common.start_run(args, nft.__file__)[0])
    assert len(names) == 2 and not (files / "runs").exists()


INTERRUPT = """
import os, signal, sys, time
sys.path[:0] = [{repo!r}, {repo!r} + "/algos"]
import common, nft, tyro
def loading(*args, **kwargs):  # Ctrl-C arrives while the model loads
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
common.load_pipeline = loading
common.run_main(nft.main, tyro.cli(nft.Args))
"""


def test_ctrl_c_while_the_model_loads_is_one_line(files):
    script = files / "interrupt.py"
    script.write_text(INTERRUPT.format(repo=str(common.REPO)))
    out = run_script([script, "--test-prompts", files / "test.txt", "--output-dir", files / "runs"], check=False, timeout=120)
    assert out.returncode == 130 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == ["error: interrupted (Ctrl-C); nothing was saved since the last checkpoint"]
    assert not (files / "runs").exists()


def test_bad_cli_choice_exits_2(files):
    out = run_script(["algos/nft.py", "--dynamics", "Foo"], check=False, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "invalid choice 'Foo'" in out.stderr


def test_saved_state_loads_without_pickle(nft_run):
    state = torch.load(nft_run / "checkpoints" / "last" / "state.pt", weights_only=True)
    assert state["algo"] == "nft" and state["args"]["num_prompts"] == 2 and sys.modules["common"] is common
