"""GenEval of a base model or a trained LoRA, without mmdet (the detector and rules of rewards/geneval.py).

    python benchmark/geneval.py --metadata geneval/prompts/evaluation_metadata.jsonl \\
        --model stabilityai/stable-diffusion-3.5-medium --num-steps 40 --guidance-scale 4.5 --resolution 512
    python benchmark/geneval.py --metadata ... --lora runs/<run>/lora     # the same noises, the run's LoRA loaded

`--metadata` is GenEval's own prompt file (djghosh13/geneval, prompts/evaluation_metadata.jsonl: 553 prompts, one JSON
object per line with "tag", "include", optional "exclude", "prompt"); it is not shipped here. As GenEval does, each prompt
gets --images-per-prompt images (4), each image is correct or not, a tag's score is its images' mean and the overall
score the mean over the six tags. The images come from the ODE sampler with fixed noise (seed + chunk index), so a base
and a LoRA are compared on the same noises. Prints the per-tag table and writes one JSON line per image (tag, prompt,
correct, clauses met, reasons: GenEval's results.jsonl fields) to --out. The numbers are close to, not equal to,
GenEval's mmdet original (see the README).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402
from common import UserError  # noqa: E402
from harness import evaluation  # noqa: E402
from rewards import geneval  # noqa: E402


def read_metadata(path: str) -> list:
    """GenEval's metadata rows, checked: a wrong file fails here with one line, before any model loads."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--metadata {path!r}: no such file (GenEval's prompts/evaluation_metadata.jsonl)")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
        clauses = row.get("include") if isinstance(row, dict) else None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("tag"), str):
            raise UserError(f'{path}:{n}: expected GenEval metadata with a "tag", a "prompt" and "include" clauses')
        if not isinstance(clauses, list) or not clauses:
            raise UserError(f'{path}:{n}: expected GenEval metadata with a "tag", a "prompt" and "include" clauses')
        for req in clauses + list(row.get("exclude", [])):
            if req.get("class") not in geneval.CLASSES or not isinstance(req.get("count"), int) or req["count"] < 1:
                raise UserError(f"{path}:{n}: clause {req} needs a COCO class of GenEval and a count >= 1")
            if "color" in req and req["color"] not in geneval.COLORS:
                raise UserError(f"{path}:{n}: colour {req['color']!r} is not one of GenEval's {geneval.COLORS}")
            if "position" in req:
                relation, target = req["position"]
                if relation not in geneval.POSITIONS or not 0 <= target < len(clauses):
                    raise UserError(f"{path}:{n}: position {req['position']} is not [relation, earlier clause]")
        rows.append(row)
    if not rows:
        raise UserError(f"--metadata {path!r} has no prompts")
    return rows


def score(args, rows: list) -> list:
    """One result per image: prompt k's images are rows k, k + P, k + 2P, ... of `evaluation.evaluate`'s repeats."""
    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pipe = models.load_pipeline(args.model, device, models.DTYPES[args.dtype], args.resolution)
    if args.lora:
        pipe.load_lora_weights(args.lora)
    scorer = geneval.GenEval(device, batch_size=args.batch)
    metadata = {}
    for row in rows:  # a prompt names its metadata; one prompt twice with different clauses cannot be scored
        if metadata.setdefault(row["prompt"], row) != row:
            raise UserError(f"prompt {row['prompt']!r} appears twice in --metadata with different clauses")
    results = []

    def judge(images, prompts):
        verdicts = scorer.verdicts(images, [metadata[p] for p in prompts])
        for p, v in zip(prompts, verdicts):
            results.append(
                {
                    "tag": metadata[p]["tag"],
                    "prompt": p,
                    "correct": v.correct,
                    "met": v.met,
                    "clauses": v.clauses,
                    "reason": "\n".join(v.reasons),
                    "metadata": json.dumps(metadata[p]),
                }
            )
        return {}

    evaluation.evaluate(
        pipe,
        pipe.transformer,
        common.PromptEncoder(pipe),
        [r["prompt"] for r in rows],
        judge,
        num_steps=args.num_steps,
        guidance_scale=args.guidance_scale,
        seed=args.seed,
        batch=args.batch,
        repeats=args.images_per_prompt,
        use_autocast=args.dtype != "float32",
    )
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metadata", required=True, help="GenEval's prompts/evaluation_metadata.jsonl")
    ap.add_argument("--model", default=common.TINY_MODEL, help="diffusers pipeline: a local folder or a hub id")
    ap.add_argument("--lora", default=None, help="an exported LoRA folder (runs/<run>/lora); default: the base model")
    ap.add_argument("--images-per-prompt", type=int, default=4, help="GenEval's 4")
    ap.add_argument("--num-steps", type=int, default=40)
    ap.add_argument("--guidance-scale", type=float, default=4.5)
    ap.add_argument("--resolution", type=int, default=None, help="image side in pixels; default native")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8, help="images per sampler and detector call")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", choices=list(models.DTYPES), default="float32", help="dtype of the generator")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (a quick look)")
    ap.add_argument("--out", default="geneval_results.jsonl", help="one JSON line per image")
    args = ap.parse_args(argv)
    try:
        for name in ("images_per_prompt", "num_steps", "batch"):
            if getattr(args, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be > 0")
        if args.limit is not None and args.limit <= 0:
            raise UserError(f"--limit {args.limit}: must be > 0")
        if args.lora and not Path(args.lora).is_dir():
            raise UserError(f"--lora {args.lora!r}: no such folder (an exported runs/<run>/lora)")
        if not Path(args.out).resolve().parent.is_dir():
            raise UserError(f"--out {args.out!r}: its folder does not exist")
        rows = read_metadata(args.metadata)[: args.limit]
        results = score(args, rows)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    os.replace(tmp, args.out)
    table = geneval.summary([r["tag"] for r in results], [r["correct"] for r in results])
    print(f"{len(results)} images, {len(rows)} prompts x {args.images_per_prompt}; results in {args.out}\n")
    print("| tag | score |\n|---|---|")
    print("\n".join(f"| {tag} | {value:.4f} |" for tag, value in table.items()))


if __name__ == "__main__":
    main()
