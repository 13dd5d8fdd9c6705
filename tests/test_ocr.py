"""The `ocr` reward on words rendered with Pillow's built-in font (right text, wrong text, noise, blank), its edit
distance and prompt parsing, and its one-line error when rapidocr is not installed."""

import sys

import numpy as np
import pytest
import torch
from conftest import needs_ocr
from PIL import Image, ImageDraw, ImageFont

import rewards
from common import UserError
from rewards import ocr

WORDS = ["cat", "OCR", "hello", "flow", "2024", "Dog", "sun", "GRPO"]


def render(text: str, size: int) -> torch.Tensor:
    """Dark text, as large as fits in 85% of the width, centred on a light [3, size, size] image in [0, 1]."""
    image = Image.new("RGB", (size, size), (235, 230, 220))
    draw = ImageDraw.Draw(image)
    font_size = size
    while draw.textlength(text, font=ImageFont.load_default(size=font_size)) > 0.85 * size or font_size > 0.6 * size:
        font_size -= 1
    draw.text((size / 2, size / 2), text, fill=(20, 20, 30), font=ImageFont.load_default(size=font_size), anchor="mm")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


def prompts_for(words) -> list:
    return [f'a shop sign that says "{w}", photo' for w in words]


@pytest.fixture(scope="module")
def reward():
    return ocr.ocr("cpu")


@pytest.fixture(scope="module", params=[64, 128])
def rendered(request):
    return torch.stack([render(w, request.param) for w in WORDS])


# ----------------------------------------------------------------------------------------------------------------
# the score on rendered images
# ----------------------------------------------------------------------------------------------------------------
@needs_ocr
def test_rendered_words_score_one(reward, rendered):
    scores = reward(rendered, prompts_for(WORDS))
    assert scores.shape == (len(WORDS),) and scores.dtype == torch.float32
    assert scores.mean() >= 0.9 and scores.min() >= 0.5, scores


@needs_ocr
def test_multi_word_text_is_read(reward):
    phrases = ["Hello World", "Step Goal", "Forever Yours"]
    scores = reward(torch.stack([render(p, 128) for p in phrases]), prompts_for(phrases))
    assert scores.mean() >= 0.9, scores


@needs_ocr
def test_wrong_words_score_clearly_lower(reward, rendered):
    right = reward(rendered, prompts_for(WORDS))
    wrong = reward(rendered, prompts_for(WORDS[1:] + WORDS[:1]))
    assert wrong.mean() <= 0.3 and (right - wrong).min() >= 0.5, (right, wrong)


@needs_ocr
def test_one_wrong_letter_loses_one_over_length(reward):
    score = reward(render("hallo", 128)[None], prompts_for(["hello"]))
    assert score.item() == pytest.approx(0.8)


@needs_ocr
def test_noise_and_blank_images_score_low(reward):
    noise = torch.rand(len(WORDS), 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert reward(noise, prompts_for(WORDS)).max() < 0.3
    blank = torch.stack([torch.full((3, 128, 128), 0.9), torch.zeros(3, 128, 128)])
    assert reward(blank, prompts_for(WORDS[:2])).max() == 0


@needs_ocr
def test_registered_and_batch_checked(rendered):
    fn = rewards.REWARDS["ocr"]("cpu")
    assert fn(rendered[:2], prompts_for(WORDS[:2])).shape == (2,)
    with pytest.raises(ValueError, match="expected images"):
        fn(rendered[:3], prompts_for(WORDS[:2]))


@needs_ocr
def test_prompts_are_checked_when_the_reward_loads():
    rewards.load_rewards("ocr", "cpu", prompts_for(WORDS))  # fine
    with pytest.raises(UserError, match="double quotes"):
        rewards.load_rewards("shapes:1,ocr:0.5", "cpu", ["a red circle"])


@needs_ocr
def test_eval_adds_exact_spelling_rate():
    """`ocr_strict` (the run's eval/ocr_strict and the tables' "final strict") is 1 exactly when the word is right."""
    images = torch.stack([render("hallo", 128), render("hello", 128)])
    out = rewards.load_rewards("ocr", "cpu").evaluate(images, prompts_for(["hello", "hello"]))
    assert out["ocr"].tolist() == pytest.approx([0.8, 1.0]) and out["ocr_strict"].tolist() == [0.0, 1.0]


# ----------------------------------------------------------------------------------------------------------------
# definition: edit distance, normalisation, quoted text
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "a, b, distance",
    [
        ("", "", 0),
        ("abc", "", 3),
        ("", "abc", 3),
        ("abc", "abc", 0),
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("abc", "acb", 2),
        ("abcd", "abxd", 1),
        ("abc", "abcd", 1),
        ("intention", "execution", 5),
        ("ab", "ba", 2),
    ],
)
def test_edit_distance(a, b, distance):
    assert ocr.edit_distance(a, b) == distance == ocr.edit_distance(b, a)


@pytest.mark.parametrize(
    "recognised, target, score",
    [
        ("Hello World", "hello world", 1.0),
        ("HELLOWORLD", "Hello World", 1.0),
        ("OPEN NOW 24h", "now", 1.0),
        ("helo", "hello", 0.8),
        ("", "hello", 0.0),
        ("xyz", "hello", 0.0),
        ("a very long unrelated line", "cat", 0.0),
        ("cta", "cat", 1 / 3),
    ],
)
def test_score_follows_flow_grpo(recognised, target, score):
    assert ocr.ocr_score(recognised, target) == pytest.approx(score)


def test_quoted_text():
    assert ocr.quoted_text('a sign "Open Now" with "other" text') == "Open Now"
    for prompt in ["a sign without quotes", 'an unclosed "quote', 'empty "" quotes', 'blank "  " quotes']:
        with pytest.raises(UserError, match="double quotes") as error:
            ocr.quoted_text(prompt)
        assert "\n" not in str(error.value)


@needs_ocr
def test_prompt_without_quotes_is_a_user_error(reward, rendered):
    with pytest.raises(UserError, match="double quotes"):
        reward(rendered[:1], ["a cat"])


# ----------------------------------------------------------------------------------------------------------------
# dependencies
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["rapidocr", "onnxruntime"])
def test_missing_package_says_what_to_install(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(UserError) as error:
        rewards.load_rewards("ocr", "cpu")
    message = str(error.value)
    assert "\n" not in message and "pip install -r rewards/requirements-ocr.txt" in message and module in message


@needs_ocr
def test_runs_offline(monkeypatch):
    from rapidocr.utils.download_file import DownloadFile

    def no_download(*args, **kwargs):
        raise AssertionError("rapidocr tried to download a file")

    monkeypatch.setattr(DownloadFile, "run", no_download)
    fn = ocr.ocr("cpu")
    assert fn(render("OK", 64)[None], prompts_for(["OK"])).item() == 1.0
