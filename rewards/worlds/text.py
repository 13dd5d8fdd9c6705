"""The tiny-text world: 64x64 images of one short word in capitals on a plain background, and their captions.

The OCR task of Flow-GRPO / DiffusionNFT / DGPO at toy scale: prompts like `a sign that says "KEPT"`, scored by the
`ocr` reward. Words are 2-4 random capitals (no dictionary: the recogniser is a CTC model without a language model,
and random strings make held-out words easy to guarantee). The test words never occur in training, so RL on them
measures whether the model spells new words, not whether it remembers old ones. Deterministic given a seed.
"""

import random

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SIZE = 64
SUPERSAMPLE = 4
# no I and O (they can read as 1/l and 0): renderings of words with them scored < 1 in 1 of 96 cases, without 0 of 256
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
TEMPLATES = ('a sign that says "{}"', 'the word "{}"', 'a label with the text "{}"')
BACKGROUNDS = ((235, 235, 235), (240, 230, 200), (210, 225, 240))
INKS = ((20, 20, 30), (150, 20, 20), (20, 40, 140))


def random_word(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4)))


def splits(num_train: int = 4000, num_test: int = 64, seed: int = 0):
    """Disjoint train / test words (test first so that it does not depend on num_train), as caption rows."""
    rng = random.Random(seed)
    test_words, train_words = [], []
    seen = set()
    for out, n in ((test_words, num_test), (train_words, num_train)):
        while len(out) < n:
            word = random_word(rng)
            if word not in seen:
                seen.add(word)
                out.append(word)
    rows = lambda words: [("text", TEMPLATES[i % len(TEMPLATES)].format(w), w) for i, w in enumerate(words)]
    return rows(train_words), rows(test_words)


FONT_SIZE = 16  # px at 64x64: cap height ~11 px, "WWWW" is ~58 px wide
JITTER = 0  # px of random shift of the whole word


def render(word: str, rng: random.Random) -> np.ndarray:
    """uint8 [SIZE, SIZE, 3]: the word centred at a fixed size, on one of three backgrounds in one of three inks.
    A fixed size and place keep the task learnable for a 2M-parameter transformer whose tokens are 8x8 pixels: with
    JITTER = 3 the built model's held-out OCR score was 0.02 (0.68 without; docs/ocr.md)."""
    s = SUPERSAMPLE
    background, ink = rng.choice(BACKGROUNDS), rng.choice(INKS)
    img = Image.new("RGB", (SIZE * s, SIZE * s), background)
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=FONT_SIZE * s)  # Pillow's bundled font: the same glyphs on every machine
    dx, dy = (rng.uniform(-JITTER, JITTER) * s for _ in range(2)) if JITTER else (0, 0)
    draw.text((SIZE * s / 2 + dx, SIZE * s / 2 + dy), word, fill=ink, font=font, anchor="mm")
    return np.asarray(img.resize((SIZE, SIZE), Image.BOX))


def make_dataset(rows, n: int, seed: int):
    """n (caption, image) pairs: a random training row each, with a fresh rendering."""
    rng = random.Random(seed)
    captions, images = [], np.empty((n, SIZE, SIZE, 3), dtype=np.uint8)
    for i in range(n):
        _, prompt, word = rng.choice(rows)
        images[i] = render(word, rng)
        captions.append(prompt)
    return captions, images
