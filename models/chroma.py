"""Chroma1-HD / -Base (ChromaPipeline): what differs from SD3; FLUX.1's layout without CLIP and guidance embedding.

Text: T5 embeddings encoded with the tokenizer's mask, padded to `max_sequence_length` (512 by default), and a token
mask in which the first padding token stays visible (Chroma's recipe, `ChromaPipeline._get_t5_prompt_embeds`): extra =
that mask. The transformer gets the text mask followed by ones for the image tokens, as a float 0/1 tensor the way the
pipeline builds it (scaled-dot-product attention then adds it to the scores rather than masking: we pass what the
pipeline passes). Latents [C, h, w] packed into FLUX.1's 2x2-patch tokens with its position ids; timestep = sigma
(the transformer scales by 1000); dynamic shift as FLUX.1 (`common.linear_mu`). Guidance: two passes ("true CFG"),
conditional then unconditional, as the pipeline. `--gradient-checkpointing` is refused: diffusers 0.42's
ChromaTransformer2DModel drops the attention mask in its checkpointed single-stream blocks, so training would see
another model than sampling.
"""

import torch

import common
from models import shared
from models.flux import image_ids, pack_latents, unpack_latents


def encode(pipe, prompts, device, max_sequence_length):
    e, _, mask, _, _, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, device=device, max_sequence_length=max_sequence_length
    )
    return e, mask


def max_sequence_length(pipe, requested):
    return shared.capped_tokens(requested, 512, pipe.tokenizer.model_max_length)  # ChromaPipeline's default; T5's maximum


def velocity(transformer, x, sigma, embeds, mask, neg, guidance_scale):
    dtype = common.model_dtype(transformer)
    b, _, h, w = x.shape
    tokens = pack_latents(x).to(dtype)
    ids = image_ids(h, w, x.device)
    t = sigma * 1000 / 1000  # the pipeline's timestep / 1000 of the scheduler's 1000 sigma, bit for bit

    def call(e, m):
        attention_mask = torch.cat([m.to(dtype), m.new_ones(b, tokens.shape[1], dtype=dtype)], 1)
        out = transformer(
            hidden_states=tokens,
            timestep=t,
            encoder_hidden_states=e.to(dtype),
            txt_ids=torch.zeros(e.shape[1], 3, device=x.device),
            img_ids=ids,
            attention_mask=attention_mask,
            return_dict=False,
        )[0]
        return out.float()

    v = call(embeds, mask)
    if guidance_scale > 1.0:
        assert neg is not None, "CFG needs the negative prompt embeddings"
        v = common.cfg(call(*neg), v, guidance_scale)
    return unpack_latents(v, h, w)


def latent_shape(pipe, height, width, num_frames):
    # packed into 2x2 patches (in_channels = 4 C); ChromaPipeline's default size is 128 latents x its VAE factor
    factor = pipe.vae_scale_factor
    h, w = (shared.latent_side(s or pipe.default_sample_size * factor, 0, factor, 2) for s in (height, width))
    return pipe.transformer.config.in_channels // 4, h, w


def check(config, args):
    if getattr(args, "gradient_checkpointing", False):
        raise common.UserError(
            "--gradient-checkpointing: diffusers' ChromaTransformer2DModel drops the text mask in its checkpointed "
            "single-stream blocks, so training would not see the model that samples"
        )


FAMILY = common.Family(
    name="chroma",
    pipelines=("ChromaPipeline",),
    transformer="ChromaTransformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=shared.vae_decode,
    max_sequence_length=max_sequence_length,
    tokens=lambda shape: shape[1] * shape[2] // 4,
    mu=common.linear_mu,
    check=check,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
)
