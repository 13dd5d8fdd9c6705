"""Seconds per epoch, split sampling / reward / training, and images/s: variants of one script run interleaved.

    python benchmark/speed.py --base 1c80a63                     # base commit vs --no-overlap-reward vs default
    python benchmark/speed.py --variants eager compile --epochs 4 --warmup 2
    python benchmark/speed.py --variants sequential mb32-sequential overlap mb32 --tasks shapes
    python benchmark/speed.py --tasks --components --throughput --base 1c80a63

Each run is a separate process of algos/<algo>.py (1 thread, its default batch: 64 images per epoch) for --epochs
epochs; the first --warmup epochs are dropped and the scripts' own `time/sampling`, `time/reward`, `time/training`
scalars are averaged over the rest (evaluation is not in them; a 2-prompt test set keeps it short). "reward" is what
the epoch waits for the reward: with the overlap, only what sampling did not hide. The variants run in turn (ABC ABC
...), so that load from other jobs hits all of them alike, and each ratio is taken between runs of the same round:
the tables give the median ratio over the rounds and its range. os.getloadavg() is recorded around every run.
`--base <rev>` runs a `git archive` copy of that commit as the variant "base". `--throughput` also runs
benchmark/throughput.py (our sampler vs StableDiffusion3Pipeline.__call__) in this checkout and in the base;
`--components` times a `transformer.dtype` read and an eval forward with the LoRA merged.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASKS = {
    "shapes": ([], "assets/test.jsonl"),
    "ocr": (
        "--model assets/tiny-text --reward ocr --train-prompts assets/text_train.jsonl".split(),
        "assets/text_test.jsonl",
    ),
}
# variant name -> (checkout: "base" or "here", extra flags)
VARIANTS = {
    "base": ("base", []),
    "sequential": ("here", ["--no-overlap-reward"]),
    "overlap": ("here", []),
    "eager": ("here", []),
    "compile": ("here", ["--compile"]),
    "mb32": ("here", ["--micro-batch", "32"]),  # also samples in chunks of 32: 2 chunks, less overlap
    "mb32-sequential": ("here", ["--micro-batch", "32", "--no-overlap-reward"]),  # vs "sequential": training alone differs
}
SECTIONS = ("sampling", "reward", "training")
COMPILED = re.compile(r"--compile: the first transformer call compiled (\d+) blocks in ([\d.]+) s")


def checkout(rev: str, into: Path) -> Path:
    """The files of commit `rev` (git archive: no worktree, nothing in this repository changes)."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    archive = into / "base.tar"
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "base", filter="data")
    return into / "base"


def epoch_times(run_dir: Path) -> list:
    """[{section: seconds}] per epoch, from the run's TensorBoard scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    per = {s: [e.value for e in acc.Scalars(f"time/{s}")] for s in SECTIONS}
    return [dict(zip(SECTIONS, values)) for values in zip(*per.values())]


def one_run(repo: Path, algo: str, task: str, flags: list, args, work: Path, env: dict) -> dict:
    task_flags, test_file = TASKS[task]
    test = work / f"test_{task}.jsonl"
    if not test.exists():  # two held-out prompts: the evaluations (not timed here) stay short
        test.write_text("".join((REPO / test_file).read_text().splitlines(keepends=True)[:2]))
    out = Path(tempfile.mkdtemp(dir=work))
    argv = [sys.executable, str(repo / "algos" / f"{algo}.py"), *task_flags, "--test-prompts", str(test)]
    argv += ["--num-epochs", str(args.epochs), "--eval-every", "1000", "--save-every", "1000", "--output-dir", str(out)]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(argv + flags, cwd=repo, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv + flags)} failed:\n{proc.stderr[-3000:]}")
    (run_dir,) = out.iterdir()
    epochs = epoch_times(run_dir)[args.warmup :]
    mean = {s: statistics.mean(e[s] for e in epochs) for s in SECTIONS}
    mean["epoch"] = sum(mean[s] for s in SECTIONS)
    images = json.loads((run_dir / "args.json").read_text())
    mean["images_per_s"] = images["num_prompts"] * images["group_size"] / mean["epoch"]
    mean["load"] = (load_before + os.getloadavg()[0]) / 2
    mean["wall"] = wall
    compiled = COMPILED.search(proc.stdout)
    if compiled:
        mean["compile_s"] = float(compiled.group(2))
    return mean


def table(task: str, algo: str, names: list, rounds: list) -> str:
    ref = names[0]
    lines = [
        f"\n**{task}** ({algo}, {len(rounds)} interleaved rounds; seconds per epoch: mean of the timed epochs, "
        "median over rounds)\n",
        f"| variant | sampling | reward (wait) | training | epoch | images/s | epoch ratio {ref}/variant (range) | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        runs = [r[name] for r in rounds]
        med = {k: statistics.median(run[k] for run in runs) for k in (*SECTIONS, "epoch", "images_per_s", "load")}
        ratios = [r[ref]["epoch"] / r[name]["epoch"] for r in rounds]
        extra = ""
        if "compile_s" in runs[0]:
            seconds = ", ".join(f"{run['compile_s']:.0f}" for run in runs)
            extra = f" (first-call compile {seconds} s)"
        lines.append(
            f"| {name}{extra} | {med['sampling']:.2f} | {med['reward']:.2f} | {med['training']:.2f} | {med['epoch']:.2f} | "
            f"{med['images_per_s']:.1f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
            f"{min(run['load'] for run in runs):.1f}-{max(run['load'] for run in runs):.1f} |"
        )
    return "\n".join(lines)


def components(repeats: int) -> str:
    """Two small measurements in this process (1 thread): the cost of reading `transformer.dtype` (what
    `common.model_dtype` caches), and an evaluation forward (batch 32, LoRA r16 on the 8 SD3 projections, nonzero)
    with the adapter applied per layer vs merged into the base weights (merge and unmerge included)."""
    import timeit

    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    sys.path.insert(0, str(REPO))
    import common
    import models  # noqa: F401  (registers the model families)
    from harness import prompt_files

    torch.set_num_threads(1)
    pipe = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"))
    transformer = pipe.transformer
    torch.manual_seed(0)
    targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    with torch.no_grad():
        for p in models.add_lora(transformer, 16, 32.0, targets):
            p.normal_(0, 0.02)
    dtype_ms = timeit.timeit(lambda: transformer.dtype, number=200) / 200 * 1e3
    prompts = (prompt_files.load_prompts(common.TEST_PROMPTS) * 2)[:32]
    cond = common.PromptEncoder(pipe).cond(prompts, negative=False)
    x = torch.randn(32, *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.full((32,), 0.6)
    layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]

    @torch.no_grad()
    def forward():
        return common.velocity(transformer, x, sigma, cond)

    def merged():
        for m in layers:
            m.merge()
        try:
            return forward()
        finally:
            for m in layers:
                m.unmerge()

    diff = (forward() - merged()).abs().max().item()
    t_lora, t_merged = [], []
    for _ in range(repeats):
        for fn, times in ((forward, t_lora), (merged, t_merged)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    step = statistics.median(t_lora)
    return (
        f"\n**components** (tiny-shapes, 1 thread, median of {repeats}, load {os.getloadavg()[0]:.1f})\n\n"
        f"- `transformer.dtype`: {dtype_ms:.2f} ms per read ({dtype_ms / 1e3 / step * 100:.1f}% of a batch-32 forward)\n"
        f"- eval forward, batch 32: LoRA per layer {step * 1e3:.0f} ms, merged {statistics.median(t_merged) * 1e3:.0f} ms "
        f"(ratio {step / statistics.median(t_merged):.3f}); max |v| difference {diff:.1e}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="a git revision to run as the variant 'base' (first in the table)")
    ap.add_argument("--variants", nargs="+", default=["base", "sequential", "overlap"], choices=sorted(VARIANTS))
    ap.add_argument("--tasks", nargs="*", default=["shapes", "ocr"], choices=sorted(TASKS), help="none: only the extras")
    ap.add_argument("--algo", default="nft", choices=["awm", "crd", "dgpo", "grpo", "nft"])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="epochs dropped from the mean (prompt cache, compilation)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--throughput", action="store_true", help="also run benchmark/throughput.py here and in the base")
    ap.add_argument("--components", action="store_true", help="also time transformer.dtype reads and a merged-LoRA forward")
    args = ap.parse_args()
    if "base" in args.variants and not args.base:
        ap.error("the variant 'base' needs --base <git revision>")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # a cold inductor cache for this benchmark: the first --compile run reports a full compilation
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
        repos = {"here": REPO, "base": checkout(args.base, work) if args.base else None}
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        print(
            f"speed.py on {os.cpu_count()} CPUs, 1 thread per run, {args.epochs} epochs ({args.warmup} dropped); "
            f"here = {head.stdout.strip()}{'' if not args.base else f', base = {args.base}'}; "
            f"load at start {os.getloadavg()[0]:.1f}"
        )
        for task in args.tasks:
            rounds = []
            for r in range(args.repeats):
                rounds.append({})
                for name in args.variants:
                    where, flags = VARIANTS[name]
                    rounds[-1][name] = one_run(repos[where], args.algo, task, flags, args, work, env)
                    run = rounds[-1][name]
                    print(
                        f"  [{task} round {r + 1}] {name}: epoch {run['epoch']:.2f} s "
                        f"({', '.join(f'{s} {run[s]:.2f}' for s in SECTIONS)}) load {run['load']:.1f}",
                        file=sys.stderr,
                    )
            print(table(task, args.algo, args.variants, rounds))
        if args.components:
            print(components(args.repeats * 5))
        if args.throughput:
            for where in ("base", "here") if args.base else ("here",):
                out = subprocess.run(
                    [sys.executable, "benchmark/throughput.py", "--threads", "1"],
                    cwd=repos[where],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rows = [line for line in out.stdout.splitlines() if line.startswith("|")]
                print(f"\n**sampler vs StableDiffusion3Pipeline.__call__** ({where}, load {os.getloadavg()[0]:.1f})\n")
                print("\n".join(rows))


if __name__ == "__main__":
    main()
