"""The paper commands in benchmark/sd35_*.sh parse with each script's flags and have a valid batch geometry on their
GPU count, for every TASK (they cannot be run here: no GPU, no hub)."""

import importlib
import os
from pathlib import Path

import pytest
import tyro
from conftest import run_script

import distributed

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "benchmark").glob("sd35_*.sh"))
# stands in for torchrun: prints the GPU count, the script and every argument, one per line
FAKE_TORCHRUN = 'torchrun() { printf "%s\\n" "$@"; }; export -f torchrun; bash "$0"'


def parse_script(script: Path, task: str, with_flags: bool = False):
    """Run a paper script with a fake torchrun; returns (GPU count, algorithm name, the parsed Args[, its arguments])."""
    out = run_script(
        ["bash", "-c", FAKE_TORCHRUN, script], python=False, timeout=60, env={**os.environ, "TASK": task, "DATA": "/data"}
    )
    argv = out.stdout.splitlines()
    assert argv[0] == "--nproc-per-node"
    world, path, flags = int(argv[1]), argv[2], argv[3:]
    algo = importlib.import_module(f"algos.{Path(path).stem}")
    args = tyro.cli(algo.Args, args=flags)
    return (world, Path(path).stem, args, flags) if with_flags else (world, Path(path).stem, args)


@pytest.mark.parametrize("task", ["pickscore", "ocr"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_paper_command_parses_with_a_valid_geometry(script, task):
    world, name, args = parse_script(script, task)
    assert args.reward == task and args.model == "stabilityai/stable-diffusion-3.5-medium"
    distributed.batch_layout(args.num_prompts * args.group_size, args.grad_steps_per_epoch, world, args.micro_batch)
    if name in ("crd", "dgpo"):  # whole groups per micro-batch
        assert args.micro_batch % args.group_size == 0


def test_best_of_k_is_the_mean_over_all_k_subsets_of_noises():
    """convergence.best_of_k (the unbiased pass@k estimator) against enumerating every k-subset of the 8 noises."""
    import itertools

    import numpy as np

    from benchmark.convergence import best_of_k

    exact = (np.random.default_rng(0).random((8, 30)) < 0.2).astype(float)
    exact[:, 0], exact[:, 1] = 0, 1  # a prompt never exact, one always
    for k in (1, 4, 8):
        brute = np.mean([np.mean([exact[list(s), p].max() for s in itertools.combinations(range(8), k)]) for p in range(30)])
        assert abs(best_of_k(exact, k) - brute) < 1e-12
    assert best_of_k(exact, 1) == exact.mean()
