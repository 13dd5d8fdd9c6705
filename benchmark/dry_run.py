"""A real-size dry run without a GPU or a download: each algorithm script trains SD3.5-Medium's transformer for one epoch.

    OMP_NUM_THREADS=1 python benchmark/dry_run.py                     # all five algorithms, 128 px, ~15-20 min on 1 core
    OMP_NUM_THREADS=1 python benchmark/dry_run.py --algos grpo,nft --gc-algos grpo --out benchmark/results/dry_run.md
    OMP_NUM_THREADS=1 python benchmark/dry_run.py --memory-table --out benchmark/results/dry_run.md   # ~10 min

`--memory-table` (issue 34, models larger than one GPU) runs no script: it counts the parameters of SD3.5-M, Qwen-Image
20B and FLUX.2-dev 32B exactly on the meta device, measures saved activations per block on real full-width blocks, and
writes per-GPU memory at 1, 8 and 16 ranks with and without FSDP and gradient checkpointing, LoRA and full fine-tuning
(the terms: `per_gpu`; the method: the section it writes). It replaces only its own section of --out.

The transformer is `SD3Transformer2DModel` built from SD3.5-Medium's published config (below) with random weights in
bf16; LoRA r32 on the attention projections as in the paper scripts. The text encoders and the VAE are stand-ins
(two one-layer CLIPs with SD3.5's pooled width, SD3.5's VAE architecture with random weights), because only the
transformer's size matters for what is measured; T5 is absent, so the text is 77 CLIP tokens + 1 zero T5 token.
Each algorithm runs `algos/<algo>.py`'s own `main` (sampling, reward, loss, optimizer step, eval, checkpoint) in a
child process: 1 prompt x group of 2, 2 sampling steps, 1 trained timestep, micro-batch 1 (2 for CRD and DGPO, which
need whole groups), jpeg_compressibility reward. Reported per run: wall time of the sampling and training sections
(from the run's own `time/*` scalars), peak RSS, and the peak bytes autograd held for the backward pass (saved
activations, measured with `torch.autograd.graph.saved_tensors_hooks`; the frozen weights are not counted).

The GPU estimate for 512 px (one H100 process at micro-batch 1) = the bf16 transformer + the LoRA weights with their
fp32 grads and AdamW moments + the saved activations scaled linearly in tokens (flash/memory-efficient attention keeps
O(tokens) per layer) from this run's 64 image + 78 text tokens to 1024 image + 205 text tokens (T5 at 128 tokens) +
the text encoders (CLIP-L, CLIP-G, T5-XXL: 11.2 GB in bf16, 0 with --offload-text-encoders) + the VAE (0.17 GB).
With --gradient-checkpointing only one block's activations are alive during the backward, plus each block's input:
saved / 24 + 24 x tokens x 1536 x 2 streams x 2 bytes. CUDA context and allocator slack (~1-3 GB) are not included.
Not part of CI.
"""

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# stabilityai/stable-diffusion-3.5-medium transformer/config.json (diffusers SD3Transformer2DModel): 2.24B parameters
SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
TEXT_ENCODERS_GB = (123e6 + 695e6 + 4762e6) * 2 / 1e9  # CLIP-L + CLIP-G + T5-XXL parameters, bf16
VAE_GB = 84e6 * 2 / 1e9
EXTRA = {  # per-algorithm flags that keep one epoch to one trained timestep; CFG as in each paper script
    "grpo": "--sde-window 0 1 --num-sde-steps 1 --micro-batch 1 --guidance-scale 4.5",
    "nft": "--num-train-timesteps 1 --micro-batch 1",
    "awm": "--num-train-timesteps 1 --micro-batch 1",
    "crd": "--num-train-timesteps 1 --micro-batch 2",
    "dgpo": "--num-train-timesteps 1 --micro-batch 2 --guidance-scale 4.5",
}


def build_standin_pipeline(path: Path):
    """Tiny CLIPs with SD3.5's pooled width (768 + 1280), SD3.5's VAE layout, and a 1-layer transformer placeholder."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from benchmark.testbeds import build_tiny_shapes as recipe

    tok = recipe.build_tokenizer(["a", "red", "circle"], max_tokens=77)
    encoders = []
    for seed, proj in ((0, 768), (1, 1280)):
        torch.manual_seed(seed)
        encoders.append(
            CLIPTextModelWithProjection(
                CLIPTextConfig(
                    vocab_size=len(tok),
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    projection_dim=proj,
                    max_position_embeddings=77,
                    bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
            )
        )
    vae = AutoencoderKL(  # SD3.5's VAE architecture (vae/config.json), random weights
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=1024,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    small = {
        **SD35_MEDIUM,
        "num_layers": 1,
        "num_attention_heads": 2,
        "caption_projection_dim": 128,
        "dual_attention_layers": (),
    }
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**small),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=tok,
        text_encoder_2=encoders[1],
        tokenizer_2=tok,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.save_pretrained(path)


class SavedTensorMeter:
    """Peak bytes of the tensors autograd keeps for backward, each storage counted once, parameters excluded."""

    def __init__(self):
        self.live, self.peak, self.storages, self.param_ptrs = 0, 0, {}, set()

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or isinstance(t, torch.nn.Parameter):
            return t
        entry = self.storages.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        holder = _Held(t)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr):
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[ptr]

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def child(algo: str, folder: str, resolution: int, gc: bool, out_dir: str):
    """One epoch of `algos/<algo>.py` with the SD3.5-M transformer swapped into the stand-in pipeline."""
    import importlib

    import tyro
    from diffusers import SD3Transformer2DModel

    import models

    meter = SavedTensorMeter()
    load = models.load_pipeline

    def load_with_sd35(model, device, dtype=torch.float32, resolution=None, **sizes):
        pipe = load(model, device, dtype, resolution, **sizes)
        t0 = time.perf_counter()
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build in bf16 directly: no 9 GB fp32 copy
        try:
            big = SD3Transformer2DModel(**SD35_MEDIUM)
        finally:
            torch.set_default_dtype(default)
        pipe.transformer = big.requires_grad_(False).eval().to(device)
        meter.param_ptrs = {p.untyped_storage().data_ptr() for p in big.parameters()}
        print(
            f"built SD3.5-M transformer: {sum(p.numel() for p in big.parameters()) / 1e9:.2f}B params in "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        return pipe

    models.load_pipeline = load_with_sd35
    prompts = Path(out_dir) / "prompts.txt"
    prompts.write_text("a red circle\n")
    flags = (
        f"--model {folder} --resolution {resolution} --base-dtype bfloat16 --mixed-precision --lora-rank 32 "
        f"--lora-alpha 64 --reward jpeg_compressibility --train-prompts {prompts} --test-prompts {prompts} "
        f"--num-prompts 1 --group-size 2 --num-steps 2 --grad-steps-per-epoch 1 --num-epochs 1 --eval-every 1000 "
        f"--eval-num-steps 1 --save-every 1000 --keep-checkpoints 0 --output-dir {out_dir}/runs {EXTRA[algo]}"
        + (" --gradient-checkpointing" if gc else "")
    ).split()
    module = importlib.import_module(f"algos.{algo}")
    args = tyro.cli(module.Args, args=flags)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        module.main(args)
    total = time.perf_counter() - t0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (Path(out_dir) / "runs").iterdir()
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    times = {tag.split("/")[1]: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"] if tag.startswith("time/")}
    lora = sd35_lora_params(args)
    print(
        "RESULT "
        + json.dumps(
            {
                "algo": algo,
                "gc": gc,
                "resolution": resolution,
                "total_s": total,
                **times,
                "lora_params": lora,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                "saved_gb": meter.peak / 1e9,
                "tokens": (resolution // 16) ** 2 + 78,
                "micro_batch": args.micro_batch,
            }
        ),
        flush=True,
    )


def sd35_lora_params(args) -> int:
    """LoRA parameter count of the run's targets on the SD3.5-M transformer (rebuilt on the meta device: no memory)."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    with torch.device("meta"):
        t = SD3Transformer2DModel(**SD35_MEDIUM)
    from models import sd3

    targets = sd3.FAMILY.lora_targets if args.lora_targets is None else args.lora_targets
    t.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=list(targets)))
    return sum(p.numel() for n, p in t.named_parameters() if "lora_" in n)


def gpu_estimate(r: dict, gc: bool, offload: bool) -> float:
    """GB on one GPU at 512 px, micro-batch as in the run (see the module docstring for the terms)."""
    weights = SD35_MEDIUM_PARAMS * 2 / 1e9
    lora = r["lora_params"] * 16 / 1e9  # fp32 weight + grad + two AdamW moments
    tokens_512 = 32**2 + 205
    act = r["saved_gb"] * tokens_512 / r["tokens"]
    if gc:
        act = act / SD35_MEDIUM["num_layers"] + SD35_MEDIUM["num_layers"] * tokens_512 * 1536 * 2 * 2 * r["micro_batch"] / 1e9
    return weights + lora + act + VAE_GB + (0 if offload else TEXT_ENCODERS_GB)


SD35_MEDIUM_PARAMS = 2_243_171_520  # measured: sum of numel of the model built from SD35_MEDIUM


# ---- Models larger than one GPU (issue 34): exact parameter counts on the meta device, measured activations ----

# Qwen/Qwen-Image transformer/config.json, as quoted in kohya-ss/musubi-tuner
# src/musubi_tuner/qwen_image/qwen_image_model.py (create_model): 20,430,401,088 parameters
QWEN_IMAGE = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
# black-forest-labs/FLUX.2-dev transformer config: huggingface/diffusers scripts/convert_flux2_to_diffusers.py,
# get_flux2_transformer_config("flux2-dev"); guidance_embeds is left at the class default True (dev is
# guidance-distilled: its checkpoint has the guidance embedder): 32,223,281,152 parameters
FLUX2_DEV = dict(
    patch_size=1,
    in_channels=128,
    num_layers=8,
    num_single_layers=48,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=True,
)
# Qwen-Image's text_encoder/config.json (Qwen2.5-VL-7B-Instruct, Qwen2_5_VLForConditionalGeneration), as quoted in
# kohya-ss/musubi-tuner src/musubi_tuner/qwen_image/qwen_image_utils.py (load_qwen2_5_vl): the sizes that set the count
QWEN25_VL_7B = dict(
    text_config=dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rope_scaling={"rope_type": "default", "mrope_section": [16, 24, 24]},
    ),
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
    tie_word_embeddings=False,
)
# FLUX.2-dev's text_encoder/config.json (Mistral-Small-3.x 24B, Mistral3ForConditionalGeneration), as quoted in
# kohya-ss/musubi-tuner src/musubi_tuner/flux_2/flux2_utils.py (Mistral3Embedder)
MISTRAL_SMALL_24B = dict(
    text_config=dict(
        model_type="mistral",
        hidden_size=5120,
        intermediate_size=32768,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=131072,
    ),
    vision_config=dict(
        model_type="pixtral",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        head_dim=64,
        patch_size=14,
        image_size=1540,
    ),
    multimodal_projector_bias=False,
    projector_hidden_act="gelu",
    spatial_merge_size=2,
    tie_word_embeddings=False,
)
IMAGE_TOKENS = 4096  # 1024x1024: a 128x128 latent (VAE factor 8) in 2x2 patches, for all three families
LORA_RANK = 32
RANKS = (1, 8, 16)
GPU_BUDGET_GB = 72.0  # of an 80 GB H100: ~10% left for the CUDA context, allocator slack, reward model, sampling


@dataclass(frozen=True)
class Scale:
    """One transformer at full size. `kinds`: (ModuleList attribute, index in the one-block-per-kind model, count in
    the full model); the full model's activations = the small model's + (count - 1) x each kind's extra block."""

    name: str
    cls: str
    config: dict
    family: str
    small: dict  # config overrides: one block of each kind, full width
    kinds: tuple
    latent: tuple  # [C, h, w] the family's sampler draws at 1024x1024
    patch: int  # latent pixels per token side: 2 where the transformer patchifies 2x2, 1 where the latent already is
    joint_dim: int
    extra: Callable  # batch -> the family's second conditioning tensor (pooled, mask or empty)
    text_tokens: int
    text_encoder: tuple  # (name, transformers config class, model class, config) or (name, parameters)
    vae: tuple  # (diffusers class, kwargs) built on meta, or (name, parameters)


SCALES = (
    Scale(
        "SD3.5-Medium",
        "SD3Transformer2DModel",
        SD35_MEDIUM,
        "sd3",
        dict(num_layers=3, dual_attention_layers=(0,)),  # a dual-attention block, a plain one, the context_pre_only last
        (("transformer_blocks", 0, 13), ("transformer_blocks", 1, 10)),
        (16, 128, 128),
        2,
        4096,
        lambda b: torch.zeros(b, 2048),
        205,  # 77 CLIP + 128 T5 tokens, as the paper scripts
        ("CLIP-L + CLIP-G + T5-XXL", 123e6 + 695e6 + 4762e6),
        ("SD3.5 VAE", 84e6),
    ),
    Scale(
        "Qwen-Image",
        "QwenImageTransformer2DModel",
        QWEN_IMAGE,
        "qwenimage",
        dict(num_layers=1),
        (("transformer_blocks", 0, 60),),
        (16, 128, 128),
        2,
        3584,
        None,  # the family takes a token mask: all ones (no padding)
        512,  # the pipeline's max_sequence_length: an upper bound, prompts are usually shorter
        ("Qwen2.5-VL-7B", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B),
        ("AutoencoderKLQwenImage", {}),
    ),
    Scale(
        "FLUX.2-dev",
        "Flux2Transformer2DModel",
        FLUX2_DEV,
        "flux2",
        dict(num_layers=1, num_single_layers=1),
        (("transformer_blocks", 0, 8), ("single_transformer_blocks", 0, 48)),
        (128, 64, 64),
        1,
        15360,
        lambda b: torch.zeros(b, 0),
        512,  # Flux2Pipeline pads every prompt to max_sequence_length 512
        ("Mistral-Small-3.x-24B", "Mistral3Config", "Mistral3ForConditionalGeneration", MISTRAL_SMALL_24B),
        ("AutoencoderKLFlux2", {}),
    ),
)


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def model_counts(s: Scale, rank: int = LORA_RANK) -> dict:
    """Exact parameter counts of the full-size transformer built on the meta device (no memory): total, LoRA (rank r
    on models/<family>.py's targets), root (outside the blocks: one FSDP unit) and the largest block (one unit)."""
    import diffusers
    from peft import LoraConfig

    with torch.device("meta"):
        t = getattr(diffusers, s.cls)(**s.config)
    total = numel(t)
    blocks = [b for attr in dict.fromkeys(k[0] for k in s.kinds) for b in getattr(t, attr)]
    unit = max(numel(b) for b in blocks)
    root = total - sum(numel(b) for b in blocks)
    targets = importlib.import_module(f"models.{s.family}").FAMILY.lora_targets
    t.add_adapter(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets)))
    lora = sum(p.numel() for n, p in t.named_parameters() if "lora_" in n)
    return dict(params=total, lora=lora, root=root, unit=unit, blocks=len(blocks))


def component_params(spec: tuple) -> float:
    """Parameters of a text encoder or VAE: built from its config on the meta device, or a stated number."""
    if len(spec) == 2 and not isinstance(spec[1], dict):
        return spec[1]
    if len(spec) == 2:
        import diffusers

        with torch.device("meta"):
            return numel(getattr(diffusers, spec[0])(**spec[1]))
    import transformers

    _, config_cls, model_cls, config = spec
    with torch.device("meta"):
        return numel(getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)))


def block_activations(s: Scale, side_scale: int = 4, text_tokens: int = 32) -> dict:
    """Saved-for-backward bytes at `tokens` (image + text), measured on real bf16 weights at full width with one block
    of each kind: the small model once, then with each kind's block run twice (the difference: one more block), for
    LoRA (adapters on the family's targets under bf16 autocast, as --mixed-precision) and for full fine-tuning
    (every bf16 weight trainable; the weights themselves are not activations). Also the bytes of a block's input
    streams (what gradient checkpointing keeps per block), and `linearity`: the small model's bytes at 4x the tokens
    over 4x its bytes at these (1.0: linear in tokens)."""
    import diffusers

    import models

    family = importlib.import_module(f"models.{s.family}").FAMILY
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        t = getattr(diffusers, s.cls)(**{**s.config, **s.small}).eval()
    finally:
        torch.set_default_dtype(default)
    c, h, w = s.latent

    def run(scale: int, lora: bool, inputs: list | None = None) -> int:
        hh, ww = h // side_scale * scale, w // side_scale * scale
        tokens = text_tokens * scale**2  # image tokens grow as scale**2: keep the text share
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, c, hh, ww, generator=g)
        embeds = torch.randn(1, tokens, s.joint_dim, generator=g)
        extra = torch.ones(1, tokens, dtype=torch.long) if s.extra is None else s.extra(1)
        meter = SavedTensorMeter()
        meter.param_ptrs = {p.untyped_storage().data_ptr() for p in t.parameters()}
        hooks = []
        if inputs is not None:  # the bytes of each block's [B, tokens, D] inputs: what a checkpoint keeps
            for attr in dict.fromkeys(k[0] for k in s.kinds):
                for block in getattr(t, attr):
                    hooks.append(
                        block.register_forward_pre_hook(
                            lambda m, a, kw: inputs.append(
                                sum(v.nbytes for v in (*a, *kw.values()) if torch.is_tensor(v) and v.dim() == 3)
                            ),
                            with_kwargs=True,
                        )
                    )
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack), torch.autocast("cpu", torch.bfloat16, lora):
            out = family.velocity(t, x, torch.full((1,), 0.5), embeds, extra, None, 1.0)
        for hook in hooks:
            hook.remove()
        assert out.requires_grad
        del out
        return meter.peak

    result = {"tokens": h * w // (side_scale * s.patch) ** 2 + text_tokens}
    for mode in ("full", "lora"):
        if mode == "full":
            t.requires_grad_(True)
        else:
            t.requires_grad_(False)
            for p in models.add_lora(t, LORA_RANK, 2 * LORA_RANK, None):
                # bf16 here, so autocast makes no per-block weight copy: those bytes do not grow with the tokens and
                # are counted once in per_gpu (2 B per LoRA parameter), not scaled with the activations
                p.data = p.data.to(torch.bfloat16)
        inputs = []
        base = run(1, mode == "lora", inputs)
        extra_blocks = {}
        for attr, index, _ in s.kinds:
            blocks = getattr(t, attr)
            setattr(t, attr, torch.nn.ModuleList([*blocks[: index + 1], blocks[index], *blocks[index + 1 :]]))
            extra_blocks[(attr, index)] = run(1, mode == "lora") - base
            setattr(t, attr, blocks)
        result[mode] = dict(base=base, blocks=extra_blocks, linearity=run(2, mode == "lora") / base / 4)
        result["block_input"] = max(max(inputs), result.get("block_input", 0))
    return result


def activations(s: Scale, a: dict, full: bool, gc: bool, tokens: int) -> float:
    """Bytes of saved activations for one sample at `tokens`, scaled linearly from the measurement: memory-efficient
    attention keeps O(tokens) per layer (the measured linearity ratio checks it). Without checkpointing: the small
    model + (count - 1) more blocks of each kind. With it: what runs outside the blocks + every block's input streams +
    one block's activations alive again during its recomputation (the largest kind)."""
    m = a["full" if full else "lora"]
    scale = tokens / a["tokens"]
    per_kind = [(m["blocks"][(attr, index)], count) for attr, index, count in s.kinds]
    if not gc:
        return scale * (m["base"] + sum(b * (count - 1) for b, count in per_kind))
    outside = max(m["base"] - sum(b for b, _ in per_kind), 0)
    blocks = sum(count for _, count in per_kind)
    return scale * (outside + blocks * a["block_input"] + max(b for b, _ in per_kind))


def per_gpu(c: dict, *, ranks: int, fsdp: bool, gc: bool, full: bool, text_encoder: bool) -> dict:
    """Bytes on one GPU, term by term, for micro-batch 1. c: model_counts + params of the text encoder (`te`) and VAE
    (`vae`) + `act` / `act_gc` (activation bytes without / with gradient checkpointing, for this method).

    Full fine-tuning = fp32 master weights, fp32 grads and AdamW's two fp32 moments (16 B/param) computed in bf16,
    plus the frozen bf16 reference copy the KL term needs. LoRA: the bf16 base (also the reference, adapter off) and
    16 B per LoRA parameter. FSDP divides weights, grads and moments by the ranks, and adds what is not divided: the
    root unit gathered for the whole forward/backward (FSDP2 keeps the root unsharded), the current and the
    prefetched block gathered in bf16, and (full) their unsharded bf16 grads before the reduce-scatter. Without FSDP,
    autocast's bf16 copies of the trained weights are held for the backward (full fine-tuning: one block's with
    checkpointing; LoRA: all, small). The text encoders, when resident, and the VAE are not sharded."""
    n = ranks if fsdp else 1
    p, unit, root = c["params"], c["unit"], c["root"]
    t = {}
    if full:
        t["trained"] = 16 * p / n
        t["reference"] = 2 * p / n
    else:
        t["base"] = 2 * p / n
        t["trained"] = 16 * c["lora"] / n
    if fsdp:
        t["gathered"] = 2 * (root + 2 * unit) + (2 * (root + unit) if full else 0)
    else:
        t["bf16 copy"] = 2 * (unit if gc else p) if full else 2 * c["lora"]
    t["activations"] = c["act_gc"] if gc else c["act"]
    t["text encoder"] = 2 * c["te"] if text_encoder else 0
    t["vae"] = 2 * c["vae"]
    return t


def min_gpus(c: dict, budget: float = GPU_BUDGET_GB * 1e9, **kw) -> int | None:
    """Fewest ranks whose per-GPU total fits the budget (None: no count does; without FSDP only one rank can help)."""
    for n in range(1, 257) if kw.get("fsdp") else (1,):
        if sum(per_gpu(c, ranks=n, **kw).values()) <= budget:
            return n
    return None


def memory_table(scales=SCALES) -> tuple[str, list]:
    """The markdown section (per-family counts and measurements, then per-GPU GB at 1/8/16 ranks) and, per row,
    (model, full, gc, fsdp, fewest GPUs with the text encoder offloaded / resident) for the README."""
    out, summary = [], []
    for s in scales:
        t0 = time.perf_counter()
        c = model_counts(s)
        c["te"], c["vae"] = component_params(s.text_encoder), component_params(s.vae)
        a = block_activations(s)
        tokens = IMAGE_TOKENS + s.text_tokens
        print(f"{s.name}: counted and measured in {time.perf_counter() - t0:.0f} s", c, a, flush=True)
        lines = [
            f"### {s.name} ({s.cls})",
            "",
            f"Transformer {c['params']:,} parameters ({c['params'] * 2 / 1e9:.1f} GB bf16) in {c['blocks']} blocks; "
            f"largest block {c['unit']:,}, outside the blocks (FSDP root unit) {c['root']:,}; LoRA r{LORA_RANK} on "
            f"`models/{s.family}.py`'s targets {c['lora']:,} ({c['lora'] * 16 / 1e9:.2f} GB with fp32 grads and AdamW). "
            f"Text encoder {s.text_encoder[0]} {c['te'] / 1e9:.2f}B parameters ({c['te'] * 2 / 1e9:.1f} GB bf16); VAE "
            f"{c['vae'] / 1e6:.0f}M. Tokens at 1024x1024: {IMAGE_TOKENS} image + {s.text_tokens} text.",
            "",
        ]
        for mode in ("lora", "full"):
            m = a[mode]
            kinds = ", ".join(
                f"one more block like `{attr}[{index}]` {m['blocks'][(attr, index)] / a['tokens'] / 1e3:.1f} kB"
                for attr, index, _ in s.kinds
            )
            lines.append(
                f"- Saved activations, {'LoRA' if mode == 'lora' else 'full fine-tuning'} (measured at {a['tokens']} tokens, "
                f"per token): the one-block-per-kind model {m['base'] / a['tokens'] / 1e3:.1f} kB, {kinds}; four times the "
                f"tokens gives {4 * m['linearity']:.2f}x the bytes. At {tokens} tokens: "
                f"{activations(s, a, mode == 'full', False, tokens) / 1e9:.1f} GB, with checkpointing "
                f"{activations(s, a, mode == 'full', True, tokens) / 1e9:.1f} GB."
            )
        lines += [
            "",
            "| method | grad. ckpt | FSDP | "
            + " | ".join(f"{n} GPU{'s' if n > 1 else ''}" for n in RANKS)
            + " | fewest H100s |",
            "|---|---|---|" + "---|" * (len(RANKS) + 1),
        ]
        for full in (False, True):
            c["act"] = activations(s, a, full, False, tokens)
            c["act_gc"] = activations(s, a, full, True, tokens)
            for gc in (False, True):
                for fsdp in (False, True):
                    cells = []
                    for n in RANKS:
                        off = sum(per_gpu(c, ranks=n, fsdp=fsdp, gc=gc, full=full, text_encoder=False).values())
                        on = sum(per_gpu(c, ranks=n, fsdp=fsdp, gc=gc, full=full, text_encoder=True).values())
                        cells.append(f"{off / 1e9:.1f} ({on / 1e9:.1f})")
                    fit = [min_gpus(c, fsdp=fsdp, gc=gc, full=full, text_encoder=te) for te in (False, True)]
                    fits = " (".join("-" if f is None else str(f) for f in fit) + ")"
                    lines.append(
                        f"| {'full' if full else 'LoRA'} | {'yes' if gc else 'no'} | {'yes' if fsdp else 'no'} | "
                        + " | ".join(cells)
                        + f" | {fits} |"
                    )
                    summary.append((s.name, full, gc, fsdp, fit))
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n", summary


MEMORY_HEADING = "## Models larger than one GPU"


def memory_section(body: str, summary: list, seconds: float) -> str:
    """The results file's section: how the numbers were made, the tables, and the fewest H100s per model."""
    import platform

    reading = []
    for name in dict.fromkeys(r[0] for r in summary):
        fit = {(full, gc, fsdp): f for n, full, gc, fsdp, f in summary if n == name}

        def say(full, fsdp):
            n = fit[(full, True, fsdp)][0]
            return "does not fit" if n is None else f"{n} GPU{'s' if n > 1 else ''}"

        worse = [
            m
            for m, full in (("LoRA", False), ("full", True))
            if (fit[(full, True, False)][0] or 1e9) < fit[(full, True, True)][0]
        ]
        reading.append(
            f"- {name}: LoRA {say(False, False)} without FSDP, {say(False, True)} with it; full fine-tuning "
            f"{say(True, False)} without FSDP, {say(True, True)} with it."
            + (
                f" ({' and '.join(worse)}: the units FSDP gathers cost more than sharding saves on so few GPUs.)"
                if worse
                else ""
            )
        )
    return (
        f"""{MEMORY_HEADING}: SD3.5-M, Qwen-Image 20B and FLUX.2-dev 32B at 1, 8 and 16 ranks (estimate)

`OMP_NUM_THREADS=1 python benchmark/dry_run.py --memory-table --out benchmark/results/dry_run.md` ({time.strftime("%Y-%m-%d")},
{platform.machine()} CPU, {seconds / 60:.0f} min on one core). No GPU and no download. **Parameter counts are exact**: each
transformer is built from its published config (sources cited beside the configs in `benchmark/dry_run.py`) on the meta
device, LoRA r{LORA_RANK} attached with peft on `models/<family>.py`'s targets; the text encoders and VAEs likewise
(transformers / diffusers classes on the meta device; SD3.5-M's CLIP-L + CLIP-G + T5-XXL and VAE: the nominal counts of
the table above). **Activations are measured** with `torch.autograd.graph.saved_tensors_hooks` (each storage once, weights
excluded) on real bf16 weights at full width: a model with one block of each kind (SD3.5-M: `transformer_blocks[0]`
dual-attention, `[1]` plain, `[2]` the last; Qwen-Image: one block; FLUX.2-dev: `transformer_blocks[0]` double-stream,
`single_transformer_blocks[0]` single-stream) runs the family's own
`velocity` at 256 image + 32 text tokens; running a kind's block twice gives the bytes of one more block of that kind, and
the full model = the small one + (count - 1) x each kind. Those bytes are **scaled linearly** to 1024x1024 (4096 image
tokens) + the family's text tokens (SD3.5-M 205 as the paper scripts, Qwen-Image 512 = its pipeline's maximum, an upper
bound, FLUX.2-dev 512 = what its pipeline always pads to); the line "four times the tokens gives ..." checks the
linearity on this CPU's memory-efficient attention (4.00 = linear; below 4, a part that does not grow with the tokens,
which the linear scaling overestimates). LoRA is measured as `--mixed-precision` runs (fp32
adapters, bf16 autocast; the adapters' bf16 copies are a separate term: they do not grow with the tokens), full
fine-tuning with every bf16 weight trainable.

Terms (`per_gpu` in the script), micro-batch 1 per rank, one transformer pass per sample (a two-pass CFG training
forward, as GRPO's, doubles the activations): LoRA = bf16 base (also the reference: adapter off) + 16 B per LoRA
parameter (fp32 weight, grad, AdamW m and v) + their bf16 autocast copies (2 B; inside the gathered units with FSDP).
**Full fine-tuning = fp32 master weights + fp32 grads + fp32 AdamW moments (16 B/param), computed in bf16**, + the
frozen bf16 reference copy the KL term needs (2 B/param); without FSDP also autocast's bf16 weight copies kept for the
backward (2 B/param; one block's with checkpointing). (bf16 weights + bf16 grads + fp32 moments would be 12 B/param and
no bf16 copy.) **FSDP** (`fully_shard` per block + root) divides weights, grads, moments and the reference by the ranks;
what it does not divide is added: the root unit gathered for the whole forward/backward (FSDP2 keeps the root
unsharded), the current and the prefetched block gathered in bf16, and for full fine-tuning their unsharded bf16 grads
before the reduce-scatter. Activations, text encoders and the VAE are per rank and not divided. Gradient checkpointing
keeps the activations outside the blocks + every block's input streams + one block recomputed at a time. Without FSDP,
more ranks change nothing per GPU (data parallel replicates everything).

Cells: GB per GPU with the text encoder offloaded to the CPU after encoding the prompts (in brackets: resident on every
GPU). "Fewest H100s": the smallest rank count whose estimate fits {GPU_BUDGET_GB:.0f} GB of an 80 GB H100 (the rest for the
CUDA context, allocator slack, the reward model and sampling buffers), text encoder offloaded (resident); "-": no count
fits. Not included: snapshots some algorithms keep besides the reference (for full fine-tuning each full bf16 copy, e.g.
NFT's sampling policy or an eval EMA, adds 2 B/param / ranks), activation gradients alive during the backward (about a
block's input at a time), the CPU RAM the offloaded encoders take. These are estimates, not GPU measurements.

{body}
Reading (gradient checkpointing on, text encoder offloaded, {GPU_BUDGET_GB:.0f} GB per 80 GB H100):
"""
        + "\n".join(reading)
        + "\n"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", default="grpo,nft,awm,crd,dgpo")
    ap.add_argument("--gc-algos", default="", help="also run these with --gradient-checkpointing")
    ap.add_argument("--resolution", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument(
        "--memory-table",
        action="store_true",
        help="instead of the SD3.5 runs: the per-GPU memory of SD3.5-M, Qwen-Image and FLUX.2-dev at 1/8/16 ranks; with "
        "--out, its section of that file is replaced (the rest kept)",
    )
    ap.add_argument("--child", nargs=4, metavar=("ALGO", "FOLDER", "GC", "DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.resolution, a.child[2] == "1", a.child[3])
    if a.out and not Path(a.out).parent.is_dir():
        print(f"--out {a.out}: the folder {Path(a.out).parent} does not exist", file=sys.stderr)
        sys.exit(2)
    if a.memory_table:
        t0 = time.perf_counter()
        body, summary = memory_table()
        section = memory_section(body, summary, time.perf_counter() - t0)
        print(section)
        if a.out:
            old = Path(a.out).read_text() if Path(a.out).is_file() else ""
            Path(a.out).write_text(old.split(MEMORY_HEADING)[0].rstrip("\n") + "\n\n" + section)
        return
    runs = [(x, False) for x in a.algos.split(",") if x] + [(x, True) for x in a.gc_algos.split(",") if x]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "standin"
        build_standin_pipeline(folder)
        for algo, gc in runs:
            work = Path(tmp) / f"{algo}{'_gc' if gc else ''}"
            work.mkdir()
            cmd = [
                sys.executable,
                __file__,
                "--resolution",
                str(a.resolution),
                "--child",
                algo,
                str(folder),
                str(int(gc)),
                str(work),
            ]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                print(f"{algo} (gc={gc}) failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}", file=sys.stderr)
                continue
            r = json.loads(line[0][7:])
            r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            print(json.dumps(r), flush=True)
    rows = [
        "| algorithm | grad. ckpt | sampling s | training s | peak RSS GB | saved activations GB | GPU est. 512 px GB "
        "(text enc. offloaded) | GPU est. 512 px + grad. ckpt GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["gc"]:  # checkpointing hides the saved activations from the meter: estimates come from the run without
            rows.append(
                f"| {r['algo']} | yes | {r.get('sampling', float('nan')):.0f} | {r.get('training', float('nan')):.0f} | "
                f"{r['peak_rss_gb']:.1f} | - | - | - |"
            )
            continue
        rows.append(
            f"| {r['algo']} | {'yes' if r['gc'] else 'no'} | {r.get('sampling', float('nan')):.0f} | "
            f"{r.get('training', float('nan')):.0f} | {r['peak_rss_gb']:.1f} | {r['saved_gb']:.2f} | "
            f"{gpu_estimate(r, False, False):.1f} ({gpu_estimate(r, False, True):.1f}) | "
            f"{gpu_estimate(r, True, True):.1f} |"
        )
    table = "\n".join(rows)
    print(table)
    if a.out:
        Path(a.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
