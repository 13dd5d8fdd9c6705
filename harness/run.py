"""A run's lifecycle, shared by the algorithm scripts: `run_main` and the command line, the flag checks that need no model,
start and resume (`start_run`), the run folder's lock, a graceful stop, seeding, and the non-finite-gradient guard.
Checkpoints are in checkpoints.py, the exported model and its card in export.py, logging in logs.py."""

import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import random
import re
import shutil
import sys
import time
import types
import typing
import urllib.parse
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import tyro

from common import FAMILIES, REPO, UserError, short
from harness.checkpoints import check_checkpoint_fields, check_no_symlinks, find_checkpoint, load_checkpoint, script_name
from harness.distributed import check_device, env_ranks
from harness.export import EXPORT_NAMES, LORA_ARGS
from harness.prompt_files import Prompt, load_prompts
from models import check_model_folder, check_pipeline_folder, compile_unavailable, looks_local, pipeline_config


def run_main(main, args, argv: Optional[Sequence[str]] = None):
    """Run `main(args)`, turning `UserError` into a one-line message and exit code 2, and Ctrl-C before training
    (while the model loads; after that `GracefulStop` handles it) into one line and exit code 130.

    `argv`: the command line `args` was parsed from (default `sys.argv[1:]`), kept as `args.argv`: `start_run` reads
    from it which flags were given, to compare them with a resumed run's."""
    if hasattr(args, "argv"):
        args.argv = tuple(sys.argv[1:] if argv is None else argv)
    try:
        check_integrations(args)
        main(args)
    except UserError as e:
        print(f"error: {e}" + (f"; {resume_hint(args)}" if getattr(e, "resumable", False) else ""), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C); nothing was saved since the last checkpoint", file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        if e.errno != errno.ENOSPC:  # anything else is a bug to see whole
            raise
        print(f"error: no space left on device ({e.filename or e}); the last complete checkpoint is kept", file=sys.stderr)
        sys.exit(2)
    finally:
        release_run_locks()


def cli(args_class, argv: Optional[Sequence[str]] = None):
    """`tyro.cli(args_class)` on `argv` (default sys.argv[1:]), with a flag tyro refuses
    (a value that is not a number, an unknown flag or choice, a missing value) made one line, exit code 2, like every
    other bad input: tyro draws a box of 5-9 lines, wrapped at the terminal's width."""
    argv = list(sys.argv[1:] if argv is None else argv)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(args_class, args=argv)
    except SystemExit as e:
        if e.code in (0, None):  # --help (printed on stdout)
            raise
        # parsing is deterministic: parse again at a width that wraps nothing, so that no word is cut by the box
        columns, os.environ["COLUMNS"] = os.environ.get("COLUMNS"), "100000"
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                tyro.cli(args_class, args=argv)
        except SystemExit:
            pass
        finally:
            if columns is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = columns
        print(f"error: {tyro_message(captured.getvalue())} (--help lists the flags)", file=sys.stderr)
        sys.exit(2)
    sys.stderr.write(captured.getvalue())  # what tyro warns about a valid command line
    return args


def tyro_message(box: str) -> str:
    """The message inside tyro's error box: its first paragraph, on one line ("Error parsing --num-steps:
    invalid literal ..." -> "--num-steps: invalid literal ...")."""
    rows = []
    # the first line is the box's top with its title; without UTF-8 on stdout the box is drawn in ASCII
    for line in re.sub(r"\x1b\[[0-9;]*m", "", box).splitlines()[1:]:
        row = line.strip().strip("│").strip()
        if not row or set(row) <= set("-─╰╯"):  # a blank row or a rule (or the ASCII box's top): the message ends
            if rows:
                break
        else:
            rows.append(row)
    return re.sub(r"^Error parsing (\S+):", r"\1:", " ".join(rows)) or "the command line could not be parsed"


def resume_hint(args) -> str:
    """How the run of `args` goes on after a failure: its last checkpoint, or that there is none yet."""
    if getattr(args, "resume", None):
        run_dir = find_checkpoint(args.resume)[0]
    elif getattr(args, "run_name", ""):  # set by `start_run`
        run_dir = Path(args.output_dir) / args.run_name
    else:
        return "no checkpoint was saved yet"
    last = run_dir / "checkpoints" / "last"
    if not last.is_dir():
        return "no checkpoint was saved yet"
    return f"--resume {run_dir} goes on from its last checkpoint ({last.resolve().name})"


class GracefulStop:
    """First Ctrl-C (or SIGTERM): finish the current epoch, checkpoint and exit cleanly (exit code 0 after Ctrl-C,
    143 after SIGTERM, at `exit()`); a second Ctrl-C aborts. `exit()` gives back the handlers it replaced, so a
    `main(args)` called from Python (a notebook, a sweep) leaves Ctrl-C and SIGTERM as it found them."""

    def __init__(self):
        import signal

        self.requested, self.signal = False, None
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signal = True, signum
        print("\nstop requested: finishing this epoch, then saving a checkpoint (Ctrl-C again to abort)", file=sys.stderr)

    def exit(self):
        """The scripts' last line: after a SIGTERM, exit 143 (128 + the signal, as a process killed by it would report),
        so that a scheduler (Slurm, Kubernetes) that stopped the run after its clean checkpoint does not take it for
        finished."""
        import signal

        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.signal == signal.SIGTERM:
            sys.exit(128 + signal.SIGTERM)


def seed_everything(seed: int, torch_deterministic: bool = True):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = torch_deterministic


# flags a resumed run may change: how long it goes on and how it reports and saves, none of what it computes.
# `device`, `output_dir` and `resume` say where this invocation runs and are never taken from the checkpoint.
SAFE_OVERRIDES = (
    "num_epochs",
    "eval_every",
    "save_every",
    "keep_checkpoints",
    "gradient_checkpointing",
    "fsdp_cpu_offload",
    "overlap_reward",
    "compile",
    "eval_num_steps",
    "eval_guidance_scale",
    "eval_noises",
    "eval_rewards",
    "test_prompts",
)


# where the run sends data or the model: only ever from this command line. A checkpoint is a file anyone can hand you,
# and one that set --push-to-hub would publish the trained weights to any repo your token can write. The reward
# servers of --reward and --eval-rewards (which receive every image and prompt) likewise: `restore_servers`.
REMOTE_TARGETS = ("track", "wandb_project_name", "wandb_entity", "push_to_hub")


NOT_RESTORED = ("device", "output_dir", "resume", "run_name", "argv", *REMOTE_TARGETS)

# what a run reads from disk (or a hub): a resume reads it as the run did, but a path a checkpoint names outside the
# repository's own assets/ is shown first (a crafted checkpoint could name any file or hub repo), and the files are
# checked as a fresh run's are. --test-prompts only sets what is evaluated: a resume may name another file.
PATH_INPUTS = ("model", "train_prompts", "test_prompts", "pairs")


MAX_STEPS = 1000

# flags that moved from one script to another (Flow-GRPO's variants to algos/grpo_variants.py): a checkpoint made
# before the move resumes when they did nothing in its run (`inert` of the saved value), else it is refused by name
MOVED_FLAGS = {
    "grpo": (
        "grpo_variants",
        {
            "window_mode": lambda v: v != "sliding",
            "window_shift": lambda v: True,  # acts with --window-mode sliding only
            "grpo_guard": lambda v: v is False,
            "guard_reweight": lambda v: True,  # acts with --grpo-guard only
            "noise_weight": lambda v: v == 0,
            "kl_mask": lambda v: v == 0,
            "win_rate_reward": lambda v: v is False,
        },
    )
}

_LOCKS = {}  # run folder -> open lock file, held until `release_run_locks`


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args, fresh: bool = True):
    """The checks that need no model, on the fields every script shares (each script checks its own after this):
    every bad value fails here, with one line, before anything is loaded or written."""
    env_ranks()  # a torchrun environment left over (no MASTER_ADDR), or a RANK that is not one: one line, first
    fields = vars(args)
    for name, value in fields.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{_flag(name)} {value}: must be a finite number")
    positive = (
        "num_epochs",
        "eval_every",
        "save_every",
        "num_prompts",
        "micro_batch",
        "grad_steps_per_epoch",
        "num_steps",
        "lora_rank",
        "num_inner_epochs",
        "num_train_timesteps",
        "lora_alpha",
        "max_grad_norm",
        "eval_noises",
        "adv_clip",  # 0 would clip every advantage to 0: nothing trains
    )
    for name in positive:
        if name in fields and fields[name] is not None and fields[name] <= 0:
            raise UserError(f"{_flag(name)} {fields[name]}: must be > 0")
    for name in ("num_steps", "eval_num_steps"):  # a flow model's schedule has 1000 training timesteps
        if fields.get(name) is not None and fields[name] > MAX_STEPS:
            raise UserError(f"{_flag(name)} {fields[name]}: at most {MAX_STEPS} sampler steps")
    for name in (
        "keep_checkpoints",
        "learning_rate",
        "weight_decay",
        "eta",
        "kl_beta",
        "off_policy_after",
        "clip_low",
        "clip_high",
    ):
        if name in fields and fields[name] is not None and fields[name] < 0:
            raise UserError(f"{_flag(name)} {fields[name]}: must be >= 0")
    if fields.get("seed", 0) < 0:
        raise UserError(f"--seed {args.seed}: must be >= 0")
    if fields.get("eval_num_steps") is not None and args.eval_num_steps <= 0:
        raise UserError(f"--eval-num-steps {args.eval_num_steps}: must be > 0")
    for name, value in fields.items():  # the snapshot/EMA decay schedules, `<snapshot>_decay_*` in the scripts (get_decay)
        if name.endswith(("_decay_start", "_decay_max")) and not 0 <= value <= 1:
            raise UserError(f"{_flag(name)} {value}: must be in [0, 1] (0 = hard copy of the weights, 1 = frozen)")
        if name.endswith(("_decay_ramp", "_decay_flat_steps")) and value < 0:
            raise UserError(f"{_flag(name)} {value}: must be >= 0")
    if fields.get("eval_guidance_scale") is not None and args.eval_guidance_scale < 1:
        raise UserError(f"--eval-guidance-scale {args.eval_guidance_scale}: must be >= 1 (1 = no CFG)")
    if not 0 <= fields.get("eval_ema_decay", 0) < 1:
        raise UserError(f"--eval-ema-decay {args.eval_ema_decay}: must be in [0, 1) (0 = off)")
    for name in ("eval_ema_interval", "eval_ema_repeats"):
        if fields.get(name, 1) < 1:
            raise UserError(f"{_flag(name)} {fields[name]}: must be >= 1")
        # without a decay there is no eval EMA to update; a run saved before this check resumes as it was
        if fresh and name in given_flags(args) and not fields.get("eval_ema_decay"):
            raise UserError(f"{_flag(name)} sets the eval EMA's updates: pass --eval-ema-decay > 0 too (0 = off)")
    if fields.get("dynamics") == "CPS" and fields.get("eta", 0) > 1:
        raise UserError(f"--eta {args.eta}: CPS needs eta in [0, 1] (the share of fresh noise is sin(eta pi / 2))")
    if fields.get("fsdp_cpu_offload") and not fields.get("fsdp"):
        raise UserError("--fsdp-cpu-offload offloads the shards of --fsdp: pass --fsdp too")
    if fields.get("fsdp_cpu_offload") and check_device(args.device).type != "cuda":
        raise UserError("--fsdp-cpu-offload moves the shards off the GPU; on the CPU they are there already: drop it")
    reason = compile_unavailable(check_device(args.device)) if fields.get("compile") else None
    if reason:
        raise UserError(f"--compile: {reason}; run without --compile (eager)")
    for name in ("height", "width", "num_frames", "max_sequence_length"):
        if fields.get(name) is not None and fields[name] <= 0:
            raise UserError(f"{_flag(name)} {fields[name]}: must be > 0")
    if fields.get("negative_prompt") and max(args.guidance_scale, fields.get("eval_guidance_scale") or 0) <= 1:
        raise UserError("--negative-prompt is used by CFG only: pass --guidance-scale > 1 (or --eval-guidance-scale > 1)")
    if fields.get("guidance_scale_2") is not None and max(args.guidance_scale, fields.get("eval_guidance_scale") or 0) <= 1:
        raise UserError("--guidance-scale-2 is used by CFG only: pass --guidance-scale > 1 (or --eval-guidance-scale > 1)")
    if "lora_targets" in fields and args.lora_targets is not None and not args.lora_targets:
        raise UserError("--lora-targets: name at least one module")
    if fresh and "full_finetune" in fields and args.full_finetune is None and given_flags(args) & set(LORA_ARGS):
        # not asked for either way, and a LoRA flag given: a LoRA. Else (None) models.trainable_params decides by the
        # transformer's size; the run's args.json and checkpoints hold what it decided
        args.full_finetune = False
    if fields.get("full_finetune"):
        lora_flags = sorted(given_flags(args) & set(LORA_ARGS))
        if lora_flags:
            raise UserError(
                f"{_flag(lora_flags[0])}: a LoRA setting, but --full-finetune trains every transformer weight (no LoRA)"
            )
    check_device(args.device)
    check_eval_rewards(args)
    model = Path(args.model).expanduser()
    if looks_local(args.model):  # a local folder, not a hub id
        check_pipeline_folder(args.model)
        check_model_folder(model, args.model)
        for name in ("resolution", "height", "width"):
            if fields.get(name) is not None:
                check_resolution(model, fields[name], name)
    elif args.resolution is not None and args.resolution <= 0:
        raise UserError(f"--resolution {args.resolution}: must be > 0")
    config = pipeline_config(args.model)
    family = FAMILIES.get(config.get("_class_name"))
    if family is not None and fields.get("num_frames") is not None and family.num_frames is None:
        raise UserError(f"--num-frames {args.num_frames}: {config['_class_name']} makes images, not videos")
    check_prompt_images(args, family, config.get("_class_name"))
    if family is not None and family.check is not None:
        family.check(config, args)  # Wan's checks --guidance-scale-2 against the folder (Wan2.2-A14B's second expert)
    if fields.get("guidance_scale_2") is not None and config.get("_class_name") != "WanPipeline":
        raise UserError(f"--guidance-scale-2 {args.guidance_scale_2}: only Wan2.2-A14B has a second (low-noise) expert")
    if fresh:
        name = getattr(args, "exp_name", "x")
        # the run folder is <output-dir>/<reward>__<exp-name>__...: a separator or ".." would put it elsewhere
        if not name or "/" in name or os.sep in name or name in (".", "..") or "\0" in name:
            raise UserError(f"--exp-name {name!r}: must be a plain name (no '/'), the run folder stays in --output-dir")
        out = Path(args.output_dir).expanduser()
        parent = out
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir() or not writable(parent):
            raise UserError(
                f"--output-dir {args.output_dir}: cannot create a run folder there ({parent} is not a writable folder)"
            )


def check_prompt_images(args, family, pipeline: Optional[str]):
    """The prompt files read now (`load_prompts`, which decodes every reference image), so that a bad line or image
    stops the run before the model loads; prompts with reference images need an edit family (`Family.encode_image`).
    A text-only file is fine for an edit family: its pipeline takes `image=None` too (FLUX.1-Kontext then samples from
    the text alone). The image size is the family's `check` (it knows the model's default resolution)."""
    for name in ("train_prompts", "test_prompts"):
        path = getattr(args, name, None)
        if path is None:
            continue
        prompts = load_prompts(path)
        if family is not None and family.encode_image is None and isinstance(prompts[0], Prompt):
            raise UserError(
                f"{_flag(name)} {path}: its prompts carry reference images, but {pipeline} takes none "
                f"(edit families: {', '.join(sorted(k for k, f in FAMILIES.items() if f.encode_image)) or 'none'})"
            )


def check_eval_rewards(args):
    """--eval-rewards: reward names (or servers, whose URLs pass --reward's checks) of the registry, each once and
    unweighted, none logging a metric the training reward's eval logs already. Rank 0, the one that evaluates, asks each
    server what it serves now, before the model loads; a served reward is compared by the name it is logged under."""
    from rewards import REWARDS, eval_metrics, parse_reward_spec, remote

    names = tuple(getattr(args, "eval_rewards", ()))
    for k, name in enumerate(names):
        shown = remote.masked(name)
        if remote.is_url(name):
            try:
                _, weight = remote.split_weight(name)
            except UserError as e:
                raise UserError(f"--eval-rewards: {e}") from None
            if weight:
                raise UserError(f"--eval-rewards {shown}: a side metric takes no weight (it is logged, not trained on)")
        elif name not in REWARDS:
            raise UserError(
                f"--eval-rewards: unknown reward {shown!r}; available: {', '.join(REWARDS)} or a server's http://HOST:PORT[/name]"
            )
        if name in names[:k]:
            raise UserError(f"--eval-rewards: {shown!r} is named twice")
    if not names:
        return
    trained = parse_reward_spec(args.reward)
    served = {}  # URL -> the name its reward is logged under
    if env_ranks()[0] == 0:
        served = {url: remote.remote(url).reward_name for url in (*trained, *names) if remote.is_url(url)}
    logged = eval_metrics(served.get(name, name) for name in trained)
    for k, name in enumerate(names):
        shown, metric = remote.masked(name), served.get(name, name)
        if name in trained:
            raise UserError(f"--eval-rewards: {shown!r} is the training reward, whose eval score is logged already")
        if metric in logged:
            raise UserError(
                f"--eval-rewards: {shown!r} logs eval/{metric}, which the training reward's eval ({args.reward}) logs already"
            )
        if metric in (served.get(n, n) for n in names[:k]):
            raise UserError(f"--eval-rewards: {shown!r} serves {metric!r}, named already")


def writable(folder: Path) -> bool:
    """Whether a file can be created in `folder`, found by creating (and removing) one: the mode bits that
    os.access reads say nothing for root, nor on a root-squashed NFS or a read-only bind mount seen from outside."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=".cleanflow-write-check-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def check_resolution(model: Path, resolution: int, name: str = "resolution"):
    """`load_pipeline`'s resolution check (of --resolution, --height or --width: `name`) from the folder's configs
    alone, before the model loads."""
    if resolution <= 0:
        raise UserError(f"--{name} {resolution}: must be > 0")
    try:
        vae = json.loads((model / "vae" / "config.json").read_text())
        transformer = json.loads((model / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return  # load_pipeline reports it
    factor = 2 ** (len(vae.get("block_out_channels", [0])) - 1)  # the pipelines' vae_scale_factor
    if "temperal_downsample" in vae:  # the 3-D VAEs of Wan and Qwen-Image
        factor = vae.get("scale_factor_spatial") or 2 ** len(vae["temperal_downsample"])
    if "spatio_temporal_scaling" in vae:  # LTX-Video's VAE: patchified input, then one halving per scaling block
        factor = vae.get("spatial_compression_ratio") or vae.get("patch_size", 1) * 2 ** sum(vae["spatio_temporal_scaling"])
    if vae.get("_class_name") == "AutoencoderKLHunyuanVideo":  # its blocks downsample as its configured ratio says
        factor = vae.get("spatial_compression_ratio", 8)
    cls = transformer.get("_class_name", "")
    patch = (  # FLUX.1 and Chroma pack 2x2 latent patches into tokens outside the transformer
        2 if "Flux" in cls or "Chroma" in cls else transformer.get("patch_size") or transformer.get("all_patch_size", [1])[0]
    )
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch  # Wan: (1, 2, 2)
    if resolution % (factor * patch) or resolution < factor * patch:
        raise UserError(f"{name} {resolution} must be a multiple of {factor * patch}")
    max_patches = transformer.get("pos_embed_max_size")  # SD3's learned position table: patches per side
    if max_patches and "AuraFlow" in cls:  # AuraFlow's counts the patches of its square grid
        max_patches = int(max_patches**0.5)
    if max_patches and resolution // (factor * patch) > max_patches:
        raise UserError(
            f"--{name} {resolution}: beyond the transformer's position embeddings ({max_patches} patches per side, "
            f"at most {max_patches * factor * patch} pixels)"
        )


def given_flags(args) -> set:
    """The fields the user set: named on the command line (`args.argv`, filled by `run_main`), or different from the defaults
    (for a `main(args)` called in-process)."""
    names = {f.name for f in dataclasses.fields(args)}
    defaults = type(args)()
    given = {n for n in names if _plain_json(getattr(args, n)) != _plain_json(getattr(defaults, n))}
    for token in getattr(args, "argv", None) or ():
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            if name not in names and name.startswith("no_") and name[3:] in names:
                name = name[3:]  # tyro's --no-<flag> for booleans
            if name in names:
                given.add(name)
    return given


def _plain_json(value):
    return json.loads(json.dumps(value, default=str))


def restore_args(args, saved: dict) -> dict:
    """Take a resumed run's hyperparameters from its checkpoint. A flag given now that differs from the saved value
    is an error unless it is in SAFE_OVERRIDES. Returns {field: (saved, now)} of the overrides applied."""
    saved = dict(saved)  # `restore_servers` edits it; the checkpoint's record stays as saved
    hints = typing.get_type_hints(type(args))
    target, moved = MOVED_FLAGS.get(script_name(args), (None, {}))
    for name, inert in moved.items():
        if name in saved and not inert(saved[name]):
            raise UserError(
                f"the run being resumed used {_flag(name)} {saved[name]!r}, which is now in algos/{target}.py; "
                "resume it with the cleanflow version that made it"
            )
        if name not in hints:
            saved.pop(name, None)  # did nothing in that run
    unknown = sorted(set(saved) - set(hints))
    if unknown:
        raise UserError(
            f"the checkpoint's settings include {', '.join(unknown[:3])}, which {script_name(args)}.py lacks "
            "(another cleanflow version, or an edited checkpoint)"
        )
    for name, value in saved.items():
        if name not in NOT_RESTORED and not _fits(value, hints[name]):
            raise UserError(f"the checkpoint's {name} is {repr(value)[:40]}; {_flag(name)} takes {_type_name(hints[name])}")
    given = given_flags(args)
    overrides = restore_servers(args, saved, given)
    for name in sorted(given - set(NOT_RESTORED)):
        if name in saved and _plain_json(getattr(args, name)) != _plain_json(saved[name]):
            if name not in SAFE_OVERRIDES:
                changeable = ", ".join(_flag(n) for n in SAFE_OVERRIDES if hasattr(args, n))
                raise UserError(
                    f"{_flag(name)} is {saved[name]!r} in the run being resumed, {getattr(args, name)!r} given; "
                    f"a resumed run keeps its settings (changeable: {changeable})"
                )
            overrides[name] = (saved[name], getattr(args, name))
    for f in dataclasses.fields(args):
        if f.name in saved and f.name not in NOT_RESTORED and f.name not in overrides:
            value = saved[f.name]
            setattr(args, f.name, tuple(value) if isinstance(value, list) else value)
    outside = [n for n in PATH_INPUTS if n not in given and isinstance(saved.get(n), str) and not _in_assets(saved[n])]
    if outside and int(os.environ.get("RANK", "0")) == 0:
        shown = ", ".join(f"{_flag(n)} {short(saved[n])}" for n in outside)
        print(f"note: the resumed run reads {shown}, as its checkpoint says", flush=True)
    return overrides


def _in_assets(path: str) -> bool:
    """Whether `path` (as a run saved it: absolute, or relative to where it ran) is inside this repository's assets/."""
    try:
        return Path(path).resolve().is_relative_to((REPO / "assets").resolve())
    except (OSError, ValueError, RuntimeError):
        return False


def restore_servers(args, saved: dict, given: set) -> dict:
    """The reward servers of a resumed run come from this command line only: a checkpoint naming a server would send
    it every image and prompt of the run. A served `--reward` is asked for again, and may name a server that moved if
    it gives the same rewards with the same weights in the same order, each URL serving the reward the run was trained
    on (`check_same_rewards`); a served `--eval-rewards` entry not given again is dropped with a note. Updates `saved`
    (the checkpoint's Args) to what the run goes on with; returns {field: (saved, now)} of a moved server."""
    from rewards import remote

    spec, overrides = saved.get("reward"), {}
    if isinstance(spec, str) and any(remote.is_url(part.strip()) for part in spec.split(",")):
        if "reward" not in given:
            raise UserError(
                f"the run's --reward is {spec}; a checkpoint never sets where images go: pass --reward again "
                "(the same rewards and weights; a server may have moved)"
            )
        if args.reward != spec:
            check_same_rewards(spec, args.reward)
            overrides["reward"] = (spec, args.reward)
            saved["reward"] = args.reward
    served = [name for name in saved.get("eval_rewards") or () if isinstance(name, str) and remote.is_url(name)]
    if served and "eval_rewards" not in given:
        saved["eval_rewards"] = [name for name in saved["eval_rewards"] if name not in served]
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"note: the run had --eval-rewards {' '.join(served)}; a checkpoint never sets where images go: pass it again",
                file=sys.stderr,
            )
    return overrides


def check_same_rewards(saved: str, now: str):
    """A resume's `--reward` `now` in place of the run's served `saved`: the same rewards, weights and order, a local
    reward where the run had one, and a server where it had one, serving the same reward (asked now, before the model
    loads). The server a URL without a name stood for is not known: any server serving one reward takes its place."""
    from rewards import parse_reward_spec, remote

    try:
        old = list(parse_reward_spec(saved).items())
    except UserError as e:
        raise UserError(f"the checkpoint's --reward {saved}: {e}") from None
    new = list(parse_reward_spec(now).items())
    same = len(old) == len(new) and all(
        w == v and remote.is_url(a) == remote.is_url(b) and (remote.is_url(a) or a == b) for (a, w), (b, v) in zip(old, new)
    )
    if not same:
        raise UserError(
            f"--reward {now}: the run was trained on {saved}; a resumed run keeps its rewards and weights, in their "
            "order (only a server's URL may change)"
        )
    for (a, _), (b, _) in zip(old, new):
        trained = urllib.parse.urlsplit(a).path.strip("/") if remote.is_url(a) else ""
        if trained:  # the name in the URL; a URL without one stood for the one reward its server served, unknown now
            serves = remote.remote(b).reward_name
            if serves != trained:
                raise UserError(f"--reward {now}: {b} serves {serves!r}, the run was trained on {trained!r} ({a})")


def _fits(value, hint) -> bool:
    """Whether a JSON-like `value` (a checkpoint's setting) is of the Args field type `hint`."""
    origin, parts = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:  # tyro.conf markers
        return _fits(value, parts[0])
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in parts)
    if origin is typing.Literal:
        return value in parts
    if origin in (tuple, list) or hint in (tuple, list):
        return isinstance(value, (tuple, list)) and (not parts or all(_fits(v, parts[0]) for v in value))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a type no script uses today: not checked


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def start_run(args, script_file: str) -> tuple:
    """The first call of every script's main: checks `args`, and for `--resume` finds and loads the checkpoint,
    checks it belongs to this script, restores the run's Args into `args` (see `restore_args`) and takes the run
    folder's lock. Writes nothing (a fresh run's folder appears in `Logger`, once the model loaded).

    Returns (run_dir, checkpoint dict or None); sets `args.run_name`. The checkpoint dict also holds, besides what was
    saved, "path" (its folder, which `restore_state` reads shards from) and "resume_record" (the line `Logger` adds to
    the run folder's resumes.jsonl)."""
    algo = Path(script_file).stem
    if not args.resume:
        check_args(args, fresh=True)
        # the random suffix keeps runs started in the same second apart (Logger also creates the folder exclusively)
        # a reward server's URL (http://host:8000/ocr) names a folder without its slashes: http_host:8000_ocr
        reward = args.reward.replace("://", "_").replace("/", "_")
        args.run_name = f"{reward}__{args.exp_name}__{args.seed}__{int(time.time())}_{os.urandom(3).hex()}"
        if int(os.environ.get("RANK", "0")) == 0:
            note_unfinished_runs(args, f"{reward}__{args.exp_name}__{args.seed}__")
        return Path(args.output_dir) / args.run_name, None
    run_dir, ckpt_dir = find_checkpoint(args.resume)
    check_no_symlinks(run_dir, folders=("samples", "checkpoints", *EXPORT_NAMES))
    ckpt = load_checkpoint(ckpt_dir)
    if ckpt.get("algo") != algo:
        raise UserError(
            f"{ckpt_dir} was written by {ckpt.get('algo')}.py; resume it with algos/{ckpt.get('algo')}.py, not {algo}.py"
        )
    check_checkpoint_fields(ckpt, ckpt_dir)
    full = bool(ckpt["args"].get("full_finetune", False))  # checkpoints from before the flag are LoRA runs
    if "full_finetune" in given_flags(args) and bool(args.full_finetune) != full:
        raise UserError(
            f"checkpoint {ckpt_dir} is of a {'full fine-tuning' if full else 'LoRA'} run; resume it "
            f"{'with' if full else 'without'} --full-finetune"
        )
    overrides = restore_args(args, ckpt["args"])
    check_args(args, fresh=False)
    if args.num_epochs <= ckpt["epoch"]:
        raise UserError(f"{ckpt_dir} is at epoch {ckpt['epoch']}; pass --num-epochs > {ckpt['epoch']} to train on")
    args.run_name = run_dir.name
    if int(os.environ.get("RANK", "0")) == 0:
        if not writable(run_dir) or not writable(run_dir / "checkpoints"):
            raise UserError(f"--resume {args.resume}: the run folder {run_dir} is not writable")
        lock_run(run_dir)
        clean_stale_temps(run_dir)
        defaults = type(args)()
        for name in REMOTE_TARGETS:  # never taken from the checkpoint: say what the run had, so the user can ask again
            saved, now = ckpt["args"].get(name), getattr(args, name, None)
            if hasattr(args, name) and saved not in (None, getattr(defaults, name)) and saved != now:
                had = _flag(name) if saved is True else f"{_flag(name)} {saved}"
                print(f"note: the run had {had}; a checkpoint never sets where data goes: pass it again", file=sys.stderr)
    ckpt["path"] = ckpt_dir
    ckpt["resume_record"] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": str(ckpt_dir),
        "epoch": ckpt["epoch"],
        "overrides": {k: {"saved": a, "now": b} for k, (a, b) in overrides.items()},
        "argv": list(getattr(args, "argv", ())),
    }
    return run_dir, ckpt


# what two runs of the same command differ in: where and when they ran, not what they compute
NOT_COMPARED = ("run_name", "resume", "device", "num_epochs", "output_dir")


def note_unfinished_runs(args, prefix: str):
    """A fresh run of the flags of an unfinished run in --output-dir (no export yet: stopped by Ctrl-C, a kill or a
    crash) says so, and how to go on with it instead: re-running the command starts a new run."""
    try:
        folders = sorted(p for p in Path(args.output_dir).glob(f"{prefix}*") if p.is_dir() and not p.is_symlink())
    except OSError:
        return
    mine = _plain_json({f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in NOT_COMPARED})
    for folder in folders:
        if any((folder / name).exists() for name in EXPORT_NAMES):  # finished: it exported
            continue
        try:
            saved = json.loads((folder / "args.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(saved, dict) and all(k in saved and saved[k] == v for k, v in mine.items()):
            print(
                f"note: {folder} is an unfinished run of these flags; `--resume {folder}` goes on with it "
                "(this starts a new run)",
                flush=True,
            )


def lock_run(run_dir: Path):
    """An exclusive lock on <run>/.lock, held while this process lives (or until `release_run_locks`): a second process
    writing the same run would interleave checkpoints and log every scalar twice."""
    import fcntl

    run_dir = Path(run_dir)
    if str(run_dir.resolve()) in _LOCKS:
        return
    try:
        f = open(run_dir / ".lock", "a")
    except OSError as e:
        raise UserError(f"run folder {run_dir}: cannot open its lock file ({e.strerror})")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UserError(f"run {run_dir} is in use by another process (its .lock is held); wait for it to end or stop it first")
    _LOCKS[str(run_dir.resolve())] = f


def release_run_locks():
    while _LOCKS:
        _LOCKS.popitem()[1].close()


def clean_stale_temps(run_dir: Path):
    """What a run killed while saving leaves in its folder: checkpoint temps, and the LoRA export's temp (an
    interrupted `export_lora`); an export moved aside but not replaced is put back."""
    doomed = [*(run_dir / "checkpoints").glob(".tmp-*")]
    for name in EXPORT_NAMES:
        doomed += run_dir.glob(f".{name}.tmp*")
        if (run_dir / f".{name}.old").is_dir():
            if (run_dir / name).exists():
                doomed.append(run_dir / f".{name}.old")
            else:
                os.rename(run_dir / f".{name}.old", run_dir / name)
    for tmp in doomed:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink(missing_ok=True)


def check_integrations(args):
    """The optional integrations' flags, checked before anything loads: `--track` needs wandb installed,
    `--push-to-hub` a valid repo id."""
    if getattr(args, "track", False):
        try:
            import wandb
        except ImportError:
            raise UserError("--track needs wandb: pip install -r requirements-track.txt")
        # wandb.init would stop with its own traceback once the run folder exists; login(prompt=False) only looks
        if os.environ.get("WANDB_MODE", "").lower() not in ("offline", "dryrun", "disabled") and (
            not wandb.login(prompt=False, verify=False) and wandb.setup().settings.mode not in ("offline", "disabled")
        ):
            raise UserError(
                "--track: wandb has no login here; run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline "
                "and upload later with `wandb sync`"
            )
    repo_id = getattr(args, "push_to_hub", None)
    if repo_id:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo_id)
        except HFValidationError as e:
            raise UserError(f"--push-to-hub {repo_id!r} is not a hub repo id (user/name): {str(e).splitlines()[0]}")


MAX_BAD_STEPS = 5  # non-finite gradients in a row before `FiniteGradients` stops the run


class FiniteGradients:
    """The loop's guard against a bad batch: `finite_grads(grad_norm, on_fail)` says whether the step's (pre-clip)
    gradient norm is finite; if not, the scripts skip the update, so that one bad batch cannot poison the weights. A
    skip prints a warning; the MAX_BAD_STEPS-th in a row calls `on_fail()` (the scripts save a checkpoint) and stops
    the run with a UserError. The loop owns the count, so a resumed run starts from 0 as it did before."""

    def __init__(self):
        self.bad_steps = 0  # non-finite gradients in a row

    def __call__(self, grad_norm: torch.Tensor, on_fail: Optional[Callable[[], None]] = None) -> bool:
        if torch.isfinite(grad_norm):
            self.bad_steps = 0
            return True
        self.bad_steps += 1
        from tqdm import tqdm

        tqdm.write(f"warning: non-finite gradient, update skipped ({self.bad_steps} in a row)")
        if self.bad_steps >= MAX_BAD_STEPS:
            if on_fail is not None:
                on_fail()
            raise UserError(f"{MAX_BAD_STEPS} non-finite updates in a row; checkpoint saved, lower the learning rate")
        return False
