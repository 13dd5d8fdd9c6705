"""Sana (SanaPipeline): what differs from SD3.

Text: Gemma-2's last hidden state over a long "complex human instruction" prefix + the prompt, of which the first
token and the last `max_sequence_length` - 1 are kept, right-padded, with a token mask (extra = the mask). The
negative prompt is encoded without the instruction, as the pipeline does (`encode_negative`). Latents [C, h, w] of a
deep-compression autoencoder (factor 32), un-normalised by its scaling factor only. timestep = 1000 sigma x the
transformer's `timestep_scale`; an `out_channels` = 2C transformer's learned-variance half is dropped. Static shift;
the released configs ship DPM-Solver: we sample with FlowMatchEuler at its `flow_shift`. Two-pass CFG batched as 2B.
Sana-Sprint (TrigFlow, SCM scheduler) is not covered.
"""

import inspect

import torch

import common
from models import shared


def instruction(pipe):
    """SanaPipeline.__call__'s default complex human instruction (what the released models were trained with)."""
    return inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default


def encode(pipe, prompts, device, max_sequence_length):
    e, mask, _, _ = pipe.encode_prompt(
        prompts,
        do_classifier_free_guidance=False,
        device=device,
        max_sequence_length=max_sequence_length,
        complex_human_instruction=instruction(pipe),
    )
    return e, mask


def encode_negative(pipe, prompts, device, max_sequence_length):
    return pipe._get_gemma_prompt_embeds(
        prompts, device, pipe.text_encoder.dtype, max_sequence_length=max_sequence_length, complex_human_instruction=False
    )


def max_sequence_length(pipe, requested):
    return requested or 300  # SanaPipeline's default


def velocity(transformer, x, sigma, embeds, mask, neg, guidance_scale):
    dtype, cfg = common.model_dtype(transformer), guidance_scale > 1.0
    if cfg:
        assert neg is not None, "CFG needs the negative prompt embeddings"
        x, sigma, embeds, mask = (
            torch.cat([x, x]),
            torch.cat([sigma, sigma]),
            torch.cat([neg[0], embeds]),
            torch.cat([neg[1], mask]),
        )
    out = transformer(
        hidden_states=x.to(dtype),
        encoder_hidden_states=embeds.to(dtype),
        encoder_attention_mask=mask,
        timestep=sigma * 1000 * transformer.config.timestep_scale,
        return_dict=False,
    )[0].float()
    if out.shape[1] == 2 * x.shape[1]:  # learned variance: keep the prediction half
        out = out.chunk(2, dim=1)[0]
    return common.cfg(*out.chunk(2), guidance_scale) if cfg else out


def card(pipe, call, settings):
    """Sample with our Euler scheduler (the released DPM-Solver's flow_shift) on our grid, without resolution binning."""
    n, shift = settings["num_steps"], pipe.scheduler.config.shift
    setup = [
        "from diffusers import FlowMatchEulerDiscreteScheduler",
        f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift={shift})",
    ]
    call = {**call, "sigmas": f"np.linspace(1.0, 1 / {n}, {n}).tolist()", "use_resolution_binning": "False"}
    return setup, call, "images"


def latent_shape(pipe, height, width, num_frames):
    cfg, factor = pipe.transformer.config, pipe.vae_scale_factor
    h, w = (shared.latent_side(s or cfg.sample_size * factor, 0, factor, cfg.patch_size) for s in (height, width))
    return cfg.in_channels, h, w


FAMILY = common.Family(
    name="sana",
    pipelines=("SanaPipeline",),
    transformer="SanaTransformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=shared.vae_decode,
    max_sequence_length=max_sequence_length,
    scheduler=common.euler_scheduler,
    encode_negative=encode_negative,
    card=card,
)
