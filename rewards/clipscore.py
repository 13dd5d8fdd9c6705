"""CLIPScore (Hessel et al. 2021, arXiv:2104.08718): image-text agreement under CLIP, here ViT-L/14 as in Flow-GRPO.

score = 2.5 * max(cos(image embedding, text embedding), 0), the paper's CLIP-S with w = 2.5 (Eq. 1), so values are
~0.5-0.9 for a matching caption. The prompt is encoded as is (the paper prefixes "A photo depicts"; a generation prompt
is not a caption of a photo). `fn.details` gives the raw cosine. Model, tokenizer and image processor come from
`openai/clip-vit-large-patch14`; $CLEANFLOW_CLIP_MODEL points them at a local copy.
"""

from typing import Callable

import torch

from rewards import _clip

MODEL, MODEL_ENV = "openai/clip-vit-large-patch14", "CLEANFLOW_CLIP_MODEL"
W = 2.5  # Hessel et al.'s rescaling of the cosine


def clipscore(device=None, dtype: torch.dtype = torch.float32, batch_size: int = 32) -> Callable:
    """The `clipscore` reward: fn(images [B, 3, H, W] float in [0, 1], prompts) -> 2.5 * max(cos, 0) [B] float32 on
    the images' device. The model runs on `device` (default: the GPU if any) in `dtype`, `batch_size` images at a time.
    `fn.details(images, prompts)` -> {"cosine": [B]}, the unclipped cosine similarity."""
    device = _clip.pick_device(device)
    tokenizer = _clip.load_tokenizer(MODEL_ENV, MODEL, "CLIP tokenizer")
    preprocess = _clip.load_preprocess(MODEL_ENV, MODEL, "CLIP image processor", device)
    model = _clip.load_clip(MODEL_ENV, MODEL, "CLIP model", device, dtype)

    @torch.no_grad()
    def cosine(images: torch.Tensor, prompts: list) -> torch.Tensor:
        _clip.check_batch(images, prompts)
        image = _clip.image_embeds(model, preprocess, images, batch_size)
        return (image * _clip.text_embeds(model, tokenizer, prompts, device)).sum(-1).to(images.device)

    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        return W * cosine(images, prompts).clamp_min(0)

    fn.details = lambda images, prompts: {"cosine": cosine(images, prompts)}
    return fn
