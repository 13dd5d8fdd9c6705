"""The README's learning figure: held-out exact against images trained, every algorithm at its defaults on tiny-shapes-8.

    python benchmark/learning_figure.py      # writes benchmark/results/learning.png from the committed curves

Each curve is a run's own evaluation every 20 epochs (1,280 images): the 30 held-out prompts x 8 fixed noises, ODE 10
steps at CFG 1, in the run (`python benchmark/convergence.py extract` read them out of its logs into the curves.jsonl
files named below; the commands are in benchmark/results/convergence/README.md). Three seeds per algorithm: the line is
their mean, the band their range. The base at CFG 1 is every run's first evaluation (the same noises); the base at CFG
4.5 is the protocol's `base` row on the held-out prompts (8 other noises). Every weight trained, at each file's defaults
(learning rate, KL, group size, ...); the runs go past the defaults' 60 epochs (3,840 images, GRPO's 40: 2,560) where the
convergence legs trained them longer.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
TESTBED8 = RESULTS / "convergence" / "testbed8"
# algorithm, the curves file under testbed8/, the setting's name in it (each file's defaults: benchmark/convergence.py's
# SETTINGS spell them out)
CURVES = [
    ("CRD", "leg8", "crd_full_lr1e-4"),
    ("NFT", "leg9b", "nft_full_lr1e-4"),
    ("DGPO", "leg9", "dgpo_full_lr1e-4"),
    ("AWM", "leg12", "awm_full_kl0.1_lr1e-4"),
    ("ELBO-GRPO", "leg13", "elbo_grpo_full_lr3e-5"),
    ("GRPO", "leg10", "grpo"),
    ("DPO", "dpo_default", "dpo_full"),
]


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def seed_curves(folder: str, setting: str) -> tuple:
    """(images, [seeds x evals] held-out exact) of the setting's runs, each seed at its longest run, cut to the length
    every seed reached."""
    runs = {}
    for row in read_jsonl(TESTBED8 / folder / "curves.jsonl"):
        if row["setting"] == setting and len(row["images"]) > len(runs.get(row["seed"], {"images": ()})["images"]):
            runs[row["seed"]] = row
    if not runs:
        raise SystemExit(f"error: no runs of {setting} in {TESTBED8 / folder / 'curves.jsonl'}")
    n = min(len(r["images"]) for r in runs.values())
    images = runs[min(runs)]["images"][:n]
    assert all(r["images"][:n] == images for r in runs.values()), f"{setting}: seeds evaluated at different images"
    return np.array(images), np.array([r["shapes_exact"][:n] for _, r in sorted(runs.items())])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "learning.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    firsts = []
    for (name, folder, setting), color in zip(CURVES, plt.get_cmap("tab10").colors):
        images, exact = seed_curves(folder, setting)
        firsts += list(exact[:, 0])
        label = f"{name} ({len(exact)} seed{'s' if len(exact) > 1 else ''})"
        ax.plot(images, exact.mean(0), color=color, marker=".", lw=1.8, label=label)
        ax.fill_between(images, exact.min(0), exact.max(0), color=color, alpha=0.15, lw=0)
        print(f"{name:10s} {setting:24s} seeds {len(exact)}: " + " ".join(f"{v:.3f}" for v in exact.mean(0)))
    if max(firsts) - min(firsts) > 1e-6:  # every run starts from the same base on the same noises
        print(f"warning: the runs' first evaluations differ ({min(firsts):.4f} .. {max(firsts):.4f})", file=sys.stderr)
    (cfg45,) = [r["exact"] for r in read_jsonl(TESTBED8 / "base.jsonl") if r["set"] == "test" and r["guidance_scale"] == 4.5]
    ax.axhline(float(np.mean(firsts)), color="k", ls=":", lw=1.2, label=f"base, CFG 1 ({np.mean(firsts):.3f})")
    ax.axhline(cfg45, color="k", ls="--", lw=1.2, label=f"base, CFG 4.5 ({cfg45:.3f}; other noises)")
    ax.axvline(3840, color="0.6", lw=0.8)
    ax.text(3840, ax.get_ylim()[0], " 60 epochs: the defaults' length", color="0.4", fontsize=8, va="bottom")
    ax.set_xlabel("images trained")
    ax.set_ylabel("held-out exact (30 prompts x 8 noises, CFG 1)")
    ax.set_title("tiny-shapes-8 (4.7M parameters), every weight trained at each file's defaults; band: range over seeds")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
