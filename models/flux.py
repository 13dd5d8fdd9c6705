"""FLUX.1-dev / -schnell (FluxPipeline): what differs from SD3.

Text: T5 embeddings only, pooled = CLIP-L's pooled output. Latents [C, h, w] are packed into 2x2-patch tokens
[h/2 * w/2, 4C] for the transformer, with rotary position ids (0, row, col) per image token and zeros for text.
timestep = sigma (the transformer scales by 1000). Dynamic shift: mu linear in the token count (`common.linear_mu`).
Guidance: never two-pass CFG. FLUX.1-dev is guidance-distilled: the scale goes into its guidance embedding
(FluxPipeline's `guidance_scale`, 3.5 typical) and `neg` is unused; FLUX.1-schnell has no guidance embedding and
ignores the scale, as FluxPipeline does. (FluxPipeline's two-pass `true_cfg_scale` is not supported.)
"""

import torch

import common
from models import shared


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> FLUX's token sequence [B, h/2 * w/2, 4 C]: each 2x2 patch becomes one token, row-major,
    channels outermost within a token (`FluxPipeline._pack_latents`)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack_latents`."""
    b, _, d = x.shape
    return x.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def encode(pipe, prompts, device, max_sequence_length):
    e, p, _ = pipe.encode_prompt(prompts, None, device=device, max_sequence_length=max_sequence_length)  # ids rebuilt below
    return e, p


def max_sequence_length(pipe, requested):
    return shared.capped_tokens(requested, 512, pipe.tokenizer_2.model_max_length)  # FluxPipeline's default; T5's maximum


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """Position ids (0, row, col) per 2x2-patch token (FluxPipeline's `_prepare_latent_image_ids`)."""
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], -1).view(-1, 3).to(device, torch.float32)


def velocity(transformer, x, sigma, embeds, pooled, neg, guidance_scale):
    dtype = common.model_dtype(transformer)
    h, w = x.shape[-2:]
    txt_ids = torch.zeros(embeds.shape[1], 3, device=x.device)
    guidance = torch.full_like(sigma, guidance_scale) if transformer.config.guidance_embeds else None
    # FLUX takes timestep = sigma (FluxPipeline passes t / 1000) and scales it, and the guidance, by 1000 itself
    out = transformer(
        hidden_states=pack_latents(x).to(dtype),
        timestep=sigma,
        guidance=guidance,
        encoder_hidden_states=embeds.to(dtype),
        pooled_projections=pooled.to(dtype),
        txt_ids=txt_ids,
        img_ids=image_ids(h, w, x.device),
        return_dict=False,
    )[0].float()
    return unpack_latents(out, h, w)


NO_NEGATIVE = (
    "FLUX.1's guidance is an embedding (one pass): no negative prompt (FluxPipeline's two-pass true_cfg_scale is not "
    "supported)"
)


def check(config, args):
    if args.negative_prompt:
        raise common.UserError(f"--negative-prompt: {NO_NEGATIVE}")


def card(pipe, call, settings):
    """FluxPipeline's `guidance_scale` is the guidance embedding's (FLUX.1-dev; schnell ignores it): no negative prompt."""
    return [], {k: v for k, v in call.items() if k != "negative_prompt"}, "images"


def latent_shape(pipe, height, width, num_frames):
    # latents are packed into 2x2 patches (in_channels = 4 C); FLUX's native size is its VAE's (1024)
    h, w = (shared.latent_side(s or pipe.vae.config.sample_size, 0, pipe.vae_scale_factor, 2) for s in (height, width))
    return pipe.transformer.config.in_channels // 4, h, w


FAMILY = common.Family(
    name="flux",
    pipelines=("FluxPipeline",),
    transformer="FluxTransformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=shared.vae_decode,
    max_sequence_length=max_sequence_length,
    tokens=lambda shape: shape[1] * shape[2] // 4,
    mu=common.linear_mu,
    check=check,
    no_negative=lambda pipe: NO_NEGATIVE,
    card=card,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
)
