"""Lumina-Image-2.0 (Lumina2Pipeline): what differs from SD3.

Text: Gemma-2 `hidden_states[-2]` of "<system prompt> <Prompt Start> <prompt>", padded to `max_sequence_length`,
with a token mask (extra = the mask); the negative prompt is encoded without the system prompt, as the pipeline does
(`encode_negative`). Latents [C, h, w] (FLUX.1's VAE: scaling and shift factors; the pipeline fixes the factor to 8).
Time runs the other way: timestep = 1 - sigma, and the output is x0 - eps, so v = -output. Guidance: two passes, then
the pipeline's default `cfg_normalization`: the guided prediction rescaled to the conditional one's norm over the last
(width) axis. The pipeline's `cfg_trunc_ratio` (CFG dropped on late steps; off by default) is not supported. Static
shift (6 in the released scheduler).
"""

import common
from models import shared


def encode(pipe, prompts, device, max_sequence_length):
    e, mask, _, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, device=device, max_sequence_length=max_sequence_length
    )
    return e, mask


def encode_negative(pipe, prompts, device, max_sequence_length):
    return pipe._get_gemma_prompt_embeds(prompts, device=device, max_sequence_length=max_sequence_length)


def max_sequence_length(pipe, requested):
    return requested or 256  # Lumina2Pipeline's default


def velocity(transformer, x, sigma, embeds, mask, neg, guidance_scale):
    dtype = common.model_dtype(transformer)
    t = 1 - sigma * 1000 / 1000  # as the pipeline computes it from its timesteps (1000 sigma)

    def call(e, m):
        return transformer(
            hidden_states=x.to(dtype),
            timestep=t,
            encoder_hidden_states=e.to(dtype),
            encoder_attention_mask=m,
            return_dict=False,
        )[0].float()

    v = call(embeds, mask)
    if guidance_scale > 1.0:
        assert neg is not None, "CFG needs the negative prompt embeddings"
        guided = common.cfg(call(*neg), v, guidance_scale)
        v = guided * (v.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
    return -v


def latent_shape(pipe, height, width, num_frames):
    cfg, factor = pipe.transformer.config, pipe.vae_scale_factor
    h, w = (shared.latent_side(s or pipe.default_image_size, 0, factor, cfg.patch_size) for s in (height, width))
    return cfg.in_channels, h, w


FAMILY = common.Family(
    name="lumina2",
    pipelines=("Lumina2Pipeline",),
    transformer="Lumina2Transformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=shared.vae_decode,
    max_sequence_length=max_sequence_length,
    tokens=lambda shape: shape[1] * shape[2] // 4,
    mu=common.linear_mu,
    encode_negative=encode_negative,
)
