"""GenEval without mmdet (rewards/geneval.py): its rules against hand computations on synthetic boxes and masks, the
prompt grammar against hand-written metadata in GenEval's format (tests/geneval_metadata.jsonl), and the plumbing on a
tiny random Mask2Former and CLIP saved with save_pretrained (nothing is downloaded)."""

import json
import math
from pathlib import Path

import pytest
import torch

from common import UserError
from rewards import geneval as ge
from rewards.geneval import Detection, judge, keep_confident, relative_position, summary

METADATA = Path(__file__).with_name("geneval_metadata.jsonl")


def det(x1, y1, x2, y2, score=1.0):
    return Detection((x1, y1, x2, y2), score)


# ---- relative position: centres, sizes and the 0.1 threshold worked out by hand ----
@pytest.mark.parametrize(
    "a, b, expected",
    [
        # centres (5, 5) and (35, 5): offset (-30, 0); 30 - 0.1 * (10 + 10) = 28 > 0, dx = -28 / 30
        ((0, 0, 10, 10), (30, 0, 40, 10), {"left of"}),
        ((30, 0, 40, 10), (0, 0, 10, 10), {"right of"}),
        # offset (-20, -20): each axis 20 - 2 = 18, / |offset| 28.28 = 0.636 > 0.5 on both
        ((0, 0, 10, 10), (20, 20, 30, 30), {"left of", "above"}),
        ((20, 20, 30, 30), (0, 0, 10, 10), {"right of", "below"}),
        # offset (-10, -8): revised (-8, -6) / 12.81 = (-0.625, -0.468): only left
        ((0, 0, 10, 10), (10, 8, 20, 18), {"left of"}),
        # offset (-1, -1) is inside 0.1 x (10 + 10) = 2 on both axes: no direction
        ((0, 0, 10, 10), (1, 1, 11, 11), set()),
        # a tall box b (height 100): offset (0, -60), 60 - 0.1 * (10 + 100) = 49, dy = -49 / 60 = -0.817
        ((0, 0, 10, 10), (0, 15, 10, 115), {"above"}),
        # the same offset with a huge b: 60 - 0.1 * (10 + 600) < 0: no direction
        ((0, 0, 10, 10), (0, -235, 10, 365), set()),
    ],
)
def test_relative_position_by_hand(a, b, expected):
    assert relative_position(a, b) == expected


def test_relative_position_threshold_is_a_parameter():
    # offset (-12, 0), sizes 20: threshold 0.5 takes 10 off -> -2 / 12 = -0.17 (none); 0.1 takes 2 -> -0.83 (left)
    assert relative_position((0, 0, 10, 10), (12, 0, 22, 10), threshold=0.5) == set()
    assert relative_position((0, 0, 10, 10), (12, 0, 22, 10), threshold=0.1) == {"left of"}


# ---- which detections count ----
def test_keep_confident_thresholds_order_and_cap():
    cats = [det(0, 0, 1, 1, s) for s in (0.5, 0.95, 0.2, 0.3, 0.91)]
    kept = keep_confident({"cat": cats, "dog": [det(0, 0, 1, 1, 0.1)]}, "two_object")
    assert [d.score for d in kept["cat"]] == [0.95, 0.91, 0.5]  # > 0.3 strictly, most confident first
    assert "dog" not in kept  # a class with nothing above the threshold is absent
    kept = keep_confident({"cat": cats}, "counting")
    assert [d.score for d in kept["cat"]] == [0.95, 0.91]  # counting: > 0.9
    many = [det(0, 0, 1, 1, 0.4 + k / 100) for k in range(20)]
    kept = keep_confident({"cat": many}, "single_object")["cat"]
    assert len(kept) == 16 and kept[0].score == pytest.approx(0.59) and kept[-1].score == pytest.approx(0.44)


# ---- the clauses ----
def colors_by_x(table):
    """A colour per detection read off its box's left edge: a fixed, hand-checkable colour assignment."""
    return lambda name, dets: [table[d.box[0]] for d in dets]


def test_counting_needs_exactly_the_count():
    meta = {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}]}
    for n, correct, met in ((1, False, 1), (2, True, 2), (3, False, 1), (4, False, 1)):
        v = judge(meta, {"clock": [det(k, 0, k + 1, 1) for k in range(n)]} if n else {}, colors_by_x({}))
        assert (v.correct, v.met, v.clauses) == (correct, met, 2), n


def test_two_objects_and_extra_objects():
    meta = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]}
    cat, dog = [det(0, 0, 5, 5)], [det(10, 0, 15, 5)]
    assert judge(meta, {"cat": cat, "dog": dog}, None).correct
    # objects that were not asked for are not penalised outside counting (GenEval has no exclude clause here)
    assert judge(meta, {"cat": cat * 3, "dog": dog, "bus": dog}, None).correct
    v = judge(meta, {"cat": cat}, None)
    assert (v.correct, v.met, v.clauses) == (False, 1, 2)


def test_colour_is_judged_on_the_most_confident_objects_only():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    table = {0: "red", 10: "blue"}
    seen = []

    def colors(name, dets):
        seen.append((name, [d.box[0] for d in dets]))
        return colors_by_x(table)(name, dets)

    assert judge(meta, {"car": [det(0, 0, 5, 5, 0.9), det(10, 0, 15, 5, 0.8)]}, colors).correct
    assert seen == [("car", [0])]  # only the top `count` car went to the colour classifier
    assert not judge(meta, {"car": [det(10, 0, 15, 5, 0.9), det(0, 0, 5, 5, 0.8)]}, colors).correct


def test_colour_attribution_checks_each_object():
    meta = {
        "tag": "color_attr",
        "include": [{"class": "cat", "count": 1, "color": "purple"}, {"class": "sink", "count": 1, "color": "black"}],
    }
    objects = {"cat": [det(0, 0, 5, 5)], "sink": [det(10, 0, 15, 5)]}
    assert judge(meta, objects, colors_by_x({0: "purple", 10: "black"})).correct
    v = judge(meta, objects, colors_by_x({0: "black", 10: "purple"}))  # swapped colours: both clauses fail
    assert (v.correct, v.met) == (False, 0)
    v = judge(meta, objects, colors_by_x({0: "purple", 10: "white"}))
    assert (v.correct, v.met) == (False, 1)


def test_position_against_every_target_and_a_missing_target():
    meta = {
        "tag": "position",
        "include": [{"class": "skateboard", "count": 1}, {"class": "bird", "count": 1, "position": ["below", 0]}],
    }
    board = [det(0, 0, 10, 10)]
    assert judge(meta, {"skateboard": board, "bird": [det(0, 30, 10, 40)]}, None).correct
    v = judge(meta, {"skateboard": board, "bird": [det(0, -40, 10, -30)]}, None)  # above instead
    assert (v.correct, v.met) == (False, 1)
    v = judge(meta, {"bird": [det(0, 30, 10, 40)]}, None)  # no skateboard: clause 0 fails, so no target for clause 1
    assert (v.correct, v.met) == (False, 0) and "no target" in v.reasons[-1]
    # only the most confident bird is placed; a second, misplaced and less confident bird does not matter
    birds = [det(0, 30, 10, 40, 0.9), det(0, -40, 10, -30, 0.5)]
    assert judge(meta, {"skateboard": board, "bird": birds}, None).correct


def test_summary_is_the_mean_over_tags_not_images():
    tags = ["single_object"] * 3 + ["counting"]
    out = summary(tags, [1, 1, 0, 1])
    assert list(out) == ["single_object", "counting", "overall"]
    assert out["single_object"] == pytest.approx(2 / 3) and out["counting"] == 1
    assert out["overall"] == pytest.approx((2 / 3 + 1) / 2)  # the image mean would be 3 / 4


# ---- prompts ----
def test_prompts_parse_back_into_the_hand_written_metadata():
    for line in METADATA.read_text().splitlines():
        meta = json.loads(line)
        assert ge.parse_prompt(meta["prompt"]) == meta


@pytest.mark.parametrize("prompt", ["a red circle", "a photo of two cats and a dog", "a photo of a red cat and a dog", ""])
def test_non_geneval_prompts_are_one_user_error(prompt):
    with pytest.raises(UserError, match="GenEval's prompts"):
        ge.parse_prompt(prompt)


# ---- mmdet's Mask2Former post-processing ----
def test_mask2former_instances_by_hand():
    # 2 queries, 3 classes + "no object"; 4 x 4 masks
    class_logits = torch.tensor([[2.0, 0.5, 0.0, 1.0], [0.0, 0.0, 3.0, 0.0]])
    mask_logits = torch.full((2, 4, 4), -5.0)
    mask_logits[0, 1:3, 0:2] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # query 0: a 2 x 2 square at x 0-1, y 1-2
    mask_logits[1, 0, 3] = 0.5  # query 1: one pixel at x 3, y 0
    found = ge.mask2former_instances(class_logits, mask_logits, max_per_image=3)
    softmax = lambda row: [math.exp(v) / sum(math.exp(u) for u in row) for v in row]  # noqa: E731
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    p0, p1 = softmax([2.0, 0.5, 0.0, 1.0]), softmax([0.0, 0.0, 3.0, 0.0])
    # probabilities: (q1, c2) 0.87, (q0, c0) 0.58, (q0, c1) 0.13, then (q0, c2) 0.08 and (q1, c0/c1) 0.04: top 3 kept
    assert sorted(found) == [0, 1, 2] and [len(found[k]) for k in (0, 1, 2)] == [1, 1, 1]
    square = sum(sig(v) for v in (1, 2, 3, 4)) / 4  # mean mask probability over the mask's 4 pixels
    (d0,), (d1,), (d2,) = found[0], found[1], found[2]
    assert d0.box == d1.box == (0, 1, 2, 3) and d0.mask.sum() == 4
    assert d0.score == pytest.approx(p0[0] * square, rel=1e-5)
    assert d1.score == pytest.approx(p0[1] * square, rel=1e-5)
    assert d2.box == (3, 0, 4, 1) and d2.score == pytest.approx(p1[2] * sig(0.5), rel=1e-5)
    # a query whose mask has no pixel gives no detection
    empty = ge.mask2former_instances(class_logits[:1], torch.full((1, 4, 4), -1.0))
    assert empty == {}
