"""The edit world: (source scene, instruction, edited scene) triples over the tiny-shapes world (`rewards/worlds/shapes.py`).

A scene holds 1-3 objects with distinct (colour, shape) pairs, so "the red circle" always names one object, and "the
circle" is written only when the scene has one circle. Four edits, in a small grammar:

    recolor  "make the [colour] <shape> <colour>"                      the object takes the new colour, in place
    add      "add a|an <colour> <shape>"                               a new object anywhere free (to 1-2 objects)
    remove   "remove the [colour] <shape>"                             the object is gone, its spot is background
    move     "move the [colour] <shape> to the left|to the right|up|down"   the object shifts 12-24 pixels that way

Everything not named stays exactly where it was, in its colour, shape and size. The edited scene is rendered by
`world.render`, so a (source, edited) pair of renders is the ground truth of an edit.

Held-out split. Every edit touches one (colour, shape): the new colour for recolor and add, the object's own colour
for remove and move. `HELD_OUT_EDITS` lists (edit, colour, shape) triples that pretraining never performs, whether
or not the instruction names the colour ("remove the triangle" on a red triangle is the held-out red-triangle
removal too); as in `assets/test.jsonl`, the objects themselves are familiar (red triangles appear in pretraining
scenes, and other triangles are removed), only the combination is new. The test prompts are exactly the
instructions that name a held-out triple (`held_out_instructions`), each on a scene drawn from its own seed, which
the tests check against the pretraining scenes; the RL train prompts are every other instruction of the grammar.

Canonical scenes. Each instruction string has one canonical scene, `task(instruction)`, drawn from a generator
seeded by its text: the prompt files pair each instruction with the render of that scene (203 train and 28 test
(scene, instruction) pairs), and the `edit` reward (`rewards/edit.py`) reads the source scene from the
prompt's image, or, for a prompt that reaches it as a plain string (a reward server), uses the canonical scene.
`python rewards/worlds/edit.py` writes assets/edit/{train,test}.jsonl and their images.
Pretraining pairs (`make_dataset`) draw many scenes per instruction from a separate seed.
"""

import functools
import json
import random
import re
import sys
import zlib
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
ASSETS = Path(__file__).resolve().parents[2] / "assets"  # what this writes: data only
from rewards.worlds import shapes as world  # noqa: E402

EDITS = ("recolor", "add", "remove", "move")
DIRECTIONS = {"to the left": (-1, 0), "to the right": (1, 0), "up": (0, -1), "down": (0, 1)}  # image y points down
MOVE_RANGE = (12, 24)  # pixels a move shifts the object in the world's edited scenes
SIZE_RANGE = (12, 18)  # object sides in edit scenes: room for three objects and a move
MAX_OBJECTS = 3
GAP = 3  # free pixels between two objects' boxes, as world._place keeps them
PAIRS = tuple((c, s) for c in world.COLORS for s in world.SHAPES)

HELD_OUT_EDITS = {
    ("recolor", "purple", "circle"),
    ("recolor", "yellow", "square"),
    ("add", "orange", "triangle"),
    ("add", "blue", "circle"),
    ("add", "red", "square"),
    ("add", "green", "triangle"),
    ("remove", "red", "triangle"),
    ("remove", "green", "square"),
    ("remove", "blue", "circle"),
    ("remove", "orange", "square"),
    ("move", "blue", "square"),
    ("move", "yellow", "triangle"),
}

_COLOR = "|".join(world.COLORS)
_SHAPE = "|".join(world.SHAPES)
_OBJECT = rf"the (?:({_COLOR}) )?({_SHAPE})"
_INSTRUCTIONS = {
    "recolor": re.compile(rf"make {_OBJECT} ({_COLOR})"),
    "add": re.compile(rf"add (?:a|an) ({_COLOR}) ({_SHAPE})"),
    "remove": re.compile(rf"remove {_OBJECT}"),
    "move": re.compile(rf"move {_OBJECT} ({'|'.join(DIRECTIONS)})"),
}
GRAMMAR = (
    "expected 'make the [colour] <shape> <colour>', 'add a <colour> <shape>', 'remove the [colour] <shape>' or "
    f"'move the [colour] <shape> <{'|'.join(DIRECTIONS)}>'; colours: {', '.join(world.COLORS)}; "
    f"shapes: {', '.join(world.SHAPES)}"
)


# ----------------------------------------------------------------------------------------------------------------
# instructions
# ----------------------------------------------------------------------------------------------------------------
def normalize(instruction: str) -> str:
    return " ".join(instruction.lower().split())


def parse_instruction(instruction: str) -> dict:
    """Instruction -> {"edit", "shape", "color" (the named object's colour, None if not named), "new_color" (recolor,
    add), "direction" (move)}. Raises ValueError (with the grammar) on anything else."""
    text = normalize(instruction)
    for edit, pattern in _INSTRUCTIONS.items():
        m = pattern.fullmatch(text)
        if m is None:
            continue
        g = m.groups()
        if edit == "add":
            out = {"edit": edit, "color": None, "shape": g[1], "new_color": g[0], "direction": None}
            if text.split()[1] != world.article(g[0]):
                raise ValueError(f"cannot parse instruction {instruction!r}: write '{world.article(g[0])} {g[0]}'")
            return out
        out = {"edit": edit, "color": g[0], "shape": g[1], "new_color": None, "direction": None}
        if edit == "recolor":
            out["new_color"] = g[2]
            if g[0] == g[2]:
                raise ValueError(f"cannot parse instruction {instruction!r}: the {g[1]} is {g[0]} already")
        if edit == "move":
            out["direction"] = g[2]
        return out
    raise ValueError(f"cannot parse instruction {instruction!r}: {GRAMMAR}")


def instruction_text(edit: str, shape: str, color=None, new_color=None, direction=None) -> str:
    """The instruction of an edit; `color` names the edited object (None: by its shape alone)."""
    obj = f"the {color + ' ' if color else ''}{shape}"
    if edit == "recolor":
        return f"make {obj} {new_color}"
    if edit == "add":
        return f"add {world.article(new_color)} {new_color} {shape}"
    if edit == "remove":
        return f"remove {obj}"
    return f"move {obj} {direction}"


def all_instructions() -> list:
    """Every instruction of the grammar, in a fixed order."""
    out = []
    for shape in world.SHAPES:
        for ref in (None, *world.COLORS):
            out += [instruction_text("recolor", shape, ref, c) for c in world.COLORS if c != ref]
            out += [instruction_text("remove", shape, ref)]
            out += [instruction_text("move", shape, ref, direction=d) for d in DIRECTIONS]
        out += [instruction_text("add", shape, new_color=c) for c in world.COLORS]
    return out


def named_key(parsed: dict):
    """The (edit, colour, shape) an instruction names, or None when its colour is left to the scene."""
    color = parsed["new_color"] if parsed["edit"] in ("recolor", "add") else parsed["color"]
    return None if color is None else (parsed["edit"], color, parsed["shape"])


def held_out_instructions() -> list:
    """The test instructions: those that name a held-out (edit, colour, shape)."""
    return [i for i in all_instructions() if named_key(parse_instruction(i)) in HELD_OUT_EDITS]


# ----------------------------------------------------------------------------------------------------------------
# scenes and edits
# ----------------------------------------------------------------------------------------------------------------
def _overlaps(box, boxes) -> bool:
    x, y, sz = box
    return any(x < bx + bs + GAP and bx < x + sz + GAP and y < by + bs + GAP and by < y + sz + GAP for bx, by, bs in boxes)


def _inside(x: int, y: int, sz: int) -> bool:
    return 2 <= x <= world.SIZE - 2 - sz and 2 <= y <= world.SIZE - 2 - sz


def _try_pair(rng: random.Random, want: dict, allow_held_out: bool):
    """One attempt at (source, instruction, edited) for the partly fixed edit `want` (None fields are free); None
    when the draw does not fit (no room for a move, a held-out edit where none is allowed)."""
    edit = want["edit"]
    shape = want["shape"] or rng.choice(world.SHAPES)
    color = want["color"]
    new_color = want["new_color"]
    if edit in ("recolor", "add") and new_color is None:
        new_color = rng.choice([c for c in world.COLORS if c != color])
    if edit != "add" and color is None:
        color = rng.choice([c for c in world.COLORS if c != new_color])
    direction = (want["direction"] or rng.choice(list(DIRECTIONS))) if edit == "move" else None
    touched = (new_color if edit in ("recolor", "add") else color, shape)
    if not allow_held_out and (edit, *touched) in HELD_OUT_EDITS:
        return None

    # the other objects: distinct pairs, none equal to the edited object before or after the edit, and no other
    # object of the shape when the instruction names the object by its shape alone ("the circle")
    named_by_shape = edit != "add" and want["color"] is None
    pool = [p for p in PAIRS if p not in {(color, shape), touched} and not (named_by_shape and p[1] == shape)]
    others = rng.sample(pool, rng.randint(1, MAX_OBJECTS - 1) if edit == "add" else rng.randint(0, MAX_OBJECTS - 1))
    boxes = world._place(rng, [rng.randint(*SIZE_RANGE) for _ in range(len(others) + 1)], [])
    rest = [(c, s, *box) for (c, s), box in zip(others, boxes[1:])]
    if edit == "add":  # the new object takes the first box: placed clear of the others like every object
        source, target = rest, rest + [(new_color, shape, *boxes[0])]
    else:
        x, y, sz = boxes[0]
        if edit == "recolor":
            edited = [(new_color, shape, x, y, sz)]
        elif edit == "remove":
            edited = []
        else:
            dx, dy = DIRECTIONS[direction]
            steps = list(range(MOVE_RANGE[0], MOVE_RANGE[1] + 1))
            rng.shuffle(steps)
            fits = [
                d
                for d in steps
                if _inside(x + d * dx, y + d * dy, sz) and not _overlaps((x + d * dx, y + d * dy, sz), boxes[1:])
            ]
            if not fits:
                return None
            edited = [(color, shape, x + fits[0] * dx, y + fits[0] * dy, sz)]
        # the edited object's place in the list (the renderer's draw order) is drawn too, the same in both scenes
        at = rng.randint(0, len(rest))
        source = rest[:at] + [(color, shape, x, y, sz)] + rest[at:]
        target = rest[:at] + edited + rest[at:]
    ref = None if named_by_shape else color
    return source, instruction_text(edit, shape, ref, new_color, direction), target


def sample_pair(rng: random.Random, want: dict, allow_held_out: bool = False):
    """(source scene, instruction, edited scene) for the edit `want` (parse_instruction's dict; None fields are drawn
    from `rng`). Scenes are lists of world objects (colour, shape, x, y, size)."""
    for _ in range(1000):
        pair = _try_pair(rng, want, allow_held_out)
        if pair is not None:
            return pair
    raise RuntimeError(f"no scene fits {want}")  # never happens: every edit of the grammar fits most draws


@functools.lru_cache(maxsize=None)
def task(instruction: str):
    """The canonical (source scene, edited scene) of an instruction: drawn from a generator seeded by its normalised
    text, so the prompt files and the edit reward agree on it. Raises ValueError if the instruction does not parse."""
    text = normalize(instruction)
    parsed = parse_instruction(text)
    rng = random.Random(zlib.crc32(f"edit-task:{text}".encode()))
    source, written, target = sample_pair(rng, parsed, allow_held_out=True)
    assert written == text, (written, text)
    return tuple(source), tuple(target)


def make_dataset(n: int, seed: int) -> list:
    """n pretraining pairs (instruction, source scene, edited scene), uniform over the four edits, no held-out edit
    among them. The object is named by colour and shape ("the red circle") in half the pairs, by its shape alone in
    the others (the scene then has one object of that shape)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        edit = rng.choice(EDITS)
        want = {"edit": edit, "shape": None, "color": None, "new_color": None, "direction": None}
        if edit != "add" and rng.random() < 0.5:
            want["color"] = rng.choice(list(world.COLORS))
        source, instruction, target = sample_pair(rng, want)
        pairs.append((instruction, source, target))
    return pairs


# ----------------------------------------------------------------------------------------------------------------
# prompt files
# ----------------------------------------------------------------------------------------------------------------
def slug(instruction: str) -> str:
    return normalize(instruction).replace(" ", "-")


def prompt_rows(instructions, held_out: bool) -> list:
    """jsonl rows: the instruction, its source render (relative to the jsonl), and the canonical scenes for readers."""
    rows = []
    for instruction in instructions:
        source, target = task(instruction)
        rows.append(
            {
                "prompt": instruction,
                "image": f"images/{slug(instruction)}.png",
                "edit": parse_instruction(instruction)["edit"],
                "held_out": held_out,
                "source": [list(o) for o in source],
                "target": [list(o) for o in target],
            }
        )
    return rows


def write_prompt_files(folder: Path) -> dict:
    """folder/train.jsonl (every instruction not held out), folder/test.jsonl (the held-out ones) and folder/images/."""
    test = held_out_instructions()
    train = [i for i in all_instructions() if i not in set(test)]
    (folder / "images").mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, instructions in (("train", train), ("test", test)):
        rows = prompt_rows(instructions, held_out=name == "test")
        for row in rows:
            Image.fromarray(world.render(task(row["prompt"])[0])).save(folder / row["image"])
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        counts[name] = len(rows)
    return counts


if __name__ == "__main__":
    out = ASSETS / "edit"
    counts = write_prompt_files(out)
    print(f"{out}: {counts['train']} train and {counts['test']} held-out test instructions, one source image each")
