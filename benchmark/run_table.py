"""The CPU results table: every algorithm on an embedded model, several seeds, each with its default hyperparameters.

    python benchmark/run_table.py --jobs 2 --threshold 0.45         # shapes_clean, 3 seeds: ~40 min on 2 idle cores
    python benchmark/run_table.py --jobs 2 --reward jpeg_compressibility --threshold -0.5 --epochs 20 --extra --eval-every 2
    python benchmark/run_table.py --jobs 2 --seeds 1 --reward ocr --threshold 0.75 --extra --model assets/tiny-text \
        --train-prompts assets/text_train.jsonl --test-prompts assets/text_test.jsonl        # OCR on tiny-text: 20 min
    python benchmark/run_table.py --jobs 2 --quick                  # 1 seed, 1/3 of the epochs: ~5 min
    python benchmark/run_table.py --table-only                      # re-read finished runs, rewrite table + plots

Needs `pip install -r benchmark/requirements.txt` (matplotlib, for the plots).
Runs go to benchmark/results/<reward>/runs/ (not in git); the table (results.md) and the plots
(score_vs_images.png, score_vs_time.png) go to benchmark/results/<reward>/. Every run's args.json records the git
commit it ran at, and the table lists the commits it was built from.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ALGOS = ("crd", "grpo", "nft", "awm", "dgpo")


def default_epochs(algo: str) -> int:
    sys.path.insert(0, str(REPO))
    import importlib

    return importlib.import_module(f"algos.{algo}").Args().num_epochs


def run(algo, seed, args, out):
    epochs = args.epochs or default_epochs(algo)
    if args.quick:
        epochs = max(2, epochs // 3)
    log = out / f"{algo}__{seed}.log"
    cmd = [
        sys.executable,
        str(REPO / "algos" / f"{algo}.py"),
        "--reward",
        args.reward,
        "--seed",
        str(seed),
        "--num-epochs",
        str(epochs),
        "--output-dir",
        str(out / "runs"),
        "--exp-name",
        algo,
        *args.extra,
    ]
    print(" ".join(cmd[1:]), flush=True)
    # parallel runs share the cores: one OpenMP pool each, sized so they do not oversubscribe (spin-waiting threads
    # of two oversubscribed pools slow both runs down several times)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.jobs))}
    with open(log, "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True, cwd=REPO, env=env)


def read_run(run_dir: Path, reward: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]

    def series(tag):
        return [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)] if tag in tags else []

    ev = series(f"eval/{reward}")
    t0 = min(e.wall_time for tag in tags for e in acc.Scalars(tag))
    out = {
        "images": np.array([s for s, _, _ in ev]),
        "wall": np.array([w - t0 for _, w, _ in ev]),
        "score": np.array([v for _, _, v in ev]),
        "strict": np.array(
            [v for _, _, v in series(f"eval/{reward}_strict" if f"eval/{reward}_strict" in tags else "eval/shapes_strict")]
        ),
        # the hacking-sensitive metrics of the shapes rewards (absent for other rewards)
        **{
            k: np.array([v for _, _, v in series(f"eval/{k}")])
            for k in ("shapes", "shapes_exact", "objects_extra", "prompt_specific_gap")
        },
        "time": {
            k: float(np.mean([v for _, _, v in series(f"time/{k}")] or [np.nan])) for k in ("sampling", "reward", "training")
        },
    }
    log = run_dir.parents[1] / f"{run_dir.name.split('__')[1]}__{run_dir.name.split('__')[2]}.log"
    rss = re.findall(r"peak RSS (\d+) MB", log.read_text()) if log.exists() else []
    out["rss"] = float(rss[-1]) if rss else np.nan
    out["commit"] = json.loads((run_dir / "args.json").read_text()).get("git_commit", "?")
    return out


def first_reach(images, wall, score, threshold):
    hit = np.nonzero(score >= threshold)[0]
    return (images[hit[0]], wall[hit[0]]) if len(hit) else (np.nan, np.nan)


def fmt(values, digits=3):
    values = np.asarray(values, dtype=float)
    if np.isnan(values).all():
        return "n/a"
    return (
        f"{np.nanmean(values):.{digits}f} ± {np.nanstd(values):.{digits}f}" if len(values) > 1 else f"{values[0]:.{digits}f}"
    )


def fmt_reach(values, digits=0):
    """Mean ± std over the seeds that reached the threshold, and how many did."""
    values = np.asarray(values, dtype=float)
    hit = values[~np.isnan(values)]
    if len(hit) == 0:
        return f"not reached (0/{len(values)})"
    return f"{fmt(hit, digits)} ({len(hit)}/{len(values)})"


def last(r, key):
    return r[key][-1] if len(r[key]) else np.nan


def gain(runs, key):
    """Mean gain of the final eval over the base (epoch 0, the same noise for every seed) ± its standard error."""
    d = np.array([last(r, key) - r[key][0] if len(r[key]) else np.nan for r in runs])
    if np.isnan(d).all():
        return "n/a"
    se = np.nanstd(d, ddof=1) / np.sqrt(len(d)) if len(d) > 1 else np.nan
    return f"{np.nanmean(d):+.3f} ± {se:.3f}" if len(d) > 1 else f"{d[0]:+.3f}"


def table(results, args, out):
    model = Path(args.extra[args.extra.index("--model") + 1]).name if "--model" in args.extra else "tiny-shapes"
    hacking = any(len(r["shapes_exact"]) for runs in results.values() for r in runs)
    lines = [
        f"Reward `{args.reward}`, {model}, held-out prompts (ODE, fixed noise); mean ± std over seeds. "
        f"Threshold for the 'to reach' columns: {args.threshold}. Commits: "
        f"{', '.join(sorted({r['commit'] for runs in results.values() for r in runs}))}."
        + (
            " exact = every asked object and nothing else; extra = objects not asked for, per image; gap = score "
            "against the image's own prompt minus against another prompt of its category; gains are final - base "
            "± standard error over seeds."
            if hacking
            else ""
        ),
        "",
        "| algorithm | seeds | base | final | final strict | "
        + ("shapes (GenEval-style) | final exact | exact gain | extra objects/img | prompt-specific gap | " if hacking else "")
        + "images to reach (seeds) | wall-clock to reach, s (seeds) | "
        "s/epoch sampling / reward / training | training / sampling | peak RSS (MB) |",
        "|---|---|---|---|---|" + ("---|---|---|---|---|" if hacking else "") + "---|---|---|---|---|",
    ]
    for algo, runs in results.items():
        reach = [first_reach(r["images"], r["wall"], r["score"], args.threshold) for r in runs]
        t = {k: np.mean([r["time"][k] for r in runs]) for k in ("sampling", "reward", "training")}
        extra = ""
        if hacking:
            extra = (
                f"{fmt([last(r, 'shapes') for r in runs])} | {fmt([last(r, 'shapes_exact') for r in runs])} | "
                f"{gain(runs, 'shapes_exact')} | {fmt([last(r, 'objects_extra') for r in runs], 2)} | "
                f"{fmt([last(r, 'prompt_specific_gap') for r in runs])} | "
            )
        lines.append(
            f"| [{algo}](../../../docs/{algo}.md) | {len(runs)} | {fmt([r['score'][0] for r in runs])} | "
            f"{fmt([r['score'][-1] for r in runs])} | {fmt([last(r, 'strict') for r in runs])} | {extra}"
            f"{fmt_reach([x for x, _ in reach])} | "
            f"{fmt_reach([w for _, w in reach])} | {t['sampling']:.1f} / {t['reward']:.1f} / {t['training']:.1f} | "
            f"{t['training'] / t['sampling']:.2f} | "
            f"{fmt([r['rss'] for r in runs], 0)} |"
        )
    if hacking:
        base = next(iter(results.values()))[0]
        lines += [
            "",
            f"Base model on these prompts and noises: shapes {base['shapes'][0]:.3f}, strict {base['strict'][0]:.3f}, "
            f"exact {base['shapes_exact'][0]:.3f}, extra objects/img {base['objects_extra'][0]:.2f}, "
            f"prompt-specific gap {base['prompt_specific_gap'][0]:.3f}.",
        ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plots(results, args, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("score", f"held-out {args.reward} (trained on)")]
    if any(len(r["shapes_exact"]) for runs in results.values() for r in runs):
        panels += [("shapes_exact", "held-out exact (not trained on)"), ("objects_extra", "extra objects per image")]
    for x_key, x_label, name in (
        ("images", "images sampled", "score_vs_images.png"),
        ("wall", "wall-clock (s)", "score_vs_time.png"),
    ):
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), dpi=110, squeeze=False)
        for ax, (key, label) in zip(axes[0], panels):
            for algo, runs in results.items():
                n = min(len(r[key]) for r in runs)
                x = np.mean([r[x_key][:n] for r in runs], axis=0)
                y = np.array([r[key][:n] for r in runs])
                (line,) = ax.plot(x, y.mean(0), label=algo)
                if len(runs) > 1:  # the band in its line's colour
                    ax.fill_between(x, y.mean(0) - y.std(0), y.mean(0) + y.std(0), alpha=0.2, color=line.get_color())
            ax.set_xlabel(x_label)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][0].legend()
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--reward", default="shapes_clean")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--epochs", type=int, default=None, help="override every algorithm's default num_epochs")
    ap.add_argument("--threshold", type=float, default=0.6)
    ap.add_argument("--quick", action="store_true", help="one seed, a third of the epochs")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each gets cores / jobs threads)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags passed to every run")
    args = ap.parse_args()
    if args.quick:
        args.seeds = args.seeds[:1]
    out = REPO / "benchmark" / "results" / args.reward.replace(":", "_").replace(",", "+")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.jobs) as pool:  # threads only wait on the subprocesses
            for job in [pool.submit(run, algo, seed, args, out) for algo in args.algos for seed in args.seeds]:
                job.result()
    results = {}
    for algo in args.algos:
        dirs = sorted((out / "runs").glob(f"*__{algo}__*"))
        latest = {}
        for d in dirs:  # the newest run per seed
            latest[d.name.split("__")[2]] = d
        runs = [
            read_run(d, args.reward.split(":")[0].split(",")[0]) for s, d in sorted(latest.items()) if int(s) in args.seeds
        ]
        if runs:
            results[algo] = runs
    table(results, args, out)
    plots(results, args, out)


if __name__ == "__main__":
    main()
