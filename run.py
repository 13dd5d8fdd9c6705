"""Run management shared by the five scripts: flag checks and resume, the run folder and its lock, logging,
checkpoints, the exported LoRA with its model card, and the hub upload."""

import contextlib
import dataclasses
import errno
import inspect
import io
import json
import math
import os
import pickle
import random
import re
import shlex
import shutil
import sys
import time
import types
import typing
import urllib.parse
import warnings
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import tyro

from common import FAMILIES, REPO, UserError, evaluate, load_prompts
from distributed import busy_cpu_hint, check_device, env_ranks
from models import EvalEMA, check_model_folder, compile_unavailable, is_fsdp, pipeline_config, swapped_weights


def run_main(main, args, argv: Optional[Sequence[str]] = None):
    """Run `main(args)`, turning `UserError` into a one-line message and exit code 2, and Ctrl-C before training
    (while the model loads; after that `GracefulStop` handles it) into one line and exit code 130.

    `argv`: the command line `args` was parsed from (default `sys.argv[1:]`); `start_run` reads from it which flags
    were given, to compare them with a resumed run's."""
    import signal

    argv = list(sys.argv[1:] if argv is None else argv)
    _CLI["argv"] = upgrade_argv(argv, type(args), warn=False) if is_dataclass(args) else argv
    try:
        check_integrations(args)
        main(args)
        if _RUN.get("stop_signal") == signal.SIGTERM:
            # stopped by a scheduler (Slurm, Kubernetes) after a clean checkpoint: 128 + signal, as a process killed by
            # it would report, so that the scheduler does not take the run for finished
            sys.exit(128 + signal.SIGTERM)
    except UserError as e:
        print(f"error: {e}" + (f"; {resume_hint()}" if getattr(e, "resumable", False) else ""), file=sys.stderr)
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
        _CLI["argv"] = None


def cli(args_class, argv: Optional[Sequence[str]] = None):
    """`tyro.cli(args_class)` on `argv` (default sys.argv[1:]; former flag names upgraded), with a flag tyro refuses
    (a value that is not a number, an unknown flag or choice, a missing value) made one line, exit code 2, like every
    other bad input: tyro draws a box of 5-9 lines, wrapped at the terminal's width."""
    argv = upgrade_argv(list(sys.argv[1:] if argv is None else argv), args_class)
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


def resume_hint() -> str:
    """How the current run goes on after a failure: its last checkpoint, or that there is none yet."""
    run_dir = _RUN.get("run_dir")
    last = Path(run_dir or ".") / "checkpoints" / "last"
    if run_dir is None or not last.is_dir():
        return "no checkpoint was saved yet"
    return f"--resume {run_dir} goes on from its last checkpoint ({last.resolve().name})"


class GracefulStop:
    """First Ctrl-C (or SIGTERM): finish the current epoch, checkpoint and exit cleanly (exit code 0 after Ctrl-C,
    143 after SIGTERM); a second Ctrl-C aborts."""

    def __init__(self):
        import signal

        self.requested = False
        self._default = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        _RUN["stop_signal"] = signum  # run_main exits 143 after a SIGTERM
        print("\nstop requested: finishing this epoch, then saving a checkpoint (Ctrl-C again to abort)", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------------
# runs: seeding, logging, checkpoints
# ----------------------------------------------------------------------------------------------------------------
def seed_everything(seed: int, torch_deterministic: bool = True):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = torch_deterministic


def rng_state() -> dict:
    """The global RNG states as tensors and plain python values, so that they load with `torch.load(weights_only=True)`."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss},
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["name"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


# ----------------------------------------------------------------------------------------------------------------
# runs: checks before anything loads, fresh and resumed runs, one writer per run folder
# ----------------------------------------------------------------------------------------------------------------
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
)


# where the run sends data or the model: only ever from this command line. A checkpoint is a file anyone can hand you,
# and one that set --push-to-hub would publish the trained weights to any repo your token can write. The reward
# servers of --reward and --eval-rewards (which receive every image and prompt) likewise: `restore_servers`.
REMOTE_TARGETS = ("track", "wandb_project_name", "wandb_entity", "push_to_hub")


NOT_RESTORED = ("device", "output_dir", "resume", "run_name", *REMOTE_TARGETS)


LORA_ARGS = ("lora_rank", "lora_alpha", "lora_targets")  # what --full-finetune (every transformer weight) has no use for


CHECKPOINT_KEYS = (  # what `save_state` writes (`save_checkpoint` adds format, algo; tensor_layout is read away)
    "params",
    "optimizer",
    "snapshots",
    "eval_ema",
    "prompt_gen",
    "rng",
    "epoch",
    "step",
    "images_seen",
    "args",
    "sampler",
    "format",
    "algo",
    "shards",
)


_CLI = {"argv": None}  # the command line of the current `run_main`


_RUN = {}  # the current run: "algo" (the script's name, stored in every checkpoint), "resume_record"


_LOCKS = {}  # run folder -> open lock file, held until `release_run_locks`


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args, fresh: bool = True):
    """The checks that need no model, on the fields the five scripts share (each script checks its own after this):
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
    )
    for name in positive:
        if name in fields and fields[name] <= 0:
            raise UserError(f"{_flag(name)} {fields[name]}: must be > 0")
    for name in ("keep_checkpoints", "learning_rate", "weight_decay", "eta", "kl_beta", "adv_clip", "off_policy_after"):
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
    if fresh and fields.get("full_finetune") and type(args)().full_finetune and "full_finetune" not in given_flags(args):
        # not asked for either way: a LoRA when a LoRA flag is given, else models.trainable_params decides by the
        # transformer's size (None until then; the run's args.json and checkpoints hold what it decided)
        args.full_finetune = False if given_flags(args) & set(LORA_ARGS) else None
    if fields.get("full_finetune"):
        lora_flags = sorted(given_flags(args) & set(LORA_ARGS))
        if lora_flags:
            raise UserError(
                f"{_flag(lora_flags[0])}: a LoRA setting, but --full-finetune trains every transformer weight (no LoRA)"
            )
    check_device(args.device)
    check_eval_rewards(args)
    model = Path(args.model).expanduser()
    if model.exists() or args.model.startswith((".", "/", "~")) or args.model.count("/") != 1:  # a local folder
        if not (model / "model_index.json").is_file():
            raise UserError(f"model {args.model!r}: no such pipeline folder (expected {model / 'model_index.json'})")
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


def load_eval_rewards(args, enabled: bool):
    """The side metrics of --eval-rewards as one MultiReward (None without any), on rank 0 only (`enabled`): only the
    logger's rank evaluates."""
    names = tuple(getattr(args, "eval_rewards", ()))
    if not enabled or not names:
        return None
    from rewards import MultiReward

    multi = MultiReward(dict.fromkeys(names, 1.0), check_device(getattr(args, "device", None)))
    for fn in multi.fns.values():  # a reward that needs something of its prompts (ocr: a quoted text) sees the eval ones
        if hasattr(fn, "check_prompts"):
            fn.check_prompts(load_prompts(args.test_prompts))
    return multi


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
    """The fields the user set: named on the command line (`run_main`'s argv), or different from the defaults
    (for a `main(args)` called in-process)."""
    names = {f.name for f in dataclasses.fields(args)}
    defaults = type(args)()
    given = {n for n in names if _plain_json(getattr(args, n)) != _plain_json(getattr(defaults, n))}
    for token in _CLI["argv"] or []:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            if name not in names and name.startswith("no_") and name[3:] in names:
                name = name[3:]  # tyro's --no-<flag> for booleans
            if name in names:
                given.add(name)
    return given


def _plain_json(value):
    return json.loads(json.dumps(value, default=str))


# Args renamed since checkpoints were first written, per script: the old name -> today's. Checkpoints that hold an old
# name resume with their own settings (`upgrade_saved_args`), and an old flag still works on the command line
# (`upgrade_argv`), in the script that had it only.
RENAMED_ARGS = {
    "nft": {"decay_flat_steps": "old_decay_flat_steps", "decay_ramp": "old_decay_ramp", "decay_max": "old_decay_max"},
    "awm": {"ema_decay": "ema_decay_max"},
    "dgpo": {
        "ema_ref_max_decay": "ema_ref_decay_max",
        "ema_ref_ramp_rate": "ema_ref_decay_ramp",
        "switch_ema_ref": "off_policy_after",  # a step count, unlike the off_policy switch of nft and awm
    },
    "crd": {"adaptive_logp": "adaptive_weighting"},  # DiffusionNFT's name for the same self-normalised error
}
# CRD's former `--<snapshot>-model-decay "flat_steps-start-ramp-max"` strings, now four fields per snapshot
DECAY_STRINGS = {"crd": ("old", "sampling")}
# snapshots saved under another key by an earlier version, per script: {old key: today's key}
RENAMED_SNAPSHOTS = {"nft": {"ema": "old"}}


def _decay_fields(snapshot: str, spec) -> dict:
    """CRD's former `--<snapshot>-model-decay` string "flat_steps-start-ramp-max" as today's four fields."""
    try:
        flat_steps, start, ramp, max_decay = (float(x) for x in str(spec).split("-"))
        assert flat_steps == int(flat_steps)
    except (ValueError, AssertionError):
        raise UserError(
            f"{snapshot}_model_decay {spec!r} is not flat_steps-start-ramp-max; "
            f"pass its values as --{snapshot}-decay-flat-steps/-start/-ramp/-max"
        )
    return {
        f"{snapshot}_decay_start": start,
        f"{snapshot}_decay_flat_steps": int(flat_steps),
        f"{snapshot}_decay_ramp": ramp,
        f"{snapshot}_decay_max": max_decay,
    }


def upgrade_saved_args(saved: dict, algo: str) -> dict:
    """A checkpoint's Args of script `algo` under today's field names (`RENAMED_ARGS`, `DECAY_STRINGS` split into
    their four fields)."""
    renamed = RENAMED_ARGS.get(algo, {})
    saved = {renamed.get(k, k): v for k, v in saved.items()}
    for snapshot in DECAY_STRINGS.get(algo, ()):
        spec = saved.pop(f"{snapshot}_model_decay", None)
        if spec is not None:
            try:
                saved.update(_decay_fields(snapshot, spec))
            except UserError as e:
                raise UserError(f"the checkpoint's {e}") from None
    return saved


def upgrade_argv(argv: Sequence[str], args_class, warn: bool = True) -> list:
    """`argv` of the script that defines `args_class` with each of its renamed flags under today's name
    (`RENAMED_ARGS`, `--no-<flag>` too; `DECAY_STRINGS` as their four flags), and with `warn` one line on stderr per
    old name. An old name and its new name given together, or a bad decay string: one line and exit code 2."""
    fields = {f.name for f in dataclasses.fields(args_class)}
    algo = next(f.default for f in dataclasses.fields(args_class) if f.name == "exp_name")  # the script's name
    renames, decay_strings = RENAMED_ARGS.get(algo, {}), DECAY_STRINGS.get(algo, ())
    out, renamed, direct = [], {}, set()
    tokens = list(argv)
    while tokens:
        token = tokens.pop(0)
        if not token.startswith("--") or token == "--":
            out.append(token)
            continue
        flag, has_value, value = token[2:].partition("=")
        name = flag.replace("-", "_")
        negated = name.startswith("no_") and name not in fields
        base = name[3:] if negated else name
        snapshot = base[: -len("_model_decay")] if base.endswith("_model_decay") else None
        if base in fields or not (base in renames or snapshot in decay_strings):
            direct.add(base)
            out.append(token)
            continue
        if snapshot:
            spec = value if has_value else (tokens.pop(0) if tokens else "")
            try:
                new_fields = _decay_fields(snapshot, spec)
            except UserError as e:
                print(f"error: --{flag}: {e}", file=sys.stderr)
                sys.exit(2)
            for new, v in new_fields.items():
                renamed[new] = base
                out += [_flag(new), str(v)]
            news = f"--{snapshot}-decay-start/-flat-steps/-ramp/-max"
        else:
            new = renames[base]
            renamed[new] = base
            out.append(_flag(("no_" if negated else "") + new) + (f"={value}" if has_value else ""))
            news = _flag(new)
        if warn:
            print(f"warning: --{flag} is deprecated, use {news}", file=sys.stderr)
    both = sorted(set(renamed) & direct)
    if both:
        print(f"error: {_flag(renamed[both[0]])} and {_flag(both[0])} name the same setting; give one", file=sys.stderr)
        sys.exit(2)
    return out


def restore_args(args, saved: dict) -> dict:
    """Take a resumed run's hyperparameters from its checkpoint. A flag given now that differs from the saved value
    is an error unless it is in SAFE_OVERRIDES. Returns {field: (saved, now)} of the overrides applied."""
    saved = upgrade_saved_args(saved, _RUN.get("algo", ""))
    hints = typing.get_type_hints(type(args))
    unknown = sorted(set(saved) - set(hints))
    if unknown:
        raise UserError(
            f"the checkpoint's settings include {', '.join(unknown[:3])}, which {_RUN.get('algo', 'this script')}.py lacks "
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
    return overrides


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


def start_run(args, script_file: str) -> tuple:
    """The first call of every script's main: checks `args`, and for `--resume` finds and loads the checkpoint,
    checks it belongs to this script, restores the run's Args into `args` (see `restore_args`) and takes the run
    folder's lock. Writes nothing (a fresh run's folder appears in `Logger`, once the model loaded).

    Returns (run_dir, checkpoint dict or None); sets `args.run_name`."""
    algo = Path(script_file).stem
    _RUN.clear()
    _RUN["algo"] = algo
    if not args.resume:
        check_args(args, fresh=True)
        # the random suffix keeps runs started in the same second apart (Logger also creates the folder exclusively)
        # a reward server's URL (http://host:8000/ocr) names a folder without its slashes: http_host:8000_ocr
        reward = args.reward.replace("://", "_").replace("/", "_")
        args.run_name = f"{reward}__{args.exp_name}__{args.seed}__{int(time.time())}_{os.urandom(3).hex()}"
        _RUN["run_dir"] = Path(args.output_dir) / args.run_name
        return _RUN["run_dir"], None
    run_dir, ckpt_dir = find_checkpoint(args.resume)
    check_no_symlinks(run_dir)
    ckpt = load_checkpoint(ckpt_dir)
    if ckpt.get("algo") != algo:
        raise UserError(
            f"{ckpt_dir} was written by {ckpt.get('algo')}.py; resume it with algos/{ckpt.get('algo')}.py, not {algo}.py"
        )
    check_checkpoint_fields(ckpt, ckpt_dir, args)
    for old, new in RENAMED_SNAPSHOTS.get(algo, {}).items():
        if isinstance(ckpt.get("snapshots"), dict) and old in ckpt["snapshots"] and new not in ckpt["snapshots"]:
            ckpt["snapshots"][new] = ckpt["snapshots"].pop(old)
    overrides = restore_args(args, ckpt["args"])
    check_args(args, fresh=False)
    if args.num_epochs <= ckpt["epoch"]:
        raise UserError(f"{ckpt_dir} is at epoch {ckpt['epoch']}; pass --num-epochs > {ckpt['epoch']} to train on")
    args.run_name = run_dir.name
    _RUN["checkpoint"], _RUN["run_dir"] = ckpt_dir, run_dir
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
    _RUN["resume_record"] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": str(ckpt_dir),
        "epoch": ckpt["epoch"],
        "overrides": {k: {"saved": a, "now": b} for k, (a, b) in overrides.items()},
        "argv": _CLI["argv"],
    }
    return run_dir, ckpt


def check_no_symlinks(run_dir: Path):
    """A resumed run writes only inside its folder: refuse a run folder that is a symlink, or has one in it or below it
    (samples/, checkpoints/, an epoch folder, the export, an events file, resumes.jsonl, .lock, ...). A resume appends,
    saves and removes old checkpoints through whatever a link points at, outside the folder too. Allowed: the links the
    run makes itself, checkpoints/last (and the .tmp-last.<pid> a kill can leave) naming an epoch folder beside it."""
    run_dir = Path(run_dir)
    if run_dir.is_symlink():
        raise UserError(f"run folder {run_dir} is a symbolic link (to {os.readlink(run_dir)}); resume the folder itself")
    for folder, dirs, files in os.walk(run_dir):  # walks into no linked folder
        for name in sorted((*dirs, *files)):
            path = Path(folder) / name
            if path.is_symlink() and not _own_link(run_dir, path):
                raise UserError(
                    f"run folder {run_dir}: {path.relative_to(run_dir)} is a symbolic link (to {os.readlink(path)}); a "
                    "resumed run writes only inside its own folder: put the file or folder itself there"
                )


def _own_link(run_dir: Path, link: Path) -> bool:
    """Whether `link` is one `save_checkpoint` makes: checkpoints/last or .tmp-last.<pid>, naming an epoch folder there
    (or one removed since: `find_checkpoint` then takes the newest)."""
    target = os.readlink(link)
    beside = link.parent / target
    return (
        link.parent == run_dir / "checkpoints"
        and (link.name == "last" or link.name.startswith(".tmp-last."))
        and re.fullmatch(r"epoch_\d+", target) is not None
        and not beside.is_symlink()
        and (beside.is_dir() or not beside.exists())
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


class Logger:
    """TensorBoard scalars and captioned image grids under runs/<run_name>/; a no-op on ranks other than 0.

    With `args.track` the run is mirrored to wandb (CleanRL's `--track`): `wandb.init(sync_tensorboard=True)` before
    the SummaryWriter exists patches it, so every scalar and image written here also goes to wandb. The newest value
    of every scalar and the newest grid of every image tag are kept (`last_scalars`, `last_images`) for the model card."""

    def __init__(self, run_dir: Path, args, enabled: bool = True):
        """A fresh run: creates the run folder (exclusively: never someone else's), locks it, writes args.json. A resumed
        run (`start_run` locked it): appends a record to resumes.jsonl instead, args.json stays as the run began."""
        self.enabled, self.run_dir = enabled, Path(run_dir)
        self.writer = self.wandb = None
        self.last_scalars, self.last_images = {}, {}  # tag -> (value, step); tag -> ([H, W, 3] uint8 grid, captions, step)
        # the side metrics rank 0 scores at each eval (`evaluate_and_log`), loaded before the first write: a model that
        # cannot be loaded stops the run with one line and nothing written
        self.eval_rewards = load_eval_rewards(args, enabled)
        if not enabled:
            return
        rng = rng_state()  # created after a resume restored the RNGs: whatever wandb or TensorBoard draws is given back
        try:
            self._start(args)
        finally:
            set_rng_state(rng)

    def _start(self, args):
        from torch.utils.tensorboard import SummaryWriter

        run_dir = self.run_dir
        config = asdict(args) if is_dataclass(args) else dict(vars(args))
        config["git_commit"] = git_commit()
        if getattr(args, "resume", None):
            with open(run_dir / "resumes.jsonl", "a") as f:
                f.write(json.dumps({**_RUN.get("resume_record", {}), "git_commit": config["git_commit"]}, default=str) + "\n")
        else:
            try:
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                run_dir.mkdir()
            except FileExistsError:
                raise UserError(f"run folder {run_dir} exists already (another run of the same name); start again")
            except OSError as e:
                raise UserError(f"cannot create the run folder {run_dir} ({e.strerror})")
            lock_run(run_dir)
            config["algo"] = _RUN.get("algo")
            (run_dir / "args.json").write_text(json.dumps(config, indent=2, default=str))
        device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        if torch.device(device).type == "cpu" and (hint := busy_cpu_hint()):  # once every check passed, as training starts
            print(hint, file=sys.stderr)
        if getattr(args, "track", False):
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                name=run_dir.name,
                config=config,
                sync_tensorboard=True,
            )
        self.writer = SummaryWriter(str(run_dir))
        table = "\n".join(f"|{k}|{v}|" for k, v in config.items())
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")

    def scalars(self, values: dict, step: int):
        if self.enabled:
            check_run_folder(self.run_dir)
            for k, v in values.items():
                self.writer.add_scalar(k, float(v), step)
                self.last_scalars[k] = (float(v), step)

    def images(self, tag: str, images: torch.Tensor, captions: Sequence[str], step: int, ncol: int = 8):
        """A grid of images with each caption drawn under its image, to TensorBoard and as
        runs/<run>/samples/<eval|train>_<images seen>.png (so that hacking, e.g. extra objects, is seen at a glance)."""
        if not self.enabled:
            return
        from PIL import Image

        check_run_folder(self.run_dir)
        grid = captioned_grid(images, captions, ncol)
        self.writer.add_image(tag, grid, step, dataformats="HWC")
        self.writer.add_text(tag + "/captions", "\n".join(f"{i}: {cap}  " for i, cap in enumerate(captions)), step)
        (self.run_dir / "samples").mkdir(exist_ok=True)
        Image.fromarray(grid).save(self.run_dir / "samples" / f"{tag.split('/')[0]}_{step:07d}.png")
        self.last_images[tag] = (grid, list(captions), step)

    def close(self):
        if self.enabled:
            self.writer.close()
            if self.wandb is not None:
                import wandb

                self.wandb.finish()
                wandb.tensorboard.unpatch()  # finish() leaves SummaryWriter patched: a later run in this process would fail
        release_run_locks()


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


# ----------------------------------------------------------------------------------------------------------------
# the trained model out: a diffusers LoRA folder, or a transformer folder (--full-finetune), with a model card
# ----------------------------------------------------------------------------------------------------------------
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # the file name diffusers' load_lora_weights looks for


EXPORT_NAMES = ("lora", "transformer")  # the export folder in the run folder: LoRA, --full-finetune


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
    logger: Optional[Logger] = None,
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


def captions(prompts: Sequence[str], scores: dict) -> list:
    """One caption per image: the prompt, then its eval scores (shortened names), e.g. "a red circle" /
    "shapes .50 strict 0 exact 0 objects 3"."""
    short = {"shapes_strict": "strict", "shapes_exact": "exact", "shapes_clean": "clean", "ocr_strict": "strict"}
    skip = {"objects_extra", "prompt_specific_gap"}
    out = []
    for i, prompt in enumerate(prompts):
        values = " ".join(
            f"{short.get(k, k)} {float(v[i]):.2f}".replace(".00", "").replace(" 0.", " .")
            for k, v in scores.items()
            if k not in skip
        )
        out.append(f"{prompt} | {values}")
    return out


def captioned_grid(images: torch.Tensor, captions: Sequence[str], ncol: int = 8, scale: int = 2) -> np.ndarray:
    """images [N, 3, H, W] in [0, 1] -> uint8 [H', W', 3]: a grid, each image upscaled `scale` times (nearest) with its
    caption wrapped under it ("prompt | scores": the prompt on the first lines, the scores on the next)."""
    import textwrap

    from PIL import Image, ImageDraw

    if images.dim() == 5:  # video [N, F, 3, H, W]: its middle frame
        images = images[:, images.shape[1] // 2]
    n = images.shape[0]
    ncol = min(ncol, n)
    h, w = images.shape[2] * scale, images.shape[3] * scale
    width = max(w, 128) + 8
    chars = width // 6  # PIL's default bitmap font is ~6 px wide
    wrapped = [sum((textwrap.wrap(part.strip(), chars) or [""] for part in c.split("|")), []) for c in captions]
    lines = max((len(x) for x in wrapped), default=0)
    cell_h = h + 4 + 11 * lines
    canvas = Image.new("RGB", (ncol * width, -(-n // ncol) * cell_h), "white")
    draw = ImageDraw.Draw(canvas)
    pixels = (images.detach().float().cpu().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy()
    for i in range(n):
        r, k = divmod(i, ncol)
        x0, y0 = k * width + (width - w) // 2, r * cell_h + 2
        canvas.paste(Image.fromarray(pixels[i]).resize((w, h), Image.NEAREST), (x0, y0))
        for j, line in enumerate(wrapped[i] if i < len(wrapped) else []):
            draw.text((k * width + 3, y0 + h + 2 + 11 * j), line, fill="black")
    return np.asarray(canvas)


# A checkpoint is a folder <run>/checkpoints/epoch_<E>/ holding two files that load without unpickling code:
#   weights.safetensors  every tensor, dict of tensors or list of tensors of the saved state (params, snapshots, EMAs)
#   state.pt             the rest (optimizer, RNG states, counters, Args), loadable with torch.load(weights_only=True)
# It is written as a .tmp-* folder and renamed into place, then <run>/checkpoints/last, a symlink, is pointed at it
# (an atomic replace): a kill at any moment leaves `last` on a complete checkpoint. .tmp-* leftovers of a kill are
# removed when the run resumes.
CHECKPOINT_FORMAT = "cleanflow-checkpoint-1"


WEIGHTS_FILE, STATE_FILE = "weights.safetensors", "state.pt"


def _all_tensors(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, str) and _all_tensors(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_all_tensors(v) for v in value)
    return False


def _flatten(value, prefix: str, out: dict):
    """Tensors of a nested dict/list into `out` under "prefix/key/..." names; returns the structure with the names."""
    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().to("cpu", copy=True).contiguous()  # own storage: safetensors refuses shared memory
        return prefix
    if isinstance(value, dict):
        return {k: _flatten(v, f"{prefix}/{k}", out) for k, v in value.items()}
    return [_flatten(v, f"{prefix}/{i}", out) for i, v in enumerate(value)]


def _unflatten(layout, tensors: dict):
    if isinstance(layout, str):
        return tensors[layout]
    if isinstance(layout, dict):
        return {k: _unflatten(v, tensors) for k, v in layout.items()}
    return [_unflatten(v, tensors) for v in layout]


def _plain(value):
    """What torch.load(weights_only=True) accepts: tensors, containers and python scalars (numpy -> torch/python)."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def save_checkpoint(path: Path, state: dict, keep: int = 0, staged: Optional[Path] = None):
    """Save `state` as the checkpoint folder <path's folder>/epoch_<state["epoch"]>/ and point `last` at it (see above).

    `path` is <run>/checkpoints/last. Top-level entries that are tensors or dicts/lists of tensors go to
    safetensors, whatever their name; everything else to state.pt. Keeps the newest max(keep, 1) epoch folders.
    A failed write (disk full, file-size limit) removes what it wrote and stops the run with one line.
    `staged`: the temp folder, already holding what other writers put there (the shards of `save_shards`)."""
    root = Path(path).parent
    tensors, layout, rest = {}, {}, {}
    for key, value in state.items():
        if key != "optimizer" and _all_tensors(value):
            layout[key] = _flatten(value, key, tensors)
        else:
            rest[key] = _plain(value)
    rest.update(format=CHECKPOINT_FORMAT, algo=_RUN.get("algo"), tensor_layout=layout)
    name = f"epoch_{state['epoch']:06d}"
    target, tmp, link = root / name, staged or root / f".tmp-{name}.{os.getpid()}", root / f".tmp-last.{os.getpid()}"
    old = None
    try:
        from safetensors.torch import save_file

        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(exist_ok=staged is not None)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": CHECKPOINT_FORMAT})
        torch.save(rest, tmp / STATE_FILE)
        if target.exists():  # saved twice at one epoch (a stop after a non-finite abort): replace it
            old = root / f".tmp-old-{name}.{os.getpid()}"
            os.rename(target, old)
        os.rename(tmp, target)
        try:
            os.symlink(name, link)
        except OSError as e:  # a filesystem without symlinks: no `last`, resume takes the newest epoch folder
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        else:
            os.replace(link, root / "last")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        link.unlink(missing_ok=True)
        if old is not None and not target.exists():
            os.rename(old, target)
        if isinstance(e, Exception):  # OSError, torch's RuntimeError, SafetensorError: ENOSPC, EFBIG, EIO, ...
            reason = write_error_reason(e, root)
            raise UserError(
                f"could not write the checkpoint {target} ({reason}); nothing half-written is left, "
                f"the previous checkpoint is intact"
            ) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    saved = sorted(p for p in root.glob("epoch_*") if p.is_dir() and not p.name.startswith("."))
    for stale in saved[: -max(keep, 1)]:
        if stale != target:  # renamed away first (atomic), so a kill mid-delete never leaves a half-deleted epoch_<E>
            doomed = root / f".tmp-old-{stale.name}.{os.getpid()}"
            os.rename(stale, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def find_checkpoint(resume: str) -> tuple:
    """`--resume` -> (run folder, checkpoint folder). A run folder means its newest checkpoint (`last`). A checkpoint
    folder must sit in a run folder (<run>/checkpoints/<name>, with <run>/args.json): a copied-out checkpoint has no
    run folder to continue, and its parent folders are not one."""
    p = Path(resume).expanduser()
    if not p.exists():
        raise UserError(f"--resume {resume}: no such run folder or checkpoint")
    if p.is_file():
        if p.name in (WEIGHTS_FILE, STATE_FILE):
            p = p.parent
        elif p.suffix == ".pt":
            raise UserError(
                f"--resume {resume}: a pickled checkpoint of an older cleanflow; it is not loaded (unpickling "
                "can run code) -- checkpoints are now folders checkpoints/epoch_<E>/"
            )
        else:
            raise UserError(f"--resume {resume}: not a run folder or a checkpoint folder")
    if (p / "checkpoints").is_dir() or (p / "args.json").is_file():  # a run folder
        run_dir, root = p, p / "checkpoints"
        if (root / "last").is_dir():
            ckpt_dir = root / (root / "last").resolve().name
        else:  # `last` missing: the newest complete checkpoint folder
            saved = sorted(c for c in root.glob("epoch_*") if (c / STATE_FILE).is_file()) if root.is_dir() else []
            if not saved:
                old = (root / "last.pt").exists()
                old = " (only a pickled last.pt of an older cleanflow, which is not loaded)" if old else ""
                raise UserError(f"--resume {resume}: the run folder has no checkpoint{old}")
            ckpt_dir = saved[-1]
    elif (p / STATE_FILE).exists() or (p / WEIGHTS_FILE).exists():
        ckpt_dir, parent = p, p.absolute().parent
        if parent.name != "checkpoints" or not (parent.parent / "args.json").is_file():
            raise UserError(
                f"--resume {resume}: this checkpoint is not inside a run folder (<run>/checkpoints/<name> next to "
                "<run>/args.json); copy and resume the whole run folder"
            )
        run_dir = parent.parent
    else:
        raise UserError(f"--resume {resume}: not a run folder or a checkpoint folder")
    if not (run_dir / "args.json").is_file():
        raise UserError(f"--resume {resume}: {run_dir} is not a run folder (no args.json)")
    return run_dir, ckpt_dir


def load_checkpoint(path: Path, full: bool = False) -> dict:
    """A checkpoint folder (or a run folder: its newest) -> the state dict `save_checkpoint` was given, without
    unpickling code. Missing, truncated or foreign files fail with one line. A sharded checkpoint (--fsdp) leaves
    its tensors in shards/ (`restore_state` reads them into the sharded run) unless `full`: then they are read whole
    (`read_shards`), so the result has the entries of an unsharded checkpoint."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        path = find_checkpoint(str(path))[1]
    weights, state_file = path / WEIGHTS_FILE, path / STATE_FILE
    for f in (state_file, weights):
        if not f.is_file():
            raise UserError(f"checkpoint {path}: {f.name} is missing")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - empty, truncated, garbage or pickled code: all one message
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise UserError(
            f"checkpoint {state_file} cannot be read ({reason}): truncated, corrupt or not a cleanflow checkpoint"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"checkpoint {state_file} is not a cleanflow checkpoint ({CHECKPOINT_FORMAT})")
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights))
        for key, layout in state.pop("tensor_layout").items():
            state[key] = _unflatten(layout, tensors)
    except Exception as e:  # noqa: BLE001
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise UserError(f"checkpoint {weights} cannot be read ({reason}): truncated or corrupt") from None
    if "shards" in state:
        check_shards(path, state["shards"])
    if full and state.get("shards"):
        state.update(read_shards(path / SHARDS_DIR, state["shards"]))
    return state


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


def check_checkpoint_fields(ckpt: dict, ckpt_dir: Path, args=None):
    """A checkpoint's plain fields before anything of the run is touched: known keys only, and counters that are
    whole numbers in range, the epoch the one its folder is named after (a crafted epoch -5 would retrain from -5 and
    overwrite epochs 1-3). With `args` (the command line's): a LoRA run is not resumed with --full-finetune, nor a
    full fine-tune without it."""
    unknown = sorted(set(ckpt) - set(CHECKPOINT_KEYS))
    if unknown:
        raise UserError(
            f"checkpoint {ckpt_dir}: unknown entries {', '.join(map(str, unknown[:3]))}; not a cleanflow checkpoint"
        )
    for key in ("epoch", "step", "images_seen"):
        value = ckpt.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "epoch" else 0):
            raise UserError(
                f"checkpoint {ckpt_dir}: {key} is {value!r}, expected a whole number >= {1 if key == 'epoch' else 0}"
            )
    if ckpt_dir.name.startswith("epoch_") and ckpt_dir.name != f"epoch_{ckpt['epoch']:06d}":
        raise UserError(f"checkpoint {ckpt_dir}: it says epoch {ckpt['epoch']}, its folder name another")
    if not isinstance(ckpt.get("args"), dict):
        raise UserError(f"checkpoint {ckpt_dir}: its settings (args) are missing")
    full = bool(ckpt["args"].get("full_finetune", False))  # checkpoints from before the flag are LoRA runs
    if args is not None and "full_finetune" in given_flags(args) and bool(args.full_finetune) != full:
        raise UserError(
            f"checkpoint {ckpt_dir} is of a {'full fine-tuning' if full else 'LoRA'} run; resume it "
            f"{'with' if full else 'without'} --full-finetune"
        )


def check_state_fits(ckpt: dict, named: dict, optimizer, snapshots: dict, eval_ema: EvalEMA, prompt_gen: torch.Generator):
    """Every tensor a resume copies into the run has the shape and dtype of what it replaces (a crafted or foreign
    checkpoint would otherwise fail half-way through the copies, or later inside the optimizer)."""

    def fits(saved, live, what: str):
        if not isinstance(saved, torch.Tensor) or saved.shape != live.shape or saved.dtype != live.dtype:
            got = f"{tuple(saved.shape)} {saved.dtype}" if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise UserError(f"{what} is {got}, expected {tuple(live.shape)} {live.dtype}")

    params = ckpt.get("params")
    if not isinstance(params, dict) or set(params) != set(named):
        extra = sorted(set(params or {}) ^ set(named))[:2] if isinstance(params, dict) else []
        raise UserError(f"its trainable weights are not this run's (e.g. {', '.join(extra) or 'none saved'})")
    for name, p in named.items():
        fits(params[name], p, name)
    saved_opt, live_params = ckpt.get("optimizer"), [p for g in optimizer.param_groups for p in g["params"]]
    if not isinstance(saved_opt, dict) or not isinstance(saved_opt.get("state"), dict):
        raise UserError("its optimizer state is not an optimizer's state_dict")
    for i, state in saved_opt["state"].items():
        if not isinstance(i, int) or not 0 <= i < len(live_params) or not isinstance(state, dict):
            raise UserError(f"its optimizer state has an entry {i!r} for no parameter")
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # AdamW's moments; `step` is a scalar
                fits(value, live_params[i], f"optimizer {key} of parameter {i}")
    for key, tensors in snapshots.items():
        saved = (ckpt.get("snapshots") or {}).get(key)
        if not isinstance(saved, list) or len(saved) != len(tensors):
            raise UserError(
                f"its {key!r} snapshot has {len(saved) if isinstance(saved, list) else 0} tensors, not {len(tensors)}"
            )
        for t, v in zip(tensors, saved):
            fits(v, t, f"the {key!r} snapshot")
    saved_ema = ckpt.get("eval_ema")
    if saved_ema is not None and eval_ema.shadow:
        if not isinstance(saved_ema, list) or len(saved_ema) != len(eval_ema.shadow):
            raise UserError("its eval EMA does not match the trainable weights")
        for t, v in zip(eval_ema.shadow, saved_ema):
            fits(v, t, "the eval EMA")
    fits(ckpt.get("prompt_gen"), prompt_gen.get_state(), "the prompt generator's state")


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


def check_run_folder(run_dir: Path):
    """The run folder still there (TensorBoard would go on writing to its deleted event file, and a checkpoint would
    create a new, half-empty folder): one line instead."""
    if not (Path(run_dir) / "args.json").is_file():
        raise UserError(f"the run folder {run_dir} was removed or moved while the run was going; stopped")


def disk_full(e: BaseException, folder: Optional[Path] = None) -> bool:
    """Whether a failed write ran out of space. torch.save says only "file write failed" and safetensors wraps the
    OS error in its own text, so the free space of `folder`'s filesystem decides too (under 1 MiB left)."""
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e) or "StorageFull" in str(e):
        return True
    try:
        stat = os.statvfs(folder) if folder is not None else None
    except OSError:
        return False
    return stat is not None and stat.f_bavail * stat.f_frsize < 2**20


def write_error_reason(e: BaseException, folder: Optional[Path] = None) -> str:
    """One line on why a write failed, "no space left on device" whenever that is why (see `disk_full`)."""
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return f"no space left on device: {reason}" if disk_full(e, folder) and "No space left" not in reason else reason


MAX_BAD_STEPS = 5  # non-finite gradients in a row before `gradient_is_finite` stops the run


def gradient_is_finite(grad_norm: torch.Tensor, on_fail: Optional[Callable[[], None]] = None) -> bool:
    """Whether the step's (pre-clip) gradient norm is finite; if not, the scripts skip the update, so that one bad batch
    cannot poison the weights. A skip prints a warning; the MAX_BAD_STEPS-th in a row calls `on_fail()` (the scripts
    save a checkpoint) and stops the run with a UserError. The count lives in the current run's state (`start_run`
    resets it), so a resumed run starts from 0 as it did before."""
    if torch.isfinite(grad_norm):
        _RUN["bad_steps"] = 0
        return True
    _RUN["bad_steps"] = bad = _RUN.get("bad_steps", 0) + 1
    from tqdm import tqdm

    tqdm.write(f"warning: non-finite gradient, update skipped ({bad} in a row)")
    if bad >= MAX_BAD_STEPS:
        if on_fail is not None:
            on_fail()
        raise UserError(f"{MAX_BAD_STEPS} non-finite updates in a row; checkpoint saved, lower the learning rate")
    return False


def trainable_state(params_by_name: dict) -> dict:
    return {n: p.detach().cpu().clone() for n, p in params_by_name.items()}


def load_trainable_state(params_by_name: dict, state: dict):
    with torch.no_grad():
        for n, p in params_by_name.items():
            p.copy_(state[n])


def save_state(
    run_dir: Path,
    args,
    pipe,
    named: dict,
    optimizer,
    snapshots: dict,
    eval_ema: EvalEMA,
    prompt_gen: torch.Generator,
    logger: "Logger",
    algo_doc: str,
    *,
    epoch: int,
    step: int,
    images_seen: int,
):
    """Rank 0 (the logger's rank): everything an exact `--resume` needs -- the trainable weights `named`, the optimizer,
    the algorithm's `snapshots` ({name: [tensors]}), the eval EMA, the prompt stream, every RNG, the counters, the Args
    and the sampler settings -- to checkpoints/epoch_<E>/ with `checkpoints/last` pointing at it (keeping the newest
    `--keep-checkpoints`), then the export that users load (`export_dir`: runs/<run>/lora, or transformer).

    Under --fsdp every rank calls it: the tensors are written sharded (`save_shards`), the export gathered."""
    if is_fsdp(pipe.transformer):
        return save_shards(
            run_dir, args, pipe, named, optimizer, snapshots, eval_ema, prompt_gen, logger, algo_doc, epoch, step, images_seen
        )
    if not logger.enabled:
        return
    check_run_folder(run_dir)
    save_checkpoint(
        Path(run_dir) / "checkpoints" / "last",
        {
            "params": trainable_state(named),
            "optimizer": optimizer.state_dict(),
            "snapshots": {k: [t.cpu() for t in v] for k, v in snapshots.items()},
            "eval_ema": eval_ema.state(),
            **run_state(args, pipe, prompt_gen, epoch, step, images_seen),
        },
        keep=args.keep_checkpoints,
    )
    export_lora(export_dir(run_dir, args), pipe, pipe.transformer, args, algo_doc, epoch, logger, **eval_ema.export())


def run_state(args, pipe, prompt_gen: torch.Generator, epoch: int, step: int, images_seen: int) -> dict:
    """What a checkpoint holds besides the trainable tensors: the prompt stream, the RNGs, the counters, the Args and
    the sampler settings."""
    return {
        "prompt_gen": prompt_gen.get_state(),
        "rng": rng_state(),
        "epoch": epoch,
        "step": step,
        "images_seen": images_seen,
        "args": vars(args),
        "sampler": {
            "num_steps": args.num_steps,
            "guidance_scale": args.guidance_scale,
            "dynamics": args.dynamics,
            "eta": args.eta,
            "scheduler": dict(pipe.scheduler.config),
        },
    }


def restore_state(
    ckpt: Optional[dict], named: dict, optimizer, snapshots: dict, eval_ema: EvalEMA, prompt_gen: torch.Generator
) -> tuple:
    """The inverse of `save_state` for a resumed run (`ckpt` from `start_run`; None: a fresh run, nothing to do).
    Returns (start_epoch, step, images_seen)."""
    if ckpt is None:
        return 0, 0, 0
    where = f"checkpoint {_RUN.get('checkpoint', '')}".rstrip()
    try:
        if ckpt.get("shards"):  # written under --fsdp, on any number of ranks: read into this run's tensors, resharded
            load_shards(Path(_RUN["checkpoint"]) / SHARDS_DIR, named, optimizer, snapshots, eval_ema)
        else:
            check_state_fits(ckpt, named, optimizer, snapshots, eval_ema, prompt_gen)
            load_trainable_state(named, ckpt["params"])
            optimizer.load_state_dict(ckpt["optimizer"])
            for key, tensors in snapshots.items():
                for t, saved in zip(tensors, ckpt["snapshots"][key]):
                    t.copy_(saved)
            eval_ema.load(ckpt.get("eval_ema"))
        prompt_gen.set_state(ckpt["prompt_gen"])
        set_rng_state(ckpt["rng"])
    except UserError as e:
        raise UserError(f"{where} does not fit this run: {e}; nothing was changed") from None
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"{where} does not fit this run ({type(e).__name__}: {reason}); nothing was changed") from None
    return ckpt["epoch"], ckpt["step"], ckpt["images_seen"]


# ----------------------------------------------------------------------------------------------------------------
# sharded checkpoints (--fsdp): every rank writes its own shards with torch.distributed.checkpoint (DCP)
# ----------------------------------------------------------------------------------------------------------------
# epoch_<E>/ holds state.pt and weights.safetensors as below (counters, RNGs, Args, the prompt stream; "shards" says
# how many ranks wrote it and the trainable weights' names in order) plus shards/, a DCP folder (.metadata and one
# __<rank>_0.distcp per rank) with the trainable weights, the optimizer state, the snapshots and the eval EMA under
# flat names: "params/<name>", "optimizer/<name>/exp_avg", "snapshots/<key>/<i>", "eval_ema/<i>". DCP records every
# tensor's global shape and each shard's offsets, so a run on another number of ranks reads the pieces it holds.
# The shards go into the .tmp-* folder that rank 0 then renames into place (`save_checkpoint`): a kill during a
# save leaves `last` on the previous checkpoint, as without --fsdp.
SHARDS_DIR = "shards"


def shard_tensors(named: dict, optimizer, snapshots: dict, eval_ema: EvalEMA) -> dict:
    """The live tensors of a sharded checkpoint by their flat names (above): DCP writes them, or reads into them."""
    out = {f"params/{n}": p.detach() for n, p in named.items()}
    names = {id(p): n for n, p in named.items()}
    for p, state in optimizer.state.items():
        out.update({f"optimizer/{names[id(p)]}/{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    for key, tensors in snapshots.items():
        out.update({f"snapshots/{key}/{i}": t for i, t in enumerate(tensors)})
    out.update({f"eval_ema/{i}": t for i, t in enumerate(eval_ema.shadow)})
    return out


def init_optimizer_state(optimizer):
    """Give a fresh optimizer its state tensors (AdamW's moments and step) with one step on zero gradients at learning
    rate 0, which moves no weight (weight decay included), so that a sharded load has tensors to read into."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _from_main(value):
    """Rank 0's `value` on every rank (a picklable object): the ranks of a sharded save take one decision together."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_shards(
    run_dir, args, pipe, named, optimizer, snapshots, eval_ema, prompt_gen, logger, algo_doc, epoch, step, images_seen
):
    """`save_state` under --fsdp, on every rank: each rank writes its shards into rank 0's temp folder, rank 0 adds the
    rest and renames it into place, then the export is gathered. A failure on any rank stops every rank with one line."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    root, tmp, message = Path(run_dir) / "checkpoints", None, None
    if logger.enabled:
        try:
            check_run_folder(run_dir)
            tmp = root / f".tmp-epoch_{epoch:06d}.{os.getpid()}"  # the name `save_checkpoint` gives its temp folder
            (tmp / SHARDS_DIR).mkdir(parents=True)
        except (UserError, OSError) as e:
            message = str(e) if isinstance(e, UserError) else f"could not write the checkpoint ({write_error_reason(e, root)})"
    tmp, message = _from_main((tmp, message))
    if message is None:
        try:
            dcp.save(shard_tensors(named, optimizer, snapshots, eval_ema), checkpoint_id=tmp / SHARDS_DIR)
        except (Exception, CheckpointException) as e:  # DCP raises a failure of any rank on every rank
            message = f"could not write the checkpoint shards ({write_error_reason(e, root)})"
        if message is None and logger.enabled:
            state = run_state(args, pipe, prompt_gen, epoch, step, images_seen)
            state["shards"] = {"ranks": dist.get_world_size(), "params": list(named)}
            try:
                save_checkpoint(root / "last", state, keep=args.keep_checkpoints, staged=tmp)
            except UserError as e:
                message = str(e)
        message = _from_main(message)
    if message is not None:
        if logger.enabled and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(message if "intact" in message else f"{message}; the previous checkpoint is intact")
    export_lora(export_dir(run_dir, args), pipe, pipe.transformer, args, algo_doc, epoch, logger, **eval_ema.export())


# DCP keeps its index in shards/.metadata as a pickle and reads it with a bare pickle.load, which runs whatever a
# crafted file names. So this reads it with an unpickler that builds only DCP's tensor-metadata classes, and checks
# what it built before DCP reads a byte of the shards: each entry a tensor (DCP's bytes entries are pickled objects,
# which DCP's load would unpickle in full), stored untransformed in a plain file inside shards/.
class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata only: its dataclasses, torch.Size, dtypes, layouts, memory formats and the checkpoint's
    path; any other global refuses the file."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup of torch.strided and the like by name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, where the shards were written
        ("pathlib._local", "PosixPath"),  # its module from Python 3.13
    }

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not DCP tensor metadata")


def _is_chunk(chunk, dims: int) -> bool:
    """Whether `chunk` is DCP's ChunkStorageMetadata of a piece of a `dims`-dimensional tensor."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return isinstance(chunk, ChunkStorageMetadata) and all(
        isinstance(s, torch.Size) and len(s) == dims for s in (chunk.offsets, chunk.sizes)
    )


def read_shards_metadata(folder: Path):
    """shards/.metadata (DCP's `Metadata`) read by `MetadataUnpickler` and checked: every entry a tensor, each piece of
    it in a plain file of `folder`, untransformed. Anything else: one line (`UserError`), and nothing was unpickled
    beyond DCP's own classes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    path = folder / ".metadata"
    if folder.is_symlink() or path.is_symlink() or not path.is_file():
        raise UserError(f"its shards' {path} cannot be read (missing or not a plain file)")
    try:
        with open(path, "rb") as f:
            meta = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise UserError(f"its shards' {path} is refused ({e}): unpickling it could run code") from None
    except Exception as e:  # noqa: BLE001 - truncated or garbage: what the allowed classes raise on bad arguments
        raise UserError(f"its shards' {path} cannot be read ({type(e).__name__}): missing or corrupt") from None
    entries = getattr(meta, "state_dict_metadata", None)
    pieces = getattr(meta, "storage_data", None)
    if not isinstance(meta, Metadata) or not isinstance(entries, dict) or not isinstance(pieces, dict):
        raise UserError(f"its shards' {path} is not DCP metadata")
    if not isinstance(meta.storage_meta, (StorageMeta, type(None))):
        raise UserError(f"its shards' {path} is not DCP metadata")
    for key, entry in entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UserError(f"its shards' entry {str(key)[:80]!r} is a {type(entry).__name__}, not a tensor: refused")
        chunks = entry.chunks if isinstance(entry.chunks, list) else [None]
        if (
            not isinstance(key, str)
            or not isinstance(entry.size, torch.Size)
            or not isinstance(entry.properties, TensorProperties)
            or not isinstance(entry.properties.dtype, torch.dtype)
            or not all(_is_chunk(c, len(entry.size)) for c in chunks)
        ):
            raise UserError(f"its shards' entry {str(key)[:80]!r} is not a tensor's metadata")
    for index, piece in pieces.items():
        name = getattr(piece, "relative_path", None)
        if (
            not isinstance(index, MetadataIndex)
            or not isinstance(piece, _StorageInfo)
            or index.fqn not in entries
            or not all(isinstance(n, int) and n >= 0 for n in (piece.offset, piece.length))
        ):
            raise UserError(f"its shards' {path} lists a piece of no tensor entry")
        if not isinstance(name, str) or name != Path(name).name or name.startswith("."):
            raise UserError(f"its shards' {index.fqn!r} is stored in {str(name)[:80]!r}, not a shard file in {folder}")
        if (folder / name).is_symlink() or not (folder / name).is_file():
            raise UserError(f"its shards' file {folder / name} cannot be read (missing or not a plain file)")
        if piece.transform_descriptors:
            raise UserError(f"its shards' {index.fqn!r} is stored transformed, which cleanflow never writes")
    return meta


def shards_reader(folder: Path):
    """DCP's FileSystemReader of `folder`, reading the metadata with `read_shards_metadata` (dcp.load asks for it)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class ShardsReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            meta = read_shards_metadata(folder)
            meta.storage_meta = meta.storage_meta or StorageMeta()
            meta.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
            return meta

    return ShardsReader(str(folder))


def check_shards(ckpt_dir: Path, info):
    """A checkpoint's "shards" entry (`save_shards`), when it has one, before anything loads: the ranks and weight names
    it records, and its shards/ folder's metadata (`read_shards_metadata`). The entry alone routes a resume to the
    shards, so a plain run's state.pt given one is checked as a sharded checkpoint."""
    ranks, params = (info.get("ranks"), info.get("params")) if isinstance(info, dict) else (None, None)
    if (
        set(info if isinstance(info, dict) else ()) != {"ranks", "params"}
        or not isinstance(ranks, int)
        or ranks < 1
        or not isinstance(params, list)
        or not all(isinstance(n, str) for n in params)
    ):
        raise UserError(f"checkpoint {ckpt_dir}: its shards entry is {repr(info)[:60]}, not the ranks and weight names")
    try:
        read_shards_metadata(ckpt_dir / SHARDS_DIR)
    except UserError as e:
        raise UserError(f"checkpoint {ckpt_dir}: {e}") from None


def load_shards(folder: Path, named: dict, optimizer, snapshots: dict, eval_ema: EvalEMA):
    """Read a sharded checkpoint into this run's tensors (`restore_state`): DCP reshards from the ranks that wrote it
    to the ranks (and sharding) of this run. Names, shapes and dtypes are checked first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = shards_reader(folder)
    saved = reader.read_metadata().state_dict_metadata
    if any(k.startswith("optimizer/") for k in saved):
        init_optimizer_state(optimizer)
    live = shard_tensors(named, optimizer, snapshots, eval_ema)
    if set(saved) != set(live):
        extra = sorted(set(saved) ^ set(live))[:2]
        raise UserError(f"its sharded tensors are not this run's (e.g. {', '.join(extra)})")
    for key, t in live.items():
        meta = saved[key]
        if tuple(meta.size) != tuple(t.shape) or meta.properties.dtype != t.dtype:
            raise UserError(f"{key} is {tuple(meta.size)} {meta.properties.dtype}, expected {tuple(t.shape)} {t.dtype}")
    try:
        dcp.load(live, storage_reader=reader)
    except CheckpointException as e:  # a BaseException: a missing or truncated shard file on some rank
        failures = [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in e.failures.items()]
        reason = "; ".join(
            f"rank {rank}: {type(x).__name__}: {(str(x).strip().splitlines() or [''])[0][:80]}" for rank, x in failures
        )
        raise UserError(f"its shards cannot be read ({reason or type(e).__name__}): truncated or corrupt") from None


def read_shards(folder: Path, info: dict) -> dict:
    """A sharded checkpoint's tensors whole, in this process (no process group): the `load_checkpoint(full=True)`
    entries params, optimizer ({"state": {index: {...}}} in parameter order, as `optimizer.state_dict()`), snapshots
    and eval_ema, for tools and tests that compare checkpoints."""
    import torch.distributed.checkpoint as dcp

    reader = shards_reader(folder)
    saved = reader.read_metadata().state_dict_metadata
    flat = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()}
    with warnings.catch_warnings():  # that no process group is there: none is needed
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, storage_reader=reader, no_dist=True)
    out = {"params": {}, "optimizer": {"state": {}}, "snapshots": {}, "eval_ema": None}
    index = {name: i for i, name in enumerate(info["params"])}
    for key in sorted(flat, key=lambda k: [int(x) if x.isdigit() else x for x in k.split("/")]):
        kind, rest = key.split("/", 1)
        if kind == "params":
            out["params"][rest] = flat[key]
        elif kind == "optimizer":
            name, entry = rest.rsplit("/", 1)
            out["optimizer"]["state"].setdefault(index[name], {})[entry] = flat[key]
        elif kind == "snapshots":
            out["snapshots"].setdefault(rest.split("/")[0], []).append(flat[key])
        else:
            out["eval_ema"] = (out["eval_ema"] or []) + [flat[key]]
    out["optimizer"]["state"] = dict(sorted(out["optimizer"]["state"].items()))
    return out


def evaluate_and_log(
    args, pipe, encoder, prompts, rewards, eval_ema: EvalEMA, logger: "Logger", images_seen: int, label: str = "eval"
):
    """Rank 0 (the logger's rank): `evaluate` the held-out `prompts` with the eval sampler (--eval-num-steps,
    --eval-guidance-scale; the eval EMA's weights when --eval-ema-decay > 0), log eval/<reward> and a captioned grid
    at x = images seen, with the side metrics of --eval-rewards (the logger's) beside the training rewards, and print the
    means as a line that stays above the progress bar. Returns {reward: mean} (None on the other ranks). Under --fsdp
    every rank samples with rank 0, since each forward gathers the weights from all of them."""
    if not logger.enabled and not is_fsdp(pipe.transformer):
        return None

    def score(images, prompts):  # the training rewards' eval metrics, then the side metrics (--eval-rewards)
        out = rewards.evaluate(images, prompts)
        side = logger.eval_rewards(images, prompts) if logger.eval_rewards is not None else {}
        return {**out, **{k: v for k, v in side.items() if k not in out}}

    with eval_ema.swapped():
        imgs, scores = evaluate(
            pipe,
            pipe.transformer,
            encoder,
            prompts,
            score,
            num_steps=args.eval_num_steps or args.num_steps,
            guidance_scale=args.guidance_scale if args.eval_guidance_scale is None else args.eval_guidance_scale,
            seed=0,
            use_autocast=args.mixed_precision,
            repeats=getattr(args, "eval_noises", 2),
            schedule=getattr(args, "sigma_schedule", "pipeline"),
            solver=getattr(args, "eval_solver", "euler"),
            progress=False,  # the run's one progress bar is the epochs'
        )
    if not logger.enabled:
        return None
    logger.scalars({f"eval/{k}": v.mean() for k, v in scores.items()}, images_seen)
    logger.images("eval/images", imgs[:16], captions(prompts[:16], scores), images_seen)
    means = {k: v.mean().item() for k, v in scores.items()}
    from tqdm import tqdm

    tqdm.write(f"{label} after {images_seen:,} images: {scores_line(means)}")
    return means


def scores_line(means: dict) -> str:
    """{reward: mean} as "shapes_clean 0.578  shapes_exact 0.45": 3 significant digits, already finer than the
    standard error of a held-out mean (about 0.06 for a 0/1 score over the default 60 images)."""
    return "  ".join(f"{name} {value:.3g}" for name, value in means.items())


class Timer:
    """Accumulates wall-clock per section: `with timer("sampling"): ...`; `timer.pop()` returns and resets."""

    def __init__(self):
        self.totals = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict:
        out, self.totals = self.totals, {}
        return out


def nanmean(values) -> float:
    """Mean ignoring NaNs; NaN (without numpy's warning) when nothing is left."""
    finite = [float(v) for v in values if not math.isnan(float(v))]
    return sum(finite) / len(finite) if finite else float("nan")


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
