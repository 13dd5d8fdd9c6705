"""Offline preference pairs from the base model's own rollouts: the data `algos/dpo.py --pairs` trains on.

    python benchmark/pairs_from_base.py runs/pairs                        # tiny-shapes, shapes_clean, 8 per prompt
    python algos/dpo.py --pairs runs/pairs/pairs.jsonl                    # offline DPO on them
    python algos/dpo.py --pairs runs/pairs/chosen.jsonl                   # SFT on the same chosen images, the baseline

Every training prompt is sampled `--samples-per-prompt` times by the base (the ODE sampler at --guidance-scale, noise
keyed by (seed, prompt, sample) as the scripts key theirs) and scored by `--reward`; the best and the worst image of
each prompt become one line of `pairs.jsonl` ({"prompt", "chosen", "rejected"}, paths relative to the folder) and the
best alone a line of `chosen.jsonl` (the SFT file). A prompt whose samples all score the same gives no line. The
folder must not exist yet; it is written whole or not at all.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402,F401  (registers the model families with common)
from harness import prompt_files  # noqa: E402
from rewards import load_rewards  # noqa: E402


def best_and_worst(scores: torch.Tensor, k: int) -> list:
    """[(best, worst)] sample indices per prompt of k contiguous samples (the first of equals), None where all tie."""
    out = []
    for g, row in enumerate(scores.view(-1, k).tolist()):
        hi, lo = max(range(k), key=lambda i: row[i]), min(range(k), key=lambda i: row[i])
        out.append((g * k + hi, g * k + lo) if row[hi] > row[lo] else None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the folder to write (must not exist)")
    ap.add_argument("--model", default=common.TINY_MODEL)
    ap.add_argument("--reward", default="shapes_clean")
    ap.add_argument("--prompts", default=common.TRAIN_PROMPTS, help="the training prompts (never the held-out ones)")
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--guidance-scale", type=float, default=1.0)
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        if args.out.exists():
            raise common.UserError(f"{args.out} exists: name a new folder")
        if args.samples_per_prompt < 2 or args.num_steps < 1:
            raise common.UserError("--samples-per-prompt must be >= 2 and --num-steps >= 1")
        prompts = prompt_files.load_prompts(args.prompts)
        rewards = load_rewards(args.reward, torch.device("cpu"), prompts)
        pipe = models.load_pipeline(args.model, torch.device("cpu"))
    except common.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    encoder = common.PromptEncoder(pipe)
    k = args.samples_per_prompt
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    try:
        (tmp / "images").mkdir()
        pairs, chosen = [], []
        for p, prompt in enumerate(prompts):
            batch = [prompt] * k
            rollout = common.sample(
                pipe.transformer,
                pipe.scheduler,
                encoder.cond(batch, negative=args.guidance_scale > 1),
                num_steps=args.num_steps,
                guidance_scale=args.guidance_scale,
                generator=common.keyed_generators(args.seed, "pairs", p, indices=range(k)),
                latent_shape=pipe.latent_shape,
            )
            images = common.decode(pipe, rollout.latents)
            scores = rewards.total(rewards(images, batch)).float().cpu()
            (pick,) = best_and_worst(scores, k)
            if pick is None:
                continue
            names = []
            for side, i in zip(("chosen", "rejected"), pick):
                name = f"images/{p:05d}_{side}.png"
                pixels = (images[i].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
                Image.fromarray(pixels).save(tmp / name)
                names.append(name)
            pairs.append({"prompt": prompt, "chosen": names[0], "rejected": names[1], "rewards": scores[list(pick)].tolist()})
            chosen.append({"prompt": prompt, "chosen": names[0]})
            print(f"\r{p + 1}/{len(prompts)} prompts, {len(pairs)} pairs", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        for name, rows in (("pairs.jsonl", pairs), ("chosen.jsonl", chosen)):
            (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    gap = np.mean([r["rewards"][0] - r["rewards"][1] for r in pairs]) if pairs else 0.0
    print(f"{len(pairs)} pairs of {len(prompts)} prompts (mean reward gap {gap:.3f}) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
