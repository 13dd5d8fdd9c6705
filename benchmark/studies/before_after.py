"""Before/after picture of one run: its first and last captioned eval grids (same prompts, same noise), stacked.

    python benchmark/studies/before_after.py runs/<run> --out benchmark/results/shapes/hacking.png

Every run writes runs/<run>/samples/eval_<images seen>.png at each evaluation (the base model at 0 images); this puts
the first above the last with a title each, so that what RL changed, e.g. extra objects, is seen at a glance.
"""

import argparse
from pathlib import Path

from PIL import Image, ImageDraw


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run folder with samples/eval_*.png")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="", help="what the run trained, e.g. 'NFT on the GenEval-style shapes reward'")
    args = ap.parse_args()
    grids = sorted((Path(args.run) / "samples").glob("eval_*.png"))
    if len(grids) < 2:
        raise SystemExit(f"error: {args.run} has fewer than two eval grids in samples/")
    first, last = (Image.open(p).convert("RGB") for p in (grids[0], grids[-1]))
    steps = [int(p.stem.split("_")[1]) for p in (grids[0], grids[-1])]
    band = 18
    canvas = Image.new("RGB", (max(first.width, last.width), first.height + last.height + 2 * band), "white")
    draw = ImageDraw.Draw(canvas)
    y = 0
    for image, images_seen in zip((first, last), steps):
        label = (
            "base model"
            if images_seen == 0
            else f"after {images_seen} images of RL" + (f": {args.title}" if args.title else "")
        )
        draw.text((4, y + 4), label, fill="black")
        canvas.paste(image, (0, y + band))
        y += band + image.height
    canvas.save(args.out)
    print(f"saved {args.out} ({grids[0].name} above {grids[-1].name})")


if __name__ == "__main__":
    main()
