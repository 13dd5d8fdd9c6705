"""The `edit` reward of the edit world (`assets/edit_world.py`): was the asked edit made, and nothing else changed?

The output image is read by the shapes detector (`rewards/shapes.py`: every coloured component of at least MIN_AREA
pixels, named after the shape template it fits best) and compared with the instruction's source scene,
`edit_world.task(instruction)` (a reward sees only images and prompts: each instruction has one canonical scene, the
one its prompt file shows). An object of the source scene that the instruction does not name is *kept* when an
object of its colour and shape lies within POSITION_TOLERANCE pixels of its centre, at its size within SIZE_TOLERANCE.
The *asked* change is made when:
  recolor  an object of the new colour and the shape lies at the named object's place and size;
  add      an object of the asked colour and shape lies anywhere, apart from the kept objects;
  remove   no component (but the kept objects) lies on the named object's place, and none of its colour and shape
           is left anywhere;
  move     an object of the named colour and shape, at its size, has moved at least MIN_MOVE pixels the asked way
           and at most POSITION_TOLERANCE pixels across it.
Every component that is neither kept nor the asked object is *extra*. With `rest` the other objects of the scene:

    edit = asked x (1 + kept) / (1 + rest + extra)

a recall x precision score like `shapes_clean`, gated by the asked change: an output that leaves the image as it was,
or makes another edit, scores 0; one that makes the edit but loses or moves another object, or draws something
unasked, scores in between; only the exact edit scores 1. The metrics no reward can fake, logged at every eval:
`edit_exact` (the asked change, every other object kept, and no other component, blobs that fit no shape included),
`edit_asked`, `rest_unchanged` (every other object kept) and `objects_extra`.
"""

import math
from typing import Callable, Optional

import torch

from assets import edit_world
from rewards import shapes

POSITION_TOLERANCE = 4.0  # pixels between a kept object's centre and where it was (sizes are 12-18 pixels)
SIZE_TOLERANCE = 0.3  # relative error of a kept object's side, sqrt(area), against its drawn size
MIN_MOVE = 8.0  # pixels a moved object must travel the asked way (the world moves objects 12-24)

AREA_PER_SIDE2 = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}  # drawn area / size^2 of each shape


def centre(obj) -> tuple:
    """Centre of mass of a world object (colour, shape, x, y, size), in pixels: the upward triangle's is 2/3 down."""
    _, shape, x, y, size = obj
    return x + size / 2, y + (2 / 3 if shape == "triangle" else 1 / 2) * size


def same_size(found: dict, obj) -> bool:
    expected = AREA_PER_SIDE2[obj[1]] * obj[4] ** 2
    return abs(math.sqrt(found["area"] / expected) - 1) <= SIZE_TOLERANCE


def is_object(found: dict) -> bool:
    return found["iou"] >= shapes.MIN_IOU


def kept_at(found: dict, obj) -> bool:
    """found (a detected component) is obj (colour, shape, x, y, size) left as it was."""
    cx, cy = centre(obj)
    return (
        is_object(found)
        and (found["color"], found["shape"]) == obj[:2]
        and math.hypot(found["x"] - cx, found["y"] - cy) <= POSITION_TOLERANCE
        and same_size(found, obj)
    )


def score_one(found: list, source, instruction: str) -> dict:
    """asked, kept, rest, extra of one output's components `found` (shapes.components) for an instruction on `source`.
    Scenes hold one object per (colour, shape) before and after an edit, so each component matches at most one
    object and the greedy matching below is the only one."""
    want = edit_world.parse_instruction(instruction)
    named = None
    if want["edit"] != "add":
        named = next((o for o in source if o[1] == want["shape"] and want["color"] in (None, o[0])), None)
        if named is None:
            raise ValueError(f"the source scene {source} has no object that {instruction!r} names")
    rest = [o for o in source if o is not named]
    used = set()
    for obj in rest:
        cx, cy = centre(obj)
        matches = [k for k, f in enumerate(found) if k not in used and kept_at(f, obj)]
        if matches:  # the nearest, should a blob of the same colour and shape lie within the tolerance too
            used.add(min(matches, key=lambda k: math.hypot(found[k]["x"] - cx, found[k]["y"] - cy)))
    free = [found[k] for k in range(len(found)) if k not in used]

    def is_pair(f, color, shape):
        return is_object(f) and (f["color"], f["shape"]) == (color, shape)

    if want["edit"] == "remove":  # nothing left on its place (in any colour), and nothing of its kind anywhere
        cx, cy = centre(named)
        asked = not any(math.hypot(f["x"] - cx, f["y"] - cy) <= POSITION_TOLERANCE or is_pair(f, *named[:2]) for f in free)
        return {"asked": asked, "kept": len(used), "rest": len(rest), "extra": len(free)}
    if want["edit"] == "recolor":
        after = (want["new_color"],) + named[1:]
        hits = [f for f in free if kept_at(f, after)]
    elif want["edit"] == "add":
        hits = [f for f in free if is_pair(f, want["new_color"], want["shape"])]
    else:
        (ux, uy), (cx, cy) = edit_world.DIRECTIONS[want["direction"]], centre(named)
        along = [(f["x"] - cx) * ux + (f["y"] - cy) * uy for f in free]
        across = [abs((f["x"] - cx) * uy - (f["y"] - cy) * ux) for f in free]
        hits = [
            f
            for f, a, c in zip(free, along, across)
            if is_pair(f, *named[:2]) and same_size(f, named) and a >= MIN_MOVE and c <= POSITION_TOLERANCE
        ]
    return {"asked": bool(hits), "kept": len(used), "rest": len(rest), "extra": len(free) - bool(hits)}


@torch.no_grad()
def evaluate(images: torch.Tensor, prompts: list, sources: Optional[list] = None) -> dict:
    """images [B, 3, H, W] float in [0, 1] and their instructions -> per image, float32 [B] on the images' device:

    edit            asked x (1 + kept) / (1 + rest + extra) (the `edit` reward)
    edit_exact      1 iff the asked change is made, every other object kept and nothing else present
    edit_asked      1 iff the asked change is made
    rest_unchanged  1 iff every object the instruction does not name is kept (colour, shape, place and size)
    objects_extra   components that are neither kept nor the asked object

    `sources`: the source scenes (world objects) of the instructions; None: each instruction's canonical scene
    (`edit_world.task`), as the reward scores them.
    """
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
        raise ValueError(f"expected images [B, 3, H, W] and B prompts, got {tuple(images.shape)} and {len(prompts)} prompts")
    if sources is None:
        sources = [edit_world.task(p)[0] for p in prompts]  # a bad instruction fails before any detection work
    rows = [score_one(found, src, p) for found, src, p in zip(shapes.components(images), sources, prompts)]
    out = {
        "edit": [r["asked"] * (1 + r["kept"]) / (1 + r["rest"] + r["extra"]) for r in rows],
        "edit_exact": [float(r["asked"] and r["kept"] == r["rest"] and r["extra"] == 0) for r in rows],
        "edit_asked": [float(r["asked"]) for r in rows],
        "rest_unchanged": [float(r["kept"] == r["rest"]) for r in rows],
        "objects_extra": [float(r["extra"]) for r in rows],
    }
    return {k: torch.tensor(v, dtype=torch.float32, device=images.device) for k, v in out.items()}


def edit(device: Optional[torch.device] = None) -> Callable:
    """The `edit` reward: fn(images [B, 3, H, W] float in [0, 1], instructions) -> asked x (1 + kept) / (1 + rest +
    extra) [B] against each instruction's canonical scene (see the module docstring). Runs on the images' device."""

    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        return evaluate(images, prompts)["edit"]

    fn.check_prompts = _check_prompts
    fn.thread_safe = True  # pure tensor code and a cached pure function
    return fn


def _check_prompts(prompts) -> None:
    """Run before the model loads (rewards.load_rewards): every prompt is an edit instruction of the grammar."""
    from common import UserError, short

    for p in dict.fromkeys(prompts):
        try:
            edit_world.parse_instruction(p)
        except ValueError:
            raise UserError(f"the edit reward cannot score the prompt {short(p)} ({edit_world.GRAMMAR})") from None
