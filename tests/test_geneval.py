"""GenEval without mmdet (rewards/geneval.py): its rules against hand computations on synthetic boxes and masks, the
prompt grammar against hand-written metadata in GenEval's format (tests/geneval_metadata.jsonl), and the plumbing on a
tiny random Mask2Former and CLIP saved with save_pretrained (nothing is downloaded)."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

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


# ---- plumbing: tiny random Mask2Former and CLIP through the real loading code ----
CAT = ge.CLASSES.index("cat")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """{"detector": a Mask2Former COCO-instance folder whose every query finds a cat covering the whole image (class
    head: weight 0, bias +10 for cat; masks: pixel embeddings 1, query embeddings 0.1 -> logit 3.2 everywhere),
    "clip": a random CLIP whose tokenizer knows the colour templates' words}."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, Mask2FormerConfig, Mask2FormerImageProcessorPil

    from benchmark.testbeds.build_tiny_shapes import build_tokenizer

    root = tmp_path_factory.mktemp("tiny-geneval")
    torch.manual_seed(0)
    backbone = dict(model_type="swin", image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1])
    backbone |= dict(num_heads=[1, 1, 1, 1], window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = Mask2FormerConfig(
        backbone_config=backbone,
        num_labels=80,
        num_queries=2,
        hidden_dim=32,
        mask_feature_size=32,
        feature_size=32,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        dim_feedforward=32,
        encoder_feedforward_dim=32,
        use_pretrained_backbone=False,
    )
    detector = ge._mask2former_class()(cfg)
    with torch.no_grad():
        detector.class_predictor.weight.zero_()
        detector.class_predictor.bias.zero_()
        detector.class_predictor.bias[CAT] = 10.0
        projection = detector.model.pixel_level_module.decoder.mask_projection
        projection.weight.zero_()
        projection.bias.fill_(1.0)
        embedder = detector.model.transformer_module.decoder.mask_predictor.mask_embedder
        last = [m for m in embedder.modules() if isinstance(m, torch.nn.Linear)][-1]
        last.weight.zero_()
        last.bias.fill_(0.1)
    detector.save_pretrained(root / "detector")
    Mask2FormerImageProcessorPil(size_divisor=32).save_pretrained(root / "detector")

    # CLIP's pre-tokenizer splits "red-colored" at the hyphen: whole words are the pieces between spaces and hyphens
    words = {w for c in ge.COLORS for t in ge.COLOR_TEMPLATES for w in t.format(c=c, obj="cat").replace("-", " ").split()}
    words.add("-")
    tok = build_tokenizer(words)
    clip_cfg = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
        ),
        projection_dim=16,
    )
    tok.save_pretrained(root / "clip")
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root / "clip")
    CLIPModel(clip_cfg).save_pretrained(root / "clip")
    return {"detector": str(root / "detector"), "clip": str(root / "clip")}


@pytest.fixture
def env(monkeypatch, tiny_models):
    monkeypatch.setenv(ge.DETECTOR_ENV, tiny_models["detector"])
    monkeypatch.setenv(ge.CLIP_ENV, tiny_models["clip"])


def solid(n, h=48, w=40):
    torch.manual_seed(1)
    return torch.rand(n, 3, 1, 1).expand(n, 3, h, w).clone()


@pytest.mark.parametrize("h, w, expected", [(512, 512, (800, 800)), (48, 40, (960, 800)), (100, 1000, (133, 1333))])
def test_detector_input_size_is_mmdets_test_resize(h, w, expected):
    # the shorter side to 800 unless the longer would pass 1333: 100 x 1000 scales by 1.333, not 8
    assert ge.Detector.resized(h, w) == expected


def test_detector_finds_the_planted_cats(env):
    scorer = ge.GenEval("cpu")
    (found,) = scorer.detector(solid(1))
    assert list(found) == ["cat"] or max(d.score for k, v in found.items() if k != "cat" for d in v) < 1e-3
    cats = found["cat"]
    assert len(cats) == 2 and all(d.box == (0, 0, 40, 48) and d.mask.all() for d in cats)  # the image's own size
    p = math.exp(10) / (math.exp(10) + 80)  # softmax over 80 classes + no-object, cat's logit 10, the others 0
    assert cats[0].score == pytest.approx(p / (1 + math.exp(-3.2)), rel=1e-4)  # x mean mask probability sigmoid(3.2)


@pytest.mark.slow
def test_rewards_score_the_rules_end_to_end(env):
    from transformers import CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

    images = solid(6)
    # the colour CLIP should give the whole image (the cats' masks cover it), computed here with the processor on PIL
    model, tok = CLIPModel.from_pretrained(os.environ[ge.CLIP_ENV]), CLIPTokenizer.from_pretrained(os.environ[ge.CLIP_ENV])
    processor = CLIPImageProcessorPil.from_pretrained(os.environ[ge.CLIP_ENV])
    pil = Image.fromarray((images[0].permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
    with torch.no_grad():
        img = model.get_image_features(**processor(images=pil, return_tensors="pt"))
        img = (img if isinstance(img, torch.Tensor) else img.pooler_output)[0]
        texts = [t.format(c=c, obj="cat") for c in ge.COLORS for t in ge.COLOR_TEMPLATES]
        txt = model.get_text_features(**tok(texts, padding=True, return_tensors="pt"))
        txt = txt if isinstance(txt, torch.Tensor) else txt.pooler_output
    txt = torch.nn.functional.normalize(txt, dim=-1).view(len(ge.COLORS), len(ge.COLOR_TEMPLATES), -1).mean(1)
    sims = torch.nn.functional.normalize(txt, dim=-1) @ torch.nn.functional.normalize(img, dim=-1)
    colour = ge.COLORS[int(sims.argmax())]
    other = next(c for c in ge.COLORS if c != colour)
    prompts = [
        "a photo of a cat",  # 1 of 1 clause
        "a photo of a dog",  # 0 of 1
        "a photo of two cats",  # counting: 2 cats above 0.9, fewer than 3: 2 of 2
        "a photo of three cats",  # 2 found: include fails, exclude holds: 1 of 2
        f"a photo of a {colour} cat",
        f"a photo of an {other} cat" if other[0] in "aeiou" else f"a photo of a {other} cat",
    ]
    strict = ge.geneval_strict("cpu")(images, prompts)
    partial = ge.geneval("cpu", batch_size=4)(images, prompts)  # other chunking, same per-image scores
    assert strict.tolist() == [1, 0, 1, 0, 1, 0]
    assert partial.tolist() == [1, 0, 1, 0.5, 1, 0]
    one_by_one = torch.cat([ge.geneval("cpu", batch_size=1)(images[k : k + 1], prompts[k : k + 1]) for k in range(6)])
    assert one_by_one.tolist() == partial.tolist()


def test_a_non_geneval_prompt_stops_before_training(env):
    from rewards import load_rewards

    with pytest.raises(UserError, match="GenEval's prompts"):
        load_rewards("geneval", torch.device("cpu"), ["a photo of a cat", "a red circle"])


def test_a_detector_without_coco_classes_is_one_line(env, tmp_path, monkeypatch, tiny_models):
    import shutil

    folder = tmp_path / "detector"
    shutil.copytree(tiny_models["detector"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_labels"] = 3
    config["id2label"] = {str(k): f"c{k}" for k in range(3)}
    config["label2id"] = {f"c{k}": k for k in range(3)}
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv(ge.DETECTOR_ENV, str(folder))
    with pytest.raises(UserError, match="has 3 classes: expected a Mask2Former of COCO's 80"):
        ge.GenEval("cpu")


# ---- benchmark/geneval.py: GenEval's protocol on the tiny generator with the planted-cat detector ----
def run_benchmark(argv, capsys):
    from benchmark import geneval as bench

    capsys.readouterr()
    try:
        bench.main([str(a) for a in argv])
        rc = 0
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow
def test_benchmark_scores_per_tag_and_overall(env, tmp_path, capsys):
    rows = [json.loads(line) for line in METADATA.read_text().splitlines()][:3]  # single_object x 2, two_object
    rows.append({"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"})
    rows.append({"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}],
                 "prompt": "a photo of two cats"})  # fmt: skip
    meta = tmp_path / "meta.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.jsonl"
    flags = ["--num-steps", "2", "--images-per-prompt", "2", "--guidance-scale", "1", "--batch", "4", "--device", "cpu"]
    rc, stdout, err = run_benchmark(["--metadata", meta, "--out", out, *flags], capsys)
    assert rc == 0, err[-2000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 2 * len(rows)
    assert [r["prompt"] for r in results] == [r["prompt"] for r in rows] * 2  # each prompt's images on two noises
    # every image holds exactly the two planted cats: only the cat prompts are correct
    assert [r["correct"] for r in results] == [False, False, False, True, True] * 2
    # single_object: 1 of 3 prompts correct; two_object 0; counting 1 -> overall (1/3 + 0 + 1) / 3
    assert "| single_object | 0.3333 |" in stdout and "| two_object | 0.0000 |" in stdout
    assert "| counting | 1.0000 |" in stdout and f"| overall | {(1 / 3 + 0 + 1) / 3:.4f} |" in stdout


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json\n", "meta.jsonl:1: not JSON"),
        ('{"prompt": "a photo of a cat"}\n', 'expected GenEval metadata with a "tag"'),
        ('{"tag": "t", "prompt": "p", "include": [{"class": "unicorn", "count": 1}]}\n', "needs a COCO class of GenEval"),
        ('{"tag": "t", "prompt": "p", "include": [{"class": "cat", "count": 1, "color": "teal"}]}\n', "colour 'teal'"),
        ("\n", "has no prompts"),
    ],
)
def test_benchmark_bad_metadata_is_one_line_and_writes_nothing(env, tmp_path, capsys, content, message):
    meta, out = tmp_path / "meta.jsonl", tmp_path / "results.jsonl"
    meta.write_text(content)
    rc, _, err = run_benchmark(["--metadata", meta, "--out", out], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not out.exists()


@pytest.mark.slow
def test_tiny_training_run_on_geneval_with_the_strict_score_as_a_side_metric(env, tmp_path):
    from conftest import run_in_process
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from algos import nft

    (tmp_path / "train.txt").write_text("a photo of a cat\na photo of two cats\na photo of three cats\n")
    (tmp_path / "test.txt").write_text("a photo of a cat\na photo of a dog\n")
    flags = "--num-prompts 2 --group-size 2 --micro-batch 4 --num-steps 2 --grad-steps-per-epoch 1 --num-train-timesteps 1"
    argv = [*flags.split(), "--num-epochs", "1", "--reward", "geneval", "--eval-rewards", "geneval_strict"]
    argv += ["--train-prompts", tmp_path / "train.txt", "--test-prompts", tmp_path / "test.txt"]
    assert run_in_process(nft, [*argv, "--output-dir", tmp_path / "runs"]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    # the planted detector sees two cats in every image: "a cat" holds and "a dog" does not, whatever the weights
    assert [e.value for e in acc.Scalars("eval/geneval")] == [0.5, 0.5]
    assert [e.value for e in acc.Scalars("eval/geneval_strict")] == [0.5, 0.5]
    # training prompts: a cat 1, two cats 1, three cats 1/2 (the include clause fails, the exclude holds)
    assert 0.5 <= acc.Scalars("charts/reward_mean")[0].value <= 1
