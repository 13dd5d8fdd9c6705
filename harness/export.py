"""The trained model out of a run: a diffusers LoRA folder (runs/<run>/lora), or a transformer folder with
--full-finetune (runs/<run>/transformer), each with its model card (README.md) and samples; and the hub upload."""

import contextlib
import inspect
import json
import os
import shlex
import shutil
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from common import REPO, UserError
from harness.checkpoints import disk_full, write_error_reason
from models import EvalEMA, is_fsdp, swapped_weights

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # the file name diffusers' load_lora_weights looks for


EXPORT_NAMES = ("lora", "transformer")  # the export folder in the run folder: LoRA, --full-finetune


LORA_ARGS = ("lora_rank", "lora_alpha", "lora_targets")  # what --full-finetune (every transformer weight) has no use for


def export_dir(run_dir: Path, args) -> Path:
    """Where a run's export goes: runs/<run>/lora, or with --full-finetune runs/<run>/transformer."""
    return Path(run_dir) / EXPORT_NAMES[bool(getattr(args, "full_finetune", False))]


def lora_files(transformer) -> dict:
    """The pipeline component each LoRA file of the export loads into -> its file name: LORA_WEIGHTS for `transformer`;
    Wan2.2-A14B's low-noise expert (`wan.Experts`) gets its own file, which diffusers loads into `transformer_2` with
    `load_lora_weights(folder, weight_name=..., load_into_transformer_2=True)` (WanLoraLoaderMixin, its keys prefixed
    `transformer.` as the first file's)."""
    names = getattr(transformer, "experts", None) or ["transformer"]
    return {name: LORA_WEIGHTS if name == "transformer" else f"pytorch_lora_weights_{name}.safetensors" for name in names}


CARD_ARGS = (
    "model",
    "reward",
    "seed",
    "num_epochs",
    "num_prompts",
    "group_size",
    "learning_rate",
    "lora_rank",
    "lora_alpha",
    "num_steps",
    "guidance_scale",
    "dynamics",
    "eta",
    "resolution",
    "base_dtype",
)


def export_lora(
    out_dir: Path,
    pipe,
    transformer,
    args,
    algo_doc: str,
    epoch: int,
    logger=None,
    *,
    samples=None,
    weights: Optional[Sequence[torch.Tensor]] = None,
    weights_name: str = "the trained policy",
):
    """Write `out_dir` (runs/<run>/lora) as a diffusers LoRA folder: `pytorch_lora_weights.safetensors`, saved by the
    pipeline class's own `save_lora_weights`, a model card README.md and samples.png. Atomic: built in a temp folder,
    then swapped in, so a kill leaves the previous export (at worst under .lora.old) and never a half-written one.
    With --full-finetune (`args.full_finetune`), `out_dir` (runs/<run>/transformer) is instead the transformer's own
    `save_pretrained` folder (config.json + fp32 safetensors) that `<Family>Transformer...from_pretrained` loads.

    The adapter metadata (peft's LoraConfig: r, lora_alpha, targets) goes into the safetensors header; without it
    diffusers assumes lora_alpha = r and would apply our alpha = 2r LoRA at half strength.
    `weights`: other values for the trainable parameters (an EMA), in `trainable_params`' order, exported instead of the
    live ones, which are left untouched; `weights_name` says which in the card. `logger`: its newest eval/* scalars
    go into the card's table and its newest "eval/images" grid (captioned) becomes samples.png, unless `samples` (a [3, H, W]
    image in [0, 1]) is given. Call it on one rank only; under --fsdp on every rank (the LoRA is gathered from all of
    them), and rank 0 writes."""
    from peft import get_peft_model_state_dict

    full = getattr(args, "full_finetune", False)
    params = list(transformer.parameters()) if full else [p for n, p in transformer.named_parameters() if "lora_" in n]
    experts = getattr(transformer, "experts", None) or {"transformer": transformer}
    with swapped_weights(params, weights) if weights is not None else contextlib.nullcontext():
        if is_fsdp(transformer):
            import torch.distributed as dist
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # the whole trainable state on rank 0's CPU, one parameter at a time (the others get nothing)
            options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
            gathered = get_model_state_dict(transformer, options=options)
            if dist.get_rank() != 0:
                return out_dir
            peft = get_peft_model_state_dict(transformer, state_dict=gathered) if not full else gathered
            states = {"transformer": {k: v.clone() for k, v in peft.items()}}
        elif full:
            states = {"transformer": {k: v.detach().cpu().clone() for k, v in transformer.state_dict().items()}}
        else:
            states = {
                k: {n: v.detach().cpu().clone() for n, v in get_peft_model_state_dict(m).items()} for k, m in experts.items()
            }
    out_dir = Path(out_dir)
    tmp, old = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}"), out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if full:  # a diffusers transformer folder: its config and the (gathered) weights
            from safetensors.torch import save_file

            transformer.save_config(tmp)
            # FSDP2 renames the class FSDP<class>; the base's local path is this machine's, not the reader's
            config = json.loads((tmp / "config.json").read_text())
            config = {k: v for k, v in config.items() if k != "_name_or_path"} | {"_class_name": pipe.family.transformer}
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            save_file(
                {k: v.contiguous() for k, v in states["transformer"].items()}, tmp / "diffusion_pytorch_model.safetensors"
            )
        for name, file in {} if full else lora_files(transformer).items():
            type(pipe.pipe).save_lora_weights(
                tmp,
                transformer_lora_layers=states[name],
                transformer_lora_adapter_metadata=experts[name].peft_config["default"].to_dict(),
                weight_name=file,
            )
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.glob("*.safetensors"):  # safetensors writes 0600; the export is meant to be shared, like the run
            os.chmod(f, 0o666 & ~umask)
        if samples is None and logger is not None and "eval/images" in logger.last_images:
            samples = logger.last_images["eval/images"][0]
        if samples is not None:
            from PIL import Image

            if isinstance(samples, torch.Tensor):  # [3, H, W] in [0, 1]; the logger's grids are already uint8 [H, W, 3]
                samples = (samples.detach().float().clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()
            Image.fromarray(samples).save(tmp / "samples.png")
        evals = {k: v for k, v in (logger.last_scalars.items() if logger is not None else ()) if k.startswith("eval/")}
        (tmp / "README.md").write_text(model_card(pipe, args, algo_doc, epoch, evals, weights_name, samples is not None))
    except Exception as e:  # a full disk, a removed folder: the previous export stays, nothing half-written is left
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, OSError) and not disk_full(e, out_dir.parent):
            raise  # a bug, to see whole
        raise UserError(f"could not write the export {out_dir} ({write_error_reason(e, out_dir.parent)})") from None
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def export_model(run_dir: Path, pipe, args, algo_doc: str, epoch: int, logger, eval_ema: EvalEMA):
    """The scripts' export after each checkpoint: `export_lora` of the run's transformer into `export_dir`, with the
    eval EMA's weights when --eval-ema-decay > 0. Rank 0 (the logger's rank) writes; under --fsdp every rank calls it,
    since the weights are gathered from all of them."""
    if not logger.enabled and not is_fsdp(pipe.transformer):
        return None
    return export_lora(export_dir(run_dir, args), pipe, pipe.transformer, args, algo_doc, epoch, logger, **eval_ema.export())


def card_call(pipe, settings: dict) -> tuple:
    """How the stock pipeline reproduces our ODE sampler: (setup lines run after loading, {keyword: Python source} of
    `pipe(prompt, ...)`, "images" or "frames"). `settings`: num_steps, guidance_scale, negative_prompt,
    max_sequence_length (the encoder's), height, width (pixels or None), num_frames. What differs per family (the
    keyword of the guidance, the scheduler, the sigma grid) is the family's `card`."""
    g = float(settings["guidance_scale"])
    call = {"num_inference_steps": str(settings["num_steps"]), "guidance_scale": repr(g)}
    if g > 1:
        call["negative_prompt"] = json.dumps(settings.get("negative_prompt") or "")
    if settings.get("height"):
        call["height"] = str(settings["height"])
    if settings.get("width"):
        call["width"] = str(settings["width"])
    if "max_sequence_length" in inspect.signature(type(pipe.pipe).__call__).parameters:
        call["max_sequence_length"] = str(settings["max_sequence_length"])
    return pipe.family.card(pipe, call, settings) if pipe.family.card else ([], call, "images")


def lora_snippet(
    pipe_class: str,
    model: str,
    lora_dir: str,
    setup: list,
    call: dict,
    output: str,
    gpu: bool = False,
    no_t5: bool = False,
    transformer_class: Optional[str] = None,
    files: Optional[dict] = None,
) -> str:
    """The lines that load an exported LoRA into a stock diffusers pipeline and sample as training did (`card_call`).
    With `transformer_class` (--full-finetune), `lora_dir` is a transformer folder loaded in place of the base's.
    `files`: `lora_files` of the trained transformer (None: the one file, into `transformer`)."""
    dtype = ", dtype=torch.bfloat16" if gpu else ""
    load = f"{pipe_class}.from_pretrained({json.dumps(model)}" + (", text_encoder_3=None, tokenizer_3=None" if no_t5 else "")
    load += ", transformer=transformer" if transformer_class else ""
    load += f'{dtype}).to("cuda")' if gpu else ")"
    code = "\n".join([*setup, "", *call.values()])
    imports = ["import numpy as np"] * ("np." in code) + ["import torch"] * (gpu or "torch." in code)
    classes = ", ".join(sorted({pipe_class, transformer_class} - {None}))
    imports += [f"from diffusers import {classes}"] + [x for x in setup if x.startswith(("from ", "import "))]
    setup = "\n".join(x for x in setup if not x.startswith(("from ", "import "))).strip("\n").splitlines()
    if output == "frames":
        imports.append("from diffusers.utils import export_to_video")
    kwargs = ", ".join(f"{k}={v}" for k, v in call.items())
    save = 'export_to_video(videos[0], "sample.mp4", fps=16)' if output == "frames" else 'images[0].save("sample.png")'
    if transformer_class:
        lines = [*imports, f"transformer = {transformer_class}.from_pretrained({json.dumps(lora_dir)}{dtype})"]
        lines += [f"pipe = {load}", *setup]
    else:
        loads = [
            f"pipe.load_lora_weights({json.dumps(lora_dir)})"
            if name == "transformer"
            else f"pipe.load_lora_weights({json.dumps(lora_dir)}, weight_name={json.dumps(file)}, load_into_{name}=True)"
            for name, file in (files or {"transformer": LORA_WEIGHTS}).items()
        ]
        lines = [*imports, f"pipe = {load}", *loads, *setup]
    lines += [
        'prompt = ["a red circle"]',
        f"{'videos' if output == 'frames' else 'images'} = pipe(prompt=prompt, {kwargs}).{output}",
    ]
    return "\n".join(lines + [save]) + "\n"


def model_card(pipe, args, algo_doc: str, epoch: int, evals: dict, weights_name: str, has_samples: bool) -> str:
    """The model card of an export (a LoRA, or a transformer with --full-finetune): what it is, how well it scores,
    how it was made, how to load it."""
    config = asdict(args) if is_dataclass(args) else dict(vars(args))
    doc = (algo_doc or "").strip()
    algo = doc.splitlines()[0] if doc else config.get("exp_name", "?")
    pipe_class, model = type(pipe.pipe).__name__, str(config.get("model", ""))
    no_t5 = pipe_class == "StableDiffusion3Pipeline" and pipe.text_encoder_3 is None
    # the scripts' Args have every field; a bare record (another caller) gets the scripts' defaults
    settings = {k: config.get(k) or default for k, default in (("num_steps", 10), ("guidance_scale", 1.0))}
    settings["negative_prompt"] = config.get("negative_prompt") or ""
    settings["height"] = config.get("height") or config.get("resolution")
    settings["width"] = config.get("width") or config.get("resolution")
    settings["num_frames"] = config.get("num_frames") or pipe.family.num_frames
    settings["sigma_schedule"] = config.get("sigma_schedule") or "pipeline"
    # as long as in training (PromptEncoder): e.g. SD3 without T5 pads with 1 zero token, not the pipeline's 256
    settings["max_sequence_length"] = pipe.family.max_sequence_length(pipe.pipe, config.get("max_sequence_length"))
    full = bool(config.get("full_finetune"))
    tag = "full-finetune" if full else "lora"
    front = ["---", "library_name: diffusers", f"tags: [{tag}, text-to-image, cleanflow, " + str(config.get("exp_name")) + "]"]
    hub = not Path(model).expanduser().exists() and model.count("/") == 1
    if hub:
        front.append(f"base_model: {model}")
    targets = ", ".join(config.get("lora_targets") or pipe.family.lora_targets)
    transformer_class = pipe.family.transformer if full else None
    snippet = lora_snippet(
        pipe_class,
        model,
        "<this folder>",
        *card_call(pipe, settings),
        gpu=hub,
        no_t5=no_t5,
        transformer_class=transformer_class,
        files=None if full else lora_files(pipe.transformer),
    )
    if full:
        what = f"A fine-tuned transformer ({transformer_class})"
        trained = f"| trained | every transformer weight ({sum(p.numel() for p in pipe.transformer.parameters()):,}) |"
    else:
        what = "A LoRA"
        trained = f"| LoRA | rank {config.get('lora_rank')}, alpha {config.get('lora_alpha')}, on {targets} |"
    lines = front + [
        "---",
        "",
        f"# {config.get('run_name') or 'cleanflow LoRA'}",
        "",
        f"{what} for `{model}` ({pipe_class}) trained with reinforcement learning by cleanflow.",
        "",
        "| | |",
        "|-|-|",
        f"| base model | `{model}` |",
        f"| algorithm | {algo} |",
        f"| reward | `{config.get('reward')}` |",
        f"| weights | {weights_name}, after epoch {epoch} |",
        trained,
        "",
        "## Use it",
        "",
        "```python",
        snippet.rstrip(),
        "```",
        "",
    ]
    steps = sorted({step for _, step in evals.values()})
    lines += ["## Evaluation", ""]
    if evals:
        lines += [
            f"Held-out prompts (`{config.get('test_prompts')}`), ODE sampler, {config.get('num_steps')} steps, "
            f"CFG {config.get('guidance_scale')}, after {max(steps)} training images:",
            "",
            "| metric | value |",
            "|-|-|",
        ] + [f"| {k} | {v:.4f} |" for k, (v, _) in sorted(evals.items())]
    else:
        lines.append("No evaluation logged yet.")
    if has_samples:
        lines += ["", "![samples](samples.png)"]
    lines += ["", "## Training", "", "| argument | value |", "|-|-|"]
    lines += [f"| {k} | {config[k]} |" for k in CARD_ARGS if k in config and not (full and k in LORA_ARGS)]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = f"torchrun --nproc-per-node {world_size}" if world_size > 1 else "python"
    lines += [
        "",
        "Every argument: `args.json` in the run folder.",
        "",
        f"Command: `{launcher} {shlex.join(sys.argv)}`",
        "",
        f"Git commit: `{git_commit()}`",
        "",
    ]
    return "\n".join(lines)


def push_to_hub(folder: Path, repo_id: str) -> Optional[str]:
    """Upload an exported LoRA folder to a hub model repo (created if missing; needs `hf auth login` or HF_TOKEN).

    A failed upload (no token, no network) is one warning line with the command to retry, not an exception: it comes
    after training, and the run must still close its logs; the folder stays on disk."""
    from huggingface_hub import create_repo, upload_folder

    try:
        create_repo(repo_id, repo_type="model", exist_ok=True)
        url = upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=f"cleanflow: {folder.parent.name}")
    except Exception as e:  # noqa: BLE001 - any hub/network failure: the run itself succeeded
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"warning: --push-to-hub {repo_id} failed ({first}); retry: hf upload {repo_id} {folder} .", file=sys.stderr)
        return None
    print(f"pushed {folder} to {url}")
    return str(url)


def git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"
