"""Wan2.1 / Wan2.2 text-to-video (WanPipeline): what differs from SD3.

Text: UMT5 embeddings cut to the prompt's true length and zero-padded to `max_sequence_length`, no mask, no pooled
vector (extra = [B, 0]). Latents are video: [C, F', h, w] with F' = (frames - 1) / temporal factor + 1, normalised by
the VAE's latents_mean/std; the transformer patchifies (1, 2, 2) and builds its 3-D rotary embedding inside.
timestep = 1000 sigma, static shift (3 at 480p, 5 at 720p), two-pass CFG (as the pipeline). `decode` returns video
[B, F, 3, H, W]; image rewards score it frame by frame (rewards/video.py). The released configs ship a UniPC
scheduler: we sample with FlowMatchEuler at its `flow_shift`. Frames per video: --num-frames, default 33 (Wan's own
is 81; 4k + 1 for the released VAE's temporal factor 4); size: WanPipeline's default 480 x 832. Not supported,
refused before loading (`check`): Wan2.2-A14B's second expert (`transformer_2` below `boundary_ratio`) and
Wan2.2-TI2V-5B's per-token timesteps (`expand_timesteps`).
"""

import json
from pathlib import Path

import torch

import common


def encode(pipe, prompts, device, max_sequence_length):
    e, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length, device=device
    )
    return e, e.new_zeros(e.shape[0], 0)


def max_sequence_length(pipe, requested):
    return common.capped_tokens(requested, 512, pipe.tokenizer.model_max_length)  # WanPipeline.__call__'s default


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


def latent_shape(pipe, height, width, num_frames):
    factor, temporal, patch = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal, pipe.transformer.config.patch_size
    h, w = (common.latent_side(s, 0, factor, patch[1]) for s in (height or 480, width or 832))  # WanPipeline's defaults
    if num_frames % temporal != 1 % temporal:
        raise common.UserError(f"--num-frames {num_frames} must be {temporal} k + 1 (the VAE's temporal factor {temporal})")
    return pipe.transformer.config.in_channels, (num_frames - 1) // temporal + 1, h, w


def check(config, args):
    """Wan2.2's two-expert and per-token-timestep checkpoints are refused (a hub id: by its name); --num-frames against
    the VAE's temporal factor, from a local folder's configs before loading."""
    local = (Path(args.model).expanduser() / "model_index.json").is_file()
    name = args.model.lower()
    if (config.get("boundary_ratio") is not None or (config.get("transformer_2") or [None])[0]) if local else "a14b" in name:
        raise common.UserError(
            f"model {args.model!r}: Wan2.2-A14B's second expert (transformer_2 below boundary_ratio) is not supported; "
            f"sampling with the first alone would not be the model"
        )
    if config.get("expand_timesteps") if local else "ti2v" in name:
        raise common.UserError(f"model {args.model!r}: Wan2.2-TI2V's per-token timesteps (expand_timesteps) are not supported")
    try:
        vae = json.loads((Path(args.model).expanduser() / "vae" / "config.json").read_text())
    except (OSError, ValueError):
        return  # a hub id: latent_shape checks it once loaded
    temporal = vae.get("scale_factor_temporal") or 2 ** sum(vae.get("temperal_downsample", []))
    if args.num_frames is not None and args.num_frames % temporal != 1 % temporal:
        raise common.UserError(
            f"--num-frames {args.num_frames} must be {temporal} k + 1 (the VAE's temporal factor {temporal})"
        )


CARD_SCHEDULER = """from diffusers import FlowMatchEulerDiscreteScheduler


class Euler(FlowMatchEulerDiscreteScheduler):  # cleanflow's grid: sigmas linspace(1, 1/N, N), then the shift
    def set_timesteps(self, num_inference_steps, device=None, **kwargs):
        super().set_timesteps(sigmas=np.linspace(1.0, 1 / num_inference_steps, num_inference_steps).tolist(), device=device)


pipe.scheduler = Euler(shift={shift})"""


def card(pipe, call, settings):
    """WanPipeline takes no sigmas: an Euler scheduler (for the released UniPC) that sets our grid; the frames."""
    setup = CARD_SCHEDULER.format(shift=pipe.scheduler.config.shift).splitlines()
    return setup, {**call, "num_frames": str(settings["num_frames"])}, "frames"


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
    num_frames=33,
    card=card,
    check=check,
)
