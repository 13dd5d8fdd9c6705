"""Evaluate finished runs on more noise than their training-time evals, paired with the base model on the same noise.

    python benchmark/eval_runs.py benchmark/results/shapes_clean/runs/*        # 30 held-out prompts x 8 noises
    python benchmark/eval_runs.py runs/<run> --seeds 0 1 2 3

A training-time eval scores 60 images (30 prompts x 2 noises), so a binary metric such as `exact` moves by 1/60 per
image and a single eval is noisy (about +-0.05). This loads each run's export (runs/<run>/lora, or
runs/<run>/transformer after --full-finetune: what a user gets) into a fresh copy of the base pipeline and scores every
held-out prompt with `--seeds` noise seeds (the same noises for the base and every run), with the metrics every eval
logs. Prints one row per run, then per algorithm the
mean over its runs and the gain over the base with its standard error over runs (seeds).
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402
from harness import evaluation, prompt_files  # noqa: E402
from rewards import load_rewards  # noqa: E402

try:  # the model-family registry, where this checkout has one
    import models  # noqa: E402,F401
except ImportError:
    pass

METRICS = ("shapes", "shapes_strict", "shapes_exact", "objects_extra", "prompt_specific_gap")


def score(model: str, prompts: list, seeds: list, export=None) -> dict:
    """The metrics of `model` with `export` (a run's lora/ folder, or its transformer/ after --full-finetune) loaded
    the way a user loads it, averaged over the held-out prompts and `seeds`."""
    pipe = models.load_pipeline(model, torch.device("cpu"))
    if export is not None and export.name == "transformer":
        pipe.transformer = type(pipe.transformer).from_pretrained(str(export))
    elif export is not None:
        pipe.load_lora_weights(str(export))
    encoder, rewards = common.PromptEncoder(pipe), load_rewards("shapes_clean", "cpu")
    out = defaultdict(list)
    for seed in seeds:
        _, scores = evaluation.evaluate(
            pipe,
            pipe.transformer,
            encoder,
            prompts,
            rewards.evaluate,
            num_steps=10,
            guidance_scale=1.0,
            seed=1000 * seed,
            repeats=1,
            progress=False,
        )
        for k in METRICS:
            out[k].append(scores[k])
    return {k: torch.cat(v).mean().item() for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders with an exported lora/ (or transformer/)")
    ap.add_argument("--model", default=common.TINY_MODEL)
    ap.add_argument("--prompts", default=common.TEST_PROMPTS)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from diffusers.utils import logging

    logging.set_verbosity_error()  # load_lora_weights warns that the LoRA has no text-encoder part (it has none)
    prompts = prompt_files.load_prompts(args.prompts)
    base = score(args.model, prompts, args.seeds)
    print(f"{len(prompts)} held-out prompts x {len(args.seeds)} noises, ODE 10 steps, CFG 1\n")
    print("| run | " + " | ".join(METRICS) + " |\n|---|" + "---|" * len(METRICS))
    print("| base | " + " | ".join(f"{base[k]:.3f}" for k in METRICS) + " |")
    by_algo = defaultdict(list)
    for run in sorted(Path(r) for r in args.runs):
        exports = [run / name for name in ("lora", "transformer") if (run / name).is_dir()]
        if not exports:
            continue
        result = score(args.model, prompts, args.seeds, exports[0])
        algo = json.loads((run / "args.json").read_text()).get("exp_name", run.name)
        by_algo[algo].append(result)
        print(f"| {run.name} | " + " | ".join(f"{result[k]:.3f}" for k in METRICS) + " |", flush=True)
    print(
        "\n| algorithm | runs | " + " | ".join(f"{k} (gain ± se)" for k in METRICS) + " |\n|---|---|" + "---|" * len(METRICS)
    )
    for algo, results in by_algo.items():
        cells = []
        for k in METRICS:
            v = np.array([r[k] for r in results])
            spread = f" ± {v.std(ddof=1) / np.sqrt(len(v)):.3f}" if len(v) > 1 else ""  # one run has no standard error
            cells.append(f"{v.mean():.3f} ({v.mean() - base[k]:+.3f}{spread})")
        print(f"| {algo} | {len(results)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
