"""LTX-Video 0.9.x text-to-video (LTXPipeline): what differs from SD3.

Text: T5 embeddings of the prompt padded to `max_sequence_length` (128 by default; T5 runs without the mask) and the
tokenizer's mask, which the transformer turns into an attention bias (extra = that mask). Latents are video
[C, F', h, w] with F' = (frames - 1) / temporal ratio + 1, normalised by the VAE's latents_mean/std and
scaling_factor; the transformer sees them packed into tokens [F' h w, C] (patch 1 x 1 x 1 in the released models) with
rotary positions scaled by (temporal ratio / frame rate, spatial ratio, spatial ratio) at the pipeline's default 25 fps.
timestep = 1000 sigma. Dynamic shift: mu linear in the latent video's F' h w (`common.linear_mu`), then the scheduler's
`shift_terminal`. Guidance: two-pass CFG batched as one 2B call; the pipeline's `guidance_rescale` (0 by default) is
not supported. Decoding: the pipeline's default `decode_timestep` 0 (no decode noise) for the timestep-conditioned VAE
of 0.9.1+. Frames per video: --num-frames, default 33 (LTX's own is 161; 8k + 1 for the released VAE); size: the
pipeline's default 512 x 704.
"""

import json
import weakref
from pathlib import Path

import torch

import common
from models import shared

FRAME_RATE = 25  # LTXPipeline's default `frame_rate`, which only scales the rotary positions
# transformer -> (temporal ratio / frame rate, spatial, spatial): the VAE's ratios, which the transformer's rotary
# positions need and `velocity` (given only the transformer) cannot see; recorded by `latent_shape` at load
ROPE_SCALE = weakref.WeakKeyDictionary()


def encode(pipe, prompts, device, max_sequence_length):
    e, mask, _, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length, device=device
    )
    return e, mask


def max_sequence_length(pipe, requested):
    return shared.capped_tokens(requested, 128, pipe.tokenizer.model_max_length)  # LTXPipeline's default


def pack_latents(x: torch.Tensor, p: int, pt: int) -> torch.Tensor:
    """[B, C, F, h, w] -> tokens [B, F/pt * h/p * w/p, C pt p p] (`LTXPipeline._pack_latents`)."""
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f // pt, pt, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_latents(x: torch.Tensor, f: int, h: int, w: int, p: int, pt: int) -> torch.Tensor:
    """The inverse of `pack_latents`, for the unpatched latent sizes f, h, w."""
    b = x.shape[0]
    x = x.reshape(b, f // pt, h // p, w // p, -1, pt, p, p)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def velocity(transformer, x, sigma, embeds, mask, neg, guidance_scale):
    dtype = common.model_dtype(transformer)
    p, pt = transformer.config.patch_size, transformer.config.patch_size_t
    _, _, f, h, w = x.shape
    tokens, t = pack_latents(x, p, pt), sigma * 1000
    if guidance_scale > 1.0:  # one 2B call, the negative prompt first, as the pipeline
        assert neg is not None, "CFG needs the negative prompt embeddings"
        tokens, t = torch.cat([tokens, tokens]), torch.cat([t, t])
        embeds, mask = torch.cat([neg[0], embeds]), torch.cat([neg[1], mask])
    out = transformer(
        hidden_states=tokens.to(dtype),
        encoder_hidden_states=embeds.to(dtype),
        timestep=t,
        encoder_attention_mask=mask,
        num_frames=f,
        height=h,
        width=w,
        rope_interpolation_scale=ROPE_SCALE[transformer],
        return_dict=False,
    )[0].float()
    if guidance_scale > 1.0:
        out = common.cfg(*out.chunk(2), guidance_scale)
    return unpack_latents(out, f, h, w, p, pt)


def latent_shape(pipe, height, width, num_frames):
    spatial, temporal = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
    cfg = pipe.transformer.config
    ROPE_SCALE[pipe.transformer] = (temporal / FRAME_RATE, spatial, spatial)
    h, w = (shared.latent_side(s, 0, spatial, cfg.patch_size) for s in (height or 512, width or 704))  # the defaults
    if num_frames % temporal != 1 % temporal:
        raise common.UserError(f"--num-frames {num_frames} must be {temporal} k + 1 (the VAE's temporal ratio {temporal})")
    return cfg.in_channels, (num_frames - 1) // temporal + 1, h, w


def decode(pipe, z):
    """latents * std / scaling_factor + mean, decoded at the pipeline's default decode timestep 0, to video
    [B, F, 3, H, W]."""
    vae = pipe.vae
    mean, std = (s.view(1, -1, 1, 1, 1).to(z) for s in (vae.latents_mean, vae.latents_std))
    z = (z * std / vae.config.scaling_factor + mean).to(vae.dtype)
    temb = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device) if vae.config.timestep_conditioning else None
    return vae.decode(z, temb, return_dict=False)[0].transpose(1, 2)


def card(pipe, call, settings):
    """LTXPipeline sets our grid itself (linspace sigmas with the dynamic shift); the frames, as float arrays."""
    return [], {**call, "num_frames": str(settings["num_frames"]), "output_type": '"np"'}, "frames"


def check(config, args):
    """--num-frames against the VAE's temporal ratio, from a local folder's configs before loading."""
    try:
        vae = json.loads((Path(args.model).expanduser() / "vae" / "config.json").read_text())
    except (OSError, ValueError):
        return  # a hub id: latent_shape checks it once loaded
    temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2 ** sum(
        vae.get("spatio_temporal_scaling", [])
    )
    if args.num_frames is not None and args.num_frames % temporal != 1 % temporal:
        raise common.UserError(
            f"--num-frames {args.num_frames} must be {temporal} k + 1 (the VAE's temporal ratio {temporal})"
        )


FAMILY = common.Family(
    name="ltx",
    pipelines=("LTXPipeline",),
    transformer="LTXVideoTransformer3DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=decode,
    max_sequence_length=max_sequence_length,
    tokens=lambda shape: shape[1] * shape[2] * shape[3],  # the pipeline's video_sequence_length: unpatched latents
    mu=common.linear_mu,
    num_frames=33,
    card=card,
    check=check,
)
