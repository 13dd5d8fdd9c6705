"""The tiny-shapes world: procedural 64x64 images of 1-4 flat shapes and the caption grammar that describes them.

The grammar mirrors GenEval's six categories (single object, two objects, counting, colours, position, colour
attribution). A few combinations are held out of the training captions so that RL on the test split measures
generalisation, as GenEval does for SD3.5: colour-shape pairs, one count-shape pair and some position triples.
Everything here is deterministic given a `random.Random`.
"""

import itertools
import random

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64  # image side in pixels
SUPERSAMPLE = 4  # draw at 4x and box-filter down: anti-aliased edges like a generator's
BACKGROUND = (235, 235, 235)
COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 50, 190),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
RELATIONS = ("to the left of", "to the right of", "above", "below")
CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

# never written in a training caption (images may still contain them when the caption leaves colour open)
HELD_OUT_PAIRS = {("purple", "triangle"), ("orange", "circle"), ("green", "square")}
HELD_OUT_COUNTS = {(4, "triangle")}
HELD_OUT_POSITIONS = {("triangle", "above", "circle"), ("square", "to the left of", "triangle")}


def plural(shape: str) -> str:
    return shape + "s"


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def all_prompts():
    """Every caption of the grammar, as (category, prompt, spec) with spec the list of required objects."""
    out = []
    for s in SHAPES:
        out.append(("single_object", f"a {s}", [(None, s)]))
    for s1, s2 in itertools.permutations(SHAPES, 2):
        out.append(("two_object", f"a {s1} and a {s2}", [(None, s1), (None, s2)]))
    for n, s in itertools.product((2, 3, 4), SHAPES):
        out.append(("counting", f"{NUMBERS[n]} {plural(s)}", [(None, s)] * n))
    for c, s in itertools.product(COLORS, SHAPES):
        out.append(("colors", f"{article(c)} {c} {s}", [(c, s)]))
    for (s1, s2), rel in itertools.product(itertools.permutations(SHAPES, 2), RELATIONS):
        out.append(("position", f"a {s1} {rel} a {s2}", [(None, s1), (None, s2)]))
    for (c1, s1), (c2, s2) in itertools.permutations(itertools.product(COLORS, SHAPES), 2):
        if s1 != s2:
            out.append(("color_attr", f"{article(c1)} {c1} {s1} and {article(c2)} {c2} {s2}", [(c1, s1), (c2, s2)]))
    return out


def is_held_out(category: str, prompt: str) -> bool:
    words = prompt.split()
    pairs = {(words[i], words[i + 1]) for i in range(len(words) - 1)}
    if pairs & HELD_OUT_PAIRS:
        return True
    if category == "counting":
        n = {v: k for k, v in NUMBERS.items()}[words[0]]
        return (n, words[1][:-1]) in HELD_OUT_COUNTS
    if category == "position":
        return any(f"a {a} {rel} a {b}" == prompt for a, rel, b in HELD_OUT_POSITIONS)
    return False


def splits(num_test_per_category: int = 8, seed: int = 0):
    """Train prompts (everything not held out) and a test set balanced over categories.

    The test set takes the held-out prompts first, then fills each category up to `num_test_per_category` with
    other prompts (whose colour-shape pairs were seen, as in GenEval, where objects are familiar but combinations are not).
    Test prompts with nothing held out are removed from train so that the two splits never share a caption.
    """
    rng = random.Random(seed)
    prompts = all_prompts()
    test = []
    for cat in CATEGORIES:
        rows = [p for p in prompts if p[0] == cat]
        held = [p for p in rows if is_held_out(cat, p[1])]
        rng.shuffle(held)
        picked = held[:num_test_per_category]
        rest = [p for p in rows if p not in picked and not is_held_out(cat, p[1])]
        rng.shuffle(rest)
        # keep at least two thirds of a small category for training
        room = min(num_test_per_category - len(picked), len(rest) // 3)
        test += picked + rest[:room]
    test_set = {p[1] for p in test}
    train = [p for p in prompts if p[1] not in test_set and not is_held_out(p[0], p[1])]
    return train, test


def _place(rng: random.Random, sizes, placed, relation=None):
    """Rejection-sample non-overlapping square boxes (x, y, size) inside the image."""
    for _ in range(200):
        boxes = list(placed)
        ok = True
        for sz in sizes:
            x, y = rng.randint(2, SIZE - 2 - sz), rng.randint(2, SIZE - 2 - sz)
            if any(x < bx + bs + 3 and bx < x + sz + 3 and y < by + bs + 3 and by < y + sz + 3 for bx, by, bs in boxes):
                ok = False
                break
            boxes.append((x, y, sz))
        if ok and relation is not None:
            (ax, ay, as_), (bx, by, bs) = boxes[-2:]
            dx, dy = (bx + bs / 2) - (ax + as_ / 2), (by + bs / 2) - (ay + as_ / 2)  # b minus a, image y points down
            main, other = {"to the left of": (dx, dy), "to the right of": (-dx, dy), "above": (dy, dx), "below": (-dy, dx)}[
                relation
            ]
            ok = main > 14 and abs(other) < main / 2
        if ok:
            return boxes[len(placed) :]
    raise RuntimeError("could not place the objects")  # never happens with <= 4 objects of size <= 20


def sample_scene(rng: random.Random, category: str, prompt: str, spec):
    """A scene (list of (colour, shape, x, y, size)) that satisfies the caption; free colours are drawn at random."""
    sizes = [rng.randint(12, 20) if len(spec) <= 2 else rng.randint(10, 15) for _ in spec]
    relation = next((r for r in RELATIONS if f" {r} " in prompt), None) if category == "position" else None
    boxes = _place(rng, sizes, [], relation)
    objects = []
    counting_colour = rng.choice(list(COLORS))
    for (colour, shape), (x, y, sz) in zip(spec, boxes):
        if colour is None:
            colour = counting_colour if category == "counting" and rng.random() < 0.5 else rng.choice(list(COLORS))
        objects.append((colour, shape, x, y, sz))
    return objects


def render(objects) -> np.ndarray:
    """uint8 [SIZE, SIZE, 3] image of the scene, anti-aliased by supersampling."""
    s = SUPERSAMPLE
    img = Image.new("RGB", (SIZE * s, SIZE * s), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for colour, shape, x, y, sz in objects:
        x0, y0, x1, y1 = x * s, y * s, (x + sz) * s - 1, (y + sz) * s - 1
        fill = COLORS[colour]
        if shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return np.asarray(img.resize((SIZE, SIZE), Image.BOX))


def make_dataset(prompts, n: int, seed: int):
    """n (caption, image) pairs drawn uniformly over categories, then over the given prompts."""
    rng = random.Random(seed)
    by_cat = {c: [p for p in prompts if p[0] == c] for c in CATEGORIES}
    cats = [c for c in CATEGORIES if by_cat[c]]
    captions, images = [], np.empty((n, SIZE, SIZE, 3), dtype=np.uint8)
    for i in range(n):
        cat, prompt, spec = rng.choice(by_cat[rng.choice(cats)])
        images[i] = render(sample_scene(rng, cat, prompt, spec))
        captions.append(prompt)
    return captions, images
