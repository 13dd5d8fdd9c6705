"""The tables of issue few-step, from benchmark/results/convergence/few_step/ (`convergence.py final` rows):

    python benchmark/few_step_table.py

1. DiffusionOPD: held-out exact per prompt domain (colour attribution; every other kind) for the base, each teacher,
   the student distilled from both and CRD on every prompt (the RL run of the same images), and the student's paired
   gain over each (per prompt, same noises), mean over seeds, ± one SE over the domain's prompts; bold beyond two.
2. Few-step: the DMD2 generator at its steps against the base at the same steps and at 10 (CFG 1 and 4.5), and TDM-R1
   against the DMD2 model it starts from.
"""

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "benchmark" / "results" / "convergence" / "few_step"
DOMAINS = {"colour attribution": lambda c: c == "color_attr", "every other kind": lambda c: c != "color_attr"}


def read(name: str) -> list:
    return [json.loads(line) for line in (FOLDER / name).read_text().splitlines() if line.strip()]


def cell(diff: np.ndarray) -> str:
    mean, se = diff.mean(), diff.std(ddof=1) / np.sqrt(len(diff))
    text = f"{mean:+.3f} ± {se:.3f}"
    return f"**{text}**" if abs(mean) > 2 * se else text


def per_prompt(rows: list, base: np.ndarray, tag: str = "cfg1") -> np.ndarray:
    """The seeds' mean per-prompt exact: the base's plus each run's paired gain."""
    return base + np.mean([r[f"exact_gain_{tag}_per_prompt"] for r in rows], axis=0)


def opd_table(finals: list, base: dict, kinds: np.ndarray) -> list:
    settings = [
        ("teacher: colour attribution (CRD)", "opd_teacher_attr"),
        ("teacher: every other kind (CRD)", "opd_teacher_rest"),
        ("CRD on every prompt", "opd_crd_all"),
        ("DiffusionOPD student", "opd"),
    ]
    exact = {"base": base[1.0]}
    seeds = {"base": 0}
    for label, setting in settings:
        rows = [r for r in finals if r["setting"] == setting]
        if rows:
            exact[label], seeds[label] = per_prompt(rows, base[1.0]), len(rows)
    student = exact.get("DiffusionOPD student")
    out = [
        "| model | seeds | "
        + " | ".join(f"exact: {d}" for d in DOMAINS)
        + " | all | "
        + " | ".join(f"student minus it: {d}" for d in DOMAINS)
        + " |",
        "|---" * (3 + 2 * len(DOMAINS)) + "|",
    ]
    for label, values in exact.items():
        masks = [np.array([pick(k) for k in kinds]) for pick in DOMAINS.values()]
        cells = [f"{values[m].mean():.3f}" for m in masks] + [f"{values.mean():.3f}"]
        if student is not None and label != "DiffusionOPD student":
            cells += [cell((student - values)[m]) for m in masks]
        else:
            cells += [""] * len(masks)
        out.append(f"| {label} | {seeds[label] or '-'} | " + " | ".join(cells) + " |")
    return out


FEW_STEP = [
    ("DMD2", "dmd2"),
    ("DMD2, real score at CFG 1", "dmd2_real_cfg1"),
    ("TDM-R1 (surrogate KL 0.1, the default)", "tdm_r1"),
    ("TDM-R1 without the reward pull (--rl-weight 0): DMD2 continued", "tdm_r1_rl0"),
    ("TDM-R1, surrogate KL 0.001 (the authors')", "tdm_r1_rkl0.001"),
    ("TDM-R1, surrogate KL 0.001, reward CFG 1", "tdm_r1_rcfg1"),
]


def few_step_table(finals: list, base: dict) -> list:
    out = [
        "| model | steps | seeds | exact | vs base at its steps | vs base, 10 steps, CFG 1 | vs base, 10 steps, CFG 4.5 "
        "| vs the DMD2 model TDM-R1 starts from | extra objects/img |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| base, CFG 1 | 10 | - | {base[1.0].mean():.3f} | | | | | |",
        f"| base, CFG 4.5 | 10 | - | {base[4.5].mean():.3f} | | | | | |",
    ]
    start = None
    for label, setting in FEW_STEP:
        rows = [r for r in finals if r["setting"] == setting]
        if not rows:
            continue
        steps = rows[0]["num_steps"]
        mine = per_prompt(rows, base[1.0])
        own = np.mean([r[f"exact_gain_cfg1_{steps}steps_per_prompt"] for r in rows], axis=0)
        if setting == "dmd2":  # TDM-R1 starts from its seed 1 (benchmark/results/convergence/few_step/dmd2__s1)
            start = per_prompt([r for r in rows if r["seed"] == 1], base[1.0])
        vs_start = cell(mine - start) if setting.startswith("tdm_r1") and start is not None else ""
        out.append(
            f"| {label} | {steps} | {len(rows)} | {mine.mean():.3f} | {cell(own)} | {cell(mine - base[1.0])} | "
            f"{cell(mine - base[4.5])} | {vs_start} | {np.mean([r['extra'] for r in rows]):.2f} |"
        )
    rl = [[r for r in finals if r["setting"] == s] for s in ("tdm_r1", "tdm_r1_rl0")]
    if all(rl):  # what the reward pull itself adds: the seeds' mean per-prompt exact, with it minus without it
        diff = per_prompt(rl[0], base[1.0]) - per_prompt(rl[1], base[1.0])
        score = np.mean([r["score"] for r in rl[0]]) - np.mean([r["score"] for r in rl[1]])
        out.append(
            f"| TDM-R1 minus the same runs without the reward pull | | | {cell(diff)} (shapes score {score:+.3f}) | | | | | |"
        )
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print(__doc__ if argv in (["--help"], ["-h"]) else "few_step_table.py takes no arguments", file=sys.stderr)
        sys.exit(0 if argv in (["--help"], ["-h"]) else 2)
    finals = [r for r in read("final.jsonl") if r["set"] == "test"]
    base = {r["guidance_scale"]: np.array(r["exact_per_prompt"]) for r in read("base.jsonl") if r["set"] == "test"}
    test = [json.loads(line) for line in (REPO / "assets" / "test.jsonl").read_text().splitlines()]
    kinds = np.array([t["category"] for t in test])
    print("\n".join(opd_table(finals, base, kinds)))
    print()
    print("\n".join(few_step_table(finals, base)))


if __name__ == "__main__":
    main()
