"""Flow-GRPO's OCR reward (Liu et al. 2025, arXiv:2505.05470): how well the image spells the prompt's quoted text.

score = 1 - min(1, d / len(target)), where target is the text between the prompt's first pair of double quotes and d
is the Levenshtein distance between it and the recognised text, both with spaces removed and lower-cased; d = 0 when
the target occurs inside the recognised text (extra words are not penalised). This is `flow_grpo/ocr.py` (OcrScorer,
yifan123/flow_grpo@ac4c86e, lines 31-60). Differences: rapidocr (PaddleOCR's PP-OCRv6 det + rec models as ONNX, in the
wheel, so offline) instead of PaddleOCR; a prompt without a quoted, non-empty text is a UserError (Flow-GRPO raises
IndexError / ZeroDivisionError); OCR exceptions are not swallowed. As in PaddleOCR, detection then recognition, no angle
classifier, text lines with recognition confidence < 0.5 dropped, the kept lines joined without separator.
Optional dependencies: `pip install -r rewards/requirements-ocr.txt`.
"""

import queue
import re
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from common import UserError, short

QUOTED = re.compile(r'"([^"]*)"')
DET_MIN_SIDE = 256  # detection upscales images whose shorter side is below this (rapidocr: 736, 6x slower here)
MIN_CONFIDENCE = 0.5  # PaddleOCR's drop_score and rapidocr's Global.text_score


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions turning a into b."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def quoted_text(prompt: str) -> str:
    """The text between the first pair of double quotes; a prompt without one cannot be scored."""
    match = QUOTED.search(prompt)
    if match is None or not match.group(1).replace(" ", ""):
        raise UserError(f"the ocr reward needs the text to write in double quotes in each prompt, got {short(prompt)}")
    return match.group(1)


def ocr_score(recognised: str, target: str) -> float:
    """1 - min(1, edit distance / target length) after removing spaces and lower-casing; 1 if target is contained."""
    recognised, target = recognised.replace(" ", "").lower(), target.replace(" ", "").lower()
    distance = 0 if target in recognised else min(edit_distance(recognised, target), len(target))
    return 1.0 - distance / len(target)


def ocr(device: Optional[torch.device] = None) -> Callable:
    """The `ocr` reward: fn(images [B, 3, H, W] float in [0, 1], prompts with a "quoted" text) -> score [B] float32 in
    [0, 1] on the images' device. The OCR runs on the CPU (onnxruntime, torch.get_num_threads() threads), one image at a
    time (~30 ms each for 64-256 px images); `device` is unused."""
    try:
        import onnxruntime  # noqa: F401  (rapidocr itself imports it only when it first runs a model)
        import rapidocr
        from rapidocr import RapidOCR
    except ImportError as e:
        raise UserError(f"the ocr reward needs rapidocr and onnxruntime ({e}): pip install -r rewards/requirements-ocr.txt")

    models = Path(rapidocr.__file__).parent / "models"  # the wheel's ONNX files: given as paths, nothing is downloaded
    threads = torch.get_num_threads()
    params = {
        "Global.log_level": "error",
        "Global.use_cls": False,
        "Global.text_score": MIN_CONFIDENCE,
        "Det.model_path": str(models / "PP-OCRv6_det_small.onnx"),
        "Det.limit_side_len": DET_MIN_SIDE,
        "Rec.model_path": str(models / "PP-OCRv6_rec_small.onnx"),  # the character list is inside the ONNX file
        "Cls.model_path": str(models / "ch_ppocr_mobile_v2.0_cls_mobile.onnx"),  # unused (use_cls off), never fetched
        "EngineConfig.onnxruntime.intra_op_num_threads": threads,
        "EngineConfig.onnxruntime.inter_op_num_threads": 1,
    }
    # idle engines: a call takes one (or builds one) and gives it back, so two threads (common.Scorer) never share one;
    # rapidocr does not document its engine as thread-safe. The first is built now: a bad install fails before the model loads
    idle = queue.SimpleQueue()
    idle.put(RapidOCR(params=params))

    def recognise(image: np.ndarray) -> str:
        try:
            engine = idle.get_nowait()
        except queue.Empty:
            engine = RapidOCR(params=params)
        try:
            result = engine(image[:, :, ::-1].copy())  # rapidocr takes arrays as BGR
        finally:
            idle.put(engine)
        return "".join(result.txts) if getattr(result, "txts", None) is not None else ""

    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
            got = f"{tuple(images.shape)} and {len(prompts)} prompts"
            raise ValueError(f"expected images [B, 3, H, W] float in [0, 1] and B prompts, got {got}")
        targets = [quoted_text(p) for p in prompts]
        pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        scores = [ocr_score(recognise(image), target) for image, target in zip(pixels, targets)]
        return torch.tensor(scores, dtype=torch.float32, device=images.device)

    def check_prompts(prompts):
        """Run before the model loads (rewards.load_rewards): every prompt has a text to write."""
        try:
            for p in prompts:
                quoted_text(p)
        except UserError as e:
            raise UserError(
                f"{e} (the OCR task on tiny-text: --model assets/tiny-text --train-prompts "
                "assets/text_train.jsonl --test-prompts assets/text_test.jsonl)"
            ) from None

    fn.check_prompts = check_prompts
    fn.thread_safe = True  # common.Scorer may score two chunks at once (each call has its own engine)
    return fn
