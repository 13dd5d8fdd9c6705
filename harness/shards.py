"""Sharded checkpoints (--fsdp): every rank writes its own shards of the trainable tensors with
torch.distributed.checkpoint (DCP), and a run on any number of ranks reads them back (checkpoints.py calls these)."""

import pickle
import warnings
from pathlib import Path

import torch

from common import UserError
from models import EvalEMA

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


def from_main(value):
    """Rank 0's `value` on every rank (a picklable object): the ranks of a sharded save take one decision together."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    """A checkpoint's "shards" entry (`checkpoints.save_shards`), when it has one, before anything loads: the ranks and
    weight names it records, and its shards/ folder's metadata (`read_shards_metadata`). The entry alone routes a resume
    to the shards, so a plain run's state.pt given one is checked as a sharded checkpoint."""
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
