"""FLUX.2-dev (Flux2Pipeline) and FLUX.2-klein 4B/9B (Flux2KleinPipeline): what differs from SD3.

Text: hidden states of three text-encoder layers (Mistral-3 10/20/30 for dev, Qwen3 9/18/27 for klein) stacked on the
channel axis, padded to `max_sequence_length`, no mask, no pooled vector (extra = [B, 0]). Latents: the VAE's 2x2
patches as channels, normalised by the VAE's BatchNorm running statistics (no scaling factor): the sampler draws
[4C, h/2, w/2] and the transformer sees them flattened [h/2 * w/2, 4C] with 4-axis position ids (t, row, col, l):
image (0, r, c, 0), text (0, 0, 0, l). timestep = sigma. Shift: mu = `compute_empirical_mu(tokens, num_steps)`, which
depends on the step count too. Guidance: dev has a guidance embedding (single pass, scale 4 typical); klein base
runs two-pass CFG against the negative prompt (two calls, as the pipeline; its `__call__` takes the negative prompt
as `negative_prompt_embeds`); the distilled klein checkpoints (`is_distilled`) run without CFG: the pipeline ignores
the scale for them: `check` refuses a scale > 1 before loading, and the sampler too (`no_cfg`).
"""

import json
from pathlib import Path

import torch

import common
from models import shared


def encode(pipe, prompts, device, max_sequence_length):
    e, _ = pipe.encode_prompt(prompts, device=device, max_sequence_length=max_sequence_length)  # ids rebuilt below
    return e, e.new_zeros(e.shape[0], 0)


def max_sequence_length(pipe, requested):
    return shared.capped_tokens(requested, 512, pipe.tokenizer.model_max_length)  # the pipelines' default


def ids(batch: int, h: int, w: int, text: int, device):
    """(t, row, col, l) position ids: image tokens (0, r, c, 0) row-major, text tokens (0, 0, 0, l)."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    zero = torch.zeros_like(rows)
    img = torch.stack([zero, rows, cols, zero], -1).view(1, -1, 4)
    txt = torch.zeros(1, text, 4, dtype=img.dtype)
    txt[..., 3] = torch.arange(text)
    return img.expand(batch, -1, -1).to(device), txt.expand(batch, -1, -1).to(device)


def velocity(transformer, x, sigma, embeds, extra, neg, guidance_scale):
    b, c, h, w = x.shape
    tokens = x.reshape(b, c, h * w).transpose(1, 2).to(common.model_dtype(transformer))
    guided = transformer.config.guidance_embeds  # FLUX.2-dev: guidance embedding, one pass

    def call(e):
        img_ids, txt_ids = ids(b, h, w, e.shape[1], x.device)
        guidance = torch.full_like(sigma, guidance_scale) if guided else None
        out = transformer(
            hidden_states=tokens,
            timestep=sigma,
            guidance=guidance,
            encoder_hidden_states=e.to(common.model_dtype(transformer)),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0].float()
        return out.transpose(1, 2).reshape(b, c, h, w)

    v = call(embeds)
    if guidance_scale > 1.0 and not guided:  # klein: two-pass CFG
        assert neg is not None, "CFG needs the negative prompt embeddings"
        v = common.cfg(call(neg[0]), v, guidance_scale)
    return v


def latent_shape(pipe, height, width, num_frames):
    factor = pipe.vae_scale_factor
    h, w = (shared.latent_side(s or pipe.default_sample_size * factor, 0, factor, 2) for s in (height, width))
    return pipe.transformer.config.in_channels, h // 2, w // 2


def mu(config, tokens, num_steps):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    return compute_empirical_mu(tokens, num_steps)


NO_NEGATIVE = "FLUX.2-dev's guidance is an embedding (one pass): no negative prompt"


def distilled(model: str, config: dict) -> bool:
    """A distilled FLUX.2-klein (`is_distilled` in its model_index.json), which samples without CFG. A hub id's index
    is not read before loading: the released klein-4B/-9B are distilled, klein-base-* not."""
    if config.get("_class_name") != "Flux2KleinPipeline":
        return False
    local = (Path(model).expanduser() / "model_index.json").is_file()
    return bool(config.get("is_distilled", False)) if local else "base" not in model.lower()


def no_cfg_reason(model: str) -> str:
    return (
        f"{model} is a distilled FLUX.2-klein, which samples without CFG (Flux2KleinPipeline ignores the scale); "
        "sample at 1, or train a klein-base checkpoint"
    )


def check(config, args):
    """FLUX.2-dev takes no negative prompt (its guidance is an embedding); a distilled klein checkpoint, no CFG: not
    at --guidance-scale, --eval-guidance-scale, nor at the KL reference's --kl-cfg (CRD, DGPO)."""
    if config.get("_class_name") != "Flux2KleinPipeline" and args.negative_prompt:
        raise common.UserError(f"--negative-prompt: {NO_NEGATIVE}")
    if not distilled(args.model, config):
        return
    scales = {"--guidance-scale": args.guidance_scale, "--eval-guidance-scale": getattr(args, "eval_guidance_scale", None)}
    if getattr(args, "kl_beta", 0) > 0:
        scales["--kl-cfg"] = getattr(args, "kl_cfg", None)
    for flag, scale in scales.items():
        if scale is not None and scale > 1:
            raise common.UserError(f"{flag} {scale}: {no_cfg_reason(args.model)}")


def card(pipe, call, settings):
    """dev: the guidance embedding, no negative prompt; klein: its negative prompt is "" unless given as embeddings."""
    call = {k: v for k, v in call.items() if k != "negative_prompt"}
    neg = settings.get("negative_prompt")
    if type(pipe.pipe).__name__ == "Flux2KleinPipeline" and float(settings["guidance_scale"]) > 1 and neg:
        call["negative_prompt_embeds"] = (
            f"pipe.encode_prompt([{json.dumps(neg)}] * len(prompt), max_sequence_length={settings['max_sequence_length']})[0]"
        )
    return [], call, "images"


def decode(pipe, z):
    """Undo the BatchNorm normalisation (running statistics, eps), unpatchify 2x2, decode."""
    vae = pipe.vae
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    z = z * std.to(z) + vae.bn.running_mean.view(1, -1, 1, 1).to(z)
    b, c, h, w = z.shape
    z = z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)
    return vae.decode(z.to(vae.dtype), return_dict=False)[0]


FAMILY = common.Family(
    name="flux2",
    pipelines=("Flux2Pipeline", "Flux2KleinPipeline"),
    transformer="Flux2Transformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=decode,
    max_sequence_length=max_sequence_length,
    tokens=lambda shape: shape[1] * shape[2],
    mu=mu,
    check=check,
    no_cfg=lambda pipe: no_cfg_reason(pipe.name_or_path) if pipe.config.get("is_distilled") else None,
    no_negative=lambda pipe: None if type(pipe).__name__ == "Flux2KleinPipeline" else NO_NEGATIVE,
    card=card,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
)
