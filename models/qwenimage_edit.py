"""Qwen-Image-Edit (QwenImageEditPipeline): Qwen-Image that edits a reference image; what differs from
models/qwenimage.py.

Reference image: the pipeline resizes every input image to about REFERENCE_AREA pixels at its aspect ratio, each side
a multiple of 32 (`reference_size`, its `calculate_dimensions`), whatever size it samples at; that copy is what both
encoders see. (1) The VAE: the posterior's mode, normalised as the sampled latents ((z - latents_mean) / latents_std,
the pipeline's `_encode_vae_image`), encoded once per image (`common.PromptEncoder.images`); at every step its
2x2-patch tokens follow the sampled ones, `img_shapes` lists both grids, and the output is cut to the sampled tokens
(`qwenimage.velocity`). (2) The text encoder, Qwen2.5-VL: the prompt goes into a chat template whose user turn holds
the image's vision tokens (<|vision_start|><|image_pad|><|vision_end|>, expanded by the pipeline's Qwen2VLProcessor,
which resizes its own copy again to its pixel bounds), the first 64 tokens dropped; so the family's `encode` receives
the `Prompt` records (`Family.encode_records`) and the negative prompt is encoded on each prompt's image
(`PromptEncoder.negative`). The pipeline passes the whole template untruncated: a `max_sequence_length` is refused.

Every prompt needs an image (the pipeline fails without one), and one prompt file's images resize to one size (a
batch's reference latents are stacked): `check`, before loading. The sampled size is the run's (--height/--width,
else Qwen-Image's default); the model card passes it, since the pipeline would otherwise sample at the reference size.
Guidance: true CFG with a negative prompt and Qwen-Image's per-token rescale (`qwenimage.velocity`); the shift counts
the sampled tokens only, as the pipeline's `image_seq_len`.
"""

import importlib.util
import math

import torch

import common
from harness import prompt_files
from models import qwenimage

REFERENCE_AREA = 1024 * 1024  # the pixels QwenImageEditPipeline.__call__ resizes an input image to
MAX_ASPECT = 200  # Qwen2VLImageProcessor's `smart_resize` refuses a longer side over 200 times the shorter


def reference_size(size: tuple) -> tuple:
    """(width, height) of the pipeline's copy of an image of `size` (width, height): REFERENCE_AREA pixels at the
    image's aspect ratio, each side rounded to the nearest multiple of 32 (QwenImageEditPipeline's
    `calculate_dimensions`, computed in the same order, so the same floats round)."""
    ratio = size[0] / size[1]
    width = math.sqrt(REFERENCE_AREA * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def reference_image(pipe, record):
    """The copy of `record`'s image both encoders see: read as `prompt_files.load_image`, resized as the pipeline does
    (its VaeImageProcessor.resize, Lanczos)."""
    width, height = reference_size(record.size)
    return pipe.image_processor.resize(prompt_files.load_image(record.image), height, width)


def encode(pipe, prompts, device, max_sequence_length):
    """`Prompt` records -> (embeds, mask): Qwen2.5-VL's last hidden state over the edit template with each record's
    image (`reference_image`), as QwenImageEditPipeline.encode_prompt; one image per prompt, in order."""
    for prompt in prompts:
        if not isinstance(prompt, prompt_files.Prompt):  # `check` refuses a text-only prompt file before loading
            raise common.UserError(f"prompt {common.short(prompt)}: {NEEDS_IMAGE}")
    images = [reference_image(pipe, p) for p in prompts]
    e, mask = pipe.encode_prompt([p.text for p in prompts], image=images, device=device)
    return e, torch.ones(e.shape[:2], dtype=torch.long, device=e.device) if mask is None else mask


NEEDS_IMAGE = 'QwenImageEditPipeline edits an image: every prompt needs one (a jsonl line {"prompt": ..., "image": ...})'


NO_LENGTH = "QwenImageEditPipeline encodes the whole prompt template with the image's tokens, untruncated"


def max_sequence_length(pipe, requested):
    """None asked for: Qwen-Image's default, which the card passes and the pipeline does not use; a length asked for
    would be ignored, so it is refused."""
    if requested is not None:
        raise common.UserError(f"--max-sequence-length {requested}: {NO_LENGTH}")
    return qwenimage.max_sequence_length(pipe, None)


def encode_image(pipe, pixels):
    """Pixels [B, 3, H, W] in [-1, 1] -> reference latents [B, C, H/f, W/f]: the 3-D VAE's posterior mode of the single
    frame, (z - latents_mean) / latents_std (QwenImageEditPipeline._encode_vae_image)."""
    vae = pipe.vae
    z = vae.encode(pixels[:, :, None].to(vae.dtype)).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return ((z - mean) / std)[:, :, 0].float()


def check(config, args):
    """Before loading: no --max-sequence-length, every prompt carries an image, whose pipeline copy the VL processor
    takes (aspect at most MAX_ASPECT), and one prompt file's images resize to one size (`reference_size`)."""
    if getattr(args, "max_sequence_length", None) is not None:
        raise common.UserError(f"--max-sequence-length {args.max_sequence_length}: {NO_LENGTH}")
    for name in ("train_prompts", "test_prompts"):
        path = getattr(args, name, None)
        if path is None:
            continue
        check_images(prompt_files.load_prompts(path), None, f"--{name.replace('_', '-')} {path}")


def check_images(prompts, size, flag):
    """Every prompt carries an image, whose pipeline copy the VL processor takes (aspect at most MAX_ASPECT), and all
    resize to one size (`reference_size`: a batch's reference latents are stacked). Any image size (`size`, the
    sampled one, is not used): the pipeline resizes it."""
    if not isinstance(prompts[0], prompt_files.Prompt):
        raise common.UserError(f"{flag}: {NEEDS_IMAGE}")
    first = reference_size(prompts[0].size)
    for prompt in prompts:
        width, height = resized = reference_size(prompt.size)
        if min(resized) == 0 or max(resized) / min(resized) > MAX_ASPECT:
            raise common.UserError(
                f"{flag}: prompt {common.short(prompt)}: its image ({prompt.size[0]} x {prompt.size[1]} pixels) "
                f"resizes to {width} x {height} for Qwen-Image-Edit, beyond the VL processor's {MAX_ASPECT}:1 aspect"
            )
        if resized != first:
            raise common.UserError(
                f"{flag}: prompt {common.short(prompt)}: its image resizes to {width} x {height} for Qwen-Image-Edit, "
                f"the first prompt's to {first[0]} x {first[1]}: one file's images need one aspect ratio (a batch's "
                "reference latents are stacked)"
            )


def load_processor(folder):
    """Qwen2VLProcessor from `folder` without its video processor, for where torchvision is missing:
    Qwen2VLProcessor.from_pretrained loads a Qwen2VLVideoProcessor (which needs torchvision) that editing never calls.
    A subclass whose __init__ names only the image processor and the tokenizer, which is what from_pretrained loads."""
    from transformers import Qwen2VLProcessor

    class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return Qwen2VLImageTextProcessor.from_pretrained(str(folder))


def load_kwargs(local):
    """from_pretrained's keywords: none with torchvision; without it, the processor loaded without its video part
    (`load_processor`) from a local folder (a hub id needs torchvision)."""
    if importlib.util.find_spec("torchvision") is not None:
        return {}
    if local is None:
        raise common.UserError(
            "QwenImageEditPipeline's processor (Qwen2VLProcessor) needs torchvision to load from the hub: "
            "pip install torchvision, or download the model and pass its folder"
        )
    return {"processor": load_processor(local / "processor")}


def card(pipe, call, settings):
    """QwenImageEditPipeline's call (`qwenimage.card`: true CFG) with the image to edit, loaded as `load_image` reads
    it, and the sampled height and width (without them the pipeline samples at the reference size)."""
    setup, call, output = qwenimage.card(pipe, call, settings)
    factor = pipe.vae_scale_factor
    height, width = (side * factor for side in pipe.latent_shape[-2:])
    setup = [
        *setup,
        "from diffusers.utils import load_image",
        'image = load_image("image.png")  # the image to edit (the pipeline resizes it to ~1024^2 pixels)',
    ]
    return setup, {"image": "image", **call, "height": str(height), "width": str(width)}, output


FAMILY = common.Family(
    name="qwenimage_edit",
    pipelines=("QwenImageEditPipeline",),
    transformer="QwenImageTransformer2DModel",
    encode=encode,
    velocity=qwenimage.velocity,
    latent_shape=qwenimage.latent_shape,
    decode=qwenimage.decode,
    max_sequence_length=max_sequence_length,
    tokens=qwenimage.FAMILY.tokens,
    mu=common.linear_mu,
    load_kwargs=load_kwargs,
    check=check,
    check_images=check_images,
    card=card,
    lora_targets=qwenimage.FAMILY.lora_targets,
    encode_image=encode_image,
    reference_size=reference_size,
    encode_records=True,
)
