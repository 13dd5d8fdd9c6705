"""The edit task's results: exports of runs trained on tiny-edit, scored through the stock FluxKontextPipeline.

    R=benchmark/results/edit
    python benchmark/convergence.py train crd nft awm dgpo grpo dpo_full elbo_grpo_full --task edit --seeds 1 2 3 \\
        --epochs 60 --eval-every 20 --jobs 2                       # train (or resume) the runs, into $R/runs
    python benchmark/edit.py score $R/runs/*                       # base (once) and each export -> $R/final.jsonl
    python benchmark/edit.py table                                 # the markdown table from $R/final.jsonl
    python benchmark/edit.py grid $R/runs/*__1__* --out $R/grid.png     # input | instruction | base | each export

`score` loads each export as a user would (runs/<run>/transformer after a full fine-tune, or runs/<run>/lora) into
`FluxKontextPipeline.from_pretrained(assets/tiny-edit)` and calls the pipeline itself (not our sampler) on the 28
held-out instructions of `assets/edit/test.jsonl`, each with its own source image, `--noises` noises each (noise n is
the generator seed 1000 n for the whole batch, the same for every model), at the run's own evaluation steps and CFG
(`true_cfg_scale`, negative prompt ""). The base is scored at CFG 1 and at `--base-cfg` (4.5, as on the other
testbeds), and each export's exact edit is paired with both per instruction. Metrics are the edit reward's
(`rewards/edit.py`) against the prompt file's source scene: edit_exact (the asked change, every other object kept,
nothing else: no reward can fake it), edit_asked, rest_unchanged, objects_extra, and the reward itself, edit. The
rows use convergence.py's final.jsonl names (exact, extra, exact_gain_cfg*_per_prompt), so that
`benchmark/results_table.py` reads them as it reads the other testbeds'.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark.convergence import append, images_in_card, images_trained, mean_se, read_jsonl  # noqa: E402
from rewards import edit as edit_reward  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmark" / "results" / "edit"
MODEL = REPO / "assets" / "tiny-edit"
TEST = REPO / "assets" / "edit" / "test.jsonl"
METRICS = ("edit_exact", "edit_asked", "rest_unchanged", "objects_extra", "edit")
MAX_TOKENS = 16  # the tiny encoders' sequence length (benchmark/testbeds/build_tiny_edit.py)


def test_set(path: Path = TEST) -> tuple:
    """(instructions, source PIL images, source scenes) of an edit prompt file whose lines carry "image" and "source"."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    images = [Image.open(path.parent / r["image"]).convert("RGB") for r in rows]
    return [r["prompt"] for r in rows], images, [r["source"] for r in rows]


def load(model: Path, run: Path = None):
    """The stock edit pipeline of `model`, with a run's export in it (None: the base)."""
    import transformers
    from diffusers.utils import logging

    # quiet: a LoRA without a text-encoder part, the unused image processors' torchvision, the loading bars
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(str(model))
    if run is not None and (run / "transformer").is_dir():
        pipe.transformer = type(pipe.transformer).from_pretrained(str(run / "transformer"))
    elif run is not None:
        pipe.load_lora_weights(str(run / "lora"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def sample(pipe, prompts, images, noise: int, steps: int, cfg: float) -> torch.Tensor:
    """One image per prompt from the stock pipeline's __call__, [B, 3, H, W] in [0, 1]."""
    size = images[0].size[0]
    return pipe(
        image=images,
        prompt=list(prompts),
        negative_prompt=[""] * len(prompts) if cfg > 1 else None,
        true_cfg_scale=cfg,
        height=size,
        width=size,
        max_area=size * size,
        _auto_resize=False,  # FLUX.1-Kontext's own resolutions otherwise
        max_sequence_length=MAX_TOKENS,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(1000 * noise),
        output_type="pt",
    ).images.float()


def score(pipe, test: tuple, noises: int, steps: int, cfg: float) -> dict:
    """{metric: [noises, prompts] array} of the pipeline's outputs against each prompt's source scene."""
    prompts, images, sources = test
    out = {k: [] for k in METRICS}
    for n in range(noises):
        m = edit_reward.evaluate(sample(pipe, prompts, images, n, steps, cfg), prompts, sources)
        for k in METRICS:
            out[k].append(m[k].numpy())
    return {k: np.stack(v) for k, v in out.items()}


def row_of(m: dict) -> dict:
    """The means, under convergence.py's names where it has one (exact, extra) so that benchmark/results_table.py reads
    these rows as it reads the other testbeds'."""
    row = {"set": "test", "exact": float(m["edit_exact"].mean()), "extra": float(m["objects_extra"].mean())}
    row.update({k: float(m[k].mean()) for k in ("edit_asked", "rest_unchanged", "edit")})
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def run_settings(run: Path) -> dict:
    a = json.loads((run / "args.json").read_text())
    cfg = a.get("eval_guidance_scale") or a.get("guidance_scale") or 1.0
    steps = a.get("eval_num_steps") or a["num_steps"]
    return {"setting": a["exp_name"], "seed": a["seed"], "steps": steps, "guidance_scale": float(cfg)}


def cmd_score(args):
    test = test_set(args.prompts)
    done = {(r["run"], r["noises"]) for r in read_jsonl(args.results / "final.jsonl")}
    bases = {}
    for run in args.runs:
        s = run_settings(run)
        if (run.name, args.noises) in done:
            continue
        for cfg in (1.0, args.base_cfg):
            key = (s["steps"], cfg)
            if key not in bases:  # the base on the same noises and steps (once per results folder and key)
                bases[key] = score(load(args.model), test, args.noises, *key)
                old = read_jsonl(args.results / "base.jsonl")
                if not any((r["noises"], r["steps"], r["guidance_scale"]) == (args.noises, *key) for r in old):
                    row = {"model": "base", "steps": key[0], "guidance_scale": cfg, "noises": args.noises}
                    append(args.results / "base.jsonl", {**row, **row_of(bases[key])})
        m = score(load(args.model, run), test, args.noises, s["steps"], s["guidance_scale"])
        row = {"run": run.name, **s, "images": images_trained(run) or images_in_card(run), "noises": args.noises}
        row.update(row_of(m))
        for cfg in (1.0, args.base_cfg):  # paired: the same instruction, source image and noise
            gain = (m["edit_exact"] - bases[(s["steps"], cfg)]["edit_exact"]).mean(0)
            row[f"exact_gain_cfg{cfg:g}_per_prompt"] = gain.round(6).tolist()
        append(args.results / "final.jsonl", row)
        print(json.dumps({k: v for k, v in row.items() if "per_prompt" not in k}), flush=True)


def cmd_table(args):
    finals = [r for r in read_jsonl(args.results / "final.jsonl") if r["noises"] == args.noises]
    base = [r for r in read_jsonl(args.results / "base.jsonl") if r["noises"] == args.noises]
    if not base or not finals:
        print(f"edit.py: error: no rows with --noises {args.noises} in {args.results}", file=sys.stderr)
        sys.exit(2)
    tags = [f"cfg{c:g}" for c in sorted({1.0, args.base_cfg})]
    lines = [
        f"| model | seeds | images trained | held-out exact edit ({len(finals[0][f'exact_gain_{tags[0]}_per_prompt'])} "
        f"instructions x {args.noises} noises) | "
        + " | ".join(f"vs base CFG {t[3:]}" for t in tags)
        + " | asked edit made | rest unchanged | extra objects/img |",
        "|---|---|---|---|" + "---|" * len(tags) + "---|---|---|",
    ]
    for b in base:
        lines.append(
            f"| base, CFG {b['guidance_scale']:g}, {b['steps']} steps | - | 0 | {b['exact']:.3f} | "
            + "| " * len(tags)
            + f"{b['edit_asked']:.3f} | {b['rest_unchanged']:.3f} | {b['extra']:.2f} |"
        )
    for setting in dict.fromkeys(r["setting"] for r in finals):
        rows = [r for r in finals if r["setting"] == setting]
        gains = [np.mean([r[f"exact_gain_{t}_per_prompt"] for r in rows], axis=0) for t in tags]
        cells = [setting, str(len(rows)), "/".join(sorted({f"{r['images']:,}" for r in rows}))]
        cells += [f"{np.mean([r['exact'] for r in rows]):.3f}", *(mean_se(g) for g in gains)]
        cells += [
            f"{np.mean([r[k] for r in rows]):.{n}f}" for k, n in (("edit_asked", 3), ("rest_unchanged", 3), ("extra", 2))
        ]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))


def cmd_grid(args):
    """Rows: held-out instructions (every `--every`th); columns: the source, the base (CFG 1), each run's export; noise
    0, the run's own steps and CFG. The instruction is written above each row."""
    prompts, images, sources = test_set(args.prompts)
    pick = list(range(0, len(prompts), args.every))
    prompts, images = [prompts[i] for i in pick], [images[i] for i in pick]
    columns = [("input", [np.asarray(im) for im in images])]
    settings = [run_settings(r) for r in args.runs]
    models = [("base", None, settings[0]["steps"] if settings else 16, 1.0)]
    models += [(s["setting"], r, s["steps"], s["guidance_scale"]) for s, r in zip(settings, args.runs)]
    for name, run, steps, cfg in models:
        out = sample(load(args.model, run), prompts, images, 0, steps, cfg)
        columns.append((name, [(x.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8) for x in out]))
    scale, pad, cap = 2, 4, 14
    cell = images[0].size[0] * scale
    width, height = len(columns) * (cell + pad) + pad, cap + len(prompts) * (cell + cap + pad) + pad
    grid = Image.new("RGB", (width, height), "white")
    draw, font = ImageDraw.Draw(grid), ImageFont.load_default()
    for c, (name, _) in enumerate(columns):
        draw.text((pad + c * (cell + pad), 1), name, fill="black", font=font)
    for r, prompt in enumerate(prompts):
        y = cap + r * (cell + cap + pad)
        draw.text((pad, y + 1), prompt, fill="black", font=font)
        for c, (_, ims) in enumerate(columns):
            tile = Image.fromarray(ims[r]).resize((cell, cell), Image.NEAREST)
            grid.paste(tile, (pad + c * (cell + pad), y + cap))
    grid.save(args.out)
    print(f"wrote {args.out} ({len(prompts)} instructions x {len(columns)} columns)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["score", "table", "grid"])
    ap.add_argument("runs", nargs="*", type=Path, help="run folders (score, grid)")
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--prompts", type=Path, default=TEST, help="held-out edit prompts with image and source")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--noises", type=int, default=8, help="noises per instruction (score, table)")
    ap.add_argument("--base-cfg", type=float, default=4.5, help="the base's second CFG (true_cfg_scale) besides 1")
    ap.add_argument("--every", type=int, default=4, help="grid: every n-th held-out instruction")
    ap.add_argument("--out", type=Path, default=RESULTS / "grid.png", help="grid: the png")
    args = ap.parse_args(argv)
    if args.noises < 1 or args.every < 1 or args.base_cfg < 1:
        ap.error("--noises and --every must be >= 1, --base-cfg >= 1")
    for run in args.runs:
        if not (run / "args.json").is_file():
            ap.error(f"{run}: not a run folder (no args.json)")
        if not any((run / d).is_dir() for d in ("transformer", "lora")):
            ap.error(f"{run}: no export (transformer/ or lora/): the run has not finished")
    if args.command == "score" and not args.runs:
        ap.error("score: give the run folders")
    if args.command != "table" and not (args.model / "model_index.json").is_file():
        ap.error(f"--model {args.model}: not a pipeline folder (build it: python benchmark/testbeds/build_tiny_edit.py)")
    if not args.prompts.is_file():
        ap.error(f"--prompts {args.prompts}: not found")
    try:
        test_set(args.prompts)
    except (OSError, ValueError, KeyError, TypeError) as e:  # a line without "image" / "source", a missing image
        ap.error(f"--prompts {args.prompts}: not an edit prompt file with image and source per line ({type(e).__name__}: {e})")
    if args.command == "score":
        args.results.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    {"score": cmd_score, "table": cmd_table, "grid": cmd_grid}[args.command](args)


if __name__ == "__main__":
    main()
