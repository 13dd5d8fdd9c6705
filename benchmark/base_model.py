"""Score a model (default: the embedded tiny-shapes base) on the held-out prompts, per category.

    python benchmark/base_model.py                          # ODE, 10 steps, CFG 1 and 4.5, 4 seeds per prompt
    python benchmark/base_model.py --grid assets/tiny-shapes-samples.png
    python benchmark/base_model.py --reward ocr --model assets/tiny-text --prompts assets/text_test.jsonl

Prints a markdown table per category: the mean score and the strict pass rate (for `shapes` GenEval's all requirements
met, for `ocr` the word spelled exactly), and for `shapes` also exact (every asked object and nothing else), extra
objects per image and the prompt-specific gap (score minus the score against another prompt of the same category).
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402,F401  (registers the model families with common)
from harness import evaluation  # noqa: E402
from rewards import shapes  # noqa: E402


def ocr_evaluate():
    """The `ocr` score and its strict rate as the training scripts' eval logs them (eval/ocr, eval/ocr_strict)."""
    from rewards import load_rewards

    multi = load_rewards("ocr", torch.device("cpu"))

    def evaluate(images, prompts):
        out = multi.evaluate(images, prompts)
        return {"score": out["ocr"], "strict": out["ocr_strict"]}

    return evaluate


def shapes_evaluate(images, prompts):
    """The shapes metrics every training script's eval logs (eval/shapes, shapes_strict, shapes_exact, ...)."""
    m = shapes.evaluate(images, prompts, [shapes.wrong_prompt(p) for p in prompts])
    return {
        "score": m["score"],
        "strict": m["strict"],
        "exact": m["exact"],
        "extra objects": m["extra"],
        "prompt-specific gap": m["score"] - m["wrong"],
    }


def score_model(pipe, rows, guidance_scale, num_steps, seeds, scorer=shapes_evaluate):
    encoder = common.PromptEncoder(pipe)
    prompts = [r["prompt"] for r in rows]
    per_cat = defaultdict(lambda: defaultdict(list))
    images = []
    for seed in seeds:
        imgs, _ = evaluation.evaluate(
            pipe,
            pipe.transformer,
            encoder,
            prompts,
            lambda i, p: {},
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            seed=seed,
            repeats=1,
        )
        result = scorer(imgs, prompts)
        for i, r in enumerate(rows):
            for cat in (r.get("category", "all"), "overall"):
                for k, v in result.items():
                    per_cat[cat][k].append(v[i].item())
        images.append(imgs)
    return per_cat, images[0]


def save_grid(images, prompts, path, ncol=6):
    n = len(images)
    nrow = -(-n // ncol)
    cell_w, cell_h = 200, 150
    canvas = Image.new("RGB", (ncol * cell_w, nrow * cell_h), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (img, prompt) in enumerate(zip(images, prompts)):
        r, c = divmod(i, ncol)
        pil = Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).resize((128, 128), Image.NEAREST)
        canvas.paste(pil, (c * cell_w + 36, r * cell_h + 2))
        draw.text((c * cell_w + 4, r * cell_h + 132), prompt[:34], fill="black")
    canvas.save(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=common.TINY_MODEL)
    ap.add_argument("--prompts", default=common.TEST_PROMPTS)
    ap.add_argument("--reward", choices=("shapes", "ocr"), default="shapes")
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--guidance-scales", type=float, nargs="+", default=[1.0, 4.5])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--grid", default=None, help="save a PNG grid of the first seed's samples (first CFG, first 36 prompts)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    pipe = models.load_pipeline(args.model, torch.device("cpu"))
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    scorer = ocr_evaluate() if args.reward == "ocr" else shapes_evaluate
    for g in args.guidance_scales:
        per_cat, images = score_model(pipe, rows, g, args.num_steps, args.seeds, scorer)
        print(f"\nCFG {g}, {args.num_steps} ODE steps, seeds {args.seeds}, {len(rows)} prompts\n")
        keys = list(per_cat["overall"])
        print(f"| category | prompts | {' | '.join(keys)} |\n|---|---|{'---|' * len(keys)}")
        for cat, v in sorted(per_cat.items(), key=lambda kv: kv[0] == "overall"):
            print(f"| {cat} | {len(v['score']) // len(args.seeds)} | {' | '.join(f'{np.mean(v[k]):.3f}' for k in keys)} |")
        if args.grid and g == args.guidance_scales[0]:
            save_grid(images[:36], [r["prompt"] for r in rows][:36], args.grid)
            print(f"\ngrid saved to {args.grid}")


if __name__ == "__main__":
    main()
