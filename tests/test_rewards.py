"""The CPU rewards: the GenEval-style `shapes` checker on rendered ground truth (clean, degraded, wrong, noise), DDPO's
JPEG rewards, and the weighted reward registry."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import rewards
from common import UserError
from rewards import jpeg, load_rewards, parse_reward_spec, shapes
from rewards.worlds import shapes as world

CATEGORY = {prompt: category for category, prompt, _ in world.all_prompts()}


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float [N, 3, H, W] in [0, 1]."""
    return torch.from_numpy(np.array(images)).permute(0, 3, 1, 2).float() / 255


def render(*objects) -> torch.Tensor:
    """One scene of (colour, shape, x, y, size) objects as a [1, 3, 64, 64] batch."""
    return to_tensor(world.render(list(objects))[None])


def blur(images: torch.Tensor, sigma: float = 1.0) -> torch.Tensor:
    """Separable Gaussian blur (radius 3 sigma), edges replicated."""
    r = int(3 * sigma)
    k = torch.exp(-(torch.arange(-r, r + 1).float() ** 2) / (2 * sigma**2))
    k = (k / k.sum()).expand(3, 1, 1, -1)
    images = F.conv2d(F.pad(images, (r, r, 0, 0), mode="replicate"), k, groups=3)
    return F.conv2d(F.pad(images, (0, 0, r, r), mode="replicate"), k.transpose(2, 3), groups=3)


@pytest.fixture(scope="module")
def ground_truth():
    """200 rendered scenes, uniform over the six categories, with their captions."""
    captions, images = world.make_dataset(world.all_prompts(), 200, seed=0)
    return to_tensor(images), captions


# ----------------------------------------------------------------------------------------------------------------
# parsing
# ----------------------------------------------------------------------------------------------------------------
def test_parse_every_world_prompt():
    for category, prompt, spec in world.all_prompts():
        parsed = shapes.parse_prompt(prompt)
        assert parsed["category"] == category, prompt
        assert [(o["color"], o["shape"]) for o in parsed["objects"] for _ in range(o["count"] or 1)] == spec, prompt
        assert (parsed["relation"] is not None) == (category == "position")


@pytest.mark.parametrize(
    "prompt, category, objects, relation",
    [
        ("three red circles", "counting", [("circle", "red", 3)], None),
        ("one square", "counting", [("square", None, 1)], None),
        ("An  Orange Square", "colors", [("square", "orange", None)], None),
        (
            "a purple triangle above an orange circle",
            "position",
            [("triangle", "purple", None), ("circle", "orange", None)],
            "above",
        ),
        ("a red circle and a square", "color_attr", [("circle", "red", None), ("square", None, None)], None),
    ],
)
def test_parse_unseen_combinations(prompt, category, objects, relation):
    parsed = shapes.parse_prompt(prompt)
    assert parsed["category"] == category and parsed["relation"] == relation
    assert [(o["shape"], o["color"], o["count"]) for o in parsed["objects"]] == objects


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        "a dog",
        "circle",
        "a circles",
        "three circle",
        "one circles",
        "five circles",
        "a red",
        "a circle and",
        "a circle next to a square",
        "a circle and a square and a triangle",
        "a pink circle",
    ],
)
def test_parse_rejects_garbage(prompt):
    with pytest.raises(ValueError, match="cannot parse prompt"):
        shapes.parse_prompt(prompt)


# ----------------------------------------------------------------------------------------------------------------
# detection and scoring
# ----------------------------------------------------------------------------------------------------------------
def test_detect_finds_the_drawn_objects():
    scene = [("red", "circle", 5, 5, 14), ("blue", "triangle", 30, 30, 12), ("yellow", "square", 40, 4, 16)]
    image = world.render(scene)
    found = sorted(shapes.detect(image), key=lambda o: o["color"])
    assert [(o["color"], o["shape"]) for o in found] == [("blue", "triangle"), ("red", "circle"), ("yellow", "square")]
    for obj, (_, _, x, y, size) in zip(found, sorted(scene)):
        assert np.allclose(obj["bbox"], (x, y, x + size, y + size), atol=1.5)
    as_float = shapes.detect(image.astype(np.float32) / 255)
    assert [(o["color"], o["shape"], o["bbox"]) for o in sorted(as_float, key=lambda o: o["color"])] == [
        (o["color"], o["shape"], o["bbox"]) for o in found
    ]


def test_relative_position_follows_geneval():
    def box(x0, y0, size=10):
        return {"bbox": (x0, y0, x0 + size, y0 + size)}

    assert shapes.relative_position(box(0, 20), box(30, 20)) == {"to the left of"}
    assert shapes.relative_position(box(20, 40), box(20, 0)) == {"below"}
    assert shapes.relative_position(box(0, 0), box(20, 20)) == {"to the left of", "above"}  # GenEval allows both
    assert shapes.relative_position(box(0, 0), box(1, 0)) == set()  # within the 10% margin: no relation


def test_ground_truth_scores_one(ground_truth):
    images, captions = ground_truth
    result = shapes.evaluate(images, captions)
    assert result["score"].shape == (len(captions),) and result["score"].dtype == torch.float32
    assert result["score"].mean() >= 0.98 and result["strict"].mean() >= 0.95
    for category in world.CATEGORIES:
        in_category = torch.tensor([CATEGORY[c] == category for c in captions])
        assert result["score"][in_category].mean() >= 0.95, category


def test_blurred_noisy_shifted_ground_truth_scores_high(ground_truth):
    images, captions = ground_truth
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(0))
    shift = torch.tensor([0.03, -0.03, 0.02]).view(1, 3, 1, 1)
    degraded = (blur(images) + 0.05 * noise + shift).clamp(0, 1)
    assert shapes.evaluate(degraded, captions)["score"].mean() >= 0.9


def test_any_resolution(ground_truth):
    images, captions = ground_truth
    upsampled = F.interpolate(images[:48], scale_factor=2, mode="bilinear", align_corners=False)
    assert shapes.evaluate(upsampled, captions[:48])["score"].mean() >= 0.98


@pytest.mark.parametrize(
    "prompt, scene, expected",
    [
        ("three circles", [("red", "circle", 5, 5, 14), ("blue", "circle", 40, 40, 14)], 1 / 2),
        (
            "two triangles",
            [("red", "triangle", 5, 5, 12), ("red", "triangle", 40, 5, 12), ("red", "triangle", 20, 40, 12)],
            1 / 2,
        ),
        ("a circle to the left of a square", [("red", "square", 5, 20, 15), ("blue", "circle", 40, 20, 15)], 2 / 3),
        ("a circle to the right of a square", [("red", "square", 5, 20, 15), ("blue", "circle", 40, 20, 15)], 1.0),
        ("a square above a triangle", [("green", "square", 5, 40, 15), ("blue", "triangle", 5, 5, 15)], 2 / 3),
        ("a red circle", [("blue", "circle", 20, 20, 16)], 1 / 2),
        ("a red circle and a blue square", [("blue", "circle", 5, 5, 16), ("red", "square", 40, 40, 16)], 1 / 2),
        ("a red circle and a blue square", [("red", "circle", 5, 5, 16), ("red", "square", 40, 40, 16)], 3 / 4),
        ("a circle and a square", [("green", "circle", 20, 20, 16)], 1 / 2),
        ("a triangle", [("green", "square", 20, 20, 16)], 0.0),
    ],
)
def test_wrong_images_lose_exactly_the_failed_requirements(prompt, scene, expected):
    result = shapes.evaluate(render(*scene), [prompt])
    assert result["score"].item() == pytest.approx(expected)
    assert result["strict"].item() == float(expected == 1.0)


# ----------------------------------------------------------------------------------------------------------------
# exact, shapes_clean and the wrong-prompt control: what the GenEval-style score cannot see (extra objects)
# ----------------------------------------------------------------------------------------------------------------
def plus_sign(image: np.ndarray, colour: str, x: int, y: int) -> np.ndarray:
    """A 20-pixel plus sign drawn into a rendered image: a coloured blob that fits no shape template."""
    image = image.copy()
    image[y : y + 20, x + 8 : x + 12] = world.COLORS[colour]
    image[y + 8 : y + 12, x : x + 20] = world.COLORS[colour]
    return image


def test_exact_is_one_on_renders_of_the_caption(ground_truth):
    images, captions = ground_truth
    result = shapes.evaluate(images, captions)
    assert result["exact"].mean() == 1.0 and result["extra"].max() == 0 and result["clean"].mean() == 1.0
    asked = torch.tensor([float(shapes.asked_objects(shapes.parse_prompt(c))) for c in captions])
    assert torch.equal(result["objects"], asked)


@pytest.mark.parametrize("extra", ["shape", "blob"])
def test_one_extra_object_breaks_exact_but_not_the_geneval_score(extra):
    scene = [("blue", "circle", 4, 4, 16), ("red", "square", 40, 4, 16)]
    prompt = "a blue circle and a red square"
    clean = world.render(scene)
    if extra == "shape":
        dirty = world.render(scene + [("green", "triangle", 22, 40, 16)])
    else:
        dirty = plus_sign(clean, "yellow", 22, 40)
        assert len(shapes.detect(dirty)) == 2  # the blob is no object for the requirements...
    before, after = (shapes.evaluate(to_tensor(im[None]), [prompt]) for im in (clean, dirty))
    assert before["exact"].item() == 1.0 and after["exact"].item() == 0.0  # ...but it is an extra object for exact
    assert after["score"].item() == before["score"].item() == 1.0 and after["strict"].item() == 1.0  # GenEval: unchanged
    assert after["objects"].item() == 3 and after["extra"].item() == 1
    assert after["clean"].item() == pytest.approx(1.0 * 2 / 3)  # every requirement met, 2 of 3 objects asked for


def test_clean_counts_each_extra_object_as_an_unmet_requirement(ground_truth):
    """shapes_clean = (met / requirements) x asked / (asked + extra), computed here from the requirements and the
    detections."""
    images, captions = ground_truth
    rng = np.random.default_rng(0)
    dirty = []
    for image in images[:40]:
        image = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        for _ in range(rng.integers(0, 3)):
            image = plus_sign(image, str(rng.choice(list(world.COLORS))), int(rng.integers(0, 44)), int(rng.integers(0, 44)))
        dirty.append(image)
    dirty, prompts = to_tensor(np.stack(dirty)), captions[:40]
    result = shapes.evaluate(dirty, prompts)
    for i, prompt in enumerate(prompts):
        parsed = shapes.parse_prompt(prompt)
        met = shapes.requirements_met(parsed, shapes.detect_batch(dirty[i : i + 1])[0])
        extra = max(0, len(shapes.components(dirty[i : i + 1])[0]) - shapes.asked_objects(parsed))
        asked = shapes.asked_objects(parsed)
        assert result["clean"][i].item() == pytest.approx(sum(met) / len(met) * asked / (asked + extra))
        assert result["exact"][i].item() == float(
            all(met) and extra == 0 and result["objects"][i] == shapes.asked_objects(parsed)
        )
    assert result["extra"].sum() > 10  # the test really added extra objects


def test_wrong_prompt_control_on_renders(ground_truth):
    images, captions = ground_truth
    wrong = [shapes.wrong_prompt(c) for c in captions]
    assert all(w != c and CATEGORY[w] == CATEGORY[c] for w, c in zip(wrong, captions))
    assert shapes.wrong_prompt("three red circles") != "three red circles"  # captions outside the grammar work too
    result = shapes.evaluate(images, captions, wrong)
    assert result["score"].mean() == 1.0 and 0.2 < result["wrong"].mean() < 0.7  # a correct image fits another prompt a bit
    # independent check of one: "a circle" drawn, scored against "a square" -> 0
    circle = render(("red", "circle", 20, 20, 16))
    assert shapes.evaluate(circle, ["a circle"], ["a square"])["wrong"].item() == 0.0


def test_eval_logs_the_hacking_metrics_for_either_shapes_reward(ground_truth):
    images, captions = ground_truth
    for spec in ("shapes", "shapes_clean"):
        out = load_rewards(spec, "cpu").evaluate(images[:12], captions[:12])
        assert {
            "shapes",
            "shapes_strict",
            "shapes_clean",
            "shapes_exact",
            "objects",
            "objects_extra",
            "prompt_specific_gap",
        } <= set(out)
        assert out["shapes_exact"].mean() == 1.0 and out["prompt_specific_gap"].min() > 0
        # what --eval-rewards compares with (run.check_eval_rewards): exactly the metrics the eval logs
        assert set(out) == rewards.eval_metrics([spec]) == set(rewards.SHAPES_METRICS)
    assert rewards.eval_metrics(["ocr", "jpeg_compressibility"]) == {"ocr", "ocr_strict", "jpeg_compressibility"}
    with pytest.raises(UserError, match="cannot score the prompt 'a dog'"):
        load_rewards("shapes_clean", "cpu", ["a circle", "a dog"])


def test_noise_and_blank_images_score_zero(ground_truth):
    captions = ground_truth[1][:64]
    noise = torch.rand(len(captions), 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert shapes.evaluate(noise, captions)["score"].mean() <= 0.1
    blank = torch.tensor(world.BACKGROUND).view(1, 3, 1, 1).expand(len(captions), 3, 64, 64) / 255
    assert shapes.evaluate(blank, captions)["score"].max() == 0


def test_evaluate_rejects_mismatched_inputs(ground_truth):
    images, captions = ground_truth
    with pytest.raises(ValueError, match="expected images"):
        shapes.evaluate(images[:3], captions[:2])
    with pytest.raises(ValueError, match="cannot parse prompt"):
        shapes.evaluate(images[:1], ["a dog"])


# ----------------------------------------------------------------------------------------------------------------
# JPEG
# ----------------------------------------------------------------------------------------------------------------
def test_jpeg_flat_is_more_compressible_than_noise():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    images = torch.cat([flat, noise])
    compressibility = jpeg.jpeg_compressibility("cpu")(images, ["", ""])
    incompressibility = jpeg.jpeg_incompressibility("cpu")(images, ["", ""])
    assert compressibility[0] > compressibility[1] and incompressibility[0] < incompressibility[1]
    assert torch.equal(compressibility, -incompressibility)
    assert compressibility.dtype == torch.float32 and compressibility.abs().max() < 20  # O(1) at 64x64


# ----------------------------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------------------------
def test_parse_reward_spec():
    assert parse_reward_spec("shapes:1.0,jpeg_compressibility:0.1") == {"shapes": 1.0, "jpeg_compressibility": 0.1}
    assert parse_reward_spec("shapes") == {"shapes": 1.0}
    assert parse_reward_spec(" shapes:2 , jpeg_incompressibility ") == {"shapes": 2.0, "jpeg_incompressibility": 1.0}


@pytest.mark.parametrize("spec", ["nosuchreward", "shapes:abc", "", "shapes,"])
def test_bad_reward_spec_is_a_user_error(spec):
    with pytest.raises(UserError) as error:
        parse_reward_spec(spec)
    assert "\n" not in str(error.value)
    if spec == "nosuchreward":
        assert all(name in str(error.value) for name in rewards.REWARDS)


def test_load_rewards_weighted_total_and_eval_metrics(ground_truth):
    images, captions = images_and_captions = ground_truth[0][:8], ground_truth[1][:8]
    multi = load_rewards("shapes:1.0,jpeg_compressibility:0.1", "cpu")
    scores = multi(*images_and_captions)
    assert set(scores) == {"shapes", "jpeg_compressibility"} and multi.weights["jpeg_compressibility"] == 0.1
    assert all(v.shape == (8,) and v.dtype == torch.float32 for v in scores.values())
    assert torch.allclose(multi.total(scores), scores["shapes"] + 0.1 * scores["jpeg_compressibility"])
    assert torch.equal(multi.evaluate(images, captions)["shapes_strict"], shapes.evaluate(images, captions)["strict"])


@pytest.mark.parametrize(
    "broken, message",
    [(lambda n: torch.full((n,), float("nan")), "NaN"), (lambda n: torch.zeros(n, 2), "expected a tensor of shape")],
)
def test_broken_reward_is_named(monkeypatch, broken, message):
    monkeypatch.setitem(rewards.REWARDS, "broken", lambda device: lambda images, prompts: broken(len(prompts)))
    with pytest.raises(UserError, match=f"'broken'.*{message}"):
        load_rewards("broken", "cpu")(torch.zeros(4, 3, 64, 64), ["a circle"] * 4)
