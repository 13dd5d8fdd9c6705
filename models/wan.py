"""Wan2.1 / Wan2.2 text-to-video (WanPipeline): what differs from SD3.

Text: UMT5 embeddings cut to the prompt's true length and zero-padded to `max_sequence_length`, no mask, no pooled
vector (extra = [B, 0]). Latents are video: [C, F', h, w] with F' = (frames - 1) / temporal factor + 1, normalised by
the VAE's latents_mean/std; the transformer patchifies (1, 2, 2) and builds its 3-D rotary embedding inside.
timestep = 1000 sigma, static shift (3 at 480p, 5 at 720p), two-pass CFG (as the pipeline). `decode` returns video
[B, F, 3, H, W]; image rewards score it frame by frame (rewards/video.py). The released configs ship a UniPC
scheduler: we sample with FlowMatchEuler at its `flow_shift`. Not supported: Wan2.2-A14B's second expert
(`transformer_2` below `boundary_ratio`) and Wan2.2-TI2V-5B's per-token timesteps (`expand_timesteps`); there is no
--num-frames flag yet (`NUM_FRAMES` below; Wan's own default is 81).
"""

import torch

import common

NUM_FRAMES = 33  # frames per video the sampler draws (4k + 1 for the released VAE's temporal factor 4)


def encode(pipe, prompts, device, max_sequence_length):
    e, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length, device=device
    )
    return e, e.new_zeros(e.shape[0], 0)


def max_sequence_length(pipe, requested):
    return min(requested or 512, pipe.tokenizer.model_max_length)  # WanPipeline.__call__'s default, capped at the tokenizer's


def velocity(transformer, x, sigma, embeds, extra, neg, guidance_scale):
    dtype = common.model_dtype(transformer)

    def call(e):
        out = transformer(
            hidden_states=x.to(dtype), timestep=sigma * 1000, encoder_hidden_states=e.to(dtype), return_dict=False
        )
        return out[0].float()

    v = call(embeds)
    if guidance_scale > 1.0:
        assert neg is not None, "CFG needs the negative prompt embeddings"
        v = common.cfg(call(neg[0]), v, guidance_scale)
    return v


def latent_shape(pipe, resolution):
    factor = pipe.vae_scale_factor_spatial
    side = common.latent_side(resolution or 480, 0, factor, pipe.transformer.config.patch_size[1])  # Wan2.1 480p's short side
    frames = (NUM_FRAMES - 1) // pipe.vae_scale_factor_temporal + 1
    return pipe.transformer.config.in_channels, frames, side, side


def decode(pipe, z):
    """latents * std + mean, decoded to video [B, F, 3, H, W]."""
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return vae.decode((z * std + mean).to(vae.dtype), return_dict=False)[0].transpose(1, 2)


FAMILY = common.Family(
    name="wan",
    pipelines=("WanPipeline",),
    transformer="WanTransformer3DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=decode,
    max_sequence_length=max_sequence_length,
    scheduler=common.euler_scheduler,
    tokens=lambda shape: shape[1] * shape[2] * shape[3] // 4,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
)
