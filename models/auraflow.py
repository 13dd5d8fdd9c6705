"""AuraFlow v0.1-v0.3 (AuraFlowPipeline): what differs from SD3.

Text: the last hidden state of its UMT5 encoder (Pile-T5 tokenizer), encoded with the tokenizer's mask, padded to
`max_sequence_length` (256 by default) and multiplied by the mask, so padding tokens are zeros; the transformer gets no
mask and attends to them (extra = [B, 0]). Latents [C, h, w] (the transformer patchifies inside, with a learned
position table cropped from the centre of a square grid); timestep = sigma (the transformer scales by 1000). Static
shift (1.73 in the released scheduler); the pipeline passes no sigmas by default, so its grid is the scheduler's own
(`sd3.card` passes ours). Guidance: two-pass CFG batched as one 2B call, as SD3. Decode: latents / scaling_factor,
no shift factor, as the pipeline.
"""

import torch

import common
from models import sd3, shared


def encode(pipe, prompts, device, max_sequence_length):
    e, _, _, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, device=device, max_sequence_length=max_sequence_length
    )
    return e, e.new_zeros(e.shape[0], 0)


def max_sequence_length(pipe, requested):
    return shared.capped_tokens(requested, 256, pipe.tokenizer.model_max_length)  # AuraFlowPipeline's default


def velocity(transformer, x, sigma, embeds, extra, neg, guidance_scale):
    dtype = common.model_dtype(transformer)
    t = sigma * 1000 / 1000  # the pipeline's t / 1000 of the scheduler's 1000 sigma, bit for bit
    if guidance_scale > 1.0:
        assert neg is not None, "CFG needs the negative prompt embeddings"
        out = transformer(
            torch.cat([x, x]).to(dtype),
            encoder_hidden_states=torch.cat([neg[0], embeds]).to(dtype),
            timestep=torch.cat([t, t]),
            return_dict=False,
        )[0].float()
        v_uncond, v_cond = out.chunk(2)
        return common.cfg(v_uncond, v_cond, guidance_scale)
    return transformer(x.to(dtype), encoder_hidden_states=embeds.to(dtype), timestep=t, return_dict=False)[0].float()


def latent_shape(pipe, height, width, num_frames):
    cfg, factor = pipe.transformer.config, pipe.vae_scale_factor
    # AuraFlowPipeline's default size is 1024 x 1024 (not the transformer's sample_size)
    h, w = (shared.latent_side(s or 1024, 0, factor, cfg.patch_size) for s in (height, width))
    side = int(cfg.pos_embed_max_size**0.5)  # the position table is a side x side grid of patches
    if max(h, w) // cfg.patch_size > side:
        raise common.UserError(
            f"size {h * factor} x {w * factor}: AuraFlow's position table covers at most {side * cfg.patch_size * factor} "
            "pixels a side"
        )
    return cfg.in_channels, h, w


def decode(pipe, z):
    """latents / scaling_factor in the VAE's dtype, decoded: AuraFlowPipeline applies no shift factor."""
    vae = pipe.vae
    return vae.decode(z.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]


FAMILY = common.Family(
    name="auraflow",
    pipelines=("AuraFlowPipeline",),
    transformer="AuraFlowTransformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=decode,
    max_sequence_length=max_sequence_length,
    card=sd3.card,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
)
