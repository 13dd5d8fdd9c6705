"""HunyuanVideo text-to-video (HunyuanVideoPipeline): what differs from SD3.

Text: Llama `hidden_states[-3]` of the prompt inside the pipeline's video-description template, padded to
`max_sequence_length` (256 by default) after the template's first 95 tokens are cut, with its token mask, and CLIP-L's
pooled output; extra = [pooled, mask] in one row per prompt (`split_extra`). Latents are video [C, F', h, w]
(F' = (frames - 1) / 4 + 1, 8x spatial), the transformer patchifies (1, 2, 2) inside; timestep = 1000 sigma; static
shift (7 in the released scheduler) on the grid linspace(1, 1/N, N), which the pipeline passes itself. Guidance: the
released T2V model is guidance-distilled: the scale goes into its guidance embedding (x 1000, as the pipeline) in one
pass, no negative prompt; the pipeline's two-pass `true_cfg_scale` is not supported. Decode: latents / scaling_factor.
Frames per video: --num-frames, default 33 (HunyuanVideo's own is 129; 4k + 1); size: the pipeline's 720 x 1280.
"""

import json
from pathlib import Path

import torch

import common
from models import shared


def encode(pipe, prompts, device, max_sequence_length):
    e, pooled, mask = pipe.encode_prompt(prompts, device=device, max_sequence_length=max_sequence_length)
    return e, torch.cat([pooled, mask.to(pooled.dtype)], 1)


def split_extra(transformer, extra):
    """extra [B, pooled + L] -> (CLIP's pooled vector [B, pooled], the Llama token mask [B, L])."""
    return extra.split(
        [transformer.config.pooled_projection_dim, extra.shape[1] - transformer.config.pooled_projection_dim], 1
    )


def max_sequence_length(pipe, requested):
    return shared.capped_tokens(requested, 256, pipe.tokenizer.model_max_length)  # HunyuanVideoPipeline's default


def velocity(transformer, x, sigma, embeds, extra, neg, guidance_scale):
    dtype = common.model_dtype(transformer)
    pooled, mask = split_extra(transformer, extra)
    guidance = torch.full_like(sigma, guidance_scale).to(dtype) * 1000.0 if transformer.config.guidance_embeds else None
    return transformer(
        hidden_states=x.to(dtype),
        timestep=sigma * 1000,
        encoder_hidden_states=embeds.to(dtype),
        encoder_attention_mask=mask.to(dtype),
        pooled_projections=pooled.to(dtype),
        guidance=guidance,
        return_dict=False,
    )[0].float()


def latent_shape(pipe, height, width, num_frames):
    spatial, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    p = pipe.transformer.config.patch_size
    h, w = (shared.latent_side(s, 0, spatial, p) for s in (height or 720, width or 1280))  # the pipeline's defaults
    if num_frames % temporal != 1 % temporal:
        raise common.UserError(f"--num-frames {num_frames} must be {temporal} k + 1 (the VAE's temporal ratio {temporal})")
    return pipe.transformer.config.in_channels, (num_frames - 1) // temporal + 1, h, w


def decode(pipe, z):
    """latents / scaling_factor in the VAE's dtype, decoded to video [B, F, 3, H, W]."""
    vae = pipe.vae
    return vae.decode(z.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0].transpose(1, 2)


def card(pipe, call, settings):
    """HunyuanVideoPipeline's `guidance_scale` is the guidance embedding's: no negative prompt; the frames, as float
    arrays."""
    call = {k: v for k, v in call.items() if k != "negative_prompt"}
    return [], {**call, "num_frames": str(settings["num_frames"]), "output_type": '"np"'}, "frames"


NO_NEGATIVE = (
    "HunyuanVideo's guidance is an embedding (one pass): no negative prompt (the pipeline's two-pass true_cfg_scale is "
    "not supported)"
)


def check(config, args):
    if args.negative_prompt:
        raise common.UserError(f"--negative-prompt: {NO_NEGATIVE}")
    try:
        vae = json.loads((Path(args.model).expanduser() / "vae" / "config.json").read_text())
    except (OSError, ValueError):
        return  # a hub id: latent_shape checks it once loaded
    temporal = vae.get("temporal_compression_ratio", 4)
    if args.num_frames is not None and args.num_frames % temporal != 1 % temporal:
        raise common.UserError(
            f"--num-frames {args.num_frames} must be {temporal} k + 1 (the VAE's temporal ratio {temporal})"
        )


FAMILY = common.Family(
    name="hunyuanvideo",
    pipelines=("HunyuanVideoPipeline",),
    transformer="HunyuanVideoTransformer3DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=decode,
    max_sequence_length=max_sequence_length,
    tokens=lambda shape: shape[1] * shape[2] * shape[3] // 4,
    num_frames=33,
    card=card,
    check=check,
    no_negative=lambda pipe: NO_NEGATIVE,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
)
