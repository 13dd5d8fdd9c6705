"""CogView4 (CogView4Pipeline): what differs from SD3.

Text: GLM-4 `hidden_states[-2]`, no mask, no pooled vector (extra = [B, 0]). As the pipeline's `_get_glm_embeds`, a
batch is tokenized to its longest prompt (cut at `max_sequence_length`, default 1024 as the pipeline's) and left-padded
with pad tokens to a multiple of 16; GLM attends to that padding, so a prompt's embedding depends on its batch
(`text_length`; `common.PromptEncoder` caches per (prompt, length)). The negative prompt is encoded alone, at its own
length, as the pipeline encodes [negative] * B. SDXL-style micro-conditioning: original = target size = the image's
pixels (8 x the latents: CogView4's VAE), crop (0, 0). Shift: mu = 0.75 sqrt(tokens / 256) + 0.25 applied as the
scheduler's linear time shift sigma' = mu / (mu + 1/sigma - 1); the transformer is conditioned on the *unshifted* time
(the pipeline passes its unshifted grid as timesteps), so `velocity` inverts the shift: t = 1000 / (1 + mu (1/sigma'
- 1)). Two-pass CFG, as the pipeline.
"""

import torch

import common
from models import shared

VAE_FACTOR = 8  # CogView4-6B's VAE: the micro-conditioning sizes are in pixels
SHIFT = dict(
    base_image_seq_len=256, base_shift=0.25, max_shift=0.75
)  # the released scheduler config (and the pipeline's defaults)


def mu(config, tokens, num_steps):
    """CogView4Pipeline's `calculate_shift`: mu = max_shift sqrt(tokens / base) + base_shift."""
    cfg = {k: config.get(k, v) for k, v in SHIFT.items()}
    return (tokens / cfg["base_image_seq_len"]) ** 0.5 * cfg["max_shift"] + cfg["base_shift"]


def text_length(pipe, prompts, max_sequence_length):
    """The batch's longest prompt in tokens, cut at `max_sequence_length` (`_get_glm_embeds`' padding="longest")."""
    ids = pipe.tokenizer(list(prompts), max_length=max_sequence_length, truncation=True, add_special_tokens=True).input_ids
    return max(len(i) for i in ids)


def encode(pipe, prompts, device, max_sequence_length, length=None):
    """`_get_glm_embeds` of a batch whose longest prompt has `length` tokens (default: these prompts' longest)."""
    length = length or text_length(pipe, prompts, max_sequence_length)
    ids = pipe.tokenizer(
        list(prompts), padding="max_length", max_length=length, truncation=True, add_special_tokens=True, return_tensors="pt"
    ).input_ids
    pad = torch.full((ids.shape[0], -length % 16), pipe.tokenizer.pad_token_id, dtype=ids.dtype)
    ids = torch.cat([pad, ids], 1)  # to a multiple of 16, on the left whatever the tokenizer's side (as the pipeline)
    e = pipe.text_encoder(ids.to(device), output_hidden_states=True).hidden_states[-2].to(pipe.text_encoder.dtype)
    return e, e.new_zeros(e.shape[0], 0)


def max_sequence_length(pipe, requested):
    return requested or 1024  # CogView4Pipeline's default


def velocity(transformer, x, sigma, embeds, extra, neg, guidance_scale):
    dtype, (b, _, h, w) = common.model_dtype(transformer), x.shape
    m = mu({}, h * w // transformer.config.patch_size**2, 0)
    t = 1000 / (1 + m * (1 / sigma - 1))  # the unshifted time of sigma
    size = torch.tensor([[h * VAE_FACTOR, w * VAE_FACTOR]], dtype=dtype, device=x.device).expand(b, 2)
    crop = torch.zeros(b, 2, dtype=dtype, device=x.device)

    def call(e):
        return transformer(
            hidden_states=x.to(dtype),
            encoder_hidden_states=e.to(dtype),
            timestep=t,
            original_size=size,
            target_size=size,
            crop_coords=crop,
            return_dict=False,
        )[0].float()

    v = call(embeds)
    if guidance_scale > 1.0:
        assert neg is not None, "CFG needs the negative prompt embeddings"
        v = common.cfg(call(neg[0]), v, guidance_scale)
    return v


def latent_shape(pipe, height, width, num_frames):
    cfg, factor = pipe.transformer.config, pipe.vae_scale_factor
    h, w = (shared.latent_side(s or cfg.sample_size * factor, 0, factor, cfg.patch_size) for s in (height, width))
    return cfg.in_channels, h, w


def card(pipe, call, settings):
    """The pipeline takes the unshifted grid as integer timesteps (exact when the step count divides 1000)."""
    n = settings["num_steps"]
    return [], {**call, "timesteps": f"np.linspace(1000, 1000 / {n}, {n}).tolist()"}, "images"


FAMILY = common.Family(
    name="cogview4",
    pipelines=("CogView4Pipeline",),
    transformer="CogView4Transformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=shared.vae_decode,
    max_sequence_length=max_sequence_length,
    tokens=lambda shape: shape[1] * shape[2] // 4,
    mu=mu,
    text_length=text_length,
    card=card,
)
