"""Checkpoints: their format, the atomic save, finding and loading one for `--resume`, the checks of what a checkpoint
holds before anything of the run is touched, and `save_state` / `restore_state`, which the scripts call. Sharded
checkpoints (--fsdp) keep their tensors in a DCP folder: shards.py."""

import errno
import os
import random
import re
import shutil
import stat
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from common import UserError
from harness.shards import SHARDS_DIR, check_shards, from_main, load_shards, read_shards, shard_tensors
from models import EvalEMA, is_fsdp

# A checkpoint is a folder <run>/checkpoints/epoch_<E>/ holding two files that load without unpickling code:
#   weights.safetensors  every tensor, dict of tensors or list of tensors of the saved state (params, snapshots, EMAs)
#   state.pt             the rest (optimizer, RNG states, counters, Args), loadable with torch.load(weights_only=True)
# It is written as a .tmp-* folder and renamed into place, then <run>/checkpoints/last, a symlink, is pointed at it
# (an atomic replace): a kill at any moment leaves `last` on a complete checkpoint. .tmp-* leftovers of a kill are
# removed when the run resumes.
CHECKPOINT_FORMAT = "cleanflow-checkpoint-1"


WEIGHTS_FILE, STATE_FILE = "weights.safetensors", "state.pt"


CHECKPOINT_KEYS = (  # what `save_state` writes (`save_checkpoint` adds format; tensor_layout is read away)
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


def script_name(args) -> str:
    """The algorithm script a run's Args belong to (its `exp_name` default, the file's stem), stored in every
    checkpoint and args.json so that a run resumes only with its own script."""
    return getattr(type(args), "exp_name", None)


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
    rest.update(format=CHECKPOINT_FORMAT, tensor_layout=layout)
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


def check_checkpoint_fields(ckpt: dict, ckpt_dir: Path):
    """A checkpoint's plain fields before anything of the run is touched: known keys only, and counters that are
    whole numbers in range, the epoch the one its folder is named after (a crafted epoch -5 would retrain from -5 and
    overwrite epochs 1-3)."""
    unknown = sorted(set(ckpt) - set(CHECKPOINT_KEYS))
    if unknown:
        raise UserError(
            f"checkpoint {ckpt_dir}: unknown entries {', '.join(map(str, unknown[:3]))}; not a cleanflow checkpoint"
        )
    for key in ("epoch", "step", "images_seen"):
        value = ckpt.get(key)
        low = 1 if key == "epoch" else 0
        # the upper end: a count no run reaches that TensorBoard (int64 steps) and float64 still hold exactly
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_COUNT:
            raise UserError(f"checkpoint {ckpt_dir}: {key} is {value!r}, expected a whole number in [{low}, 2^53]")
    if ckpt_dir.name.startswith("epoch_") and ckpt_dir.name != f"epoch_{ckpt['epoch']:06d}":
        raise UserError(f"checkpoint {ckpt_dir}: it says epoch {ckpt['epoch']}, its folder name another")
    if not isinstance(ckpt.get("args"), dict):
        raise UserError(f"checkpoint {ckpt_dir}: its settings (args) are missing")


MAX_COUNT = 2**53


def optimizer_state(saved: dict, optimizer) -> dict:
    """The optimizer state a resume loads: the saved moments and step counts, under this run's own hyper-parameters.
    A checkpoint's `param_groups` (lr, betas, eps, weight decay, maximize, ...) are never loaded: they come from the
    run's flags, which `restore_args` checked, so a crafted lr of NaN or 1e30, or `maximize: true`, cannot steer the
    run. Each saved entry must be AdamW's whole state for its parameter, finite, its second moment >= 0."""
    live = optimizer.state_dict()
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(live["param_groups"]):
        raise UserError("its optimizer's parameter groups are not this run's")
    for g, mine in zip(groups, live["param_groups"]):
        if not isinstance(g, dict) or g.get("params") != mine["params"]:
            raise UserError("its optimizer's parameter groups are not this run's")
    amsgrad = any(g.get("amsgrad") for g in live["param_groups"])
    expected = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
    for i, state in saved["state"].items():
        if set(state) != expected:
            missing = sorted(expected - set(state)) or sorted(set(state) - expected)
            raise UserError(f"its optimizer state of parameter {i} is not AdamW's (at {', '.join(map(str, missing))})")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise UserError(f"its optimizer {key} of parameter {i} is {type(value).__name__}, not a float tensor")
            if not torch.isfinite(value).all():
                raise UserError(f"its optimizer {key} of parameter {i} holds NaN or inf")
        step = state["step"]
        if step.numel() != 1 or not 0 <= step.item() <= MAX_COUNT or step.item() != int(step.item()):
            raise UserError(f"its optimizer step of parameter {i} is {step.flatten()[:1].tolist()}, not a count")
        if (state["exp_avg_sq"] < 0).any():
            raise UserError(f"its optimizer exp_avg_sq of parameter {i} is negative: not a second moment")
    return {"state": saved["state"], "param_groups": live["param_groups"]}


def check_finite(named: dict, snapshots: dict, eval_ema: EvalEMA):
    """The weights a resume loaded (trainable, snapshots, eval EMA) hold no NaN or inf: a run saved after its weights
    went non-finite would train and export NaN without a word (the gradient guard stops a run before it saves such
    weights, so only a damaged or crafted checkpoint holds them)."""
    groups = [(f"weight {n}", [p]) for n, p in named.items()]
    groups += [(f"the {k!r} snapshot", ts) for k, ts in snapshots.items()] + [("the eval EMA", eval_ema.shadow)]
    for what, tensors in groups:
        if any(not torch.isfinite(t).all() for t in tensors):
            raise UserError(f"its {what} holds NaN or inf")


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


def check_no_symlinks(run_dir: Path, folders: tuple = ()):
    """A resumed run writes only inside its folder: refuse a run folder that is a symlink, or has one in it or below it
    (samples/, checkpoints/, an epoch folder, the export, an events file, resumes.jsonl, .lock, ...). A resume appends,
    saves and removes old checkpoints through whatever a link points at, outside the folder too. Allowed: the links the
    run makes itself, checkpoints/last (and the .tmp-last.<pid> a kill can leave) naming an epoch folder beside it. Also
    refused: a hard link, a FIFO, socket or device, and a file where the run keeps one of its `folders`."""
    run_dir = Path(run_dir)
    if run_dir.is_symlink():
        raise UserError(f"run folder {run_dir} is a symbolic link (to {os.readlink(run_dir)}); resume the folder itself")
    for folder, dirs, files in os.walk(run_dir):  # walks into no linked folder
        for name in sorted((*dirs, *files)):
            path = Path(folder) / name
            where = f"run folder {run_dir}: {path.relative_to(run_dir)}"
            if path.is_symlink():
                if _own_link(run_dir, path):
                    continue
                raise UserError(
                    f"{where} is a symbolic link (to {os.readlink(path)}); a "
                    "resumed run writes only inside its own folder: put the file or folder itself there"
                )
            mode = path.lstat()
            if stat.S_ISDIR(mode.st_mode):
                continue
            if not stat.S_ISREG(mode.st_mode):  # a FIFO would hang the open of .lock or resumes.jsonl; a device worse
                raise UserError(f"{where} is not a regular file (a FIFO, socket or device); a run folder holds files only")
            if mode.st_nlink > 1:  # appending to or replacing it would change the other name's file too, outside the run
                raise UserError(
                    f"{where} is a hard link ({mode.st_nlink} names for one file); a resumed run writes only inside its "
                    "own folder: put a copy of the file there"
                )
            if folder == str(run_dir) and name in folders:
                raise UserError(f"{where} is a file, where the run keeps a folder; move it away to resume")


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
    logger,
    *,
    epoch: int,
    step: int,
    images_seen: int,
):
    """Rank 0 (the logger's rank): everything an exact `--resume` needs -- the trainable weights `named`, the optimizer,
    the algorithm's `snapshots` ({name: [tensors]}), the eval EMA, the prompt stream, every RNG, the counters, the Args
    and the sampler settings -- to checkpoints/epoch_<E>/ with `checkpoints/last` pointing at it (keeping the newest
    `--keep-checkpoints`). The scripts then write the export that users load (`export.export_model`).

    Under --fsdp every rank calls it: the tensors are written sharded (`save_shards`)."""
    if is_fsdp(pipe.transformer):
        return save_shards(
            run_dir, args, pipe, named, optimizer, snapshots, eval_ema, prompt_gen, logger, epoch, step, images_seen
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


def save_shards(run_dir, args, pipe, named, optimizer, snapshots, eval_ema, prompt_gen, logger, epoch, step, images_seen):
    """`save_state` under --fsdp, on every rank: each rank writes its shards (shards.py) into rank 0's temp folder, rank
    0 adds the rest and renames it into place. A failure on any rank stops every rank with one line."""
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
    tmp, message = from_main((tmp, message))
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
        message = from_main(message)
    if message is not None:
        if logger.enabled and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(message if "intact" in message else f"{message}; the previous checkpoint is intact")


def run_state(args, pipe, prompt_gen: torch.Generator, epoch: int, step: int, images_seen: int) -> dict:
    """What a checkpoint holds besides the trainable tensors: the script that wrote it, the prompt stream, the RNGs, the
    counters, the Args and the sampler settings."""
    return {
        "algo": script_name(args),
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
    where = f"checkpoint {ckpt.get('path', '')}".rstrip()
    try:
        if ckpt.get("shards"):  # written under --fsdp, on any number of ranks: read into this run's tensors, resharded
            load_shards(Path(ckpt["path"]) / SHARDS_DIR, named, optimizer, snapshots, eval_ema)
        else:
            check_state_fits(ckpt, named, optimizer, snapshots, eval_ema, prompt_gen)
            opt_state = optimizer_state(ckpt["optimizer"], optimizer)
            load_trainable_state(named, ckpt["params"])
            optimizer.load_state_dict(opt_state)
            with torch.no_grad():  # a snapshot may be trained weights of their own (DMD2's fake score)
                for key, tensors in snapshots.items():
                    for t, saved in zip(tensors, ckpt["snapshots"][key]):
                        t.copy_(saved)
            eval_ema.load(ckpt.get("eval_ema"))
            check_finite(named, snapshots, eval_ema)  # loaded in memory only: the run stops before it writes anything
        prompt_gen.set_state(ckpt["prompt_gen"])
        set_rng_state(ckpt["rng"])
    except UserError as e:
        raise UserError(f"{where} does not fit this run: {e}; nothing was changed") from None
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"{where} does not fit this run ({type(e).__name__}: {reason}); nothing was changed") from None
    return ckpt["epoch"], ckpt["step"], ckpt["images_seen"]
