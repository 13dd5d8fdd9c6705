"""Writes assets/unseen_colors.jsonl: 30 colour-attribution prompts that no training run saw as a caption.

Every colour-attribution caption of the grammar that is in neither train.jsonl nor test.jsonl holds a held-out
colour-shape pair (the splits train on every other one), so each of these asks for at least one colour-shape pair
never written in a training caption. The 6 that hold two such pairs come first, then 24 of the rest, drawn with seed 0.

    python benchmark/testbeds/unseen_colors.py
"""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
ASSETS = Path(__file__).resolve().parents[2] / "assets"  # what this writes: data only
from rewards.worlds import shapes as world  # noqa: E402

train, test = world.splits()
seen = {p[1] for p in train + test}
unseen = [p for p in world.all_prompts() if p[0] == "color_attr" and p[1] not in seen]
both = [p for p in unseen if all(pair in world.HELD_OUT_PAIRS for pair in p[2])]
rest = [p for p in unseen if p not in both]
random.Random(0).shuffle(rest)
rows = [{"prompt": prompt, "category": cat, "held_out": True} for cat, prompt, _ in both + rest[: 30 - len(both)]]
out = ASSETS / "unseen_colors.jsonl"
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"{out}: {len(rows)} of {len(unseen)} unseen colour-attribution prompts ({len(both)} with two held-out pairs)")
