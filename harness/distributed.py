"""Multi-process plumbing: torchrun sets the environment; a single process runs the same code with
world size 1. An epoch's samples are laid out so that N ranks compute what one process computes (`batch_layout`,
`rank_indices`)."""

import itertools
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from common import UserError


# ----------------------------------------------------------------------------------------------------------------
# distributed: torchrun sets the env; a single process runs the same code with world_size 1
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_ranks() -> Tuple[int, int, int]:
    """(rank, world size, local rank) from the environment torchrun sets, checked: an environment left over from
    torchrun, or set by hand, is one line rather than torch's traceback from `init_process_group`."""
    values = []
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        text = os.environ.get(name, default)
        try:
            values.append(int(text))
        except ValueError:
            raise UserError(f"{name}={text!r} in the environment is not a whole number (torchrun sets it)") from None
    rank, world_size, local_rank = values
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise UserError(
            f"RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank} in the environment: expected 0 <= RANK < "
            "WORLD_SIZE and LOCAL_RANK >= 0 (torchrun sets them; unset them to run one process)"
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if world_size > 1 and not os.environ.get(name)]
    if missing:
        raise UserError(
            f"WORLD_SIZE={world_size} in the environment but no {' or '.join(missing)}: launch with "
            f"`torchrun --nproc-per-node {world_size} ...`, or unset WORLD_SIZE and RANK to run one process"
        )
    return rank, world_size, local_rank


def setup_distributed(device: Optional[str] = None) -> Dist:
    rank, world_size, local_rank = env_ranks()
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = check_device(device)
    if dev.type == "cuda" and dev.index is None:  # a bare "cuda" means this rank's GPU (set_device needs an index)
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world_size, local_rank, dev)


def check_device(device: Optional[str]) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available to this torch ({torch.__version__}); use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {device}: MPS is not available; use --device cpu")
    return dev


def busy_cpu_hint() -> Optional[str]:
    """A one-line hint when torch's CPU threads (default: one per core) must share the cores with other work.

    OpenMP threads that wait for a descheduled sibling make every op slow: on 2 busy cores (load 5.7) a tiny-shapes
    training step took 1.1-5.2 s with 2 threads and 0.24-0.29 s with 1. Only a hint, not a change of the thread
    count: results must not depend on the machine's load. None when OMP_NUM_THREADS is set (torchrun sets it)."""
    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "getloadavg"):
        return None
    threads, load = torch.get_num_threads(), os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > 1 and load + threads > cores + 0.5:
        return (
            f"note: the CPU is busy (load {load:.1f} on {cores} cores) and torch runs {threads} threads, which can be "
            f"several times slower than one here; set OMP_NUM_THREADS (e.g. OMP_NUM_THREADS=1) to choose"
        )
    return None


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (identity when not distributed)."""
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return x


def all_reduce_grads(params: Sequence[torch.Tensor]):
    """Average the accumulated gradients over ranks, in place. One all-reduce per parameter instead of DDP: the
    algorithms swap snapshot/EMA weights into the same module, which DDP's bucketing would not expect. Parameters
    sharded by FSDP (DTensors) are skipped: FSDP's reduce-scatter already averaged their gradients over the ranks."""
    for p in params:
        if p.grad is not None and not is_sharded(p):
            p.grad.copy_(all_reduce_mean(p.grad))


# columns summed together: one sum over fewer than torch's GRAIN_SIZE (32768) elements runs on one thread, so a row's
# partial sums depend on its values alone (not on the thread count, nor on the rows beside it on this rank)
ROW_BLOCK = 16384


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (L2), with a global norm that does not depend on how the gradients are sharded.

    torch sums the squares per tensor and then over the tensors; FSDP sums them per shard and then over the ranks, so
    2 ranks and one process round differently (1 float32 ulp of the norm), and an active clip then scales every
    gradient differently. Here each gradient is cut into rows along dim 0 (the dim FSDP shards), each row's sum of
    squares is taken in float64 from that row alone (in blocks of ROW_BLOCK columns), a sharded gradient's rows are
    all-reduced into their places (each entry has one non-zero term, so the sum is exact), and all rows are added by
    `math.fsum`, which rounds correctly in any order. One process, N ranks with replicated gradients (after
    `all_reduce_grads`) and N ranks holding FSDP shards (DTensors sharded on dim 0) thus get the same norm bit for bit
    on the CPU (tested). On CUDA (untested) the reduction kernel may split a row's sum by the tensor's shape, so a
    shard's rows could differ from the whole gradient's in their last float64 bits. The scaling is torch's:
    coefficient max_norm / (norm + 1e-6) in float32, clamped to 1. Returns the norm before clipping (float64, on the
    CPU); a NaN or inf gradient makes it NaN or inf, as in torch."""
    grads = [p.grad for p in params if p.grad is not None]
    whole, sharded, mesh = [], [], None  # [rows, blocks] float64 partial sums; shards with where their rows sit
    for g in grads:
        shard = _shard_rows(g) if is_sharded(g) else None
        if shard is None:
            whole.append(_row_sums(g.to_local() if is_sharded(g) else g))
        else:
            sharded.append((_row_sums(g.to_local()), *shard))
            mesh = g.device_mesh
    parts = [s.flatten().tolist() for s in whole]
    if sharded:
        # every rank's rows in one buffer, zero where another rank holds the row: the all-reduce adds exact zeros
        sizes = [rows * s.shape[1] for s, _, rows in sharded]
        buffer = torch.zeros(sum(sizes), dtype=torch.float64, device=sharded[0][0].device)
        for (s, start, rows), place in zip(sharded, buffer.split(sizes)):
            place.view(rows, s.shape[1])[start : start + len(s)] = s
        dist.all_reduce(buffer, group=mesh.get_group())
        parts.append(buffer.tolist())
    norm = torch.tensor(math.sqrt(math.fsum(itertools.chain.from_iterable(parts))), dtype=torch.float64)
    coef = (max_norm / (norm.float() + 1e-6)).clamp(max=1.0)  # torch's expression on its float32 norm
    for g in grads:
        part = g.to_local() if is_sharded(g) else g
        part.mul_(coef.to(part.device, part.dtype))
    return norm


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """The float64 sums of squares of each dim-0 row of `x` (a 1-D tensor's rows are its elements), per block of
    ROW_BLOCK columns: [rows, blocks]. A row longer than a block is zero-padded to whole blocks (adding 0 is exact)."""
    rows = x.detach().reshape(x.shape[0] if x.dim() else 1, math.prod(x.shape[1:])).double()
    blocks = max(1, -(-rows.shape[1] // ROW_BLOCK))
    if blocks > 1:
        rows = torch.nn.functional.pad(rows, (0, blocks * ROW_BLOCK - rows.shape[1]))
    return rows.square().reshape(len(rows), blocks, rows.shape[1] // blocks).sum(-1)


def _shard_rows(g: torch.Tensor) -> Optional[tuple]:
    """Where a DTensor gradient's local rows sit: (global index of the first, global row count), or None when every
    rank holds every row (replicated). FSDP2 shards dim 0 over a 1-D mesh as torch.chunk splits it: ceil(rows / N)
    rows per rank, the last ranks fewer or none."""
    from torch.distributed.tensor import Replicate, Shard

    if all(p == Replicate() for p in g.placements):
        return None
    if g.device_mesh.ndim != 1 or g.placements != (Shard(0),):
        raise ValueError(f"clip_grad_norm: gradients placed as {g.placements} on a {g.device_mesh.ndim}-D mesh")
    rows, held = g.shape[0], g.to_local().shape[0]
    per = -(-rows // g.device_mesh.size())
    start = min(g.device_mesh.get_local_rank() * per, rows)
    if held != min(per, rows - start):
        raise ValueError(f"clip_grad_norm: a shard of {held} rows where torch.chunk puts {min(per, rows - start)}")
    return start, rows


def is_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor: a parameter (or its gradient, or a clone of it) that FSDP shards over the ranks."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def fsdp_mesh(device: torch.device):
    """The 1-D device mesh FSDP shards over: every rank. A single process gets a process group of its own, so that
    `--fsdp` runs the same code at any world size (a resume on 1 rank of a run sharded over N reads its checkpoint)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:  # torchrun --nproc-per-node 1
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Concatenate equally-shaped tensors from all ranks along dim 0, in rank order."""
    if not dist.is_initialized():
        return x
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out)


def check_same_on_all_ranks(params: Sequence[torch.Tensor]):
    """Trainable weights must start identical on every rank (seeding alone is not a guarantee)."""
    if not dist.is_initialized():
        return
    checksum = torch.stack([p.detach().double().sum() for p in params]).sum().view(1)
    # NCCL gathers CUDA tensors only; the weights may still be on the CPU (--fsdp shards them from there)
    gathered = all_gather_cat(checksum.to("cuda" if dist.get_backend() == "nccl" else "cpu"))
    if not torch.allclose(gathered, gathered[0].expand_as(gathered), rtol=0, atol=0):
        raise UserError(f"trainable weights differ across ranks at start (checksums {gathered.tolist()})")


def batch_layout(total: int, grad_steps: int, world_size: int, micro_batch: int) -> int:
    """Checks the epoch's batch geometry; returns the per-rank samples per optimizer step.

    The epoch's `total` samples are cut into `grad_steps` contiguous chunks (one optimizer step each) and every
    chunk into `world_size` contiguous slices (one per rank), each a whole number of micro-batches."""
    if total % (grad_steps * world_size):
        raise UserError(
            f"grad_steps_per_epoch x world size ({grad_steps} x {world_size}) must divide the images per epoch ({total})"
        )
    per_rank_step = total // (grad_steps * world_size)
    if per_rank_step % micro_batch:
        raise UserError(f"micro_batch ({micro_batch}) must divide the per-rank images per optimizer step ({per_rank_step})")
    return per_rank_step


def rank_indices(total: int, grad_steps: int, world_size: int, rank: int) -> torch.Tensor:
    """The global sample indices a rank works on, in its processing order (see `batch_layout`).

    With this layout optimizer step s averages the same samples on any number of ranks, and a rank's micro-batch
    is always one of the single-process micro-batches, so N ranks compute what one process computes."""
    step = total // grad_steps
    per = step // world_size
    return torch.cat([torch.arange(s * step + rank * per, s * step + (rank + 1) * per) for s in range(grad_steps)])


def gather_samples(x: torch.Tensor, total: int, grad_steps: int) -> torch.Tensor:
    """All ranks' per-sample values (laid out by `rank_indices`) -> the epoch's [total] tensor in global order."""
    if not dist.is_initialized():
        return x
    world = dist.get_world_size()
    gathered = all_gather_cat(x)
    order = torch.cat([rank_indices(total, grad_steps, world, r) for r in range(world)]).to(gathered.device)
    out = torch.empty_like(gathered)
    out[order] = gathered
    return out


def gather_scores(scores: dict, total: int, grad_steps: int) -> dict:
    """`gather_samples` for every reward of a {name: [local B]} dict (on the CPU, where the rewards' statistics run)."""
    out = {}
    for name, value in scores.items():
        if dist.is_initialized() and dist.get_backend() == "nccl":
            value = value.cuda()
        out[name] = gather_samples(value.float(), total, grad_steps).cpu()
    return out


def cleanup_distributed():
    if dist.is_initialized():
        dist.barrier()  # without it a rank can abort at exit while another is still tearing down
        dist.destroy_process_group()
