"""Loading and on-device preprocessing shared by the CLIP-based hub rewards (`pickscore`, `clipscore`, `aesthetic`).

Images stay tensors on the reward device: resized (antialiased, with the processor's resample filter), centre cropped
and normalised with the values read from the checkpoint's own preprocessor config, as the processor would do to the
same image, but without a PIL round trip per sample. transformers is imported inside the functions, so importing
`rewards` stays light.
"""

import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from common import UserError

_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL filter codes used by transformers image processors


def pick_device(device) -> torch.device:
    """The reward's device: `device` if given, else the first GPU when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def first_line(e: BaseException) -> str:
    """An exception as one line: transformers' and hub errors run over several."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def load(loader: Callable, env: str, default: str, what: str, local: str = "a hub snapshot or save_pretrained directory"):
    """loader(name) where name is $env or the hub id `default`; a model that is missing (not in the local cache with
    the hub unreachable, a wrong path) becomes one line saying which id failed and which variable to set to `local`."""
    name = os.environ.get(env) or default
    try:
        return loader(name)
    except OSError as e:
        raise UserError(f"cannot load the {what} from {name!r} ({first_line(e)}); set {env} to a local copy ({local})") from e


def load_clip(env: str, default: str, what: str, device: torch.device, dtype: torch.dtype):
    """A transformers CLIPModel in eval mode on `device` in `dtype`, without gradients."""
    from transformers import CLIPModel

    model = load(CLIPModel.from_pretrained, env, default, what)
    return model.eval().requires_grad_(False).to(device=device, dtype=dtype)


def load_tokenizer(env: str, default: str, what: str):
    from transformers import AutoTokenizer

    return load(AutoTokenizer.from_pretrained, env, default, what)


def load_preprocess(env: str, default: str, what: str, device: torch.device) -> Callable:
    """The checkpoint's CLIP image processor as a tensor function (see `tensor_preprocess`)."""
    import transformers

    # only the processor's settings are used, so the PIL backend (no torchvision needed) does as well as the default
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return tensor_preprocess(load(cls.from_pretrained, env, default, what), device)


def tensor_preprocess(processor, device: torch.device) -> Callable:
    """fn(images [B, 3, H, W] float in [0, 1]) -> pixel_values [B, 3, h, w] float32, what `processor` gives for the
    same images as uint8 up to rounding and the resize kernel: resize (shortest edge to size, or to height x width),
    centre crop, normalise with the processor's mean and std."""
    size = {k: v for k, v in dict(processor.size).items() if v is not None} if processor.do_resize else None
    crop = {k: v for k, v in dict(processor.crop_size).items() if v is not None} if processor.do_center_crop else None
    if size is not None and not ({"shortest_edge"} <= size.keys() or {"height", "width"} <= size.keys()):
        raise ValueError(f"unsupported image processor size {size}: expected shortest_edge or height and width")
    mode = _RESAMPLE.get(int(processor.resample)) if size is not None else None
    if size is not None and mode is None:
        raise ValueError(f"unsupported image processor resample filter {processor.resample}: expected {_RESAMPLE}")
    mean = torch.tensor(processor.image_mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std, dtype=torch.float32, device=device).view(1, 3, 1, 1)

    def fn(images: torch.Tensor) -> torch.Tensor:
        x = images.to(device=device, dtype=torch.float32)
        if size is not None:
            h, w = x.shape[-2:]
            if "shortest_edge" in size:  # transformers' get_resize_output_image_size(default_to_square=False)
                short, long = (h, w) if h <= w else (w, h)
                new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
                out = (new_short, new_long) if h <= w else (new_long, new_short)
            else:
                out = (size["height"], size["width"])
            if out != (h, w):
                smooth = mode != "nearest"
                x = F.interpolate(x, size=out, mode=mode, antialias=smooth, align_corners=False if smooth else None)
                x = x.clamp(0, 1)  # bicubic overshoots; the processor resizes uint8 images, which clip
        if crop is not None:
            h, w = x.shape[-2:]
            if h < crop["height"] or w < crop["width"]:
                raise ValueError(f"image {h}x{w} after resizing is smaller than the processor's crop {crop}")
            top, left = (h - crop["height"]) // 2, (w - crop["width"]) // 2
            x = x[..., top : top + crop["height"], left : left + crop["width"]]
        return (x - mean) / std if processor.do_normalize else x

    return fn


def _pooled(out) -> torch.Tensor:
    """get_*_features returns a tensor (transformers 4) or an output whose pooler_output is projected (5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@torch.no_grad()
def image_embeds(model, preprocess: Callable, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Unit-norm CLIP image embeddings [B, D] float32 of images [B, 3, H, W] in [0, 1], `batch_size` at a time."""
    dtype = next(model.parameters()).dtype
    out = [
        _pooled(model.get_image_features(pixel_values=preprocess(chunk).to(dtype))).float()
        for chunk in images.split(batch_size)
    ]
    emb = torch.cat(out)
    return emb / emb.norm(dim=-1, keepdim=True)


@torch.no_grad()
def text_embeds(model, tokenizer, prompts: list, device: torch.device) -> torch.Tensor:
    """Unit-norm CLIP text embeddings [B, D] float32; each distinct prompt is encoded once (groups repeat prompts)."""
    index = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    unique = list(index)
    max_length = min(tokenizer.model_max_length, model.config.text_config.max_position_embeddings)
    tokens = tokenizer(unique, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)
    emb = _pooled(model.get_text_features(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)).float()
    emb = emb / emb.norm(dim=-1, keepdim=True)
    return emb[torch.tensor([index[p] for p in prompts], device=emb.device)]


def check_batch(images: torch.Tensor, prompts: Optional[list]) -> None:
    if images.ndim != 4 or images.shape[1] != 3 or (prompts is not None and images.shape[0] != len(prompts)):
        n = "" if prompts is None else f" and {len(prompts)} prompts"
        raise ValueError(f"expected images [B, 3, H, W] float in [0, 1] and B prompts, got {tuple(images.shape)}{n}")
