"""The hub rewards (pickscore, clipscore, aesthetic) through their real loading code, on a tiny random CLIP saved with
save_pretrained and reached through the CLEANFLOW_* variables: nothing is downloaded."""

import pytest
import torch
from PIL import Image
from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

from assets.build_tiny_shapes import MAX_TOKENS, build_tokenizer
from common import UserError
from rewards import _clip
from rewards.aesthetic import HEAD_ENV, HEAD_URL, AestheticMLP, aesthetic
from rewards.clipscore import clipscore
from rewards.pickscore import pickscore

PROMPTS = ["a red circle", "a blue square", "a red circle", "a red circle and a blue square"]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """{"clip": dir with model, tokenizer and image processor, "processor": dir with only the latter two (PickScore
    takes them from another repository), "head": a random aesthetic head state_dict for the 16-dim embeddings}."""
    root = tmp_path_factory.mktemp("tiny-clip")
    tok = build_tokenizer(" ".join(PROMPTS).split())
    torch.manual_seed(0)
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
        ),
        projection_dim=16,
    )
    # non-default mean and std, so the test sees them read from the saved config
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.25, 0.3],
    )
    for name in ("clip", "processor"):
        tok.save_pretrained(root / name)
        processor.save_pretrained(root / name)
    CLIPModel(cfg).save_pretrained(root / "clip")
    torch.save(AestheticMLP(16).state_dict(), root / "head.pth")
    return {name: str(root / name) for name in ("clip", "processor")} | {"head": str(root / "head.pth")}


@pytest.fixture
def env(monkeypatch, tiny_clip):
    for var, path in [
        ("CLEANFLOW_PICKSCORE_MODEL", "clip"),
        ("CLEANFLOW_PICKSCORE_PROCESSOR", "processor"),
        ("CLEANFLOW_CLIP_MODEL", "clip"),
        ("CLEANFLOW_AESTHETIC_CLIP", "clip"),
        (HEAD_ENV, "head"),
    ]:
        monkeypatch.setenv(var, tiny_clip[path])
    return monkeypatch


def smooth_images(n, h=64, w=64, seed=0):
    """n images [n, 3, h, w] in [0, 1] on the uint8 grid (what a PIL image holds), smooth like decoded samples."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, h // 8, w // 8, generator=g)
    return (torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear") * 255).round() / 255


def to_pil(images):
    return [Image.fromarray((im.permute(1, 2, 0) * 255).round().byte().numpy()) for im in images]


def reference(tiny_clip, images, prompts):
    """Unit image and text embeddings and exp(logit_scale) the plain transformers way: the processor on PIL images."""
    from transformers import AutoTokenizer

    model = CLIPModel.from_pretrained(tiny_clip["clip"]).eval()
    processor = CLIPImageProcessorPil.from_pretrained(tiny_clip["processor"])
    tok = AutoTokenizer.from_pretrained(tiny_clip["processor"])
    pil = to_pil(images)
    with torch.no_grad():
        out = model(**tok(prompts, padding=True, return_tensors="pt"), **processor(pil, return_tensors="pt"))
    return out.image_embeds, out.text_embeds, model.logit_scale.exp()


@pytest.mark.parametrize("h, w", [(64, 64), (48, 80), (96, 40)])
def test_tensor_preprocess_matches_processor(tiny_clip, h, w):
    processor = CLIPImageProcessorPil.from_pretrained(tiny_clip["processor"])
    images = smooth_images(3, h, w)
    pil = to_pil(images)
    expected = processor(pil, return_tensors="pt")["pixel_values"]
    got = _clip.tensor_preprocess(processor, torch.device("cpu"))(images)
    assert got.shape == expected.shape == (3, 3, 32, 32)
    # PIL resizes uint8 with its own bicubic kernel, torch float: ~1/255 apart (/ std ~0.25) at most
    assert (got - expected).abs().max() < 0.03, (got - expected).abs().max()


def check_reward(fn, images, prompts):
    """Shape [B], float32, finite, the same twice; returns the scores."""
    scores = fn(images, prompts)
    assert scores.shape == (len(images),) and scores.dtype == torch.float32 and scores.isfinite().all()
    assert torch.equal(scores, fn(images, prompts))
    return scores


def test_pickscore(env, tiny_clip):
    images = smooth_images(len(PROMPTS))
    scores = check_reward(pickscore("cpu"), images, PROMPTS)
    image_emb, text_emb, scale = reference(tiny_clip, images, PROMPTS)
    torch.testing.assert_close(scores, scale * (image_emb * text_emb).sum(-1) / 26, atol=2e-3, rtol=0)
    same_images = images[:1].expand(2, -1, -1, -1)
    assert pickscore("cpu")(same_images, PROMPTS[:2]).unique().numel() == 2  # the prompt matters


def test_clipscore(env, tiny_clip):
    images = smooth_images(len(PROMPTS))
    fn = clipscore("cpu")
    scores = check_reward(fn, images, PROMPTS)
    cosine = fn.details(images, PROMPTS)["cosine"]
    image_emb, text_emb, _ = reference(tiny_clip, images, PROMPTS)
    torch.testing.assert_close(cosine, (image_emb * text_emb).sum(-1), atol=2e-3, rtol=0)
    torch.testing.assert_close(scores, 2.5 * cosine.clamp_min(0))
    same_images = images[:1].expand(2, -1, -1, -1)
    assert fn.details(same_images, PROMPTS[:2])["cosine"].unique().numel() == 2


def test_aesthetic(env, tiny_clip):
    images = smooth_images(len(PROMPTS))
    scores = check_reward(aesthetic("cpu"), images, PROMPTS)
    head = AestheticMLP(16).eval()  # no dropout
    head.load_state_dict(torch.load(tiny_clip["head"]))
    image_emb, _, _ = reference(tiny_clip, images, PROMPTS)
    with torch.no_grad():
        torch.testing.assert_close(scores, head(image_emb)[:, 0], atol=2e-3, rtol=0)
    assert scores.unique().numel() == len(PROMPTS)  # the image matters, the prompt does not:
    assert torch.equal(aesthetic("cpu")(images, PROMPTS[::-1]), scores)


@pytest.mark.parametrize(
    "factory, var",
    [
        (pickscore, "CLEANFLOW_PICKSCORE_MODEL"),
        (pickscore, "CLEANFLOW_PICKSCORE_PROCESSOR"),
        (clipscore, "CLEANFLOW_CLIP_MODEL"),
        (aesthetic, "CLEANFLOW_AESTHETIC_CLIP"),
    ],
)
@pytest.mark.parametrize("missing", ["dir", "hub id"])
def test_missing_model_is_one_line(env, tmp_path, factory, var, missing):
    name = str(tmp_path / "no-such-model") if missing == "dir" else "cleanflow-tests/no-such-model"  # HF_HUB_OFFLINE=1
    env.setenv(var, name)
    with pytest.raises(UserError) as err:
        factory("cpu")
    message = str(err.value)
    assert "\n" not in message and name in message and var in message


def test_aesthetic_head_errors(env, tmp_path):
    env.delenv(HEAD_ENV)
    with pytest.raises(UserError, match=HEAD_ENV) as err:
        aesthetic("cpu")
    assert HEAD_URL in str(err.value) and "\n" not in str(err.value)
    env.setenv(HEAD_ENV, str(tmp_path / "missing.pth"))
    with pytest.raises(UserError, match="not found"):
        aesthetic("cpu")
    torch.save(AestheticMLP(768).state_dict(), tmp_path / "wide.pth")  # the real head's width on a 16-dim CLIP
    with pytest.raises(UserError, match="do not fit"):
        aesthetic("cpu", head_path=str(tmp_path / "wide.pth"))


def test_registry(env):
    from rewards import load_rewards

    rewards = load_rewards("pickscore:1.0,clipscore:0.5,aesthetic:0.1", "cpu")
    scores = rewards(smooth_images(2), PROMPTS[:2])
    assert set(scores) == {"pickscore", "clipscore", "aesthetic"} and rewards.total(scores).shape == (2,)
