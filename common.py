"""Shared plumbing for the cleanflow algorithms: model loading, the flow-matching sampler, prompts, rewards, runs.

Algorithm math (advantage weighting, losses, KL terms, update schedules) lives in `algos/<algo>.py`; this file only
holds what every algorithm needs in the same form.

Conventions, used everywhere in cleanflow:
  * sigma in [0, 1]; sigma = 1 is pure noise, sigma = 0 is data.
  * x_t = (1 - sigma) x0 + sigma eps, and the model predicts the velocity v = eps - x0.
  * Hence x0_hat = x_t - sigma v and eps_hat = x_t + (1 - sigma) v. SD3 takes timestep = 1000 sigma.
  * One Euler step from sigma to sigma_next (< sigma) is x_next = x + (sigma_next - sigma) v.
  * Per-step log-probs are means over the latent elements (as in Flow-Factory), so they are O(1) whatever the
    resolution and PPO clip ranges on exp(logp - logp_old) are small (~1e-4 .. 1e-2).
"""

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import inspect
import json
import math
import os
import random
import shlex
import shutil
import sys
import threading
import time
import types
import typing
import weakref
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent
TINY_MODEL = str(REPO / "assets" / "tiny-shapes")
TRAIN_PROMPTS = str(REPO / "assets" / "train.jsonl")
TEST_PROMPTS = str(REPO / "assets" / "test.jsonl")
DYNAMICS = ("ODE", "Flow-SDE", "Dance-SDE", "CPS")


class UserError(ValueError):
    """Bad input from the user: reported as one line, without a traceback (see `run_main`)."""


def run_main(main, args, argv: Optional[Sequence[str]] = None):
    """Run `main(args)`, turning `UserError` into a one-line message and exit code 2, and Ctrl-C before training
    (while the model loads; after that `GracefulStop` handles it) into one line and exit code 130.

    `argv`: the command line `args` was parsed from (default `sys.argv[1:]`); `start_run` reads from it which flags
    were given, to compare them with a resumed run's."""
    import signal

    _CLI["argv"] = list(sys.argv[1:] if argv is None else argv)
    try:
        check_integrations(args)
        main(args)
        if _RUN.get("stop_signal") == signal.SIGTERM:
            # stopped by a scheduler (Slurm, Kubernetes) after a clean checkpoint: 128 + signal, as a process killed by
            # it would report, so that the scheduler does not take the run for finished
            sys.exit(128 + signal.SIGTERM)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
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


def short(text: str, n: int = 80) -> str:
    """`text` quoted, cut to `n` characters for one-line error messages."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


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


def setup_distributed(device: Optional[str] = None) -> Dist:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
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
    gathered = all_gather_cat(checksum.to(params[0].device))
    if not torch.allclose(gathered, gathered[0].expand_as(gathered), rtol=0, atol=0):
        raise UserError(f"trainable weights differ across ranks at start (checksums {gathered.tolist()})")


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


def keyed_generator(*key) -> torch.Generator:
    """A CPU generator seeded by what its draws are for, e.g. (seed, epoch, "rollout", global sample index).

    Every random draw of a training epoch comes from such a keyed stream rather than from one stream that each rank
    consumes in its own order, so a run draws the same numbers on 1 or N ranks, and after a resume."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def keyed_generators(*key, indices: Sequence[int]) -> list:
    """One keyed generator per index: `keyed_generators(seed, epoch, "rollout", indices=idx)`."""
    return [keyed_generator(*key, int(i)) for i in indices]


def randn(shape: Sequence[int], generator) -> torch.Tensor:
    """Standard normal [B, *shape[1:]] on the CPU from one generator, or one row per generator from a list of them."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {shape[0]}")
        return torch.stack([torch.randn(tuple(shape[1:]), generator=g) for g in generator])
    return torch.randn(tuple(shape), generator=generator)


def cleanup_distributed():
    if dist.is_initialized():
        dist.barrier()  # without it a rank can abort at exit while another is still tearing down
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# model: a diffusers flow-matching pipeline (the family's differences live in models/), LoRA via peft, reference = adapter off
# ----------------------------------------------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Family:
    """What one model family changes in the sampler; each `models/<family>.py` fills one (common never imports models/).

    `pipe` below is the diffusers pipeline. `encode(pipe, prompts, device, max_sequence_length)` -> (embeds [B, L, D],
    extra [B, ...]), one record per prompt: `extra` is the family's second text input, CLIP's pooled vector (SD3,
    FLUX.1), a token mask (families with variable-length text) or an empty [B, 0]. `velocity(transformer, x, sigma [B],
    embeds, extra, neg, guidance_scale)` -> v = eps - x0 (fp32, x's shape), CFG included; `neg` = the negative prompt's
    (embeds, extra). `latent_shape(pipe, height, width, num_frames)` (pixels and frames, None: the model's default) ->
    what the sampler draws for one sample (the family's own layout, e.g. FLUX.2's patchified, normalised latents);
    `tokens(latent_shape)` -> image tokens (for the shift); `mu(scheduler config, tokens, num_steps)` -> the dynamic
    shift's mu; `decode(pipe, latents)` -> images in [-1, 1], [B, 3, H, W] (video: [B, F, 3, H, W]);
    `max_sequence_length(pipe, requested or None)` -> text tokens encoded;
    `load_kwargs(local folder or None)` -> extra `from_pretrained` keywords; `lora_targets`: the attention projections
    the scripts adapt when `--lora-targets` is not given (peft names: a module name or its dotted suffix; tested);
    `num_frames`: a video family's default frames per video (None: an image family); `check(config, args)`: the
    family's checks of the scripts' flags against the pipeline's model_index.json (`pipeline_config`), before loading;
    `scheduler(pipe)`: the Euler flow-matching scheduler to sample with where the pipeline ships another (Wan's UniPC);
    `encode_negative`: `encode` for the negative prompt, where the pipeline encodes it differently (Sana: no instruction);
    `text_length(pipe, prompts, max_sequence_length)` -> the text length a batch is encoded at, for families whose
    embedding of a prompt depends on the rest of its batch (CogView4: GLM sees the batch's padding, unmasked); `encode`
    then takes it as `length=` and `PromptEncoder` caches per (prompt, length)."""

    name: str
    pipelines: tuple
    transformer: str
    encode: Callable
    velocity: Callable
    latent_shape: Callable
    decode: Callable
    max_sequence_length: Callable
    tokens: Callable = lambda shape: 0
    mu: Optional[Callable] = None
    load_kwargs: Callable = lambda local: {}
    lora_targets: tuple = ("to_q", "to_k", "to_v", "to_out.0")
    scheduler: Optional[Callable] = None  # (pipe) -> the flow-matching scheduler to sample with, if not the pipeline's
    encode_negative: Optional[Callable] = None  # like `encode`, for the negative prompt where the pipeline encodes it apart
    text_length: Optional[Callable] = None  # (pipe, prompts, max_sequence_length) -> a batch's text length (see above)
    card: Optional[Callable] = None  # (Model, call, settings) -> (setup lines, call, output): see `card_call`
    num_frames: Optional[int] = None  # video families: frames per video by default
    check: Optional[Callable] = None  # (model_index.json as a dict, args) -> None, raises UserError


FAMILIES: dict = {}  # pipeline class name -> Family, filled by `import models` (register); common never imports models/


def register(family: Family):
    for name in family.pipelines:
        FAMILIES[name] = family


def family_of(transformer) -> Family:
    """The family whose transformer class `transformer` is (LoRA wraps its layers in place; the class stays)."""
    name = type(transformer).__name__
    for family in FAMILIES.values():
        if family.transformer == name:
            return family
    raise UserError(
        f"no model family for {name}; `import models` registers them ({', '.join(sorted(FAMILIES)) or 'none yet'})"
    )


@dataclass
class Model:
    """What `load_pipeline` returns: the diffusers pipeline and the state the sampler needs, kept here rather than
    on the pipeline's objects. Attributes it does not hold (vae, text encoders, tokenizers) are the pipeline's."""

    pipe: object  # the diffusers pipeline
    family: Family
    transformer: torch.nn.Module
    scheduler: object
    latent_shape: tuple  # one sample's latents as the sampler draws them, e.g. SD3 [C, h, w]

    def __getattr__(self, name):  # only called for names the record does not have
        if name == "pipe":
            raise AttributeError(name)
        return getattr(self.pipe, name)

    def __call__(self, *args, **kwargs):
        """The pipeline's own `__call__` (the reference the tests compare the sampler with)."""
        return self.pipe(*args, **kwargs)

    @property
    def tokens(self) -> int:
        return self.family.tokens(self.latent_shape)

    def sigmas(self, num_steps: int, device=None, schedule: str = "pipeline") -> torch.Tensor:
        """The sampler's sigma schedule at this model's resolution (see `sigma_schedule`)."""
        mu = mu_for(self.family, self.scheduler, self.latent_shape, num_steps)
        return sigma_schedule(self.scheduler, num_steps, device, mu, schedule)


def pipeline_config(model: str) -> dict:
    """A local folder's model_index.json; for a hub id (not downloaded before loading) only its guessed `_class_name`."""
    local = Path(model).expanduser()
    try:
        return json.loads((local / "model_index.json").read_text())
    except (OSError, ValueError):
        try:
            return {"_class_name": pipeline_class(model)}
        except UserError:
            return {}  # load_pipeline reports it


def pipeline_class(model: str) -> str:
    """The pipeline class of a local folder (model_index.json's `_class_name`) or, for a hub id, a guess from its name."""
    local = Path(model).expanduser()
    if (local / "model_index.json").is_file():
        return read_model_index(local, model).get("_class_name", "")
    name = model.lower()
    for key, cls in HUB_NAMES:
        if key in name:
            return cls
    raise UserError(
        f"model {model!r}: cannot tell its family from the name; download it and pass the folder "
        f"(its model_index.json names the pipeline class)"
    )


def read_model_index(local: Path, model: str) -> dict:
    """A local pipeline folder's model_index.json, or one line saying why it cannot be read."""
    path = local / "model_index.json"
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UserError(f"model {model!r}: {path} is not valid JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(index, dict):
        raise UserError(f"model {model!r}: {path} is not a JSON object")
    return index


def check_model_folder(local: Path, model: str):
    """Before the model loads: the folder's pipeline class is a registered family's, and the transformer it holds is
    that family's (a class name over another family's parts loads, then fails at the first prompt)."""
    index = read_model_index(local, model)
    cls = index.get("_class_name", "")
    if cls not in FAMILIES:
        raise UserError(
            f"model {model!r}: pipeline class {cls!r} is not a supported family "
            f"({', '.join(sorted(FAMILIES)) or 'none registered: import models'})"
        )
    entry, want = index.get("transformer"), FAMILIES[cls].transformer
    got = entry[1] if isinstance(entry, list) and len(entry) == 2 else entry
    if got != want:
        raise UserError(
            f"model {model!r}: model_index.json names {cls}, whose transformer is {want}, but the folder holds {got}"
        )


# hub id substring -> pipeline class, first match wins (for hub ids without a local folder)
HUB_NAMES = (
    ("flux.2-klein", "Flux2KleinPipeline"),
    ("flux.2", "Flux2Pipeline"),
    ("flux", "FluxPipeline"),
    ("qwen-image", "QwenImagePipeline"),
    ("z-image", "ZImagePipeline"),
    ("wan2", "WanPipeline"),
    ("sana_sprint", "SanaSprintPipeline"),
    ("sana", "SanaPipeline"),
    ("lumina-image-2", "Lumina2Pipeline"),
    ("cogview4", "CogView4Pipeline"),
    ("stable-diffusion-3", "StableDiffusion3Pipeline"),
    ("sd3", "StableDiffusion3Pipeline"),
)


def load_pipeline(
    model: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    resolution: Optional[int] = None,
    *,
    height: Optional[int] = None,
    width: Optional[int] = None,
    num_frames: Optional[int] = None,
):
    """Load a flow-matching pipeline of a registered family from a local folder or a hub id, frozen, in eval mode.

    The family comes from the folder's model_index.json (`_class_name`), or for a hub id from its name (`HUB_NAMES`).
    `height` x `width` (pixels; each defaults to `resolution`, then to the model's native size) and a video family's
    `num_frames` set the returned `Model.latent_shape`, what the sampler draws, in the family's layout; the
    resolution-dependent shift of some families follows from it (`Model.sigmas`).
    """
    import transformers

    local = Path(model).expanduser()
    looks_local = local.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1
    if looks_local and not (local / "model_index.json").exists():
        raise UserError(f"model {model!r}: no such pipeline folder (expected {local / 'model_index.json'})")
    cls = pipeline_class(model)
    if cls not in FAMILIES:
        raise UserError(
            f"model {model!r}: pipeline class {cls!r} is not a supported family "
            f"({', '.join(sorted(FAMILIES)) or 'none registered: import models'})"
        )
    family = FAMILIES[cls]
    if num_frames is not None and family.num_frames is None:
        raise UserError(f"--num-frames {num_frames}: {cls} makes images, not videos")
    verbosity = transformers.logging.get_verbosity()
    # importing the pipelines warns about torchvision for SD3's unused image encoder
    transformers.logging.set_verbosity_error()
    try:
        import diffusers

        pipeline = getattr(diffusers, cls)
    finally:
        transformers.logging.set_verbosity(verbosity)
    try:
        pipe = pipeline.from_pretrained(
            str(local) if looks_local else model,
            dtype=dtype,
            local_files_only=looks_local,
            **family.load_kwargs(local if looks_local else None),
        )
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"model {model!r} could not be loaded ({first}); pass a local pipeline folder or a reachable hub id")
    pipe.set_progress_bar_config(disable=True)
    shape = family.latent_shape(pipe, height or resolution, width or resolution, num_frames or family.num_frames)
    for m in pipe.components.values():
        if isinstance(m, torch.nn.Module):
            m.requires_grad_(False).eval()
    pipe = pipe.to(device)
    return Model(pipe, family, pipe.transformer, family.scheduler(pipe) if family.scheduler else pipe.scheduler, tuple(shape))


def latent_side(resolution: Optional[int], native: int, factor: int, patch: int) -> int:
    """Latent side for `resolution` pixels (None: `native` latents) with VAE factor `factor` and transformer patch
    `patch`; the families' shared resolution check."""
    if resolution is None:
        return native
    if resolution % (factor * patch) or resolution // factor < patch:
        raise UserError(f"resolution {resolution} must be a multiple of {factor * patch}")
    return resolution // factor


def add_lora(transformer, rank: int, alpha: float, target_modules: Optional[Sequence[str]]) -> list:
    """Attach a peft LoRA adapter; returns its parameters, kept in fp32 whatever the base dtype (master weights).
    `target_modules` None: the family's `lora_targets`."""
    from peft import LoraConfig

    target_modules = family_of(transformer).lora_targets if target_modules is None else target_modules
    try:
        transformer.add_adapter(
            LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(target_modules))
        )
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(
            f"--lora-targets {' '.join(target_modules)}: no LoRA could be attached to "
            f"{type(transformer).__name__} ({first[:200]})"
        )
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    return params


def enable_gradient_checkpointing(transformer):
    """Recompute each transformer block's activations in the backward pass instead of keeping them: activation
    memory of one block instead of all (FLUX.1 has 57), for about one more forward per training step.

    diffusers checkpoints every block with non-reentrant `torch.utils.checkpoint`, so the LoRA weights inside a block
    get their gradients although the block's inputs need none, and only forwards with grad enabled are affected
    (sampling under no_grad runs as before). The loss and gradients are unchanged."""
    if not getattr(transformer, "_supports_gradient_checkpointing", False):
        raise UserError(f"{type(transformer).__name__} does not support gradient checkpointing")
    transformer.enable_gradient_checkpointing()


def compile_unavailable(device) -> Optional[str]:
    """Why `torch.compile` cannot run on `device` here, or None: inductor's CPU code is C++ built by the machine's
    compiler at first use, and its GPU code needs triton."""
    if torch.device(device).type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as e:  # inductor raises RuntimeError when no C++ compiler is on PATH (or $CXX is wrong)
            return f"no C++ compiler for inductor's CPU code ({short(str(e).strip(), 120)})"
    elif torch.device(device).type == "cuda":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "inductor's GPU code needs triton (pip install triton)"
    return None


def compile_transformer(transformer) -> int:
    """Regional compilation (diffusers' advice): `torch.compile` each repeated transformer block rather than the whole
    model, so one block's graph is compiled once and reused by its siblings, and the code between blocks stays eager.
    Uses diffusers' `compile_repeated_blocks` where the model class names its blocks (`_repeated_blocks`; SD3's list is
    empty in diffusers 0.42), else compiles each module of the transformer's `*blocks` lists. In place: parameter names,
    LoRA, checkpoints and the export are unchanged. Compilation happens at the first call of each new input shape or
    mode (sampling, training with grad, the reference model, eval's batch); the first call's time is printed once.
    Returns the number of blocks compiled."""
    if getattr(transformer, "_repeated_blocks", None):
        transformer.compile_repeated_blocks()
        blocks = [m for m in transformer.modules() if type(m).__name__ in transformer._repeated_blocks]
    else:
        blocks = [
            block
            for name, child in transformer.named_children()
            if isinstance(child, torch.nn.ModuleList) and name.endswith("blocks")
            for block in child
        ]
        for block in blocks:
            block.compile()
    if not blocks:
        raise UserError(f"--compile: {type(transformer).__name__} has no transformer block lists to compile")
    start = {}

    def before(module, args, kwargs):
        start["t"] = time.perf_counter()

    def after(module, args, kwargs, output):
        from tqdm import tqdm

        seconds = time.perf_counter() - start["t"]
        tqdm.write(f"--compile: the first transformer call compiled {len(blocks)} blocks in {seconds:.1f} s")
        for hook in hooks:
            hook.remove()

    hooks = [
        transformer.register_forward_pre_hook(before, with_kwargs=True),
        transformer.register_forward_hook(after, with_kwargs=True),
    ]
    return len(blocks)


@contextlib.contextmanager
def reference_model(transformer):
    """The frozen base model: the same transformer with its LoRA adapter disabled."""
    transformer.disable_adapters()
    try:
        yield transformer
    finally:
        transformer.enable_adapters()


@contextlib.contextmanager
def swapped_weights(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
    """Temporarily load other values (an EMA or a snapshot) into the trainable parameters."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


class EvalEMA:
    """An EMA of the trainable weights kept only for evaluation (the papers' protocol: flow_grpo, DiffusionNFT, AWM and
    DGPO all report an EMA of the weights); training never sees it. decay 0 = off: `swapped()` is a no-op.

    `update(step)` after optimizer step `step` (counted from 1): e <- d e + (1 - d) p with d = min(decay, (1 + step) /
    (10 + step)), flow_grpo's warm-up (flow_grpo/ema.py), so early evaluations are not dominated by the initial weights.
    Only at the steps with (step + 1) % interval == 0 (flow_grpo/ema.py `update_step_interval`), and there `repeats`
    times: flow_grpo's and DGPO's training loops call `ema.step(global_step)` after every micro-batch, so an update
    step gets one update per micro-batch of its optimizer step (2 in flow_grpo's 32-GPU SD3.5 configs: decay 0.9 at
    interval 8 then averages 0.974 per step; 4 in DGPO's 4-GPU PickScore one: 0.949 per step).
    """

    def __init__(self, params: Sequence[torch.Tensor], decay: float, interval: int = 1, repeats: int = 1):
        if not 0 <= decay < 1:
            raise UserError(f"eval_ema_decay must be in [0, 1) (0 = off), got {decay}")
        if interval < 1 or repeats < 1:
            raise UserError(f"eval_ema_interval and eval_ema_repeats must be >= 1, got {interval} and {repeats}")
        self.params, self.decay, self.interval, self.repeats = list(params), decay, interval, repeats
        self.shadow = [p.detach().clone() for p in self.params] if decay > 0 else []

    @torch.no_grad()
    def update(self, step: int):
        if (step + 1) % self.interval:
            return
        d = min(self.decay, (1 + step) / (10 + step))
        for _ in range(self.repeats):
            for e, p in zip(self.shadow, self.params):
                e.lerp_(p.detach(), 1 - d)

    def swapped(self):
        return swapped_weights(self.params, self.shadow) if self.shadow else contextlib.nullcontext()

    def state(self) -> Optional[list]:
        return [e.cpu() for e in self.shadow] if self.shadow else None

    def export(self) -> dict:
        """`export_lora`'s keywords: the EMA is what evaluation reports, so it is also what users get."""
        return {"weights": self.shadow, "weights_name": f"the eval EMA (decay {self.decay})"} if self.shadow else {}

    @torch.no_grad()
    def load(self, state: Optional[list]):
        """Restore a saved EMA; a checkpoint without one (EMA off when it was written) restarts it from the weights."""
        for e, p, v in zip(self.shadow, self.params, state or [None] * len(self.shadow)):
            e.copy_(p if v is None else v)


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast for forwards (trainable weights stay fp32); a no-op context when disabled."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


# ----------------------------------------------------------------------------------------------------------------
# text, velocity, decode
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cond:
    """The text conditioning of a batch, as `PromptEncoder.cond` returns it: the prompts' token embeddings and the
    family's second text input (`pooled`, see `PromptEncoder`), and the same two of the negative prompt for CFG (None
    when no CFG is needed). `cond[i]` (an index, slice or index tensor) takes those samples of every field."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    neg_embeds: Optional[torch.Tensor] = None
    neg_pooled: Optional[torch.Tensor] = None

    def __getitem__(self, idx) -> "Cond":
        return Cond(*(None if t is None else t[idx] for t in (self.embeds, self.pooled, self.neg_embeds, self.neg_pooled)))

    @property
    def neg(self) -> Optional[tuple]:
        """The negative prompt's (embeds, pooled), the form the model families take; None without one."""
        return None if self.neg_embeds is None else (self.neg_embeds, self.neg_pooled)


class PromptEncoder:
    """Encodes prompts once and caches (embeds, extra) per prompt; the negative prompt for CFG is "" by default.

    embeds are the token embeddings the transformer attends to and extra the family's second text input (`Family`):
    SD3: CLIP-L/G + T5 concatenated, and both CLIPs' pooled projections; FLUX.1: T5, and CLIP-L's pooled output;
    families with variable-length text: their token mask, the embeddings zero-padded to the batch's longest prompt.
    `max_sequence_length` (text tokens): the family's default (SD3 128, FLUX.1 512 capped at the T5 tokenizer's
    maximum). `cache_device` holds the cache (default: the transformer's device; "cpu" for large prompt sets, e.g.
    FLUX keeps 512 x 4096 values per prompt) and lookups move it to that device.
    """

    def __init__(self, pipe, max_sequence_length: Optional[int] = None, negative_prompt: str = "", cache_device=None):
        self.pipe, self.family = pipe.pipe, pipe.family
        self.max_sequence_length = self.family.max_sequence_length(self.pipe, max_sequence_length)
        self.negative_prompt = negative_prompt
        self.device = pipe.transformer.device
        self.cache_device = torch.device(cache_device) if cache_device is not None else self.device
        self.cache = {}

    def text_encoders(self) -> list:
        return [m for n, m in sorted(self.pipe.components.items()) if n.startswith("text_encoder") and m is not None]

    @torch.no_grad()
    def _encode(self, prompts: Sequence[str], length: Optional[int] = None):
        """Encode `prompts` as one batch into the cache (at text `length`, cached per (prompt, length), if given)."""
        # encode where the text encoders are (the CPU after `offload`), so pass their device, not the pipeline's
        device = self.text_encoders()[0].device
        kwargs = {} if length is None else {"length": length}
        e, p = self.family.encode(
            self.pipe, list(prompts), device, self.max_sequence_length, **kwargs
        )  # a copy: Z-Image edits it
        for i, prompt in enumerate(prompts):
            self.cache[prompt if length is None else (prompt, length)] = (
                e[i].to(self.cache_device),
                p[i].to(self.cache_device),
            )

    def __call__(self, prompts: Sequence[str]):
        # a prompt not cached is encoded alone: the text encoders' output depends (~1e-6) on the batch it is computed in,
        # so batching the prompts that happen to be new would make an embedding depend on the run's history and a
        # resumed run (empty cache) drift from the uninterrupted one. Alone costs ~4 ms/prompt on tiny-text (CPU).
        length = self.family.text_length(self.pipe, prompts, self.max_sequence_length) if self.family.text_length else None
        keys = list(prompts) if length is None else [(p, length) for p in prompts]
        for key in dict.fromkeys(k for k in keys if k not in self.cache):
            self._encode([key if length is None else key[0]], length)
        embeds = pad_stack([self.cache[k][0] for k in keys]).to(self.device)
        extra = pad_stack([self.cache[k][1] for k in keys]).to(self.device)
        return embeds, extra

    def cond(self, prompts: Sequence[str], negative: bool = True) -> Cond:
        """The prompts' `Cond`, with the negative prompt repeated for each (for CFG) unless `negative` is False."""
        embeds, pooled = self(prompts)
        return Cond(embeds, pooled, *(self.negative(len(prompts)) if negative else (None, None)))

    def negative(self, batch: int):
        if self.family.encode_negative is None:
            e, p = self([self.negative_prompt])
        else:  # encoded the family's own way, cached apart from the same text as a prompt
            key = ("negative", self.negative_prompt)
            if key not in self.cache:
                with torch.no_grad():
                    e, p = self.family.encode_negative(
                        self.pipe, [self.negative_prompt], self.text_encoders()[0].device, self.max_sequence_length
                    )
                self.cache[key] = (e[0].to(self.cache_device), p[0].to(self.cache_device))
            e, p = (t[None].to(self.device) for t in self.cache[key])
        return e.expand(batch, *e.shape[1:]), p.expand(batch, *p.shape[1:])

    def precompute(self, prompts: Sequence[str], batch: int = 64):
        """Cache every prompt (and the negative prompt) now, `batch` at a time, e.g. before `offload`.

        Called once at start with the run's whole prompt set (4000 tiny-text prompts: 2.5 s on CPU, vs 16 s one by one);
        these embeddings differ from one-by-one ones by ~1e-6, so a run keeps its `--offload-text-encoders` on resume.
        A family with `text_length` (CogView4) caches each prompt at its own length: a batch with a longer prompt
        encodes the shorter ones again at that length (on the CPU after `offload`)."""
        prompts = [self.negative_prompt, *dict.fromkeys(prompts)]
        if self.family.text_length is not None:  # a batch's embeddings depend on it: each prompt alone, at its own length
            for prompt in prompts:
                self([prompt])
            return
        for k in range(0, len(prompts), batch):  # fixed chunks of a fixed list: the same embeddings in every run and resume
            self._encode(prompts[k : k + batch])
        if self.family.encode_negative is not None:  # the negative prompt encoded the family's own way, cached too
            self.negative(1)

    def offload(self):
        """Move the text encoders to the CPU (FLUX's and SD3's T5-XXL is ~9 GB in bf16), typically after `precompute`
        of the train and test prompts. Cached prompts are unaffected; a prompt not cached still works, encoded on
        the CPU (slowly)."""
        for m in self.text_encoders():
            m.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def capped_tokens(requested: Optional[int], default: int, maximum: int) -> int:
    """A family's `max_sequence_length`: --max-sequence-length (None: the pipeline's `default`, capped at the
    tokenizer's `maximum`); more than `maximum` is refused, not cut silently."""
    if requested is not None and requested > maximum:
        raise UserError(f"--max-sequence-length {requested}: this model's tokenizer takes at most {maximum} tokens")
    return min(requested or default, maximum)


def pad_stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack per-prompt tensors, zero-padding dim 0 (text tokens) to the longest: a no-op for fixed-length families;
    for variable-length ones the padded tokens are masked out by the mask in `extra`, padded the same way."""
    n = max(t.shape[0] for t in tensors)
    return torch.stack([t if t.shape[0] == n else torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])]) for t in tensors])


def cfg(v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance: v_uncond + g (v_cond - v_uncond)."""
    return v_uncond + guidance_scale * (v_cond - v_uncond)


_DTYPES = weakref.WeakKeyDictionary()  # transformer -> its compute dtype (see `model_dtype`)


def model_dtype(transformer) -> torch.dtype:
    """`transformer.dtype`, read once per model: diffusers' property walks every submodule and parameter on each read
    (~1 ms on the tiny model with LoRA, ~2% of a sampling step). The base dtype is fixed when `load_pipeline` loads the
    model, so the first answer stays right; a model cast to another dtype afterwards needs `_DTYPES.pop(transformer)`."""
    if transformer not in _DTYPES:
        _DTYPES[transformer] = transformer.dtype
    return _DTYPES[transformer]


def velocity(transformer, x, sigma, cond: Cond, guidance_scale: float = 1.0) -> torch.Tensor:
    """One transformer call v(x, sigma | text) on latents x in the family's layout (`Model.latent_shape`, batched).
    Returns fp32 like x. `cond` is the batch's text (`Cond`); its negative prompt is used for CFG (scale > 1); the
    family's own guidance mode applies (see models/<family>.py)."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0])
    return family_of(transformer).velocity(transformer, x, sigma, cond.embeds, cond.pooled, cond.neg, guidance_scale)


@torch.no_grad()
def decode(pipe, latents: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Latents -> images in [0, 1], float32 [B, 3, H, W] (video: [B, F, 3, H, W]); decoded in chunks to bound memory."""
    out = [pipe.family.decode(pipe.pipe, z).float() for z in latents.split(chunk)]
    return (torch.cat(out) / 2 + 0.5).clamp(0, 1)


def vae_decode(pipe, z: torch.Tensor) -> torch.Tensor:
    """SD3's and FLUX.1's VAE un-normalisation and decode: z / scaling_factor + shift_factor."""
    vae = pipe.vae
    z = z / vae.config.scaling_factor + (getattr(vae.config, "shift_factor", None) or 0.0)
    return vae.decode(z.to(vae.dtype), return_dict=False)[0]


def euler_scheduler(pipe):
    """`Family.scheduler` for pipelines released with a multistep flow solver (Wan's UniPC, Sana's DPM-Solver): the
    Euler flow-matching scheduler at the same static `flow_shift`, which the sampler's SDE steps need."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
        return pipe.scheduler
    return FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.get("flow_shift", 3.0))


def linear_mu(config, tokens: int, num_steps: int) -> float:
    """FLUX.1's dynamic shift (FluxPipeline's `calculate_shift`): mu linear in the image's token count, 0.5 at 256
    tokens (512 px), 1.15 at 4096 (1024 px), from the scheduler config's base/max values."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(
        tokens,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def mu_for(family: Family, scheduler, latent_shape, num_steps: int) -> Optional[float]:
    """The dynamic shift's mu for one sample of `latent_shape`, or None for a scheduler with a static shift."""
    if not scheduler.config.get("use_dynamic_shifting", False):
        return None
    return (family.mu or linear_mu)(scheduler.config, family.tokens(tuple(latent_shape)), num_steps)


# ----------------------------------------------------------------------------------------------------------------
# the sampler
# ----------------------------------------------------------------------------------------------------------------
SIGMA_SCHEDULES = ("pipeline", "scheduler")


def sigma_schedule(
    scheduler, num_steps: int, device=None, mu: Optional[float] = None, schedule: str = "pipeline"
) -> torch.Tensor:
    """N+1 sigmas ending in 0. `schedule` "pipeline": linspace(1, 1/N, N) through the scheduler's shift (what the
    FLUX.1/FLUX.2/Qwen-Image/Lumina 2 pipelines pass, and Flow-Factory). "scheduler": the scheduler's own
    `set_timesteps(N)` (what StableDiffusion3Pipeline does with no sigmas, and flow_grpo, DiffusionNFT and AWM, which
    pass `sigmas=None`): linspace from sigma 1 to the shifted 1/1000, then the shift again. At 10 steps with shift 3
    that is 1, 0.960, ..., 0.278, 0.009, 0 against 1, 0.964, ..., 0.429, 0.250, 0, so its last step starts almost at
    the data.

    SD3 has a fixed shift. Schedulers with `use_dynamic_shifting` (FLUX.1, FLUX.2, Qwen-Image) shift by exp(mu), and the
    family computes mu from the image's token count (`mu_for`; `Model.sigmas` passes it for the run's resolution)."""
    import copy

    kwargs = {}
    if scheduler.config.get("use_dynamic_shifting", False):
        if mu is None:
            raise ValueError("a dynamically shifted schedule needs mu (common.mu_for); Model.sigmas passes it")
        kwargs["mu"] = mu
    if schedule not in SIGMA_SCHEDULES:
        raise UserError(f"unknown sigma schedule {schedule!r}; choose one of {', '.join(SIGMA_SCHEDULES)}")
    sched = copy.deepcopy(scheduler)  # set_timesteps mutates the scheduler; keep the pipeline's untouched
    if schedule == "scheduler":
        sched.set_timesteps(num_steps, device=device, **kwargs)
    else:
        sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps).tolist(), device=device, **kwargs)
    return sched.sigmas.float()


LOG_PROB_FORMS = ("gaussian", "mse")


def sde_step(
    x,
    v,
    sigma,
    sigma_next,
    dynamics: str,
    eta: float,
    noise=None,
    x_next=None,
    sigma_cap: Optional[float] = None,
    log_prob_form: str = "gaussian",
):
    """One step of the reverse process as a Gaussian policy N(mean, std^2 I) (Flow-Factory spec section 1).

    Returns (x_next, log_prob [B], mean, std). If `x_next` is given (training), it is scored instead of sampled.
    ODE and eta = 0 give the Euler step with std 0 and log_prob 0; so does every row whose std is 0 (e.g. a
    per-sample sigma_next = 0 under CPS) while the other rows keep theirs.
    `sigma_cap` guards Flow-SDE's 1/(1 - sigma) at sigma = 1. None (default): at sigma = 1 the factor uses
    sigma_next, which for the first step of a schedule is its second sigma, the value flow_grpo and Flow-Factory use
    (`sigma_max = sigmas[1]`); a float clamps sigma to it (0.99 gives 1.89x that first-step std on SD3.5 at 10 steps).
    `log_prob_form`: "gaussian", the exact log-density (per-element mean); "mse", the CPS authors' surrogate
    -mean (x_next - mean)^2 (also Flow-Factory's for CPS), whose log-ratios are those of "gaussian" times 2 std^2.
    """
    if log_prob_form not in LOG_PROB_FORMS:
        raise UserError(f"unknown log_prob_form {log_prob_form!r}; choose one of {', '.join(LOG_PROB_FORMS)}")
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=x.device)
    if sigma.dim() == 1:  # per-sample sigmas broadcast over the latent dims
        sigma, sigma_next = (s.view(-1, *([1] * (x.dim() - 1))) for s in (sigma, sigma_next))
    dt = sigma_next - sigma  # < 0
    x0_hat, eps_hat = x - sigma * v, x + (1 - sigma) * v
    if dynamics == "ODE" or eta == 0:
        mean, std = x + dt * v, torch.zeros_like(sigma)
    elif dynamics == "Flow-SDE":  # Flow-GRPO's SDE, sigma_t = eta sqrt(sigma / (1 - sigma))
        capped = torch.where(sigma >= 1, sigma_next, sigma) if sigma_cap is None else torch.clamp(sigma, max=sigma_cap)
        std_dev = eta * torch.sqrt(sigma / (1 - capped))
        mean = x + (v + std_dev**2 / (2 * sigma) * eps_hat) * dt
        std = std_dev * torch.sqrt(-dt)
    elif dynamics == "Dance-SDE":  # DanceGRPO: constant diffusion coefficient eta
        mean = x + (v + 0.5 * eta**2 * eps_hat / sigma) * dt
        std = eta * torch.sqrt(-dt) * torch.ones_like(sigma)
    elif dynamics == "CPS":  # coefficients-preserving sampling: re-noise x0_hat to sigma_next with a fresh-noise share
        std = sigma_next * math.sin(eta * math.pi / 2)
        mean = (1 - sigma_next) * x0_hat + torch.sqrt(sigma_next**2 - std**2) * eps_hat
    else:
        raise UserError(f"unknown dynamics {dynamics!r}; choose one of {', '.join(DYNAMICS)}")
    if x_next is None:
        x_next = mean if noise is None or not bool((std > 0).any()) else mean + std * noise
    live = (std > 0).reshape(-1).expand(x.shape[0]) if std.numel() == 1 else (std > 0).reshape(x.shape[0])  # [B]
    if not bool(live.any()):
        return x_next, torch.zeros(x.shape[0], device=x.device), mean, std
    dims = tuple(range(1, x.dim()))
    if log_prob_form == "mse":
        log_prob = -((x_next - mean) ** 2).mean(dim=dims)
    else:
        safe = torch.where(std > 0, std, torch.ones_like(std))  # no 0/0 in the rows masked below
        log_prob = (-((x_next - mean) ** 2) / (2 * safe**2) - torch.log(safe) - 0.5 * math.log(2 * math.pi)).mean(dim=dims)
    return x_next, torch.where(live, log_prob, torch.zeros_like(log_prob)), mean, std


@dataclass
class Rollout:
    latents: torch.Tensor  # [B, C, h, w] final clean latents x0
    sigmas: torch.Tensor  # [N + 1]
    trajectory: Optional[torch.Tensor] = None  # [B, N + 1, C, h, w]; position 0 is the initial noise
    log_probs: Optional[torch.Tensor] = None  # [B, N]; 0 at deterministic steps
    sde_mask: Optional[torch.Tensor] = None  # [N] bool, which steps were stochastic
    means: Optional[torch.Tensor] = None  # [B, N, C, h, w] the Gaussian steps' means (keep_means; GRPO-Guard)


@torch.no_grad()
def sample(
    transformer,
    scheduler,
    cond: Cond,
    *,
    num_steps: int = 10,
    guidance_scale: float = 1.0,
    dynamics: str = "ODE",
    eta: float = 0.7,
    sde_steps: Optional[Sequence[int]] = None,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
    keep_trajectory: bool = False,
    latent_shape: Optional[Sequence[int]] = None,
    use_autocast: bool = False,
    log_prob_form: str = "gaussian",
    keep_means: bool = False,
    chunk: Optional[int] = None,
    on_chunk: Optional[Callable] = None,
    schedule: str = "pipeline",
) -> Rollout:
    """Euler sampling from sigma = 1 to 0 with optional SDE steps; deterministic given `generator` (or `noise`).

    `sde_steps`: the step indices that get noise (the SDE window); None = every step but the last for SDE dynamics.
    Noise is drawn on the CPU from `generator` so a seed gives the same samples on any device; a list of generators
    (one per sample, see `keyed_generators`) makes each sample's noise independent of the rest of the batch.
    Latents are in the family's layout (`Model.latent_shape`, e.g. [B, C, h, w]; FLUX.1 packs them inside `velocity`).
    `log_prob_form`: see `sde_step`; `keep_means` also returns every step's mean.
    `chunk`: sample this many at a time (None: the whole batch at once), calling `on_chunk(latents, slice)` after each
    (a `Scorer` decodes and scores them while the next chunk is sampled). With one generator per sample the result is
    that of one batch (see `Scorer`): each sample's noise is its own.
    `schedule`: the sigma schedule, see `sigma_schedule`.
    """
    if dynamics not in DYNAMICS:
        raise UserError(f"unknown dynamics {dynamics!r}; choose one of {', '.join(DYNAMICS)}")
    device, batch = cond.embeds.device, cond.embeds.shape[0]
    if chunk is not None or on_chunk is not None:
        step = chunk or batch
        if step < batch and generator is not None and not isinstance(generator, (list, tuple)):
            raise ValueError("chunked sampling needs one generator per sample (keyed_generators): one stream would be cut")
        kwargs = dict(
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            dynamics=dynamics,
            eta=eta,
            sde_steps=sde_steps,
            keep_trajectory=keep_trajectory,
            latent_shape=latent_shape,
            use_autocast=use_autocast,
            log_prob_form=log_prob_form,
            keep_means=keep_means,
            schedule=schedule,
        )
        parts = []
        for start in range(0, batch, step):
            sl = slice(start, start + step)
            parts.append(
                sample(
                    transformer,
                    scheduler,
                    cond[sl],
                    generator=_rows(generator, sl),
                    noise=_rows(noise, sl),
                    **kwargs,
                )
            )
            if on_chunk is not None:
                on_chunk(parts[-1].latents, sl)
        return Rollout(
            **{
                f.name: getattr(parts[0], f.name)
                if f.name in ("sigmas", "sde_mask")
                else _cat([getattr(r, f.name) for r in parts])
                for f in dataclasses.fields(Rollout)
            }
        )
    if noise is None:
        shape = latent_shape or (
            transformer.config.in_channels,
            transformer.config.sample_size,
            transformer.config.sample_size,
        )
        noise = randn((batch, *shape), generator)
    x = noise.to(device=device, dtype=torch.float32)
    # a dynamic shift depends on the image's token count: take it from the latents actually sampled
    mu = mu_for(family_of(transformer), scheduler, x.shape[1:], num_steps)
    sigmas = sigma_schedule(scheduler, num_steps, device, mu, schedule)
    if dynamics == "ODE":
        sde_steps = []
    elif sde_steps is None:
        sde_steps = range(num_steps - 1)
    sde_mask = torch.zeros(num_steps, dtype=torch.bool)
    sde_mask[list(sde_steps)] = True
    traj, log_probs, means = [x], torch.zeros(batch, num_steps, device=device), []
    for i in range(num_steps):
        with autocast(device, use_autocast):
            v = velocity(transformer, x, sigmas[i], cond, guidance_scale)
        step_noise = randn(x.shape, generator).to(device) if sde_mask[i] else None
        x, log_probs[:, i], mean, _ = sde_step(
            x,
            v,
            sigmas[i],
            sigmas[i + 1],
            dynamics if sde_mask[i] else "ODE",
            eta,
            step_noise,
            sigma_cap=float(sigmas[1]),
            log_prob_form=log_prob_form,
        )
        if keep_trajectory:
            traj.append(x)
        if keep_means:
            means.append(mean)
    return Rollout(
        x,
        sigmas,
        torch.stack(traj, 1) if keep_trajectory else None,
        log_probs,
        sde_mask,
        torch.stack(means, 1) if keep_means else None,
    )


def _rows(value, sl: slice):
    """Rows `sl` of a batched input: a tensor, a list (of generators), a tuple of them (a negative prompt), or None."""
    if value is None or isinstance(value, torch.Generator):
        return value
    if isinstance(value, tuple):
        return tuple(_rows(v, sl) for v in value)
    return value[sl]


def _cat(values: list):
    return None if values[0] is None else torch.cat(values)


class Scorer:
    """Decodes and scores a rollout chunk by chunk, each in a worker thread while `sample` draws the next chunk
    (ddpo-pytorch's executor): `sample(..., chunk=scorer.chunk, on_chunk=scorer)`, then `images, scores = scorer.result()`.

    `chunk`: samples per chunk (the scripts' micro-batch; None: the whole batch as one chunk). `overlap` False
    (--no-overlap-reward): no worker thread; `result()` decodes and scores the same chunks after sampling. Both paths
    call the transformer, the VAE and the reward on identical chunks, so they are bit-identical on any CPU by
    construction: a CPU kernel may round differently for another batch size (on an AVX-512 Intel CPU GRPO's weights
    differed by 2.3e-6 after one epoch when the sequential path sampled the whole batch at once), never for the same one.
    One worker thread, so the reward is called once at a time, in sample order -- except that once sampling is over, a
    reward marked `thread_safe` (OCR, shapes) also runs in the main thread on the last waiting chunks, so a reward
    slower than sampling (OCR) uses both cores for its tail. On the CPU torch and onnxruntime release the GIL, so the
    worker uses a second core; on a GPU both threads queue kernels on the device. A reward error is raised in the
    caller, at the next chunk or at `result()`."""

    def __init__(
        self,
        pipe,
        reward_fn: Callable,
        prompts: Sequence[str],
        chunk: Optional[int] = None,
        overlap: bool = True,
        epoch: Optional[int] = None,
    ):
        self.pipe, self.reward_fn, self.prompts, self.chunk = pipe, reward_fn, list(prompts), chunk
        self.epoch = epoch  # epochs done before this rollout: a reward error names the epoch and how to go on
        self.pool = (
            None if chunk is None or not overlap else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward")
        )
        self.chunks, self.jobs = [], []  # the (latents, slice) of each chunk; with overlap, its future
        self.vae_lock = threading.Lock()  # the main thread may decode beside the worker once sampling is over (result)
        self.seconds = []  # time of each decode and reward call, in either thread (list.append is atomic)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        # one decode at a time: some VAEs keep state across a call (Wan's causal feature cache); grad mode is per thread
        with self.vae_lock, torch.no_grad():
            images = decode(self.pipe, latents)
        self.seconds.append(time.perf_counter() - t0)
        return images

    def _reward(self, images: torch.Tensor, sl: slice) -> tuple:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                scores = self.reward_fn(images, self.prompts[sl])
        except UserError as e:
            if self.epoch is None:
                raise
            raise UserError(f"{e} in epoch {self.epoch + 1}; {resume_hint()}") from None
        self.seconds.append(time.perf_counter() - t0)
        return images, scores

    def _score(self, latents: torch.Tensor, sl: slice) -> tuple:
        return self._reward(self._decode(latents), sl)

    def __call__(self, latents: torch.Tensor, sl: slice):
        self.chunks.append((latents, sl))
        if self.pool is None:
            return
        failed = next((job for job in self.jobs if job.done() and job.exception() is not None), None)
        if failed is not None:  # stop sampling at once when the reward failed
            self.pool.shutdown(cancel_futures=True)
            raise failed.exception()
        self.jobs.append(self.pool.submit(self._score, *self.chunks[-1]))

    def result(self) -> tuple:
        """(images [B, 3, H, W] in [0, 1], {reward name: [B]}) of every chunk, in sample order."""
        try:
            if self.pool is None:
                parts = [self._score(*chunk) for chunk in self.chunks]
            else:
                # sampling is over and the main thread would only wait: it decodes the chunks the worker has not
                # started, and the worker scores them, in order (when the reward is slower than sampling, e.g. OCR)
                waiting = [k for k, job in enumerate(self.jobs) if job.cancel()]
                # a reward that may run in two threads at once (`thread_safe`, e.g. OCR): the main thread scores the
                # last half of the waiting chunks itself (the last one when one waits), beside the worker, which still
                # finishes the chunk it is on; each chunk's numbers are the same in either thread
                mine = waiting[len(waiting) // 2 :] if getattr(self.reward_fn, "thread_safe", False) else []
                for k in waiting:
                    if k not in mine:
                        latents, sl = self.chunks[k]
                        self.jobs[k] = self.pool.submit(self._reward, self._decode(latents), sl)
                for k in mine:
                    self.jobs[k] = self._score(*self.chunks[k])
                parts = [job if isinstance(job, tuple) else job.result() for job in self.jobs]
        finally:
            if self.pool is not None:
                self.pool.shutdown(cancel_futures=True)
        if len(parts) == 1:
            return parts[0]
        images = torch.cat([p[0] for p in parts])
        return images, {name: torch.cat([p[1][name] for p in parts]) for name in parts[0][1]}


def resume_hint() -> str:
    """How the current run goes on after a failure: its last checkpoint, or that there is none yet."""
    run_dir = _RUN.get("run_dir")
    last = Path(run_dir or ".") / "checkpoints" / "last"
    if run_dir is None or not last.is_dir():
        return "no checkpoint was saved yet"
    return f"--resume {run_dir} goes on from its last checkpoint ({last.resolve().name})"


@torch.no_grad()
@torch.no_grad()
def dpm_solver_sample(
    transformer, scheduler, cond: Cond, noise: torch.Tensor, *, num_steps: int, guidance_scale: float = 1.0, use_autocast=False
) -> torch.Tensor:
    """ODE sampling with diffusers' DPMSolverMultistepScheduler (2nd-order DPM-Solver++ on flow sigmas, the Sana
    scheduler config that DGPO evaluates with, scripts/train_sd3_dgpo.py:557-559) at the pipeline scheduler's static
    shift; the model sees the scheduler's timestep t as sigma = t / 1000, as a stock pipeline passes it. Returns the
    final latents. Deterministic: no noise is drawn after `noise`."""
    from diffusers import DPMSolverMultistepScheduler

    if scheduler.config.get("use_dynamic_shifting", False):
        raise UserError("the DPM-Solver evaluation needs a scheduler with a static shift (SD3)")
    dpm = DPMSolverMultistepScheduler(
        num_train_timesteps=scheduler.config.get("num_train_timesteps", 1000),
        flow_shift=scheduler.config.get("shift", 1.0),
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        algorithm_type="dpmsolver++",
        solver_order=2,
        final_sigmas_type="zero",
        lower_order_final=True,
    )
    dpm.set_timesteps(num_steps, device=noise.device)
    x = noise.float()
    for t in dpm.timesteps:
        with autocast(noise.device, use_autocast):
            v = velocity(transformer, x, t.float() / dpm.config.num_train_timesteps, cond, guidance_scale)
        x = dpm.step(v.float(), t, x).prev_sample
    return x


def evaluate(
    pipe,
    transformer,
    encoder,
    prompts,
    reward_fn,
    *,
    num_steps,
    guidance_scale,
    seed,
    batch=32,
    use_autocast=False,
    repeats: int = 2,
    progress: bool = True,
    schedule: str = "pipeline",
    solver: str = "euler",
):
    """ODE samples for a fixed prompt list (each prompt `repeats` times) with fixed noise (seed + chunk index),
    scored by `reward_fn`. `progress`: a transient progress bar over the images (only rank 0 evaluates). `schedule`:
    the sigma schedule (`sigma_schedule`). `solver`: "euler" (the training sampler) or "dpm" (`dpm_solver_sample`,
    which ignores `schedule`: DPM-Solver brings its own flow sigmas).

    Returns (images [B,3,H,W], {reward name: [B]}) in the order prompts * repeats. The same prompts and seed give
    the same noise in every run and every algorithm, so eval curves are comparable.
    """
    from tqdm import tqdm

    prompts = list(prompts) * repeats
    images, scores = [], {}
    # a context manager, so that the bar is cleared before an error (e.g. a reward returning NaN) is reported
    with tqdm(total=len(prompts), desc="eval", unit="img", leave=False, disable=not progress) as bar:
        for k in range(0, len(prompts), batch):
            chunk = prompts[k : k + batch]
            gen = torch.Generator().manual_seed(seed + k)
            cond = encoder.cond(chunk, negative=guidance_scale > 1)
            if solver == "dpm":  # the same initial noise as the Euler sampler draws from `gen`
                shape = (
                    getattr(pipe, "latent_shape", None)
                    or (transformer.config.in_channels,) + (transformer.config.sample_size,) * 2
                )
                noise = randn((len(chunk), *shape), gen).to(cond.embeds.device)
                kwargs = dict(num_steps=num_steps, guidance_scale=guidance_scale, use_autocast=use_autocast)
                latents = dpm_solver_sample(transformer, pipe.scheduler, cond, noise, **kwargs)
            else:
                latents = sample(
                    transformer,
                    pipe.scheduler,
                    cond,
                    num_steps=num_steps,
                    guidance_scale=guidance_scale,
                    generator=gen,
                    latent_shape=getattr(pipe, "latent_shape", None),
                    use_autocast=use_autocast,
                    schedule=schedule,
                ).latents
            imgs = decode(pipe, latents)
            for name, value in reward_fn(imgs, chunk).items():
                scores.setdefault(name, []).append(value.float().cpu())
            images.append(imgs.cpu())
            bar.update(len(chunk))
    return torch.cat(images), {k: torch.cat(v) for k, v in scores.items()}


# ----------------------------------------------------------------------------------------------------------------
# prompts, groups, timesteps
# ----------------------------------------------------------------------------------------------------------------
def load_prompts(path: str) -> list:
    """Prompts from a .txt (one per line) or .jsonl (a "prompt" field per line) file; blank lines are skipped."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"prompt file {path!r} is a folder; pass a .txt or .jsonl file")
    if not p.exists():
        raise UserError(f"prompt file {path!r} not found")
    if not p.is_file():
        raise UserError(f"prompt file {path!r} is not a regular file (a device or a pipe); pass a .txt or .jsonl file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"prompt file {path!r} is not UTF-8 text (byte {e.start}: {e.reason})")
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                row = json.loads(line)
                prompts.append(str(row["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"{path}:{n}: expected a JSON object with a 'prompt' field")
        else:
            prompts.append(line.strip())
    if not prompts:
        raise UserError(f"prompt file {path!r} has no prompts")
    return prompts


def group_prompts(prompts: Sequence[str], num_prompts: int, group_size: int, generator: torch.Generator) -> list:
    """`num_prompts` prompts drawn without replacement (cycling when the set is smaller), each repeated K times,
    contiguously: [p0]*K + [p1]*K + ... so sample i belongs to group i // K."""
    idx = []
    while len(idx) < num_prompts:
        idx += torch.randperm(len(prompts), generator=generator).tolist()
    return [prompts[i] for i in idx[:num_prompts] for _ in range(group_size)]


def stratified_indices(num_indices: int, count: int, generator: torch.Generator) -> list:
    """`count` step indices in [0, num_indices), one per equal-width stratum, each index reachable (Flow-Factory's
    sampler never draws the last one). With count >= num_indices every index appears at least once."""
    edges = torch.linspace(0, num_indices, count + 1)
    u = torch.rand(count, generator=generator)
    idx = (edges[:-1] + u * (edges[1:] - edges[:-1])).floor().long().clamp(max=num_indices - 1)
    return idx.tolist()


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
    "overlap_reward",
    "compile",
    "eval_num_steps",
    "eval_guidance_scale",
    "eval_noises",
)
# where the run sends data or the model: only ever from this command line. A checkpoint is a file anyone can hand you,
# and one that set --push-to-hub would publish the trained weights to any repo your token can write.
REMOTE_TARGETS = ("track", "wandb_project_name", "wandb_entity", "push_to_hub")
NOT_RESTORED = ("device", "output_dir", "resume", "run_name", *REMOTE_TARGETS)
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
)
_CLI = {"argv": None}  # the command line of the current `run_main`
_RUN = {}  # the current run: "algo" (the script's name, stored in every checkpoint), "resume_record"
_LOCKS = {}  # run folder -> open lock file, held until `release_run_locks`


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args, fresh: bool = True):
    """The checks that need no model, on the fields the five scripts share (each script checks its own after this):
    every bad value fails here, with one line, before anything is loaded or written."""
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
    for name in ("keep_checkpoints", "learning_rate", "weight_decay", "eta", "kl_beta", "adv_clip"):
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
    if fields.get("dynamics") == "CPS" and fields.get("eta", 0) > 1:
        raise UserError(f"--eta {args.eta}: CPS needs eta in [0, 1] (the share of fresh noise is sin(eta pi / 2))")
    reason = compile_unavailable(check_device(args.device)) if fields.get("compile") else None
    if reason:
        raise UserError(f"--compile: {reason}; run without --compile (eager)")
    for name in ("height", "width", "num_frames", "max_sequence_length"):
        if fields.get(name) is not None and fields[name] <= 0:
            raise UserError(f"{_flag(name)} {fields[name]}: must be > 0")
    if fields.get("negative_prompt") and max(args.guidance_scale, fields.get("eval_guidance_scale") or 0) <= 1:
        raise UserError("--negative-prompt is used by CFG only: pass --guidance-scale > 1 (or --eval-guidance-scale > 1)")
    if "lora_targets" in fields and args.lora_targets is not None and not args.lora_targets:
        raise UserError("--lora-targets: name at least one module")
    check_device(args.device)
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
        family.check(config, args)
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
    patch = (
        2
        if "Flux" in transformer.get("_class_name", "")
        else transformer.get("patch_size") or transformer.get("all_patch_size", [1])[0]
    )
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch  # Wan: (1, 2, 2)
    if resolution % (factor * patch) or resolution < factor * patch:
        raise UserError(f"{name} {resolution} must be a multiple of {factor * patch}")
    max_patches = transformer.get("pos_embed_max_size")  # SD3's learned position table: patches per side
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


# Args renamed since checkpoints were first written: the old name -> today's, so that those runs resume with their own
# settings (the decay schedules became `<snapshot>_decay_start/_flat_steps/_ramp/_max` in every script)
RENAMED_ARGS = {
    "decay_flat_steps": "old_decay_flat_steps",  # nft
    "decay_ramp": "old_decay_ramp",
    "decay_max": "old_decay_max",
    "ema_decay": "ema_decay_max",  # awm (its ema_decay_ramp kept its name)
    "ema_ref_max_decay": "ema_ref_decay_max",  # dgpo
    "ema_ref_ramp_rate": "ema_ref_decay_ramp",
}


def upgrade_saved_args(saved: dict) -> dict:
    """A checkpoint's Args under today's field names (`RENAMED_ARGS`), CRD's former decay strings
    `--old-model-decay` / `--sampling-model-decay` "flat_steps-start-ramp-max" split into their four fields."""
    saved = {RENAMED_ARGS.get(k, k): v for k, v in saved.items()}
    for snapshot in ("old", "sampling"):
        spec = saved.pop(f"{snapshot}_model_decay", None)
        if spec is None:
            continue
        try:
            flat_steps, start, ramp, max_decay = (float(x) for x in str(spec).split("-"))
            assert flat_steps == int(flat_steps)
        except (ValueError, AssertionError):
            raise UserError(
                f"the checkpoint's {snapshot}_model_decay {spec!r} is not flat_steps-start-ramp-max; "
                f"pass its values as --{snapshot}-decay-flat-steps/-start/-ramp/-max"
            )
        saved.update(
            {
                f"{snapshot}_decay_start": start,
                f"{snapshot}_decay_flat_steps": int(flat_steps),
                f"{snapshot}_decay_ramp": ramp,
                f"{snapshot}_decay_max": max_decay,
            }
        )
    return saved


def restore_args(args, saved: dict) -> dict:
    """Take a resumed run's hyperparameters from its checkpoint. A flag given now that differs from the saved value
    is an error unless it is in SAFE_OVERRIDES. Returns {field: (saved, now)} of the overrides applied."""
    saved = upgrade_saved_args(saved)
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
    given, overrides = given_flags(args), {}
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
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "epoch" else 0):
            raise UserError(
                f"checkpoint {ckpt_dir}: {key} is {value!r}, expected a whole number >= {1 if key == 'epoch' else 0}"
            )
    if ckpt_dir.name.startswith("epoch_") and ckpt_dir.name != f"epoch_{ckpt['epoch']:06d}":
        raise UserError(f"checkpoint {ckpt_dir}: it says epoch {ckpt['epoch']}, its folder name another")
    if not isinstance(ckpt.get("args"), dict):
        raise UserError(f"checkpoint {ckpt_dir}: its settings (args) are missing")


def clean_stale_temps(run_dir: Path):
    """What a run killed while saving leaves in its folder: checkpoint temps, and the LoRA export's temp (an
    interrupted `export_lora`); an export moved aside but not replaced is put back."""
    doomed = [*(run_dir / "checkpoints").glob(".tmp-*"), *run_dir.glob(".lora.tmp*")]
    if (run_dir / ".lora.old").is_dir():
        if (run_dir / "lora").exists():
            doomed.append(run_dir / ".lora.old")
        else:
            os.rename(run_dir / ".lora.old", run_dir / "lora")
    for tmp in doomed:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink(missing_ok=True)


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
    ckpt = load_checkpoint(ckpt_dir)
    if ckpt.get("algo") != algo:
        raise UserError(
            f"{ckpt_dir} was written by {ckpt.get('algo')}.py; resume it with algos/{ckpt.get('algo')}.py, not {algo}.py"
        )
    check_checkpoint_fields(ckpt, ckpt_dir)
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


def check_run_folder(run_dir: Path):
    """The run folder still there (TensorBoard would go on writing to its deleted event file, and a checkpoint would
    create a new, half-empty folder): one line instead."""
    if not (Path(run_dir) / "args.json").is_file():
        raise UserError(f"the run folder {run_dir} was removed or moved while the run was going; stopped")


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
# the trained model out: a diffusers LoRA folder with a model card
# ----------------------------------------------------------------------------------------------------------------
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # the file name diffusers' load_lora_weights looks for
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

    The adapter metadata (peft's LoraConfig: r, lora_alpha, targets) goes into the safetensors header; without it
    diffusers assumes lora_alpha = r and would apply our alpha = 2r LoRA at half strength.
    `weights`: other values for the trainable LoRA parameters (an EMA), in `add_lora`'s order, exported instead of the
    live ones, which are left untouched; `weights_name` says which in the card. `logger`: its newest eval/* scalars
    go into the card's table and its newest "eval/images" grid (captioned) becomes samples.png, unless `samples` (a [3, H, W]
    image in [0, 1]) is given. Call it on one rank only."""
    from peft import get_peft_model_state_dict

    out_dir = Path(out_dir)
    tmp, old = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}"), out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        params = [p for n, p in transformer.named_parameters() if "lora_" in n]
        with swapped_weights(params, weights) if weights is not None else contextlib.nullcontext():
            state = {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(transformer).items()}
        type(pipe.pipe).save_lora_weights(
            tmp, transformer_lora_layers=state, transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict()
        )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp / LORA_WEIGHTS, 0o666 & ~umask)  # safetensors writes 0600; the export is meant to be shared, like the run
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
        raise UserError(f"could not write the LoRA export {out_dir} ({write_error_reason(e, out_dir.parent)})") from None
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
    pipe_class: str, model: str, lora_dir: str, setup: list, call: dict, output: str, gpu: bool = False, no_t5: bool = False
) -> str:
    """The lines that load an exported LoRA into a stock diffusers pipeline and sample as training did (`card_call`)."""
    load = f"{pipe_class}.from_pretrained({json.dumps(model)}" + (", text_encoder_3=None, tokenizer_3=None" if no_t5 else "")
    load += ', dtype=torch.bfloat16).to("cuda")' if gpu else ")"
    code = "\n".join([*setup, "", *call.values()])
    imports = ["import numpy as np"] * ("np." in code) + ["import torch"] * (gpu or "torch." in code)
    imports += [f"from diffusers import {pipe_class}"] + [x for x in setup if x.startswith(("from ", "import "))]
    setup = "\n".join(x for x in setup if not x.startswith(("from ", "import "))).strip("\n").splitlines()
    if output == "frames":
        imports.append("from diffusers.utils import export_to_video")
    kwargs = ", ".join(f"{k}={v}" for k, v in call.items())
    save = 'export_to_video(videos[0], "sample.mp4", fps=16)' if output == "frames" else 'images[0].save("sample.png")'
    lines = [*imports, f"pipe = {load}", f"pipe.load_lora_weights({json.dumps(lora_dir)})", *setup]
    lines += [
        'prompt = ["a red circle"]',
        f"{'videos' if output == 'frames' else 'images'} = pipe(prompt=prompt, {kwargs}).{output}",
    ]
    return "\n".join(lines + [save]) + "\n"


def model_card(pipe, args, algo_doc: str, epoch: int, evals: dict, weights_name: str, has_samples: bool) -> str:
    """The model card of an exported LoRA: what it is, how well it scores, how it was made, how to load it."""
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
    front = ["---", "library_name: diffusers", "tags: [lora, text-to-image, cleanflow, " + str(config.get("exp_name")) + "]"]
    hub = not Path(model).expanduser().exists() and model.count("/") == 1
    if hub:
        front.append(f"base_model: {model}")
    targets = ", ".join(config.get("lora_targets") or pipe.family.lora_targets)
    snippet = lora_snippet(pipe_class, model, "<this folder>", *card_call(pipe, settings), gpu=hub, no_t5=no_t5)
    lines = front + [
        "---",
        "",
        f"# {config.get('run_name') or 'cleanflow LoRA'}",
        "",
        f"A LoRA for `{model}` ({pipe_class}) trained with reinforcement learning by cleanflow.",
        "",
        "| | |",
        "|-|-|",
        f"| base model | `{model}` |",
        f"| algorithm | {algo} |",
        f"| reward | `{config.get('reward')}` |",
        f"| weights | {weights_name}, after epoch {epoch} |",
        f"| LoRA | rank {config.get('lora_rank')}, alpha {config.get('lora_alpha')}, on {targets} |",
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
    lines += [f"| {k} | {config[k]} |" for k in CARD_ARGS if k in config]
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


def save_checkpoint(path: Path, state: dict, keep: int = 0):
    """Save `state` as the checkpoint folder <path's folder>/epoch_<state["epoch"]>/ and point `last` at it (see above).

    `path` is <run>/checkpoints/last(.pt). Top-level entries that are tensors or dicts/lists of tensors go to
    safetensors, whatever their name; everything else to state.pt. Keeps the newest max(keep, 1) epoch folders.
    A failed write (disk full, file-size limit) removes what it wrote and stops the run with one line."""
    root = Path(path).parent
    tensors, layout, rest = {}, {}, {}
    for key, value in state.items():
        if key != "optimizer" and _all_tensors(value):
            layout[key] = _flatten(value, key, tensors)
        else:
            rest[key] = _plain(value)
    rest.update(format=CHECKPOINT_FORMAT, algo=_RUN.get("algo"), tensor_layout=layout)
    name = f"epoch_{state['epoch']:06d}"
    target, tmp, link = root / name, root / f".tmp-{name}.{os.getpid()}", root / f".tmp-last.{os.getpid()}"
    old = None
    try:
        from safetensors.torch import save_file

        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
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


def load_checkpoint(path: Path) -> dict:
    """A checkpoint folder (or a run folder: its newest) -> the state dict `save_checkpoint` was given, without
    unpickling code. Missing, truncated or foreign files fail with one line."""
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
    return state


MAX_BAD_STEPS = 5  # non-finite gradients in a row before `apply_gradients` gives up


def apply_gradients(
    params: Sequence[torch.Tensor], optimizer, max_grad_norm: float, on_fail: Optional[Callable[[], None]] = None
) -> Optional[float]:
    """Average the accumulated gradients over ranks, clip, step, zero. Returns the pre-clip grad norm, or None
    (and no update) when it is not finite, so that one bad batch cannot poison the weights.

    A skipped update prints a warning; the MAX_BAD_STEPS-th in a row calls `on_fail()` (the scripts save a checkpoint)
    and stops the run with a UserError. The count lives in the current run's state (`start_run` resets it), so a
    resumed run starts from 0 as it did before.

    One all-reduce per parameter instead of DDP: algorithms swap snapshot/EMA weights into the same module,
    which DDP's bucketing would not expect."""
    for p in params:
        if p.grad is not None:
            p.grad.copy_(all_reduce_mean(p.grad))
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if torch.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if torch.isfinite(grad_norm):
        _RUN["bad_steps"] = 0
        return grad_norm.item()
    _RUN["bad_steps"] = bad = _RUN.get("bad_steps", 0) + 1
    from tqdm import tqdm

    tqdm.write(f"warning: non-finite gradient, update skipped ({bad} in a row)")
    if bad >= MAX_BAD_STEPS:
        if on_fail is not None:
            on_fail()
        raise UserError(f"{MAX_BAD_STEPS} non-finite updates in a row; checkpoint saved, lower the learning rate")
    return None


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
    and the sampler settings -- to checkpoints/last.pt (keeping the newest `--keep-checkpoints`), then the LoRA export
    that users load (runs/<run>/lora)."""
    if not logger.enabled:
        return
    check_run_folder(run_dir)
    save_checkpoint(
        Path(run_dir) / "checkpoints" / "last.pt",
        {
            "params": trainable_state(named),
            "optimizer": optimizer.state_dict(),
            "snapshots": {k: [t.cpu() for t in v] for k, v in snapshots.items()},
            "eval_ema": eval_ema.state(),
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
        },
        keep=args.keep_checkpoints,
    )
    export_lora(Path(run_dir) / "lora", pipe, pipe.transformer, args, algo_doc, epoch, logger, **eval_ema.export())


def restore_state(
    ckpt: Optional[dict], named: dict, optimizer, snapshots: dict, eval_ema: EvalEMA, prompt_gen: torch.Generator
) -> tuple:
    """The inverse of `save_state` for a resumed run (`ckpt` from `start_run`; None: a fresh run, nothing to do).
    Returns (start_epoch, step, images_seen)."""
    if ckpt is None:
        return 0, 0, 0
    where = f"checkpoint {_RUN.get('checkpoint', '')}".rstrip()
    try:
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
        raise UserError(f"its trainable weights are not this model's LoRA (e.g. {', '.join(extra) or 'none saved'})")
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


def evaluate_and_log(args, pipe, encoder, prompts, rewards, eval_ema: EvalEMA, logger: "Logger", images_seen: int):
    """Rank 0 (the logger's rank): `evaluate` the held-out `prompts` with the eval sampler (--eval-num-steps,
    --eval-guidance-scale; the eval EMA's weights when --eval-ema-decay > 0), log eval/<reward> and a captioned grid
    at x = images seen. Returns {reward: mean} for the progress bar (None on the other ranks)."""
    if not logger.enabled:
        return None
    with eval_ema.swapped():
        imgs, scores = evaluate(
            pipe,
            pipe.transformer,
            encoder,
            prompts,
            rewards.evaluate,
            num_steps=args.eval_num_steps or args.num_steps,
            guidance_scale=args.guidance_scale if args.eval_guidance_scale is None else args.eval_guidance_scale,
            seed=0,
            use_autocast=args.mixed_precision,
            repeats=getattr(args, "eval_noises", 2),
            schedule=getattr(args, "sigma_schedule", "pipeline"),
            solver=getattr(args, "eval_solver", "euler"),
        )
    logger.scalars({f"eval/{k}": v.mean() for k, v in scores.items()}, images_seen)
    logger.images("eval/images", imgs[:16], captions(prompts[:16], scores), images_seen)
    return {k: v.mean().item() for k, v in scores.items()}


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
