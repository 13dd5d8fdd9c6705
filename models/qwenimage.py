"""Qwen-Image and Qwen-Image-2512 (QwenImagePipeline): what differs from SD3.

Text: the last hidden state of Qwen2.5-VL over a chat template (its first 34 tokens dropped), variable length, with a
token mask (extra = the mask; no pooled vector). Latents: the 3-D VAE's [C, 1, H, W] without the frame axis,
[C, h, w], normalised by the VAE's latents_mean/std; the transformer sees them packed into 2x2-patch tokens like
FLUX.1 and builds its rotary embedding from `img_shapes`. timestep = sigma. Shift: mu linear in the token count
(`common.linear_mu` with the released base 0.5 / max 0.9 over 256..8192 tokens) and the scheduler's own
`shift_terminal`. Guidance: two-pass CFG ("true CFG", as the pipeline's `true_cfg_scale`) followed by a per-token
rescale of the combined prediction to the conditional one's norm.
"""

import json

import torch

import common
from models import shared
from models.flux import pack_latents, unpack_latents


def encode(pipe, prompts, device, max_sequence_length):
    e, mask = pipe.encode_prompt(prompts, device=device, max_sequence_length=max_sequence_length)
    return e, torch.ones(e.shape[:2], dtype=torch.long, device=e.device) if mask is None else mask


def max_sequence_length(pipe, requested):
    return requested or 512  # the pipeline's default for __call__


def velocity(transformer, x, sigma, embeds, mask, neg, guidance_scale, image=None):
    """Qwen-Image's velocity; with reference latents `image` [B, C, h', w'] (Qwen-Image-Edit) their 2x2-patch tokens
    follow the sampled ones, `img_shapes` lists both grids, and each pass's output is cut to the sampled tokens before
    CFG (as QwenImageEditPipeline)."""
    b, _, h, w = x.shape
    tokens = pack_latents(x).to(common.model_dtype(transformer))
    sampled, shapes = tokens.shape[1], [(1, h // 2, w // 2)]
    if image is not None:
        tokens = torch.cat([tokens, pack_latents(image.to(x)).to(tokens.dtype)], 1)
        shapes.append((1, image.shape[-2] // 2, image.shape[-1] // 2))
    guidance = torch.full_like(sigma, guidance_scale) if transformer.config.guidance_embeds else None

    def call(e, m):
        n = int(m.sum(1).max())  # the batch's longest prompt: the rest is padding, masked out
        e, m = e[:, :n], m[:, :n]
        out = transformer(
            hidden_states=tokens,
            timestep=sigma,
            guidance=guidance,
            encoder_hidden_states=e.to(common.model_dtype(transformer)),
            encoder_hidden_states_mask=None if bool(m.all()) else m,
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0][:, :sampled]
        return out.float()  # as the pipeline: None when nothing is padded

    v = call(embeds, mask)
    if guidance_scale > 1.0 and guidance is None:
        assert neg is not None, "CFG needs the negative prompt embeddings"
        combined = common.cfg(call(*neg), v, guidance_scale)
        v = combined * (v.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))  # per token, as QwenImagePipeline
    return unpack_latents(v, h, w)


def card(pipe, call, settings):
    """QwenImagePipeline's CFG is `true_cfg_scale`, on only with a negative prompt; its `guidance_scale` is the
    guidance embedding's (none in the released models)."""
    call = {k: v for k, v in call.items() if k not in ("guidance_scale", "negative_prompt")}
    call["true_cfg_scale"] = repr(float(settings["guidance_scale"]))
    if float(settings["guidance_scale"]) > 1:
        call["negative_prompt"] = f"[{json.dumps(settings.get('negative_prompt') or '')}] * len(prompt)"
    return [], call, "images"


def latent_shape(pipe, height, width, num_frames):
    factor = pipe.vae_scale_factor
    h, w = (shared.latent_side(s or pipe.default_sample_size * factor, 0, factor, 2) for s in (height, width))
    return pipe.transformer.config.in_channels // 4, h, w


def decode(pipe, z):
    """latents * std + mean on the 3-D VAE's single frame, decoded."""
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return vae.decode((z[:, :, None] * std + mean).to(vae.dtype), return_dict=False)[0][:, :, 0]


FAMILY = common.Family(
    name="qwenimage",
    pipelines=("QwenImagePipeline",),
    transformer="QwenImageTransformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=decode,
    max_sequence_length=max_sequence_length,
    tokens=lambda shape: shape[1] * shape[2] // 4,
    mu=common.linear_mu,
    card=card,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
)
