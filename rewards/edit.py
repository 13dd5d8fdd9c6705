"""The `edit` reward of the edit world (`rewards/worlds/edit.py`): was the asked edit made, and nothing else changed?

The output image and the source scene are read by the shapes detector (`rewards/shapes.py`: every coloured component
of at least MIN_AREA pixels, named after the shape template it fits best, with its centroid and area). The source
scene is the prompt's own image when the prompt carries one (a `prompt_files.Prompt` record of a jsonl line
{"prompt": ..., "image": ...}); a prompt without it (a plain string, e.g. through a reward server) is scored against
its instruction's canonical scene, `edit_world.task`, which the edit prompt files show. An object of the source that
the instruction does not name is *kept* when an object of its colour and shape lies within POSITION_TOLERANCE pixels
of its centroid, at its size within SIZE_TOLERANCE. The *asked* change is made when:
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

import functools
import math
import re
from typing import Callable, Optional

import numpy as np
import torch

from rewards import shapes
from rewards.worlds import edit as edit_world

POSITION_TOLERANCE = 4.0  # pixels between a kept object's centre and where it was (sizes are 12-18 pixels)
SIZE_TOLERANCE = 0.3  # relative error of a kept object's side, sqrt(area), against its drawn size
MIN_MOVE = 8.0  # pixels a moved object must travel the asked way (the world moves objects 12-24)

AREA_PER_SIDE2 = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}  # drawn area / size^2 of each shape


def centre(obj) -> tuple:
    """Centre of mass of a world object (colour, shape, x, y, size), in pixels: the upward triangle's is 2/3 down."""
    _, shape, x, y, size = obj
    return x + size / 2, y + (2 / 3 if shape == "triangle" else 1 / 2) * size


def world_objects(scene) -> list:
    """World objects (colour, shape, x, y, size) as the detector describes objects: colour, shape, centroid, area."""
    return [
        {"color": o[0], "shape": o[1], "x": centre(o)[0], "y": centre(o)[1], "area": AREA_PER_SIDE2[o[1]] * o[4] ** 2}
        for o in scene
    ]


def instruction_of(prompt: str) -> str:
    """The instruction of a prompt: a `prompt_files.Prompt` record's text, or the string without the record key's
    " [<image> <digest>]" tail (a record that became a plain string, e.g. on its way to a reward server)."""
    return getattr(prompt, "text", None) or re.sub(r" \[[^\[\]]* [0-9a-f]+\]$", "", prompt)


@functools.lru_cache(maxsize=4096)
def _detected_scene(key: str, path: str) -> tuple:
    """The objects of a source image, detected once per prompt key (the key holds the file's digest)."""
    from harness import prompt_files

    pixels = torch.from_numpy(np.array(prompt_files.load_image(path))).permute(2, 0, 1)[None].float() / 255
    found = shapes.components(pixels)[0]
    if not found or not all(is_object(f) for f in found):
        raise ValueError(f"its image {path} is not a scene of the shapes world (a blob that is no shape, or no object)")
    return tuple({k: f[k] for k in ("color", "shape", "x", "y", "area")} for f in found)


def source_scene(prompt: str) -> list:
    """The source objects of a prompt: detected in its image if it carries one, else its instruction's canonical scene."""
    image = getattr(prompt, "image", None)
    if image is not None:
        return list(_detected_scene(str(prompt), str(image)))
    return world_objects(edit_world.task(instruction_of(prompt))[0])


def same_size(found: dict, ref: dict) -> bool:
    return abs(math.sqrt(found["area"] / ref["area"]) - 1) <= SIZE_TOLERANCE


def is_object(found: dict) -> bool:
    return found["iou"] >= shapes.MIN_IOU


def is_pair(found: dict, color: str, shape: str) -> bool:
    return is_object(found) and (found["color"], found["shape"]) == (color, shape)


def kept_at(found: dict, ref: dict) -> bool:
    """found (a detected component) is the reference object ref left as it was: colour, shape, place and size."""
    return (
        is_pair(found, ref["color"], ref["shape"])
        and math.hypot(found["x"] - ref["x"], found["y"] - ref["y"]) <= POSITION_TOLERANCE
        and same_size(found, ref)
    )


def named_object(source: list, want: dict, instruction: str) -> dict:
    """The one source object an instruction names; ValueError if the scene has none or several."""
    named = [o for o in source if o["shape"] == want["shape"] and want["color"] in (None, o["color"])]
    if len(named) != 1:
        raise ValueError(f"its scene has {len(named) or 'no'} objects that {instruction!r} names, not one")
    return named[0]


def score_one(found: list, source: list, instruction: str) -> dict:
    """asked, kept, rest, extra of one output's components `found` (shapes.components) for an instruction on the
    source objects `source` (`source_scene`). Scenes hold one object per (colour, shape) before and after an edit, so
    each component matches at most one object and the greedy matching below is the only one."""
    want = edit_world.parse_instruction(instruction)
    named = named_object(source, want, instruction) if want["edit"] != "add" else None
    rest = [o for o in source if o is not named]
    used = set()
    for ref in rest:
        matches = [k for k, f in enumerate(found) if k not in used and kept_at(f, ref)]
        if matches:  # the nearest, should a blob of the same colour and shape lie within the tolerance too
            used.add(min(matches, key=lambda k: math.hypot(found[k]["x"] - ref["x"], found[k]["y"] - ref["y"])))
    free = [found[k] for k in range(len(found)) if k not in used]

    if want["edit"] == "remove":  # nothing left on its place (in any colour), and nothing of its kind anywhere
        left = [
            f
            for f in free
            if math.hypot(f["x"] - named["x"], f["y"] - named["y"]) <= POSITION_TOLERANCE
            or is_pair(f, named["color"], named["shape"])
        ]
        return {"asked": not left, "kept": len(used), "rest": len(rest), "extra": len(free)}
    if want["edit"] == "recolor":
        hits = [f for f in free if kept_at(f, dict(named, color=want["new_color"]))]
    elif want["edit"] == "add":
        hits = [f for f in free if is_pair(f, want["new_color"], want["shape"])]
    else:
        ux, uy = edit_world.DIRECTIONS[want["direction"]]
        hits = []
        for f in free:
            dx, dy = f["x"] - named["x"], f["y"] - named["y"]
            along, across = dx * ux + dy * uy, abs(dx * uy - dy * ux)
            if is_pair(f, named["color"], named["shape"]) and same_size(f, named):
                if along >= MIN_MOVE and across <= POSITION_TOLERANCE:
                    hits.append(f)
    return {"asked": bool(hits), "kept": len(used), "rest": len(rest), "extra": len(free) - bool(hits)}


@torch.no_grad()
def evaluate(images: torch.Tensor, prompts: list, sources: Optional[list] = None) -> dict:
    """images [B, 3, H, W] float in [0, 1] and their instructions -> per image, float32 [B] on the images' device:

    edit            asked x (1 + kept) / (1 + rest + extra) (the `edit` reward)
    edit_exact      1 iff the asked change is made, every other object kept and nothing else present
    edit_asked      1 iff the asked change is made
    rest_unchanged  1 iff every object the instruction does not name is kept (colour, shape, place and size)
    objects_extra   components that are neither kept nor the asked object

    `sources`: the source scenes as world objects (colour, shape, x, y, size); None: each prompt's own
    (`source_scene`: its image's objects, or its instruction's canonical scene), as the reward scores them.
    """
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
        raise ValueError(f"expected images [B, 3, H, W] and B prompts, got {tuple(images.shape)} and {len(prompts)} prompts")
    instructions = [instruction_of(p) for p in prompts]
    # the sources first: a bad instruction or scene fails before any detection work on the outputs
    sources = [source_scene(p) for p in prompts] if sources is None else [world_objects(s) for s in sources]
    rows = [score_one(found, src, i) for found, src, i in zip(shapes.components(images), sources, instructions)]
    out = {
        "edit": [r["asked"] * (1 + r["kept"]) / (1 + r["rest"] + r["extra"]) for r in rows],
        "edit_exact": [float(r["asked"] and r["kept"] == r["rest"] and r["extra"] == 0) for r in rows],
        "edit_asked": [float(r["asked"]) for r in rows],
        "rest_unchanged": [float(r["kept"] == r["rest"]) for r in rows],
        "objects_extra": [float(r["extra"]) for r in rows],
    }
    return {k: torch.tensor(v, dtype=torch.float32, device=images.device) for k, v in out.items()}


def edit(device: Optional[torch.device] = None) -> Callable:
    """The `edit` reward: fn(images [B, 3, H, W] float in [0, 1], prompts) -> asked x (1 + kept) / (1 + rest + extra)
    [B] against each prompt's source scene (see the module docstring). Runs on the images' device."""

    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        return evaluate(images, prompts)["edit"]

    fn.check_prompts = _check_prompts
    fn.thread_safe = True  # pure tensor code and a cached pure function
    return fn


def _check_prompts(prompts) -> None:
    """Run before the model loads (rewards.load_rewards): every prompt is an edit instruction of the grammar, and its
    image (if it carries one) a world scene holding the one object it names. The error shows the first bad prompt."""
    from common import UserError, short

    for p in dict.fromkeys(prompts):
        try:
            want = edit_world.parse_instruction(instruction_of(p))
        except ValueError:
            raise UserError(f"the edit reward cannot score the prompt {short(p)} ({edit_world.GRAMMAR})") from None
        try:
            source = source_scene(p)
            if want["edit"] != "add":
                named_object(source, want, instruction_of(p))
        except (OSError, ValueError) as e:
            raise UserError(f"the edit reward cannot score the prompt {short(p)}: {e}") from None
