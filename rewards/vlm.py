"""VLM judge (`vlm`): the mean probability that a vision-language model answers "Yes" to yes/no questions built from
the prompt, GenEval 2 Soft-TIFA style: one question per requirement the prompt states (each object, its count, its
colour, the position between two objects), or one whole-prompt question for free text; "soft" because the score is
the answer's probability, not the sampled answer.

P(Yes) = softmax over the two logits (Yes, No) at the answer position = sigmoid(logit_Yes - logit_No), what
Flow-Factory's `vllm_evaluate` reads from a served judge's log-probs (P(Yes) / (P(Yes) + P(No))). Qwen-VL chat models
answer "Yes" / "No" capitalised, so those two tokens are read.

Default judge `Qwen/Qwen2.5-VL-7B-Instruct` (any Qwen2-VL / Qwen2.5-VL checkpoint with its tokenizer, chat template and
image processor config in one folder works); $CLEANFLOW_VLM_MODEL points at another id or a local copy, and
$CLEANFLOW_VLM_DEVICE puts the judge on its own device (e.g. cuda:1; the scores come back on the images' device).
Images stay tensors on the judge's device: resized to the processor's pixel budget (multiples of patch x merge size),
normalised and cut into the model's flattened patches as Qwen2VLImageProcessor does (`patchify`), without PIL.
"""

import os
import re
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from common import UserError
from rewards import _clip

MODEL, MODEL_ENV, DEVICE_ENV = "Qwen/Qwen2.5-VL-7B-Instruct", "CLEANFLOW_VLM_MODEL", "CLEANFLOW_VLM_DEVICE"
ANSWERS = ("Yes", "No")
ASK = " Answer Yes or No."  # appended to every question, as Flow-Factory's judge prompt ends

# GenEval-style prompts ("a photo of two red apples", "a cow left of a horse") and the tiny-shapes captions ("three red
# circles", "a square to the left of a circle"): nouns of one or two words, as GenEval's COCO class names are
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white", "gray", "grey")
RELATIONS = {
    "to the left of": "to the left of",
    "to the right of": "to the right of",
    "left of": "to the left of",
    "right of": "to the right of",
    "above": "above",
    "below": "below",
}
_OBJECT = rf"(a|an|{'|'.join(NUMBERS)}) (?:({'|'.join(COLORS)}) )?([a-z]+(?: [a-z]+)?)"
_PROMPT = re.compile(rf"(?:a photo of )?{_OBJECT}(?: (and|{'|'.join(RELATIONS)}) {_OBJECT})?")


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def questions(prompt: str) -> List[str]:
    """The yes/no questions of `prompt`: per object, one that it is there (with `a`/`an`), one for its count (a number
    word), one for its colour; one for the relation between two objects; a prompt outside this grammar (free text) gets
    one question about the whole prompt."""
    text = " ".join(prompt.lower().strip().rstrip(".").split())
    match = _PROMPT.fullmatch(text)
    if match is None or any(w in {"and", "of"} for g in (match.group(3), match.group(7)) if g for w in g.split()):
        return [f'Does this image show "{prompt.strip()}"?']
    g = match.groups()
    objects = [g[0:3]] + ([g[4:7]] if g[3] else [])
    out, nouns = [], []
    for det, color, noun in objects:
        plural = NUMBERS.get(det, 1) > 1
        nouns.append((noun, plural))
        out.append(f"Are there {noun} in the image?" if plural else f"Is there {_article(noun)} {noun} in the image?")
        if det in NUMBERS:
            out.append(
                f"Are there exactly {det} {noun} in the image?" if plural else f"Is there exactly one {noun} in the image?"
            )
        if color:
            out.append(f"Are the {noun} {color}?" if plural else f"Is the {noun} {color}?")
    if g[3] in RELATIONS:
        (first, plural), (second, _) = nouns
        out.append(f"{'Are' if plural else 'Is'} the {first} {RELATIONS[g[3]]} the {second}?")
    return out


def p_yes(logits: torch.Tensor, yes: int, no: int) -> torch.Tensor:
    """P(Yes) [N] float32 from next-token logits [N, vocab]: the softmax restricted to the two answer tokens."""
    return torch.softmax(logits[:, [yes, no]].float(), dim=-1)[:, 0]


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int):
    """Qwen2-VL's target size: each side a multiple of `factor` (patch x merge), the area within [min, max] pixels,
    the aspect ratio kept (transformers' qwen2_vl `smart_resize`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as resize

    return resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def patchify(
    images: torch.Tensor, processor, device: torch.device, max_pixels: Optional[int] = None, min_pixels: Optional[int] = None
):
    """images [B, 3, H, W] in [0, 1] -> (pixel_values [B, n, 3 * t * p * p] float32, grid (1, H' / p, W' / p)), what the
    Qwen2-VL image processor gives each image: bicubic resize to `smart_resize`'s size, normalise with the processor's
    mean and std, then patches of p x p repeated t times along time, ordered merge-block by merge-block."""
    p, m, t = processor.patch_size, processor.merge_size, processor.temporal_patch_size
    size = dict(processor.size)
    lo = min_pixels or size.get("shortest_edge") or processor.min_pixels
    hi = max_pixels or size.get("longest_edge") or processor.max_pixels
    x = images.to(device=device, dtype=torch.float32)
    b, c, h, w = x.shape
    rh, rw = smart_resize(h, w, p * m, lo, hi)
    if (rh, rw) != (h, w):
        x = F.interpolate(x, size=(rh, rw), mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    mean = torch.tensor(processor.image_mean, device=device).view(1, c, 1, 1)
    std = torch.tensor(processor.image_std, device=device).view(1, c, 1, 1)
    x = (x - mean) / std
    gh, gw = rh // p, rw // p
    # [B, C, gh/m, m, p, gw/m, m, p] -> [B, gh/m, gw/m, m, m, C, p, p]: merge blocks in raster order, channels first
    x = x.reshape(b, c, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
    x = x.unsqueeze(6).expand(*x.shape[:6], t, p, p)  # a still image is t identical frames
    return x.reshape(b, gh * gw, c * t * p * p), (1, gh, gw)


def load_judge(env: str, default: str, what: str, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer, image processor) of a Qwen2-VL class checkpoint, the model in eval mode without gradients."""
    import transformers

    def model_loader(name):
        return transformers.AutoModelForImageTextToText.from_pretrained(name, dtype=dtype)

    tokenizer = _clip.load(transformers.AutoTokenizer.from_pretrained, env, default, f"{what} tokenizer")
    # only the processor's settings are read, so the PIL backend (no torchvision needed) does
    processor = _clip.load(transformers.Qwen2VLImageProcessorPil.from_pretrained, env, default, f"{what} image processor")
    model = _clip.load(model_loader, env, default, what)
    return model.eval().requires_grad_(False).to(device), tokenizer, processor


def vlm(device=None, dtype: Optional[torch.dtype] = None, batch_size: int = 16, max_pixels: Optional[int] = None) -> Callable:
    """The `vlm` reward: fn(images [B, 3, H, W] float in [0, 1], prompts) -> mean P(Yes) over the prompt's questions
    [B] float32 on the images' device. The judge runs on $CLEANFLOW_VLM_DEVICE, else `device` (default: the GPU if
    any), in `dtype` (default bfloat16 on a GPU, float32 on the CPU), `batch_size` (image, question) pairs per forward;
    `max_pixels` caps the image area the judge sees (default: its processor's)."""
    device = _clip.pick_device(os.environ.get(DEVICE_ENV) or device)
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise UserError(f"{DEVICE_ENV or 'device'}={device} is not available on this machine")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model, tokenizer, processor = load_judge(MODEL_ENV, MODEL, "VLM judge", device, dtype)
    answer_ids = [tokenizer.encode(a, add_special_tokens=False) for a in ANSWERS]
    if any(len(ids) != 1 for ids in answer_ids):
        raise UserError(f"the VLM judge's tokenizer splits {ANSWERS} into {answer_ids}: expected one token each")
    (yes,), (no,) = answer_ids
    image_token_id = model.config.image_token_id
    image_token = tokenizer.convert_ids_to_tokens(image_token_id)
    cache = {}

    def chat(question: str, n_image_tokens: int) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question + ASK}]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if text.count(image_token) != 1:
            raise ValueError(f"the judge's chat template should place one {image_token} per image, got {text!r}")
        return text.replace(image_token, image_token * n_image_tokens)  # one token per merged patch, as the processor

    @torch.no_grad()
    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        _clip.check_batch(images, prompts)
        patches, grid = patchify(images, processor, device, max_pixels)
        n_tokens = grid[0] * grid[1] * grid[2] // processor.merge_size**2
        pairs = [(i, q) for i, prompt in enumerate(prompts) for q in cache.setdefault(prompt, questions(prompt))]
        scores = []
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start : start + batch_size]
            # left padding puts every question's answer position last, so one slice reads them all
            tokens = tokenizer(
                [chat(q, n_tokens) for _, q in chunk], padding=True, padding_side="left", return_tensors="pt"
            ).to(device)
            index = torch.tensor([i for i, _ in chunk], device=device)
            logits = model(
                input_ids=tokens.input_ids,
                attention_mask=tokens.attention_mask,
                pixel_values=patches[index].flatten(0, 1).to(dtype),
                image_grid_thw=torch.tensor([grid] * len(chunk), device=device),
                mm_token_type_ids=(tokens.input_ids == image_token_id).int(),
                logits_to_keep=1,
            ).logits[:, -1]
            scores.append(p_yes(logits, yes, no))
        owner = torch.tensor([i for i, _ in pairs], device=device)
        total = torch.zeros(len(prompts), device=device).index_add_(0, owner, torch.cat(scores))
        return (total / torch.bincount(owner, minlength=len(prompts))).to(images.device)

    return fn
