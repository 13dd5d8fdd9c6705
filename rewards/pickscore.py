"""PickScore (Kirstain et al. 2023, "Pick-a-Pic", arXiv:2305.01569): a CLIP ViT-H/14 fine-tuned on human preferences.

score = logit_scale.exp() * cos(image embedding, text embedding) / 26, the normalisation of Flow-GRPO's
`flow_grpo/pickscore_scorer.py` (`scores = scores / 26`), so values are ~0.8-0.9 instead of ~21-23 and reward curves
compare with Flow-GRPO's. Model `yuvalkirstain/PickScore_v1`, tokenizer and image processor of
`laion/CLIP-ViT-H-14-laion2B-s32B-b79K`, as in the PickScore model card; $CLEANFLOW_PICKSCORE_MODEL and
$CLEANFLOW_PICKSCORE_PROCESSOR point them at local copies.
"""

from typing import Callable

import torch

from rewards import _clip

MODEL, MODEL_ENV = "yuvalkirstain/PickScore_v1", "CLEANFLOW_PICKSCORE_MODEL"
PROCESSOR, PROCESSOR_ENV = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "CLEANFLOW_PICKSCORE_PROCESSOR"
SCALE = 26.0  # Flow-GRPO's divisor: logit_scale.exp() * cos is ~21-23 for PickScore_v1


def pickscore(device=None, dtype: torch.dtype = torch.float32, batch_size: int = 32) -> Callable:
    """The `pickscore` reward: fn(images [B, 3, H, W] float in [0, 1], prompts) -> PickScore / 26 [B] float32 on the
    images' device. The model runs on `device` (default: the GPU if any) in `dtype` (float16/bfloat16 halve memory on
    GPUs; float32, Flow-GRPO's setting, is the default), `batch_size` images at a time."""
    device = _clip.pick_device(device)
    tokenizer = _clip.load_tokenizer(PROCESSOR_ENV, PROCESSOR, "PickScore tokenizer")
    preprocess = _clip.load_preprocess(PROCESSOR_ENV, PROCESSOR, "PickScore image processor", device)
    model = _clip.load_clip(MODEL_ENV, MODEL, "PickScore model", device, dtype)
    logit_scale = model.logit_scale.float().exp().item()

    @torch.no_grad()
    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        _clip.check_batch(images, prompts)
        image = _clip.image_embeds(model, preprocess, images, batch_size)
        text = _clip.text_embeds(model, tokenizer, prompts, device)
        return (logit_scale * (image * text).sum(-1) / SCALE).to(images.device)

    return fn
