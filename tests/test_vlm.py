"""The `vlm` judge reward (rewards/vlm.py) on tiny random Qwen2-VL and Qwen2.5-VL models saved with save_pretrained,
with a word-level tokenizer built here with `tokenizers` and a Qwen-style chat template: nothing is downloaded."""

import json
import os

import pytest
import torch
from conftest import REPO, kill_group, run_script
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from common import UserError
from rewards import load_rewards, shapes, vlm

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen2-VL's template reduced to what the reward sends: one user turn with an image then text, and the assistant cue
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "user assistant Yes No Answer or Is Are Does this image show there exactly in the a an one two three four to left "
    "right of above below circle circles square squares triangle triangles red green blue yellow purple orange"
)
PROMPTS = ["a red circle", "three blue squares", "a circle to the left of a square", "a cat sitting on a mat"]


def tiny_judge(root, family: str) -> str:
    """A random tiny `family` (qwen2_vl or qwen2_5_vl) judge folder: model, tokenizer with chat template, processor."""
    vocab = {t: i for i, t in enumerate(SPECIAL + ["[UNK]"] + sorted(set(WORDS.split() + list("?.\"'"))))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL[1:],
    )
    tok.chat_template = TEMPLATE
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad", "vision_start", "vision_end")}
    text = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # 16-dim heads: 8 rotary pairs over t, h, w
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    tokens = dict(
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
    )
    torch.manual_seed(0)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **tokens))
    else:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=32, num_heads=2, window_size=56)
        vision["fullatt_block_indexes"] = [1]
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens))
    # a small pixel budget keeps the tests fast; non-default mean and std, so the test sees them read from the config
    processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=56 * 84, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3]
    )
    path = root / family
    for part in (model, tok, processor):
        part.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def judge_dir(request, tmp_path_factory):
    return tiny_judge(tmp_path_factory.mktemp("vlm"), request.param)


@pytest.fixture
def judge(judge_dir, monkeypatch):
    monkeypatch.setenv(vlm.MODEL_ENV, judge_dir)
    monkeypatch.delenv(vlm.DEVICE_ENV, raising=False)
    return judge_dir


@pytest.fixture(scope="module")
def default_judge(tmp_path_factory):
    """The default judge's class (Qwen2.5-VL) only, for the slower end-to-end tests."""
    return tiny_judge(tmp_path_factory.mktemp("vlm-default"), "qwen2_5_vl")


def smooth_images(n, h=64, w=64, seed=0):
    """n images on the uint8 grid (what a PNG holds), smooth like decoded samples."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, h // 8, w // 8, generator=g)
    return (torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear") * 255).round() / 255


def test_questions_on_geneval_and_tiny_shapes_prompts():
    assert vlm.questions("a photo of three red apples") == [
        "Are there apples in the image?",
        "Are there exactly three apples in the image?",
        "Are the apples red?",
    ]
    assert vlm.questions("a photo of an orange umbrella left of a tennis racket") == [
        "Is there an umbrella in the image?",
        "Is the umbrella orange?",
        "Is there a tennis racket in the image?",
        "Is the umbrella to the left of the tennis racket?",
    ]
    assert vlm.questions("two circles above a square") == [
        "Are there circles in the image?",
        "Are there exactly two circles in the image?",
        "Is there a square in the image?",
        "Are the circles above the square?",
    ]
    assert vlm.questions("a cow and a blue horse") == [
        "Is there a cow in the image?",
        "Is there a horse in the image?",
        "Is the horse blue?",
    ]


@pytest.mark.parametrize("prompt", ["a cat sitting on a mat", "a bowl of soup", 'a sign that says "YK"', "sunset"])
def test_free_text_gets_one_whole_prompt_question(prompt):
    assert vlm.questions(prompt) == [f'Does this image show "{prompt}"?']


def test_one_question_per_requirement_of_every_tiny_shapes_prompt():
    """rewards/shapes.py counts GenEval's requirements (object, colour, count, relation) independently of the judge."""
    prompts = [json.loads(line)["prompt"] for f in ("train.jsonl", "test.jsonl") for line in open(REPO / "assets" / f)]
    for prompt in prompts:
        parsed = shapes.parse_prompt(prompt)
        assert len(vlm.questions(prompt)) == len(shapes.requirements_met(parsed, [])), prompt


@pytest.mark.parametrize("h, w", [(64, 64), (48, 80), (100, 60)])
def test_patchify_matches_the_processor(judge_dir, h, w):
    processor = Qwen2VLImageProcessorPil.from_pretrained(judge_dir)
    images = smooth_images(2, h, w)
    pil = [Image.fromarray((im.permute(1, 2, 0) * 255).round().byte().numpy()) for im in images]
    expected = processor(pil, return_tensors="pt")
    got, grid = vlm.patchify(images, processor, torch.device("cpu"))
    assert expected["image_grid_thw"].tolist() == [list(grid)] * 2
    # PIL resizes uint8 with its own bicubic kernel, torch float: ~1/255 apart (/ std ~0.2) at most
    assert (got.flatten(0, 1) - expected["pixel_values"]).abs().max() < 0.05


def test_p_yes_is_the_softmax_of_the_two_answer_logits():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    yes, no = 7, 3
    direct = logits[:, yes].exp() / (logits[:, yes].exp() + logits[:, no].exp())
    torch.testing.assert_close(vlm.p_yes(logits, yes, no), direct)


def reference_p_yes(judge_dir, image, question):
    """P(Yes) of one image and one question the plain transformers way: the processor's patches of the PIL image, the
    chat template with the image token repeated by hand, the full logits of the last position, no padding."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(judge_dir).eval()
    tok = AutoTokenizer.from_pretrained(judge_dir)
    processor = Qwen2VLImageProcessorPil.from_pretrained(judge_dir)
    pil = Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy())
    pixels = processor([pil], return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // processor.merge_size**2
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question + " Answer Yes or No."}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n), return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
        ).logits[0, -1]
    yes, no = tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")
    return (logits[yes].exp() / (logits[yes].exp() + logits[no].exp())).item()


def test_score_is_the_mean_p_yes_of_the_questions(judge):
    images = smooth_images(2, 56, 84)  # a size the processor keeps, so no resize kernel differs
    fn = vlm.vlm("cpu")
    scores = fn(images, ["a cat sitting on a mat", "a red circle"])
    assert scores.shape == (2,) and scores.dtype == torch.float32
    free = reference_p_yes(judge, images[0], 'Does this image show "a cat sitting on a mat"?')  # one question
    assert abs(scores[0].item() - free) < 1e-5
    mean = sum(reference_p_yes(judge, images[1], q) for q in vlm.questions("a red circle")) / 2
    assert abs(scores[1].item() - mean) < 1e-5
    assert abs(free - mean) > 1e-3  # the two differ by more than the tolerance


def test_batching_and_padding_change_nothing_and_it_is_deterministic(judge):
    images = smooth_images(len(PROMPTS), seed=1)
    batched = vlm.vlm("cpu", batch_size=16)(images, PROMPTS)  # 11 questions of different lengths in one padded batch
    one_by_one = vlm.vlm("cpu", batch_size=1)
    alone = torch.cat([one_by_one(images[i : i + 1], PROMPTS[i : i + 1]) for i in range(len(PROMPTS))])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    assert torch.equal(one_by_one(images, PROMPTS), one_by_one(images, PROMPTS))
    assert ((batched > 0) & (batched < 1)).all()
    # the image and the prompt both matter
    assert one_by_one(images[:1].expand(2, -1, -1, -1), PROMPTS[:2]).unique().numel() == 2
    assert one_by_one(images[:2], PROMPTS[:1] * 2).unique().numel() == 2


def test_registry_and_errors(judge, monkeypatch, tmp_path):
    rewards = load_rewards("vlm:1.0,jpeg_compressibility:0.1", "cpu")
    assert set(rewards(smooth_images(2), PROMPTS[:2])) == {"vlm", "jpeg_compressibility"}
    monkeypatch.setenv(vlm.DEVICE_ENV, "cuda:7" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(UserError, match=vlm.DEVICE_ENV):
        vlm.vlm("cpu")
    monkeypatch.delenv(vlm.DEVICE_ENV)
    monkeypatch.setenv(vlm.MODEL_ENV, str(tmp_path / "no-such-judge"))
    with pytest.raises(UserError) as err:
        vlm.vlm("cpu")
    assert "\n" not in str(err.value) and vlm.MODEL_ENV in str(err.value)


@pytest.mark.slow
def test_served_judge_equals_the_local_one(default_judge, monkeypatch):
    """`python -m rewards.server --reward vlm` scores what the local reward scores (images travel as PNGs, which hold
    these uint8-grid images exactly)."""
    from test_reward_server import free_port, start_server

    from rewards import remote

    monkeypatch.setenv(vlm.MODEL_ENV, default_judge)  # the server process inherits it
    port = free_port()
    proc = start_server("vlm", port)
    try:
        images = smooth_images(3, seed=2)
        served = remote.remote(f"http://127.0.0.1:{port}/vlm")(images, PROMPTS[:3])
        torch.testing.assert_close(served, vlm.vlm("cpu")(images, PROMPTS[:3]), atol=1e-6, rtol=0)
    finally:
        kill_group(proc)
        proc.communicate()


@pytest.mark.slow
def test_tiny_training_run_on_the_judge(default_judge, tmp_path):
    """One GRPO epoch of the tiny model on the judge, as a user runs it: the reward is logged and the eval scores it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "train.txt").write_text("a red circle\na circle to the left of a square\n")
    argv = ["algos/grpo.py", "--num-epochs", "1", "--num-prompts", "2", "--group-size", "2", "--micro-batch", "2"]
    argv += ["--num-steps", "4", "--num-sde-steps", "1", "--eval-every", "1", "--reward", "vlm"]
    argv += ["--train-prompts", tmp_path / "train.txt", "--test-prompts", tmp_path / "train.txt"]
    run_script(argv + ["--output-dir", tmp_path / "out"], env=os.environ | {vlm.MODEL_ENV: default_judge})
    (events,) = (tmp_path / "out").rglob("events.out.tfevents*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"charts/vlm", "eval/vlm", "losses/policy_loss"} <= set(tags)
