"""GenEval-style programmatic reward for the tiny-shapes world (`rewards/worlds/shapes.py`), no detector network needed.

The caption is parsed into required objects and an optional relation; each pixel is read as a blend of the background
and one palette colour, same-colour pixels are grouped into connected components, and each component is named after
the shape template (circle, square, upward triangle) it overlaps best.
Every object phrase adds one requirement per thing it asks for: the shape exists, it exists in the asked colour, it
appears exactly the asked number of times; a relation adds one more. The reward is the fraction of requirements met
(partial credit, like the GenEval reward server of Flow-GRPO); `strict` is GenEval's all-or-nothing score.

Two rewards, because the GenEval-style one can be hacked:
  * `shapes`: the fraction of requirements met, faithful to GenEval, which (outside counting) does not penalise objects
    nobody asked for. RL learns to scatter extra shapes: each prompt is then partly satisfied by luck (measured: trained
    models drew 3.3-3.6 objects for 2.0 asked, and images showing exactly what was asked fell from 20% to 1-7%).
  * `shapes_clean` (the scripts' default): that fraction times the share of the detected objects that were asked for,
    (met / requirements) x asked / (asked + extra), a recall x precision score: an image is only fully rewarded when it
    shows the asked objects and nothing else, and hedging (drawing a third shape to catch a missed requirement) costs
    more than it gains.
The world (`rewards/worlds/shapes.py`) renders exactly the objects a caption names, so "every asked object and nothing
else" is this world's ground truth: `exact` (1 iff every requirement is met and no other object is present, counting
every coloured component of at least MIN_AREA pixels, also blobs that fit no shape) is logged at every eval next to
the reward, with the extra objects per image and a wrong-prompt control (see `evaluate`).
"""

import math
import re
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from rewards.worlds.shapes import BACKGROUND, COLORS, NUMBERS, RELATIONS, SHAPES

SIZE = 64  # detection runs at the world's resolution: other sizes are resized first, coordinates are in this frame
MAX_COLOR_DIST = 0.2  # RGB distance (in [0, 1] units) from a background-colour blend past which a pixel is ignored
MIN_AREA = 24  # pixels; half the smallest object of the world (a size-10 triangle has 50): smaller ones are noise
MIN_IOU = 0.6  # a component must fit a shape template at least this well to count as an object
POSITION_THRESHOLD = 0.1  # GenEval's margin: each axis offset shrinks by this fraction of the two boxes' summed size

BACKGROUND_RGB = torch.tensor(BACKGROUND, dtype=torch.float32) / 255
COLOR_NAMES = tuple(COLORS)
COLOR_RGB = torch.tensor([COLORS[c] for c in COLOR_NAMES], dtype=torch.float32) / 255  # [colours, 3]

_WORD_NUMBERS = {word: n for n, word in NUMBERS.items()}
_PHRASE = rf"(a|an|{'|'.join(_WORD_NUMBERS)}) (?:({'|'.join(COLORS)}) )?({'|'.join(SHAPES)})(s?)"
_PROMPT = re.compile(rf"{_PHRASE}(?: (and|{'|'.join(RELATIONS)}) {_PHRASE})?")
_GRAMMAR = (
    f"expected '<a|an|number> [colour] <shape>', optionally followed by 'and' or a relation ({', '.join(RELATIONS)}) "
    f"and a second such phrase; numbers: {', '.join(_WORD_NUMBERS)}; colours: {', '.join(COLORS)}; shapes: {', '.join(SHAPES)}"
)


# ----------------------------------------------------------------------------------------------------------------
# captions
# ----------------------------------------------------------------------------------------------------------------
def parse_prompt(prompt: str) -> dict:
    """Caption -> {"category", "objects": [{"shape", "color", "count"}], "relation"}, from the text alone.

    Any combination of the world's words parses (also ones `world.all_prompts` never writes, like "three red circles"),
    so held-out captions are scored exactly like seen ones. `color`, `count` and `relation` are None when not asked for.
    """
    match = _PROMPT.fullmatch(" ".join(prompt.lower().split()))
    if match is None:
        raise ValueError(f"cannot parse prompt {prompt!r}: {_GRAMMAR}")
    groups = match.groups()
    objects = []
    for det, color, shape, plural in (groups[:4], groups[5:]) if groups[4] else (groups[:4],):
        count = _WORD_NUMBERS.get(det)
        if bool(plural) != (count is not None and count > 1):
            raise ValueError(f"cannot parse prompt {prompt!r}: {det!r} does not agree with {shape + plural!r}")
        objects.append({"shape": shape, "color": color, "count": count})
    relation = groups[4] if groups[4] in RELATIONS else None
    if relation is not None:
        category = "position"
    elif any(o["count"] is not None for o in objects):
        category = "counting"
    elif any(o["color"] is not None for o in objects):
        category = "colors" if len(objects) == 1 else "color_attr"
    else:
        category = "single_object" if len(objects) == 1 else "two_object"
    return {"category": category, "objects": objects, "relation": relation}


# ----------------------------------------------------------------------------------------------------------------
# detection
# ----------------------------------------------------------------------------------------------------------------
def _segment(images: torch.Tensor) -> torch.Tensor:
    """images [B, 3, 64, 64] in [0, 1] -> one mask per palette colour [B, colours, 64, 64].

    Anti-aliasing and blur make a pixel a blend of the background and (at most) one colour, so each pixel is projected
    onto every background-colour segment; it takes the colour of the nearest segment when the colour's share is at
    least one half (edges stay where the renderer put them), and nothing when it is far from all segments (smudges,
    two colours mixed, noise).
    """
    b = images.shape[0]
    background, colors = BACKGROUND_RGB.to(images.device), COLOR_RGB.to(images.device)
    pixels = images.permute(0, 2, 3, 1).reshape(b, -1, 3) - background
    directions = colors - background  # [colours, 3]
    along, length2 = pixels @ directions.T, (directions**2).sum(-1)  # [B, HW, colours], [colours]
    share = (along / length2).clamp(0, 1)
    residual2 = (pixels**2).sum(-1, keepdim=True) - 2 * share * along + share**2 * length2  # |pixel - share * direction|^2
    nearest_residual2, nearest = residual2.min(-1)
    on = (share.gather(-1, nearest[..., None])[..., 0] >= 0.5) & (nearest_residual2 <= MAX_COLOR_DIST**2)
    masks = (nearest[..., None] == torch.arange(len(colors), device=images.device)) & on[..., None]
    return masks.permute(0, 2, 1).view(b, len(colors), SIZE, SIZE)


def _max3x3(x: torch.Tensor) -> torch.Tensor:
    """3x3 maximum filter of x [N, H, W] >= 0, zero-padded (as shifted maxima: ~10x faster than max_pool2d on CPU)."""
    p = F.pad(x, (1, 1, 1, 1))
    rows = torch.maximum(torch.maximum(p[:, :, :-2], p[:, :, 1:-1]), p[:, :, 2:])
    return torch.maximum(torch.maximum(rows[:, :-2], rows[:, 1:-1]), rows[:, 2:])


def _label_components(masks: torch.Tensor) -> torch.Tensor:
    """8-connected component labels of boolean masks [N, H, W]: each pixel gets 1 + the largest flat index in its
    component, 0 off the mask. Max-filter propagation restricted to the mask, plus pointer jumping (a pixel adopts
    the label of the pixel its label points to, which is in the same component), converges in about ten passes."""
    n, h, w = masks.shape
    mask = masks.float()
    labels = torch.arange(1, h * w + 1, dtype=torch.float32, device=masks.device).view(h, w) * mask
    while True:
        new = _max3x3(labels) * mask
        new = new.flatten(1).gather(1, (new.flatten(1).long() - 1).clamp_min(0)).view(n, h, w) * mask
        if torch.equal(new, labels):
            return labels
        labels = new


def _template_iou(dx: torch.Tensor, dy: torch.Tensor, comp: torch.Tensor, area: torch.Tensor) -> torch.Tensor:
    """IoU [components, shapes] of each component with the ideal circle, square and upward triangle (in SHAPES order)
    of the same centroid and standard deviations, from its pixels' offsets (dx, dy) to the centroid.

    Those templates are a circle of radius 2 sd, a square of half-side sqrt(3) sd, and a triangle of half-base sqrt(6)
    sd and height sqrt(18) sd whose apex lies 2/3 of the height above the centroid. Moments average over all pixels,
    so ragged or eroded edges barely move them. The overlap counts pixel centres against the template's exact area,
    so small shapes can score slightly above 1.
    """

    def per_component(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(area).index_add_(0, comp, v.float())

    sx = ((per_component(dx**2) / area + 1 / 12).sqrt())[comp]  # + 1/12: a pixel's own variance
    sy = ((per_component(dy**2) / area + 1 / 12).sqrt())[comp]
    height = 18**0.5 * sy
    below_apex = dy + 2 / 3 * height
    templates = {  # (pixel inside, template area), per pixel
        "circle": ((dx / (2 * sx)) ** 2 + (dy / (2 * sy)) ** 2 <= 1, 4 * math.pi * sx * sy),
        "square": ((dx.abs() <= 3**0.5 * sx) & (dy.abs() <= 3**0.5 * sy), 12 * sx * sy),
        "triangle": (
            (below_apex >= 0) & (below_apex <= height) & (dx.abs() <= 6**0.5 * sx * below_apex / height),
            6**0.5 * sx * height,
        ),
    }
    iou = []
    for shape in SHAPES:
        inside, template_area = templates[shape]
        overlap, template_area = per_component(inside), per_component(template_area) / area
        iou.append(overlap / (area + template_area - overlap))
    return torch.stack(iou, 1)


def detect_batch(images: torch.Tensor) -> list:
    """Objects in each of images [B, 3, H, W] float in [0, 1]: per image a list of {"color", "shape", "iou" (fit to
    the shape's template), "x", "y" (centroid), "area" (pixels), "bbox" (x0, y0, x1, y1)}, in a 64x64 frame.

    A component counts as an object if it has at least MIN_AREA pixels and fits some template with IoU >= MIN_IOU
    (the analogue of a detector's confidence threshold: smudges and merged blobs are not objects).
    """
    return [[o for o in objs if o["iou"] >= MIN_IOU] for objs in components(images)]


def components(images: torch.Tensor) -> list:
    """Every coloured component of at least MIN_AREA pixels in each image, as `detect_batch` describes them, whether
    or not it fits a shape template ("shape" is then its best fit, "iou" says how well): what `exact` counts."""
    images = images.detach().float()
    if images.shape[-2:] != (SIZE, SIZE):
        images = F.interpolate(images, size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)
    masks = _segment(images).flatten(0, 1)  # [B * colours, 64, 64]
    occupied = masks.flatten(1).any(1)  # most images use few colours: label only those planes
    labels = torch.zeros(masks.shape, device=masks.device)
    labels[occupied] = _label_components(masks[occupied])

    # one row per component: key (image, colour, label) -> component id `comp` of every labelled pixel
    plane, row, col = labels.nonzero(as_tuple=True)
    keys, comp = torch.unique(plane * SIZE * SIZE + labels[plane, row, col].long(), return_inverse=True)
    area = torch.bincount(comp, minlength=len(keys)).float()

    def reduce(v: torch.Tensor, how: str) -> torch.Tensor:
        return torch.zeros_like(area, dtype=v.dtype).scatter_reduce(0, comp, v, how, include_self=False)

    x, y = col.float() + 0.5, row.float() + 0.5  # pixel centres
    cx, cy = reduce(x, "sum") / area, reduce(y, "sum") / area
    fit, shape = _template_iou(x - cx[comp], y - cy[comp], comp, area).max(1)
    bbox = torch.stack([reduce(col, "amin"), reduce(row, "amin"), reduce(col, "amax") + 1, reduce(row, "amax") + 1], 1)

    keep = area >= MIN_AREA
    image_id, color_id = keys // (SIZE * SIZE * len(COLOR_NAMES)), keys // (SIZE * SIZE) % len(COLOR_NAMES)
    objects = [[] for _ in range(images.shape[0])]
    rows = zip(*(t[keep].tolist() for t in (image_id, color_id, shape, fit, cx, cy, area, bbox)))
    for i, c, s, iou, x_, y_, a, box in rows:
        objects[i].append(
            {"color": COLOR_NAMES[c], "shape": SHAPES[s], "iou": iou, "x": x_, "y": y_, "area": int(a), "bbox": tuple(box)}
        )
    return objects


def detect(image: Union[np.ndarray, torch.Tensor]) -> list:
    """Objects in one H x W x 3 image, uint8 in [0, 255] or float in [0, 1] (see `detect_batch`)."""
    image = torch.tensor(np.asarray(image))  # a copy: rendered arrays are often read-only
    image = image.float() / 255 if image.dtype == torch.uint8 else image.float()
    return detect_batch(image.permute(2, 0, 1)[None])[0]


# ----------------------------------------------------------------------------------------------------------------
# scoring
# ----------------------------------------------------------------------------------------------------------------
def relative_position(a: dict, b: dict) -> set:
    """Relations of object a to object b by GenEval's rule (`relative_position` in geneval/evaluation/evaluate_images.py):
    the box-centre offset, each axis shrunk by 10% of the two boxes' summed size, must point along the relation's axis
    with cosine > 0.5."""
    (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = a["bbox"], b["bbox"]
    dx, dy = (ax0 + ax1 - bx0 - bx1) / 2, (ay0 + ay1 - by0 - by1) / 2  # image y points down
    norm = math.hypot(dx, dy)
    rx = math.copysign(max(abs(dx) - POSITION_THRESHOLD * (ax1 - ax0 + bx1 - bx0), 0), dx)
    ry = math.copysign(max(abs(dy) - POSITION_THRESHOLD * (ay1 - ay0 + by1 - by0), 0), dy)
    if norm == 0 or max(abs(rx), abs(ry)) < 1e-3:
        return set()
    holds = {
        "to the left of": rx < -0.5 * norm,
        "to the right of": rx > 0.5 * norm,
        "above": ry < -0.5 * norm,
        "below": ry > 0.5 * norm,
    }
    return {relation for relation, ok in holds.items() if ok}


def requirements_met(parsed: dict, objects: list) -> list:
    """One bool per requirement of a parsed caption, in caption order.

    Per object phrase: the shape exists (any colour); if a colour is asked, the shape exists in that colour; if a
    number is asked, exactly that many (of that colour, if asked) exist. A relation holds if it holds for some pair of
    matching objects. Splitting "a red circle" into [circle, red circle] gives partial credit for the right shape in
    the wrong colour, as "three circles" gets it for two circles: a denser signal for RL than GenEval's pass/fail.
    """
    met, groups = [], []
    for want in parsed["objects"]:
        same_shape = [o for o in objects if o["shape"] == want["shape"]]
        matches = [o for o in same_shape if want["color"] in (None, o["color"])]
        met.append(bool(same_shape))
        if want["color"] is not None:
            met.append(bool(matches))
        if want["count"] is not None:
            met.append(len(matches) == want["count"])
        groups.append(matches)
    if parsed["relation"] is not None:
        met.append(any(parsed["relation"] in relative_position(a, b) for a in groups[0] for b in groups[1]))
    return met


def asked_objects(parsed: dict) -> int:
    """How many objects a parsed caption asks for ("three circles": 3, "a circle and a square": 2)."""
    return sum(o["count"] or 1 for o in parsed["objects"])


def wrong_prompt(prompt: str) -> str:
    """A fixed other caption of the same category (the next one in sorted order of the grammar's captions), for the
    wrong-prompt control: an image that satisfies its own prompt no better than another one has learned nothing
    prompt-specific. Every category of the grammar has at least three captions."""
    from rewards.worlds.shapes import all_prompts

    category = parse_prompt(prompt)["category"]
    others = sorted(p for c, p, _ in all_prompts() if c == category and p != prompt)
    return next((p for p in others if p > prompt), others[0])


@torch.no_grad()
def evaluate(images: torch.Tensor, prompts: list, wrong_prompts: Optional[list] = None) -> dict:
    """images [B, 3, H, W] float in [0, 1] and their captions -> per image, float32 [B] on the images' device:

    score    fraction of requirements met (the `shapes` reward)
    strict   1 iff all requirements are met (GenEval's pass/fail)
    clean    score x asked / (asked + extra) (the `shapes_clean` reward)
    exact    1 iff all requirements are met and nothing else is in the image
    objects  every component detected (blobs that fit no shape included); extra = max(0, objects - asked)
    wrong    (with `wrong_prompts`) the score of the same image against another caption: the prompt-specific part of
             the score is score - wrong
    """
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
        raise ValueError(f"expected images [B, 3, H, W] and B prompts, got {tuple(images.shape)} and {len(prompts)} prompts")
    parsed = [parse_prompt(p) for p in prompts]  # a bad caption fails before any detection work
    found = components(images)
    objects = [[o for o in objs if o["iou"] >= MIN_IOU] for objs in found]
    met = [requirements_met(p, objs) for p, objs in zip(parsed, objects)]
    extra = [max(0, len(objs) - asked_objects(p)) for p, objs in zip(parsed, found)]
    out = {
        "score": [sum(m) / len(m) for m in met],
        "strict": [float(all(m)) for m in met],
        "clean": [sum(m) / len(m) * asked_objects(p) / (asked_objects(p) + e) for m, e, p in zip(met, extra, parsed)],
        "exact": [
            float(all(m) and e == 0 and len(objs) == asked_objects(p)) for m, e, objs, p in zip(met, extra, found, parsed)
        ],
        "objects": [float(len(objs)) for objs in found],
        "extra": [float(e) for e in extra],
    }
    if wrong_prompts is not None:
        wrong = [requirements_met(parse_prompt(w), objs) for w, objs in zip(wrong_prompts, objects)]
        out["wrong"] = [sum(m) / len(m) for m in wrong]
    return {k: torch.tensor(v, dtype=torch.float32, device=images.device) for k, v in out.items()}


def shapes(device: Optional[torch.device] = None) -> Callable:
    """The GenEval-style `shapes` reward: fn(images [B, 3, H, W] float in [0, 1], prompts) -> fraction of requirements
    met [B]. Extra objects are not penalised (see the module docstring). Runs on the images' device (`device` unused)."""

    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        return evaluate(images, prompts)["score"]

    fn.check_prompts = _check_prompts
    fn.thread_safe = True  # pure tensor code: common.Scorer may score two chunks at once
    return fn


def shapes_clean(device: Optional[torch.device] = None) -> Callable:
    """The `shapes_clean` reward: (met / requirements) x asked / (asked + extra objects) [B], so that drawing objects
    nobody asked for costs reward (see the module docstring). Runs on the images' device (`device` unused)."""

    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        return evaluate(images, prompts)["clean"]

    fn.check_prompts = _check_prompts
    fn.thread_safe = True  # pure tensor code: common.Scorer may score two chunks at once
    return fn


def _check_prompts(prompts) -> None:
    """Run before the model loads (rewards.load_rewards): every prompt parses; the error shows the first bad one, cut."""
    from common import UserError, short

    for p in dict.fromkeys(prompts):
        try:
            parse_prompt(p)
        except ValueError:
            raise UserError(f"the shapes reward cannot score the prompt {short(p)} ({_GRAMMAR})") from None
