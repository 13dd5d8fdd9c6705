"""FLUX.1-Kontext (FluxKontextPipeline): FLUX.1 that edits a reference image; what differs from models/flux.py.

Reference image: encoded once by the VAE (the posterior's mode, then (z - shift_factor) x scaling_factor, as the
pipeline's `_encode_vae_image`) and cached with the prompt's text (`common.PromptEncoder.images`). At every step its
latents are packed into 2x2-patch tokens like the sampled ones and appended to the image token sequence, with position
ids (1, row, col) where the sampled tokens have (0, row, col); the velocity is the transformer's output on the sampled
tokens only. The dynamic shift counts the sampled tokens only, as the pipeline's `image_seq_len` does.

The reference image must have the sampled size (`check`): FluxKontextPipeline resizes an image to the nearest of its
preferred resolutions (`_auto_resize`) and the output to `max_area` pixels (1024^2 by default); the model card passes
`_auto_resize=False` and `max_area=height x width`, under which the pipeline takes the image and the size as they are.
A prompt without an image samples from the text alone, as the pipeline does with `image=None`.

Guidance: as FLUX.1-dev, an embedding (FLUX.1-Kontext-dev is guidance-distilled, 2.5 typical), one pass, no negative
prompt (the pipeline's two-pass `true_cfg_scale` is not supported).
"""

import json
from pathlib import Path

import torch

import common
from harness import prompt_files
from models import flux

NO_NEGATIVE = (
    "FLUX.1-Kontext's guidance is an embedding (one pass): no negative prompt (FluxKontextPipeline's two-pass "
    "true_cfg_scale is not supported)"
)


def encode_image(pipe, pixels):
    """Pixels [B, 3, H, W] in [-1, 1] -> reference latents [B, C, H/f, W/f] (FluxKontextPipeline._encode_vae_image)."""
    vae = pipe.vae
    z = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
    return ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()


def reference_ids(h: int, w: int, device) -> torch.Tensor:
    """The reference tokens' position ids: the sampled tokens' (0, row, col) with the first component 1."""
    ids = flux.image_ids(h, w, device)
    ids[:, 0] = 1
    return ids


def velocity(transformer, x, sigma, embeds, pooled, neg, guidance_scale, image=None):
    """FLUX.1's velocity (`flux.velocity`); with reference latents `image` [B, C, h', w'] their tokens join the
    sequence and the output is cut back to the sampled tokens."""
    if image is None:
        return flux.velocity(transformer, x, sigma, embeds, pooled, neg, guidance_scale)
    dtype = common.model_dtype(transformer)
    h, w = x.shape[-2:]
    tokens = flux.pack_latents(x)
    guidance = torch.full_like(sigma, guidance_scale) if transformer.config.guidance_embeds else None
    out = transformer(
        hidden_states=torch.cat([tokens, flux.pack_latents(image.to(x))], 1).to(dtype),
        timestep=sigma,
        guidance=guidance,
        encoder_hidden_states=embeds.to(dtype),
        pooled_projections=pooled.to(dtype),
        txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device),
        img_ids=torch.cat([flux.image_ids(h, w, x.device), reference_ids(*image.shape[-2:], x.device)]),
        return_dict=False,
    )[0][:, : tokens.shape[1]].float()
    return flux.unpack_latents(out, h, w)


def native_size(model: Path) -> int:
    """The pixels per side the family samples without --resolution (`flux.latent_shape`: the VAE's sample_size), read
    from the folder's VAE config before loading; None when it cannot be read (load_pipeline reports it)."""
    try:
        return json.loads((model / "vae" / "config.json").read_text())["sample_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check(config, args):
    """Before loading: no negative prompt (`flux.check`), and every reference image of the prompt files at the size
    the model samples (--height/--width, else --resolution, else the VAE's sample_size)."""
    if args.negative_prompt:
        raise common.UserError(f"--negative-prompt: {NO_NEGATIVE}")
    native = native_size(Path(args.model).expanduser())
    height = getattr(args, "height", None) or args.resolution or native
    width = getattr(args, "width", None) or args.resolution or native
    if height is None or width is None:  # a hub id: `PromptEncoder` checks the latents once the model is loaded
        return
    for name in ("train_prompts", "test_prompts"):
        path = getattr(args, name, None)
        if path is not None:
            check_images(prompt_files.load_prompts(path), (width, height), f"--{name.replace('_', '-')} {path}")


def check_images(prompts, size, flag):
    """Every reference image at `size` (width, height), the sampled size: the reference latents share the sampled
    latents' grid, and FluxKontextPipeline called with `_auto_resize=False` does not resize them (`card`)."""
    prompt_files.check_image_sizes(prompts, *size, flag)


def card(pipe, call, settings):
    """FluxKontextPipeline's call with the reference image (loaded as `load_image` reads it) at the sampled size:
    `_auto_resize=False` and `max_area=height x width` keep the pipeline from resizing the image or the output."""
    _, call, output = flux.card(pipe, call, settings)
    factor = pipe.vae_scale_factor
    height, width = (side * factor for side in pipe.latent_shape[-2:])
    setup = [
        "from diffusers.utils import load_image",
        f'image = load_image("image.png")  # the image to edit: {width} x {height} pixels, as in training',
    ]
    call = {"image": "image", **call, "height": str(height), "width": str(width)}
    call |= {"max_area": str(height * width), "_auto_resize": "False"}
    return setup, call, output


FAMILY = common.Family(
    name="flux_kontext",
    pipelines=("FluxKontextPipeline",),
    transformer="FluxTransformer2DModel",
    encode=flux.encode,
    velocity=velocity,
    latent_shape=flux.latent_shape,
    decode=flux.FAMILY.decode,
    max_sequence_length=flux.max_sequence_length,
    tokens=flux.FAMILY.tokens,
    mu=common.linear_mu,
    check=check,
    check_images=check_images,
    no_negative=lambda pipe: NO_NEGATIVE,
    card=card,
    lora_targets=flux.FAMILY.lora_targets,
    encode_image=encode_image,
)
