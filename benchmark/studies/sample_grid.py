"""Several models on the same held-out prompts and noises, one captioned row each: teachers against their student, a
few-step model against the base at 10 steps, before and after RL.

    python benchmark/studies/sample_grid.py --out benchmark/results/convergence/few_step/grid.png \
        "base, 10 steps, CFG 4.5=base@10x4.5" "DMD2, 2 steps=benchmark/results/convergence/few_step/dmd2__s1@2"

A row is LABEL=MODEL@STEPS[xCFG]: MODEL "base" (--model itself) or a run folder with a transformer/ export, sampled in
a fresh stock pipeline by the project's evaluation sampler (ODE, fixed noise: seed --seed) at STEPS steps and CFG (1 by
default), each image captioned with its tiny-shapes scores (exact: the asked objects and nothing else).
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def parse_row(text: str):
    label, sep, spec = text.rpartition("=")
    model, at, rest = spec.partition("@")
    steps, _, cfg = rest.partition("x")
    if not sep or not label or not at or not steps.isdigit() or int(steps) < 1:
        raise ValueError(f"row {text!r}: expected LABEL=MODEL@STEPS[xCFG], e.g. 'DMD2=runs/x@2'")
    return label, model, int(steps), float(cfg) if cfg else 1.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", help="LABEL=MODEL@STEPS[xCFG]")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=str(REPO / "assets" / "tiny-shapes"))
    ap.add_argument("--prompts", type=int, default=8, help="the first N held-out prompts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        rows = [parse_row(r) for r in args.rows]
    except ValueError as e:
        ap.error(str(e))
    for _, model, _, _ in rows:
        if model != "base" and not (Path(model) / "transformer" / "config.json").is_file():
            ap.error(f"{model}: not a run folder with a transformer/ export")

    import torch
    from PIL import Image, ImageDraw

    import common
    import models
    from harness import evaluation, logs, prompt_files
    from rewards import shapes

    prompts = prompt_files.load_prompts(common.TEST_PROMPTS)[: args.prompts]
    bands = []
    for label, model, steps, cfg in rows:
        pipe = models.load_pipeline(args.model, torch.device("cpu"))
        if model != "base":
            pipe.transformer.load_state_dict(
                type(pipe.transformer).from_pretrained(str(Path(model) / "transformer")).state_dict()
            )
        images, scores = evaluation.evaluate(
            pipe,
            pipe.transformer,
            common.PromptEncoder(pipe),
            prompts,
            lambda im, p: {k: v.float() for k, v in shapes.evaluate(im, p).items()},
            num_steps=steps,
            guidance_scale=cfg,
            seed=args.seed,
            repeats=1,
            progress=False,
        )
        caps = [f"{p[:22]}\nexact {int(e)} objects {int(o)}" for p, e, o in zip(prompts, scores["exact"], scores["objects"])]
        grid = Image.fromarray(logs.captioned_grid(images, caps, ncol=len(prompts)))
        band = Image.new("RGB", (grid.width, grid.height + 18), "white")
        ImageDraw.Draw(band).text((4, 3), f"{label}: exact {scores['exact'].float().mean().item():.2f}", fill="black")
        band.paste(grid, (0, 18))
        bands.append(band)
    canvas = Image.new("RGB", (max(b.width for b in bands), sum(b.height for b in bands)), "white")
    y = 0
    for b in bands:
        canvas.paste(b, (0, y))
        y += b.height
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    canvas.save(args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
