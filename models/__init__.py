"""The model families, and what loads one: `load_pipeline` -> `Model`, what trains (`trainable_params`: a LoRA, or
every transformer weight), the reference model (adapter off, or the frozen base weights swapped in), compilation,
gradient checkpointing and the eval EMA.

One file per family holds only what differs from SD3 (the transformer call, prompt encoding, guidance mode, schedule
shift, latent layout, latent un-normalisation, default LoRA targets) in a `common.Family`; importing this package
registers them with `common.register`, whose sampler and `PromptEncoder` call what the family holds. common never
imports models/, so the arrows point one way: algos -> run -> models -> common.
"""

import contextlib
import json
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

import common
from common import FAMILIES, Family, UserError, family_of, mu_for, short, sigma_schedule

from . import (
    auraflow,
    chroma,
    cogview4,
    flux,
    flux2,
    flux_kontext,
    hunyuanvideo,
    ltx,
    lumina2,
    qwenimage,
    qwenimage_edit,
    sana,
    sd3,
    wan,
    zimage,
)

# FLUX.1 before FLUX.1-Kontext, Qwen-Image before Qwen-Image-Edit: an unmarked FluxTransformer2DModel is FLUX.1's,
# an unmarked QwenImageTransformer2DModel Qwen-Image's (common.family_of)
for _module in (
    sd3,
    flux,
    flux_kontext,
    flux2,
    qwenimage,
    qwenimage_edit,
    zimage,
    wan,
    sana,
    lumina2,
    cogview4,
    chroma,
    auraflow,
    ltx,
    hunyuanvideo,
):
    common.register(_module.FAMILY)


# ----------------------------------------------------------------------------------------------------------------
# model: a diffusers flow-matching pipeline (the family's differences live in models/), LoRA via peft, reference = adapter off
# ----------------------------------------------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def check_components(index: dict, model: str):
    """Every component of a model_index.json comes from diffusers or transformers (or is absent, [null, null]): a
    custom module (["my_module", "MyClass"], a .py file in the folder) is code that from_pretrained would run, and
    diffusers' own refusal is a 36-line traceback."""
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        if entry[0] not in (None, "diffusers", "transformers"):
            raise UserError(
                f"model {model!r}: model_index.json's {name} is {entry[1]!r} from the module {entry[0]!r}, not from "
                "diffusers or transformers; cleanflow loads no code from a model folder"
            )


def check_model_folder(local: Path, model: str):
    """Before the model loads: the folder's pipeline class is a registered family's, its components are diffusers' and
    transformers' classes, and the transformer it holds is that family's (a class name over another family's parts
    loads, then fails at the first prompt)."""
    index = read_model_index(local, model)
    check_components(index, model)
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


def looks_local(model: str) -> bool:
    """Whether `model` names a local folder rather than a hub id ("owner/name"): it exists, starts like a path, has
    not exactly one "/", or its first part is a folder here (assets/tiny-shape is a mistyped local path, not a repo)."""
    local = Path(model).expanduser()
    return local.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1 or local.parent.is_dir()


def check_pipeline_folder(model: str):
    """A local `model` holds a model_index.json; else one line, naming the pipeline folders beside it whose names are
    close (a typo: assets/tiny-shape for assets/tiny-shapes)."""
    local = Path(model).expanduser()
    if (local / "model_index.json").is_file():
        return
    near = []
    if local.parent.is_dir():
        import difflib

        folders = [p.name for p in local.parent.iterdir() if (p / "model_index.json").is_file()]
        near = difflib.get_close_matches(local.name, folders, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(str(local.parent / n) for n in near)}?" if near else ""
    raise UserError(f"model {model!r}: no such pipeline folder (expected {local / 'model_index.json'}){hint}")


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


# hub id substring -> pipeline class, first match wins (for hub ids without a local folder)
HUB_NAMES = (
    ("flux.2-klein", "Flux2KleinPipeline"),
    ("flux.2", "Flux2Pipeline"),
    ("kontext", "FluxKontextPipeline"),
    ("flux", "FluxPipeline"),
    ("qwen-image-edit-25", "QwenImageEditPlusPipeline"),  # 2509, 2511: several images, another template
    ("qwen-image-edit", "QwenImageEditPipeline"),
    ("qwen-image", "QwenImagePipeline"),
    ("z-image", "ZImagePipeline"),
    ("wan2", "WanPipeline"),
    ("sana_sprint", "SanaSprintPipeline"),
    ("sana", "SanaPipeline"),
    ("lumina-image-2", "Lumina2Pipeline"),
    ("cogview4", "CogView4Pipeline"),
    ("chroma", "ChromaPipeline"),
    ("auraflow", "AuraFlowPipeline"),
    ("ltx-video", "LTXPipeline"),
    ("hunyuanvideo", "HunyuanVideoPipeline"),
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
    guidance_scale_2: Optional[float] = None,
    shard: bool = False,
):
    """Load a flow-matching pipeline of a registered family from a local folder or a hub id, frozen, in eval mode.
    `shard` (--fsdp): the transformer stays on the CPU, for `fully_shard_transformer` to move it to `device` one unit
    at a time as it shards it: no GPU holds it whole.

    The family comes from the folder's model_index.json (`_class_name`), or for a hub id from its name (`HUB_NAMES`).
    `height` x `width` (pixels; each defaults to `resolution`, then to the model's native size) and a video family's
    `num_frames` set the returned `Model.latent_shape`, what the sampler draws, in the family's layout; the
    resolution-dependent shift of some families follows from it (`Model.sigmas`). Wan2.2-A14B's two experts are one
    `Model.transformer` (`wan.Experts`), its low-noise expert guided at `guidance_scale_2` (None: the caller's scale).
    """
    import transformers

    local = Path(model).expanduser()
    if looks_local(model):
        check_pipeline_folder(model)
        check_components(read_model_index(local, model), model)
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
    if shard:  # the transformer stays on the CPU: fully_shard_transformer moves it unit by unit
        for name, m in pipe.components.items():
            if isinstance(m, torch.nn.Module) and name != "transformer":
                m.to(device)
    else:
        pipe = pipe.to(device)
    scheduler = family.scheduler(pipe) if family.scheduler else pipe.scheduler
    if family is wan.FAMILY:
        transformer = wan.sampled_transformer(pipe, scheduler, guidance_scale_2)
    elif guidance_scale_2 is not None:
        raise UserError(f"--guidance-scale-2 {guidance_scale_2}: only Wan2.2-A14B has a second (low-noise) expert")
    else:
        transformer = pipe.transformer
    transformer.cleanflow_family = family.name  # common.family_of: FLUX.1-Kontext's transformer class is FLUX.1's
    reason = family.no_cfg(pipe) if family.no_cfg else None
    if reason:  # what the pipeline would ignore, common.velocity refuses (the transformer is what the sampler is given)
        transformer.cfg_refused = reason
    return Model(pipe, family, transformer, scheduler, tuple(shape))


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


# transformer -> {its parameter: the base value of that parameter}, with --full-finetune (see `trainable_params`)
_FROZEN_BASE = weakref.WeakKeyDictionary()


# The default of --full-finetune: a LoRA of the 2.3M-weight tiny models learns little (on tiny-shapes no LoRA setting
# passed the CFG-4.5 base beyond noise; every weight at lr 1e-4 did, benchmark/results/convergence), while every weight
# of a large model in fp32 with AdamW's two moments needs 16 bytes per weight (40 GB for SD3.5-M's 2.5B).
FULL_FINETUNE_BELOW = 50_000_000


def trainable_params(transformer, args) -> list:
    """What the scripts train: a peft LoRA (`add_lora` with --lora-rank/--lora-alpha/--lora-targets), or with
    --full-finetune every transformer weight.

    Full fine-tuning keeps the weights as they were loaded (--base-dtype, exact) as the frozen base model that
    `reference_model` swaps in, then makes the transformer's weights fp32 master weights (bf16 rounding would swallow
    updates of lr x |grad| below 2^-8 of a weight; the forwards still run in bf16 under --mixed-precision). Returns the
    trainable parameters.

    `args.full_finetune` None (the default: asked for neither way, no LoRA flag given) is decided here and written
    back: every weight of a transformer under FULL_FINETUNE_BELOW weights, a LoRA of a larger one."""
    if getattr(args, "full_finetune", False) is None:
        args.full_finetune = sum(p.numel() for p in transformer.parameters()) < FULL_FINETUNE_BELOW
    if not getattr(args, "full_finetune", False):
        return add_lora(transformer, args.lora_rank, args.lora_alpha, args.lora_targets)
    base = [p.detach().clone() for p in transformer.parameters()]
    transformer.float().requires_grad_(True)
    _FROZEN_BASE[transformer] = dict(zip(transformer.parameters(), base))
    common._DTYPES.pop(transformer, None)  # the compute dtype the sampler casts inputs to is now fp32
    return list(transformer.parameters())


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


def transformer_blocks(transformer) -> list:
    """The repeated blocks of a transformer: the modules of its `*blocks` ModuleLists (SD3's `transformer_blocks`,
    FLUX's `transformer_blocks` and `single_transformer_blocks`, ...), in order."""
    return [
        block
        for name, child in transformer.named_children()
        if isinstance(child, torch.nn.ModuleList) and name.endswith("blocks")
        for block in child
    ]


def fully_shard_transformer(transformer, device: torch.device, cpu_offload: bool = False) -> list:
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) over every rank: one unit per transformer block, then the root
    (embeddings, final norm and projection). Each rank keeps 1/N of every parameter, the LoRA (added before) included,
    as DTensor shards; a unit's weights are all-gathered for its forward and backward only, and its gradients are
    reduce-scattered (averaged) in the backward. Returns the trainable parameters (requires_grad), now shards: the
    optimizer, snapshots and EMAs are built from them, so they are sharded the same way. A transformer on the CPU
    (`load_pipeline(shard=True)`) moves to `device` unit by unit, each unit whole only until its shards are cut.

    Mixed precision: every weight is gathered in the frozen base's dtype (--base-dtype: bf16 on GPUs; the fp32 LoRA
    master shards are cast to it for the compute, as autocast would) and gradients are reduced in fp32; an fp32 base
    (the CPU default) casts nothing. The forward's inputs are left as the family casts them, so the timestep stays fp32
    (cast to bf16, 1000 sigma would round to steps of 4). `cpu_offload`: the shards, their gradients and the optimizer
    step live in CPU memory, each unit is copied to the GPU for its compute."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from harness.distributed import fsdp_mesh

    blocks = transformer_blocks(transformer)
    if not blocks:
        raise UserError(f"--fsdp: {type(transformer).__name__} has no transformer block lists to shard")
    frozen = {p.dtype for p in transformer.parameters() if not p.requires_grad} - {torch.float32}
    options = {
        "mesh": fsdp_mesh(device),
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=next(iter(frozen), None), reduce_dtype=torch.float32, cast_forward_inputs=False
        ),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    base = _FROZEN_BASE.pop(transformer, None)  # --full-finetune's frozen base, in parameter order
    base = [base[p] for p in transformer.parameters()] if base is not None else None
    for block in blocks:
        fully_shard(block, **options)
    # the root too is resharded after every forward (FSDP's default keeps it gathered until the backward): the
    # algorithms copy snapshot and EMA weights into the shards between no-grad forwards (`swapped_weights`), and a
    # root left gathered after a sampling pass would go on computing with the weights it had before the copy
    fully_shard(transformer, reshard_after_forward=True, **options)
    if base is not None:  # cut the same shards of the frozen base (rank 0's values, which every rank holds)
        from torch.distributed.tensor import distribute_tensor

        shards = [
            distribute_tensor(b.to(p.device), p.device_mesh, p.placements) for p, b in zip(transformer.parameters(), base)
        ]
        _FROZEN_BASE[transformer] = dict(zip(transformer.parameters(), shards))
    report_shard_bytes(transformer)
    return [p for p in transformer.parameters() if p.requires_grad]


def report_shard_bytes(transformer) -> list:
    """Rank 0 prints, and every rank returns, the parameter bytes each rank holds ([frozen, trainable] per rank):
    the sum of its local shards, against the whole transformer's (what every rank holds without --fsdp)."""
    import torch.distributed as dist

    from harness.distributed import all_gather_cat

    local, whole = [0, 0], [0, 0]
    for p in transformer.parameters():
        local[int(p.requires_grad)] += p.to_local().numel() * p.element_size()
        whole[int(p.requires_grad)] += p.numel() * p.element_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    held = all_gather_cat(torch.tensor([local], dtype=torch.float64, device=device)).long().tolist()
    if dist.get_rank() == 0:

        def mb(kind: int) -> str:
            return f"{' + '.join(f'{r[kind] / 2**20:.3f}' for r in held)} of {whole[kind] / 2**20:.3f}"

        print(f"fsdp: transformer parameter MB per rank: frozen {mb(0)}, trainable {mb(1)}")
    return held


def is_fsdp(module) -> bool:
    """Whether `fully_shard_transformer` sharded `module`: its forward, state dict and export are collectives then,
    which every rank must call."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


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
        blocks = transformer_blocks(transformer)
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
    """The frozen base model: the same transformer with its LoRA adapter disabled, or with --full-finetune with the
    base weights in place of the trained ones.

    The base weights are put into the modules' parameter slots, not copied into the trained tensors: GRPO calls the
    reference after its policy forward and before the backward, whose graph holds the trained tensors (an in-place copy
    would fail the backward's version check), and no second copy of the weights is made."""
    base = _FROZEN_BASE.get(transformer)
    if base is None:
        transformer.disable_adapters()
        try:
            yield transformer
        finally:
            transformer.enable_adapters()
        return
    if is_fsdp(transformer):
        # FSDP2 puts its own gathered weights into the parameter slots at each forward, so the base shards are copied
        # into the trained shards instead; the backward re-gathers from the shards (reshard_after_forward), restored
        # by then, so GRPO's reference call between its forward and backward is safe here
        with swapped_weights(list(base), list(base.values())):
            yield transformer
        return
    if any(p not in base for p in transformer.parameters()):  # parameters replaced after `trainable_params`
        raise RuntimeError("the frozen base no longer matches the transformer's parameters; call trainable_params last")
    slots = [(m, name, p) for m in transformer.modules() for name, p in m._parameters.items() if p in base]
    for m, name, p in slots:
        # a bf16/fp16 base (--base-dtype) as loaded under autocast, which casts every weight anyway: the LoRA path's
        # reference, and no fp32 copy of the weights; without autocast upcast (exact) to the inputs' fp32
        cast = torch.is_autocast_enabled(p.device.type)
        m._parameters[name] = base[p] if cast else base[p].to(p.dtype)
    try:
        yield transformer
    finally:
        for m, name, p in slots:
            m._parameters[name] = p


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
