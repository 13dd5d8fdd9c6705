"""SD3 / SD3.5 (StableDiffusion3Pipeline): the reference family; the others say how they differ from it.

Text: CLIP-L/G + T5 token embeddings concatenated, and both CLIPs' pooled projections. Latents [C, h, w] (the
transformer patchifies inside), timestep = 1000 sigma, static shift, two-pass CFG batched as one 2B call.
"""

from pathlib import Path

import torch

import common
from models import shared


def encode(pipe, prompts, device, max_sequence_length):
    e, _, p, _ = pipe.encode_prompt(
        prompts, None, None, device=device, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length
    )
    return e, p


def max_sequence_length(pipe, requested):
    # without T5 the pipeline pads with zeros of this length; 1 keeps the tiny model cheap (it was trained so)
    return (requested or 128) if pipe.text_encoder_3 is not None else 1


def velocity(transformer, x, sigma, embeds, pooled, neg, guidance_scale):
    """With CFG (scale > 1) one 2B-batch call gives v = v_uncond + g (v_cond - v_uncond)."""
    dtype = common.model_dtype(transformer)
    if guidance_scale > 1.0:
        assert neg is not None, "CFG needs the negative prompt embeddings"
        out = transformer(
            hidden_states=torch.cat([x, x]).to(dtype),
            timestep=torch.cat([sigma, sigma]) * 1000,
            encoder_hidden_states=torch.cat([neg[0], embeds]).to(dtype),
            pooled_projections=torch.cat([neg[1], pooled]).to(dtype),
            return_dict=False,
        )[0].float()
        v_uncond, v_cond = out.chunk(2)
        return common.cfg(v_uncond, v_cond, guidance_scale)
    return transformer(
        hidden_states=x.to(dtype),
        timestep=sigma * 1000,
        encoder_hidden_states=embeds.to(dtype),
        pooled_projections=pooled.to(dtype),
        return_dict=False,
    )[0].float()


def latent_shape(pipe, height, width, num_frames):
    cfg = pipe.transformer.config
    h, w = (shared.latent_side(s, cfg.sample_size, pipe.vae_scale_factor, cfg.patch_size) for s in (height, width))
    return cfg.in_channels, h, w


def card(pipe, call, settings):
    """SD3's pipeline samples on the scheduler's default grid, which `--sigma-schedule scheduler` trained on; the
    default `pipeline` grid is passed explicitly (`common.sigma_schedule`)."""
    n = settings["num_steps"]
    if settings.get("sigma_schedule") == "scheduler":
        return [], call, "images"
    return [], {**call, "sigmas": f"np.linspace(1.0, 1 / {n}, {n}).tolist()"}, "images"


def has_t5(config, local) -> bool:
    """Whether the pipeline loads with T5 (text_encoder_3): a local folder needs its folder (see `load_kwargs`) and an
    index entry that is not [null, null]; a hub id's SD3/SD3.5 have one."""
    if local is None:
        return True
    return (local / "text_encoder_3").is_dir() and (config.get("text_encoder_3") or [None])[0] is not None


def check(config, args):
    """--max-sequence-length sets T5's token count: StableDiffusion3Pipeline refuses more than 512, and without T5 the
    text is CLIP's alone (the flag would change nothing)."""
    n = getattr(args, "max_sequence_length", None)
    if n is None:
        return
    if n > 512:
        raise common.UserError(f"--max-sequence-length {n}: SD3's T5 takes at most 512 tokens (the pipeline's limit)")
    local = Path(args.model).expanduser()
    if not has_t5(config, local if (local / "model_index.json").is_file() else None):
        raise common.UserError(
            f"--max-sequence-length {n}: {args.model} has no T5 (text_encoder_3), whose length it sets: drop the flag"
        )


def load_kwargs(local):
    # T5 (text_encoder_3) is optional: a folder without one loads with None, and the pipeline pads with zeros
    return (
        {"text_encoder_3": None, "tokenizer_3": None} if local is not None and not (local / "text_encoder_3").exists() else {}
    )


FAMILY = common.Family(
    name="sd3",
    pipelines=("StableDiffusion3Pipeline",),
    transformer="SD3Transformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=shared.vae_decode,
    max_sequence_length=max_sequence_length,
    load_kwargs=load_kwargs,
    card=card,
    check=check,
    # `attn.` keeps SD3.5-M's second self-attention `attn2` (dual-attention blocks 0-12: 52 more modules, +27% LoRA
    # parameters) out, as flow_grpo scripts/train_sd3.py:419-428, DiffusionNFT, AWM, DGPO and Flow-Factory do
    lora_targets=tuple(
        "attn." + t for t in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    ),
)
