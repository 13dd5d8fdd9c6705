"""Z-Image and Z-Image-Turbo (ZImagePipeline): what differs from SD3.

Text: Qwen3 `hidden_states[-2]` of the chat-templated prompt, only its unmasked tokens (variable length; extra = the
token mask). The transformer takes unbatched lists (latents [C, 1, h, w] each, text [L_i, D] each) and patchifies
inside. Time runs the other way: timestep = 1 - sigma (0 = noise), and the output is x0 - eps, so v = -output.
Guidance: two-pass CFG batched as one 2B call, written as the pipeline's pos + (g - 1)(pos - neg), which is
v_uncond + g (v_cond - v_uncond): cleanflow's `guidance_scale` g is ZImagePipeline's `guidance_scale` + 1 (Turbo: 1, no
CFG). The pipeline's optional CFG truncation and norm clamp (off by default) are not supported. Static shift (Turbo 3).
"""

import torch

import common
from models import shared


def encode(pipe, prompts, device, max_sequence_length):
    # ZImagePipeline rewrites the list it gets with the chat-templated text: give it a copy
    embeds = pipe.encode_prompt(
        list(prompts), device=device, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length
    )[0]
    mask = [torch.ones(len(e), dtype=torch.long, device=e.device) for e in embeds]
    return common.pad_stack(embeds), common.pad_stack(mask)


def max_sequence_length(pipe, requested):
    return shared.capped_tokens(requested, 512, pipe.tokenizer.model_max_length)  # the pipeline's default


def velocity(transformer, x, sigma, embeds, mask, neg, guidance_scale):
    b = x.shape[0]
    text = [e[m.bool()].to(common.model_dtype(transformer)) for e, m in zip(embeds, mask)]
    cfg = guidance_scale > 1.0
    if cfg:
        assert neg is not None, "CFG needs the negative prompt embeddings"
        text += [e[m.bool()].to(common.model_dtype(transformer)) for e, m in zip(*neg)]
    latents = list(x.to(common.model_dtype(transformer)).unsqueeze(2).unbind(0)) * (2 if cfg else 1)
    t = (1 - sigma).repeat(2 if cfg else 1)
    out = torch.stack([o.float() for o in transformer(latents, t, text, return_dict=False)[0]]).squeeze(2)
    if cfg:
        pos, neg_out = out[:b], out[b:]
        out = pos + (guidance_scale - 1) * (pos - neg_out)
    return -out


def card(pipe, call, settings):
    """ZImagePipeline's guidance_scale is ours - 1 (CFG on above 0)."""
    call = {**call, "guidance_scale": repr(float(settings["guidance_scale"]) - 1)}
    if "negative_prompt" in call:
        call["negative_prompt"] = f"[{call['negative_prompt']}] * len(prompt)"
    return [], call, "images"


def latent_shape(pipe, height, width, num_frames):
    factor, patch = pipe.vae_scale_factor, pipe.transformer.config.all_patch_size[0]
    h, w = (
        shared.latent_side(s or 1024, 0, factor, patch) for s in (height, width)
    )  # the pipeline's default height and width
    return pipe.transformer.config.in_channels, h, w


FAMILY = common.Family(
    name="zimage",
    pipelines=("ZImagePipeline",),
    transformer="ZImageTransformer2DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=shared.vae_decode,
    max_sequence_length=max_sequence_length,
    tokens=lambda shape: shape[1] * shape[2] // 4,
    mu=common.linear_mu,
    card=card,
)
