"""HPSv2 (Wu et al. 2023, "Human Preference Score v2", arXiv:2306.09341): an OpenCLIP ViT-H/14 fine-tuned on the
798k human choices of HPD v2.

score = cos(image embedding, text embedding), the diagonal of `image_features @ text_features.T` on unit features in
`hpsv2/img_score.py` (tgxs002/HPSv2): no logit scale, so values are ~0.2-0.3 (the paper's tables report 100x that).
The released weights are an open_clip state_dict (`HPS_v2_compressed.pt`, `HPS_v2.1_compressed.pt` in xswu/HPSv2);
the default is `adams-story/HPSv2-hf`, a transformers CLIPModel port of HPS v2.0 with its tokenizer and image
processor, whose embeddings its author checked against the open_clip model. $CLEANFLOW_HPSV2_MODEL points at a local
copy or at another port (HPS v2.1, which DanceGRPO trains on, has no transformers port on the hub: convert its
open_clip state_dict to a CLIPModel folder first, see docs/preference_rewards.md).
"""

from typing import Callable

import torch

from rewards import _clip

MODEL, MODEL_ENV = "adams-story/HPSv2-hf", "CLEANFLOW_HPSV2_MODEL"


def hpsv2(device=None, dtype: torch.dtype = torch.float32, batch_size: int = 32) -> Callable:
    """The `hpsv2` reward: fn(images [B, 3, H, W] float in [0, 1], prompts) -> HPS cosine [B] float32 on the images'
    device. The model runs on `device` (default: the GPU if any) in `dtype`, `batch_size` images at a time."""
    device = _clip.pick_device(device)
    tokenizer = _clip.load_tokenizer(MODEL_ENV, MODEL, "HPSv2 tokenizer")
    preprocess = _clip.load_preprocess(MODEL_ENV, MODEL, "HPSv2 image processor", device)
    model = _clip.load_clip(MODEL_ENV, MODEL, "HPSv2 model", device, dtype)

    @torch.no_grad()
    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        _clip.check_batch(images, prompts)
        image = _clip.image_embeds(model, preprocess, images, batch_size)
        return (image * _clip.text_embeds(model, tokenizer, prompts, device)).sum(-1).to(images.device)

    return fn
