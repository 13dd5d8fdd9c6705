"""The edit world (`rewards/worlds/edit.py`) and its `edit` reward (`rewards/edit.py`): world renders of the right edit
score 1, of the unchanged input, a wrong edit or an edit that also changes something else score less (by the
formula, recomputed here from counts), for every edit type; the held-out split is disjoint from pretraining."""

import json
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import rewards
from common import UserError
from rewards import edit
from rewards.worlds import edit as edit_world
from rewards.worlds import shapes as world

REPO = Path(__file__).resolve().parents[1]
TASKS = {i: edit_world.task(i) for i in edit_world.all_instructions()}


def to_tensor(scenes) -> torch.Tensor:
    """World scenes -> float [N, 3, 64, 64] in [0, 1]."""
    return torch.from_numpy(np.stack([world.render(list(s)) for s in scenes])).permute(0, 3, 1, 2).float() / 255


def scored(scenes, instructions, sources=None) -> dict:
    return edit.evaluate(to_tensor(scenes), list(instructions), sources)


def kind(instruction: str) -> str:
    return edit_world.parse_instruction(instruction)["edit"]


def by_kind(instructions) -> Counter:
    return Counter(kind(i) for i in instructions)


def touched(source, target) -> tuple:
    """(edit, colour, shape) of a (source, edited) scene pair, read from the scenes alone (an independent reading of
    what the instruction did): the object that appeared, disappeared, changed colour or moved."""
    gone, new = [o for o in source if o not in target], [o for o in target if o not in source]
    if not gone:
        return ("add", new[0][0], new[0][1])
    if not new:
        return ("remove", gone[0][0], gone[0][1])
    if gone[0][2:] == new[0][2:]:
        return ("recolor", new[0][0], new[0][1])
    return ("move", new[0][0], new[0][1])


# ----------------------------------------------------------------------------------------------------------------
# the grammar and the world
# ----------------------------------------------------------------------------------------------------------------
def test_every_instruction_parses_and_is_written_back():
    instructions = edit_world.all_instructions()
    per_shape = (6 + 6 * 5) + (1 + 6) + (4 + 6 * 4) + 6  # recolor, remove, move (named by shape, or colour too), add
    assert len(instructions) == len(set(instructions)) == 3 * per_shape
    for i in instructions:
        p = edit_world.parse_instruction(i)
        assert edit_world.instruction_text(p["edit"], p["shape"], p["color"], p["new_color"], p["direction"]) == i
    assert edit_world.parse_instruction("  Make the RED circle   blue ") == {
        "edit": "recolor",
        "shape": "circle",
        "color": "red",
        "new_color": "blue",
        "direction": None,
    }


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "a red circle",
        "make the circle",
        "make the red circle red",
        "make the pink circle red",
        "add the blue square",
        "add an blue square",
        "add a orange square",
        "remove a triangle",
        "move the square left",
        "move the square to the left of the circle",
        "remove the triangle and the circle",
    ],
)
def test_bad_instructions_are_rejected(bad):
    with pytest.raises(ValueError, match="cannot parse instruction"):
        edit_world.parse_instruction(bad)


def test_canonical_scenes_fit_their_instruction():
    for instruction, (source, target) in TASKS.items():
        p = edit_world.parse_instruction(instruction)
        assert edit_world.task(instruction.upper()) == (source, target)  # keyed by the normalised text
        for scene in (source, target):
            assert 1 <= len(scene) <= edit_world.MAX_OBJECTS or (scene == target and p["edit"] == "remove")
            assert len({o[:2] for o in scene}) == len(scene), "one object per (colour, shape)"
            for i, (_, _, x, y, sz) in enumerate(scene):  # inside the image, boxes GAP pixels apart
                assert 2 <= x <= world.SIZE - 2 - sz and 2 <= y <= world.SIZE - 2 - sz
                assert not edit_world._overlaps((x, y, sz), [o[2:] for j, o in enumerate(scene) if j != i])
        e, color, shape = touched(source, target)
        assert (e, shape) == (p["edit"], p["shape"]) and color == (p["new_color"] or color)
        if p["edit"] != "add":
            named = [o for o in source if o[1] == p["shape"] and p["color"] in (None, o[0])]
            assert len(named) == 1, "the instruction names exactly one object"
        if p["edit"] == "move":
            (old,), (new,) = [o for o in source if o not in target], [o for o in target if o not in source]
            dx, dy = edit_world.DIRECTIONS[p["direction"]]
            shift = (new[2] - old[2], new[3] - old[3])
            assert shift == (abs(sum(shift)) * dx, abs(sum(shift)) * dy) and 12 <= abs(sum(shift)) <= 24


def test_prompt_files_match_the_world():
    folder = REPO / "assets" / "edit"
    rows = {}
    for name in ("train", "test"):
        rows[name] = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
    train, test = ({r["prompt"] for r in rows[n]} for n in ("train", "test"))
    assert not train & test and train | test == set(edit_world.all_instructions())
    assert test == set(edit_world.held_out_instructions()) and by_kind(test) == {
        "recolor": 12,
        "add": 4,
        "remove": 4,
        "move": 8,
    }
    for name, held_out in (("train", False), ("test", True)):
        for r in rows[name]:
            source, target = edit_world.task(r["prompt"])
            assert r["held_out"] is held_out and r["edit"] == kind(r["prompt"])
            assert [tuple(o) for o in r["source"]] == list(source) and [tuple(o) for o in r["target"]] == list(target)
            assert np.array_equal(np.asarray(Image.open(folder / r["image"]).convert("RGB")), world.render(list(source)))


# ----------------------------------------------------------------------------------------------------------------
# the held-out split
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pretraining():
    return edit_world.make_dataset(20000, seed=0)  # the builder's default pairs


@pytest.mark.slow
def test_pretraining_never_performs_a_held_out_edit(pretraining):
    held = set(edit_world.held_out_instructions())
    done = Counter()
    for instruction, source, target in pretraining:
        assert instruction not in held
        key = touched(source, target)
        assert key not in edit_world.HELD_OUT_EDITS, (instruction, source, target)
        assert edit_world.task(instruction) != (tuple(source), tuple(target))
        done[key[0]] += 1
    assert min(done.values()) > 4800  # uniform over the four edits
    trained = set(edit_world.all_instructions()) - held
    assert {i for i, _, _ in pretraining} == trained  # every RL train instruction is seen in pretraining
    # every held-out triple is absent only as an edit: its colour-shape pair is edited otherwise and shown in scenes
    shown = {o[:2] for _, source, _ in pretraining for o in source}
    for e, color, shape in edit_world.HELD_OUT_EDITS:
        assert (color, shape) in shown
        assert any(touched(s, t)[1:] == (color, shape) for _, s, t in pretraining)


def test_test_scenes_are_unseen(pretraining):
    seen = {tuple(source) for _, source, _ in pretraining}
    for instruction in edit_world.held_out_instructions():
        assert TASKS[instruction][0] not in seen
        assert touched(*TASKS[instruction]) in edit_world.HELD_OUT_EDITS


# ----------------------------------------------------------------------------------------------------------------
# the reward on world renders
# ----------------------------------------------------------------------------------------------------------------
def test_the_right_edit_scores_one():
    instructions = list(TASKS)
    m = scored([TASKS[i][1] for i in instructions], instructions)
    for name in ("edit", "edit_exact", "edit_asked", "rest_unchanged"):
        assert m[name].tolist() == [1.0] * len(instructions), name
    assert m["objects_extra"].sum() == 0 and m["edit"].dtype == torch.float32


def test_pretraining_pairs_score_one(pretraining):
    rows = pretraining[:300]
    m = scored([t for _, _, t in rows], [i for i, _, _ in rows], [s for _, s, _ in rows])
    assert m["edit_exact"].tolist() == [1.0] * len(rows)
    assert by_kind(i for i, _, _ in rows).keys() == set(edit_world.EDITS)


def test_blurred_noisy_right_edits_score_high():
    instructions = list(TASKS)
    images = to_tensor([TASKS[i][1] for i in instructions])
    k = torch.exp(-(torch.arange(-3, 4).float() ** 2) / 2)
    k = (k / k.sum()).view(1, 1, 1, -1).expand(3, 1, 1, -1)
    images = F.conv2d(F.pad(images, (3, 3, 0, 0), mode="replicate"), k, groups=3)
    images = F.conv2d(F.pad(images, (0, 0, 3, 3), mode="replicate"), k.transpose(2, 3), groups=3)
    images = (images + 0.04 * torch.randn(images.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    assert edit.evaluate(images, instructions)["edit"].mean() >= 0.98


@pytest.mark.parametrize("name", edit_world.EDITS)
def test_the_unchanged_input_scores_zero(name):
    instructions = [i for i in TASKS if kind(i) == name]
    m = scored([TASKS[i][0] for i in instructions], instructions)
    assert m["edit"].tolist() == [0.0] * len(instructions) and m["edit_exact"].sum() == 0
    assert m["rest_unchanged"].tolist() == [1.0] * len(instructions)  # the rest is untouched, the edit is missing


def touching(scene) -> bool:
    """Two objects' boxes within a pixel of each other."""
    return any(
        ax < bx + bs + 1 and bx < ax + as_ + 1 and ay < by + bs + 1 and by < ay + as_ + 1
        for i, (_, _, ax, ay, as_) in enumerate(scene)
        for (_, _, bx, by, bs) in scene[i + 1 :]
    )


def wrong_edit(instruction, source, target):
    """The instruction's edit done wrongly: the wrong colour, the wrong object's shape, a recolor for a removal, the
    opposite direction."""
    p = edit_world.parse_instruction(instruction)
    named = next((o for o in source if o not in target), None)
    if p["edit"] == "recolor":
        colour = next(c for c in world.COLORS if c not in (named[0], p["new_color"]))
        return [(colour,) + o[1:] if o == named else o for o in source]
    if p["edit"] == "add":
        (new,) = [o for o in target if o not in source]
        shape = next(s for s in world.SHAPES if s != new[1] and (new[0], s) not in {o[:2] for o in source})
        return list(source) + [(new[0], shape) + new[2:]]
    if p["edit"] == "remove":
        colour = next(c for c in world.COLORS if (c, named[1]) not in {o[:2] for o in source})
        return [(colour,) + o[1:] if o == named else o for o in source]
    (moved,) = [o for o in target if o not in source]
    x, y = 2 * named[2] - moved[2], 2 * named[3] - moved[3]  # mirrored about where it was
    x, y = (min(max(v, 2), world.SIZE - 2 - named[4]) for v in (x, y))
    return [o[:2] + (x, y, o[4]) if o == named else o for o in source]


@pytest.mark.parametrize("name", edit_world.EDITS)
def test_a_wrong_edit_scores_zero(name):
    instructions = [i for i in TASKS if kind(i) == name]
    m = scored([wrong_edit(i, *TASKS[i]) for i in instructions], instructions)
    assert m["edit"].tolist() == [0.0] * len(instructions) and m["edit_asked"].sum() == 0 and m["edit_exact"].sum() == 0


@pytest.mark.parametrize("name", edit_world.EDITS)
@pytest.mark.parametrize("extra_change", ("recolor", "move", "remove"))
def test_an_edit_that_also_changes_another_object_scores_between(name, extra_change):
    instructions = [i for i in TASKS if kind(i) == name and len(TASKS[i][1]) >= 2 - (name == "remove")]
    assert len(instructions) >= 5
    scenes, expected = [], []
    for i in instructions:
        source, target = TASKS[i]
        other = next(o for o in source if o in target)  # an object the instruction does not name
        if extra_change == "recolor":
            colour = next(c for c in world.COLORS if (c, other[1]) not in {o[:2] for o in target})
            changed = [(colour,) + other[1:] if o == other else o for o in target]
        elif extra_change == "move":  # 6 pixels: past the position tolerance
            x = other[2] + 6 if other[2] + 6 <= world.SIZE - 2 - other[4] else other[2] - 6
            changed = [other[:2] + (x,) + other[3:] if o == other else o for o in target]
        else:
            changed = [o for o in target if o != other]
        scenes.append(changed)
        # by the formula: asked x (1 + kept) / (1 + rest + extra), with one object lost and (unless removed) one extra
        rest = len(source) - (name != "add")
        extra = 0 if extra_change == "remove" else 1
        expected.append(1 * (1 + rest - 1) / (1 + rest + extra))
    m = scored(scenes, instructions)
    clean = torch.tensor([not touching(s) for s in scenes])  # a move onto a neighbour changes both: skip those
    assert clean.sum() >= 3
    assert torch.allclose(m["edit"][clean], torch.tensor(expected)[clean])
    assert (m["edit"] < 1).all() and m["edit_exact"].sum() == 0 and m["rest_unchanged"].sum() == 0
    assert m["edit_asked"][clean].tolist() == [1.0] * int(clean.sum())


@pytest.mark.parametrize("name", edit_world.EDITS)
def test_an_unasked_extra_object_costs_by_the_formula(name):
    instructions = [i for i in TASKS if kind(i) == name]
    scenes, expected = [], []
    for i in instructions:
        source, target = TASKS[i]
        boxes = [o[2:] for o in target + source]  # clear of the emptied or vacated place too
        free = next((x, y) for x in range(2, 48) for y in range(2, 48) if not edit_world._overlaps((x, y, 14), boxes))
        pair = next(p for p in edit_world.PAIRS if p not in {o[:2] for o in target + source})
        scenes.append(list(target) + [pair + (*free, 14)])
        rest = len(source) - (name != "add")
        expected.append((1 + rest) / (1 + rest + 1))
    m = scored(scenes, instructions)
    assert torch.allclose(m["edit"], torch.tensor(expected)) and m["objects_extra"].tolist() == [1.0] * len(instructions)
    assert m["rest_unchanged"].tolist() == [1.0] * len(instructions) and m["edit_exact"].sum() == 0


def test_tolerances():
    source = [("red", "circle", 10, 10, 14), ("blue", "square", 40, 40, 14)]
    instruction = "make the circle green"
    right = [("green", "circle", 10, 10, 14), ("blue", "square", 40, 40, 14)]

    def one(scene):
        return {k: v.item() for k, v in scored([scene], [instruction], [source]).items()}

    assert one(right)["edit_exact"] == 1
    assert one([right[0], ("blue", "square", 42, 41, 14)])["edit_exact"] == 1  # 2.2 px: within the tolerance
    assert one([right[0], ("blue", "square", 45, 40, 14)])["rest_unchanged"] == 0  # 5 px: moved
    assert one([right[0], ("blue", "square", 40, 40, 9)])["rest_unchanged"] == 0  # shrunk
    assert one([("green", "circle", 16, 10, 14), right[1]])["edit_asked"] == 0  # recoloured, but moved

    move = "move the circle to the right"  # a move of MIN_MOVE pixels or more, with little drift across
    for dx, dy, ok in ((12, 0, True), (8, 3, True), (6, 0, False), (12, 6, False), (-12, 0, False)):
        scene = [("red", "circle", 10 + dx, 10 + dy, 14), source[1]]
        assert scored([scene], [move], [source])["edit_asked"].item() == ok, (dx, dy)
    assert math.isclose(edit.centre(("red", "triangle", 0, 0, 12))[1], 8.0)


class Record(str):
    """A prompt with its image, as prompt_files.Prompt: the string is a key "<text> [<image> <digest>]"."""

    def __new__(cls, text: str, image: Path):
        record = super().__new__(cls, f"{text} [{image.name} 0123456789ab]")
        record.text, record.image = text, image
        return record


def test_a_prompt_with_its_image_is_scored_against_that_image(tmp_path):
    folder = REPO / "assets" / "edit"
    rows = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()]
    records = [Record(r["prompt"], folder / r["image"]) for r in rows]
    m = scored([TASKS[r["prompt"]][1] for r in rows], records)
    assert m["edit_exact"].tolist() == [1.0] * len(rows)
    assert scored([TASKS[r["prompt"]][0] for r in rows], records)["edit"].tolist() == [0.0] * len(rows)
    # another scene for the same instruction: the record's image decides, the canonical scene does not
    source = [("blue", "square", 30, 40, 16), ("red", "circle", 6, 6, 12)]
    Image.fromarray(world.render(source)).save(tmp_path / "mine.png")
    record = Record("move the blue square up", tmp_path / "mine.png")
    moved = [("blue", "square", 30, 22, 16), ("red", "circle", 6, 6, 12)]
    assert scored([moved], [record])["edit_exact"].item() == 1
    assert scored([TASKS["move the blue square up"][1]], [record])["edit"].item() == 0
    assert scored([moved], ["move the blue square up"])["edit"].item() == 0  # the canonical scene is elsewhere


@pytest.mark.slow
def test_the_prompt_files_load_as_image_prompts_the_reward_scores():
    """Through prompt_files.load_prompts (the scripts' path): Prompt records whose image the reward reads."""
    from harness import prompt_files

    for name in ("train", "test"):
        prompts = prompt_files.load_prompts(str(REPO / "assets" / "edit" / f"{name}.jsonl"))
        assert all(isinstance(p, prompt_files.Prompt) and p.size == (64, 64) for p in prompts)
        reward = rewards.load_rewards("edit", "cpu", prompts)  # checks every image holds the object it names
        chosen = prompts[:: max(1, len(prompts) // 40)]
        out = reward.evaluate(to_tensor([TASKS[p.text][1] for p in chosen]), chosen)
        assert out["edit_exact"].tolist() == [1.0] * len(chosen) and out["edit"].tolist() == [1.0] * len(chosen)


def test_a_records_key_reads_as_its_instruction():
    assert edit.instruction_of("make the circle red [images/make-the-circle-red.png 0a1b2c3d4e5f]") == "make the circle red"
    assert edit.instruction_of("make the circle red") == "make the circle red"
    source, target = TASKS["make the circle red"]
    assert scored([target], ["make the circle red [images/make-the-circle-red.png 0a1b2c3d4e5f]"])["edit"].item() == 1


@pytest.mark.parametrize(
    "scene, message",
    [
        ([("red", "square", 10, 10, 14)], "its scene has no objects that 'remove the circle' names, not one"),
        ([("red", "circle", 10, 10, 14), ("blue", "circle", 40, 40, 14)], "its scene has 2 objects that 'remove"),
        ([], "is not a scene of the shapes world"),
        (None, "is not a scene of the shapes world"),  # noise
        ("missing", "No such file"),
    ],
)
def test_a_records_image_is_checked_before_the_model_loads(tmp_path, scene, message):
    path = tmp_path / "scene.png"
    if scene is None:
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    elif scene != "missing":
        Image.fromarray(world.render(scene)).save(path)
    with pytest.raises(UserError, match="the edit reward cannot score the prompt 'remove the circle") as error:
        rewards.load_rewards("edit", "cpu", ["remove the circle", Record("remove the circle", path)])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_canonical_lookup_is_what_the_reward_scores():
    instruction = "move the blue square up"
    source, target = edit_world.task(instruction)
    assert edit.edit("cpu")(to_tensor([target]), [instruction]).tolist() == [1.0]
    # the same move on another scene is scored against the canonical one (the prompt files always pair them)
    other = [("blue", "square", 20, 40, 14)]
    assert edit.edit("cpu")(to_tensor([[("blue", "square", 20, 24, 14)]]), [instruction]).tolist() == [0.0]
    assert scored([[("blue", "square", 20, 24, 14)]], [instruction], [other])["edit"].tolist() == [1.0]


# ----------------------------------------------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------------------------------------------
def test_registered_with_its_metrics():
    instructions = ["make the circle red", "remove the triangle", "add a red circle", "move the square up"]
    reward = rewards.load_rewards("edit", "cpu", instructions)
    images = to_tensor([TASKS[i][1] for i in instructions[:2]] + [TASKS[i][0] for i in instructions[2:]])
    out = reward.evaluate(images, instructions)
    assert set(rewards.EDIT_METRICS) <= set(out) and rewards.eval_metrics(["edit"]) >= set(rewards.EDIT_METRICS)
    assert out["edit"].tolist() == [1.0, 1.0, 0.0, 0.0] and out["edit_exact"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert rewards.REWARDS["edit"]("cpu").thread_safe


def test_bad_prompts_fail_before_the_model_loads():
    with pytest.raises(UserError, match="the edit reward cannot score the prompt 'a red circle'"):
        rewards.load_rewards("edit", "cpu", ["make the circle red", "a red circle"])
    with pytest.raises(ValueError, match="expected images"):
        edit.evaluate(torch.zeros(2, 3, 64, 64), ["remove the circle"])
    with pytest.raises(ValueError, match="its scene has no objects that 'remove the red circle' names, not one"):
        scored([[]], ["remove the red circle"], [[("blue", "circle", 5, 5, 12)]])


def test_bounded_on_noise_and_blobs():
    """Noise, flat colours and smudges: every score in [0, 1], exact only where asked and the rest hold."""
    instructions = list(TASKS)[::3]
    gen = torch.Generator().manual_seed(0)
    noise = torch.rand(len(instructions), 3, 64, 64, generator=gen)
    smooth = F.interpolate(torch.rand(len(instructions), 3, 8, 8, generator=gen), size=64, mode="bilinear")
    for images in (noise, smooth, torch.ones(len(instructions), 3, 64, 64)):
        m = edit.evaluate(images, instructions)
        assert ((m["edit"] >= 0) & (m["edit"] <= 1)).all()
        assert (m["edit_exact"] <= m["edit_asked"] * m["rest_unchanged"]).all()
        assert (m["edit"][m["edit_exact"] == 1] == 1).all() and (m["edit"][m["edit_asked"] == 0] == 0).all()


def test_any_resolution():
    instructions = random.Random(0).sample(list(TASKS), 40)
    images = F.interpolate(to_tensor([TASKS[i][1] for i in instructions]), scale_factor=2, mode="bilinear")
    assert edit.evaluate(images, instructions)["edit"].mean() >= 0.98
