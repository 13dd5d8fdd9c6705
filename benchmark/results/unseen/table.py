"""The README's table from the jsonl here: each export's exact on the unseen colour-attribution prompts and on the
colour-attribution prompts of the training sample, paired with the base on the same 16 noises (± SE over prompts).

    python benchmark/results/unseen/table.py
"""

import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from benchmark.convergence import TASKS, UNSEEN, prompt_kinds, prompt_sets  # noqa: E402

# the committed export each results folder scored, by run name (the README's commands); any other run is a run folder
# retrained for this table (`retrain/runs/`, not in the tree: the README's commands remake it)
SOURCES = {
    "tiny-shapes": {"grpo__s1": "leg7"},
    "tiny-shapes-8": {"nft_full_lr1e-4__s3": "testbed8/leg9b", "grpo__s1": "testbed8/leg10"},
}
colour = np.array(prompt_kinds(TASKS["shapes"], prompt_sets()["train"])) == "color_attr"


def mean_se(v, sign=""):
    v = np.asarray(v, float)
    return f"{v.mean():{sign}.3f} ± {v.std(ddof=1) / math.sqrt(len(v)):.3f}"


def export(model: str, row: dict) -> str:
    if row["run"] in SOURCES[model]:
        return f"{SOURCES[model][row['run']]}/{row['run']}"
    if row["run"].startswith("shapes_clean__"):
        return f"{row['setting']}, seed {row['seed']} (a run folder, not in the tree)"
    return f"leg2/{row['run']}"


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


print(f"unseen: {len(prompt_sets(unseen_file=UNSEEN)['unseen'])} prompts; training sample: {colour.sum()} of its")
print(f"{len(colour)} prompts are colour attribution. Noises: 16 per prompt (seeds 0, 1000, ..., 15000) in the first table.\n")
print(
    "| model | export (benchmark/results/convergence/...) or run | images | CFG | unseen exact | vs base CFG 1 | vs base CFG 4.5 "
    "| train colour-attr exact | vs base CFG 1 | vs base CFG 4.5 |"
)
print("|---|---|---|---|---|---|---|---|---|---|")
for model in ("tiny-shapes", "tiny-shapes-8"):  # each model's results folder
    base = {(r["set"], r["guidance_scale"]): r for r in read(HERE / model / "base.jsonl")}
    if len(base) < 4:
        continue  # not scored yet
    for cfg in (1.0, 4.5):
        train = np.array(base[("train", cfg)]["exact_per_prompt"])[colour]
        unseen = mean_se(base[("unseen", cfg)]["exact_per_prompt"])
        print(f"| {model} | base | 0 | {cfg:g} | {unseen} | | | {mean_se(train)} | | |")
    finals = read(HERE / model / "final.jsonl")
    for r in (r for r in finals if r["set"] == "unseen"):
        t = next(x for x in finals if x["run"] == r["run"] and x["set"] == "train")
        train = np.array(base[("train", 1.0)]["exact_per_prompt"]) + t["exact_gain_cfg1_per_prompt"]
        unseen = [f"{r[f'exact_gain_{k}']:+.3f} ± {r[f'exact_gain_{k}_se']:.3f}" for k in ("cfg1", "cfg4.5")]
        gains = [mean_se(np.array(t[f"exact_gain_{k}_per_prompt"])[colour], "+") for k in ("cfg1", "cfg4.5")]
        print(
            f"| {model} | {export(model, r)} | {r['images']:,} | {r['guidance_scale']:g} "
            f"| {r['exact']:.3f} | {unseen[0]} | {unseen[1]} | {train[colour].mean():.3f} | {gains[0]} | {gains[1]} |"
        )

# the unseen set again on 32 noises (noises 0-15 the same as above), the base and the exports only
print("\n| model | export | unseen exact, 32 noises | vs base CFG 1 | vs base CFG 4.5 |")
print("|---|---|---|---|---|")
for model in ("tiny-shapes", "tiny-shapes-8"):
    base = {r["guidance_scale"]: r for r in read(HERE / model / "noises32" / "base.jsonl") if r["set"] == "unseen"}
    for cfg, r in sorted(base.items()):
        print(f"| {model} | base, CFG {cfg:g} | {mean_se(r['exact_per_prompt'])} | | |")
    for r in read(HERE / model / "noises32" / "final.jsonl"):
        gains = [f"{r[f'exact_gain_{k}']:+.3f} ± {r[f'exact_gain_{k}_se']:.3f}" for k in ("cfg1", "cfg4.5")]
        print(f"| {model} | {export(model, r)} | {r['exact']:.3f} | {gains[0]} | {gains[1]} |")
