"""The hub rewards (pickscore, clipscore, aesthetic, hpsv2, imagereward) through their real loading code, on a tiny
random CLIP saved with save_pretrained and a tiny random ImageReward checkpoint in the original BLIP layout, reached
through the CLEANFLOW_* variables: nothing is downloaded."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import run_script
from PIL import Image
from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

from benchmark.testbeds.build_tiny_shapes import MAX_TOKENS, build_tokenizer
from common import UserError
from rewards import _clip, imagereward
from rewards.aesthetic import HEAD_ENV, HEAD_URL, AestheticMLP, aesthetic
from rewards.clipscore import clipscore
from rewards.hpsv2 import hpsv2
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
    torch.save(imagereward_checkpoint(), root / "ImageReward.pt")
    files = {"head": str(root / "head.pth"), "imagereward": str(root / "ImageReward.pt")}
    return {name: str(root / name) for name in ("clip", "processor")} | files


# A tiny ImageReward.pt in the layout of THUDM/ImageReward's ImageReward(BLIP_Pretrain(vit=...), MLP(768)): BLIP's
# timm-style ViT, its BERT with cross-attention, its unused contrastive projections and position_ids buffer, the MLP.
# 64-dim attention heads as in the real model, two of them on each side; 2 layers each.
IR = dict(width=128, text=128, layers=2, patch=8, image=32, vocab=512, positions=40, mlp=192)


def imagereward_checkpoint(seed=0):
    g = torch.Generator().manual_seed(seed)
    w, t, n = IR["width"], IR["text"], IR["layers"]

    def rand(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    def norm(prefix, dim):  # LayerNorm weights away from 1 and 0, so a swapped or dropped norm shows
        return {f"{prefix}.weight": 1 + rand(dim, scale=0.2), f"{prefix}.bias": rand(dim)}

    def linear(prefix, out, inp):
        return {f"{prefix}.weight": rand(out, inp, scale=1 / math.sqrt(inp)), f"{prefix}.bias": rand(out)}

    v, b = "blip.visual_encoder.", "blip.text_encoder."
    state = {
        v + "cls_token": rand(1, 1, w, scale=0.5),
        v + "pos_embed": rand(1, (IR["image"] // IR["patch"]) ** 2 + 1, w, scale=0.5),
        v + "patch_embed.proj.weight": rand(w, 3, IR["patch"], IR["patch"], scale=0.1),
        v + "patch_embed.proj.bias": rand(w),
        **norm(v + "norm", w),
        b + "embeddings.word_embeddings.weight": rand(IR["vocab"], t, scale=0.5),
        b + "embeddings.position_embeddings.weight": rand(IR["positions"], t, scale=0.5),
        b + "embeddings.position_ids": torch.arange(IR["positions"])[None],
        **norm(b + "embeddings.LayerNorm", t),
        **linear("blip.vision_proj", 256, w),
        **linear("blip.text_proj", 256, t),
    }
    for i in range(n):
        p = f"{v}blocks.{i}."
        state |= norm(p + "norm1", w) | linear(p + "attn.qkv", 3 * w, w) | linear(p + "attn.proj", w, w)
        state |= norm(p + "norm2", w) | linear(p + "mlp.fc1", IR["mlp"], w) | linear(p + "mlp.fc2", w, IR["mlp"])
        p = f"{b}encoder.layer.{i}."
        for part, ctx in (("attention", t), ("crossattention", w)):
            q = f"{p}{part}."
            state |= linear(q + "self.query", t, t) | linear(q + "self.key", t, ctx) | linear(q + "self.value", t, ctx)
            state |= linear(q + "output.dense", t, t) | norm(q + "output.LayerNorm", t)
        state |= linear(p + "intermediate.dense", IR["mlp"], t) | linear(p + "output.dense", t, IR["mlp"])
        state |= norm(p + "output.LayerNorm", t)
    for i, (out, inp) in zip((0, 2, 4, 6, 7), ((1024, t), (128, 1024), (64, 128), (16, 64), (1, 16))):
        state |= linear(f"mlp.layers.{i}", out, inp)
    return state


def imagereward_reference(state, pixel_values, input_ids, attention_mask):
    """ImageReward.score written out in plain torch on the original key names: BLIP's ViT (pre-norm blocks, eps 1e-6,
    joint qkv), its BERT (post-norm, eps 1e-12, self-attention over the padded prompt, cross-attention to every image
    token), the [CLS] feature, the linear MLP, (r - mean) / std."""

    def ln(x, p, eps):
        return F.layer_norm(x, x.shape[-1:], state[p + ".weight"], state[p + ".bias"], eps)

    def lin(x, p):
        return F.linear(x, state[p + ".weight"], state[p + ".bias"])

    def attention(q, k, v, mask=None):
        heads = q.shape[-1] // 64

        def split(x):
            return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)

        logits = split(q) @ split(k).transpose(-1, -2) / math.sqrt(64)
        if mask is not None:
            logits = logits.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        return (logits.softmax(-1) @ split(v)).transpose(1, 2).reshape(q.shape)

    v = "blip.visual_encoder."
    kernel = state[v + "patch_embed.proj.weight"]
    x = F.conv2d(pixel_values, kernel, state[v + "patch_embed.proj.bias"], stride=kernel.shape[-1]).flatten(2).mT
    x = torch.cat([state[v + "cls_token"].expand(len(x), -1, -1), x], 1) + state[v + "pos_embed"]
    for i in range(IR["layers"]):
        p = f"{v}blocks.{i}."
        x = x + lin(attention(*lin(ln(x, p + "norm1", 1e-6), p + "attn.qkv").chunk(3, -1)), p + "attn.proj")
        x = x + lin(F.gelu(lin(ln(x, p + "norm2", 1e-6), p + "mlp.fc1")), p + "mlp.fc2")
    image = ln(x, v + "norm", 1e-6)
    b = "blip.text_encoder."
    positions = state[b + "embeddings.position_embeddings.weight"][: input_ids.shape[1]]
    y = ln(state[b + "embeddings.word_embeddings.weight"][input_ids] + positions, b + "embeddings.LayerNorm", 1e-12)
    for i in range(IR["layers"]):
        p = f"{b}encoder.layer.{i}."
        for part, context, mask in (("attention", None, attention_mask), ("crossattention", image, None)):
            q, ctx = f"{p}{part}.", y if context is None else context
            a = attention(lin(y, q + "self.query"), lin(ctx, q + "self.key"), lin(ctx, q + "self.value"), mask)
            y = ln(lin(a, q + "output.dense") + y, q + "output.LayerNorm", 1e-12)
        y = ln(lin(F.gelu(lin(y, p + "intermediate.dense")), p + "output.dense") + y, p + "output.LayerNorm", 1e-12)
    r = y[:, 0]
    for i in (0, 2, 4, 6, 7):
        r = lin(r, f"mlp.layers.{i}")
    return (r[:, 0] - 0.16717362830052426) / 1.0333394966054072


@pytest.fixture
def env(monkeypatch, tiny_clip):
    for var, path in [
        ("CLEANFLOW_PICKSCORE_MODEL", "clip"),
        ("CLEANFLOW_PICKSCORE_PROCESSOR", "processor"),
        ("CLEANFLOW_CLIP_MODEL", "clip"),
        ("CLEANFLOW_AESTHETIC_CLIP", "clip"),
        ("CLEANFLOW_HPSV2_MODEL", "clip"),
        (HEAD_ENV, "head"),
        (imagereward.CKPT_ENV, "imagereward"),
        (imagereward.TOKENIZER_ENV, "processor"),
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


def test_hpsv2(env, tiny_clip):
    images = smooth_images(len(PROMPTS))
    scores = check_reward(hpsv2("cpu"), images, PROMPTS)
    image_emb, text_emb, _ = reference(tiny_clip, images, PROMPTS)
    # hpsv2/img_score.py: the diagonal of image_features @ text_features.T on unit features, no logit scale
    torch.testing.assert_close(scores, (image_emb * text_emb).sum(-1), atol=2e-3, rtol=0)
    same_images = images[:1].expand(2, -1, -1, -1)
    assert hpsv2("cpu")(same_images, PROMPTS[:2]).unique().numel() == 2


def imagereward_inputs(tiny_clip, images, prompts):
    """pixel_values and tokens the way ImageReward.score makes them: ImageReward's _transform (Resize shortest edge,
    bicubic; CenterCrop; CLIP mean and std) on PIL images, the prompt padded to 35 tokens."""
    from transformers import AutoTokenizer

    processor = CLIPImageProcessorPil(
        size={"shortest_edge": IR["image"]},
        crop_size={"height": IR["image"], "width": IR["image"]},
        resample=3,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    tokens = AutoTokenizer.from_pretrained(tiny_clip["processor"])(
        prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt"
    )
    return processor, tokens.input_ids, tokens.attention_mask


@pytest.mark.parametrize("h, w", [(64, 64), (48, 80)])
def test_imagereward_matches_the_original_computation(env, tiny_clip, h, w):
    images = smooth_images(len(PROMPTS), h, w)
    scores = check_reward(imagereward.imagereward("cpu", batch_size=3), images, PROMPTS)  # 2 chunks: 3 + 1
    state = torch.load(tiny_clip["imagereward"])
    processor, input_ids, attention_mask = imagereward_inputs(tiny_clip, images, PROMPTS)
    with torch.no_grad():
        expected = imagereward_reference(
            state, processor(to_pil(images), return_tensors="pt")["pixel_values"], input_ids, attention_mask
        )
        # the same pixels as the reward's tensor preprocessing: the model and the score formula, to float precision
        exact = imagereward_reference(
            state, _clip.tensor_preprocess(processor, torch.device("cpu"))(images), input_ids, attention_mask
        )
    assert expected.std() > 0.05  # the random model tells the images apart, so the comparisons below mean something
    torch.testing.assert_close(scores, exact, atol=2e-5, rtol=0)
    # PIL resizes uint8 with its own bicubic kernel, the reward float tensors: pixel values ~1/255 apart
    torch.testing.assert_close(scores, expected, atol=0.02 * expected.abs().max().item(), rtol=0)
    one_by_one = torch.cat(
        [imagereward.imagereward("cpu", batch_size=1)(images[i : i + 1], PROMPTS[i : i + 1]) for i in range(4)]
    )
    torch.testing.assert_close(one_by_one, scores, atol=1e-5, rtol=0)  # batching and padding change nothing
    same_images = images[:1].expand(2, -1, -1, -1)
    assert imagereward.imagereward("cpu")(same_images, PROMPTS[:2]).unique().numel() == 2  # the prompt matters


def test_imagereward_reads_the_architecture_off_the_checkpoint(tiny_clip):
    vision, text, head = imagereward.split_checkpoint(torch.load(tiny_clip["imagereward"]))
    assert vision["config"] | text["config"] == vision["config"] | {
        "hidden_size": IR["text"],
        "intermediate_size": IR["mlp"],
        "num_hidden_layers": IR["layers"],
        "num_attention_heads": 2,
        "vocab_size": IR["vocab"],
        "max_position_embeddings": IR["positions"],
        "encoder_hidden_size": IR["width"],
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
    }
    assert (vision["config"]["image_size"], vision["config"]["patch_size"], vision["config"]["layer_norm_eps"]) == (
        32,
        8,
        1e-6,
    )
    assert sorted(head) == [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("bias", "weight")]


def test_imagereward_errors(env, tiny_clip, tmp_path):
    env.delenv(imagereward.CKPT_ENV)  # the hub default, unreachable (HF_HUB_OFFLINE=1) and not cached
    with pytest.raises(UserError, match=imagereward.CKPT_ENV) as err:
        imagereward.imagereward("cpu")
    assert "THUDM/ImageReward" in str(err.value) and "ImageReward.pt" in str(err.value) and "\n" not in str(err.value)
    env.setenv(imagereward.CKPT_ENV, str(tmp_path / "missing.pt"))
    with pytest.raises(UserError, match=imagereward.CKPT_ENV) as err:
        imagereward.imagereward("cpu")
    assert "\n" not in str(err.value)
    (tmp_path / "garbage.pt").write_text("not a checkpoint")
    env.setenv(imagereward.CKPT_ENV, str(tmp_path / "garbage.pt"))
    with pytest.raises(UserError, match="cannot read ImageReward weights"):
        imagereward.imagereward("cpu")
    state = torch.load(tiny_clip["imagereward"])
    state["blip.visual_encoder.blocks.0.attn.extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "other.pt")
    env.setenv(imagereward.CKPT_ENV, str(tmp_path / "other.pt"))
    with pytest.raises(UserError, match="layout") as err:
        imagereward.imagereward("cpu")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "factory, var",
    [
        (hpsv2, "CLEANFLOW_HPSV2_MODEL"),
        (imagereward.imagereward, imagereward.TOKENIZER_ENV),
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

    rewards = load_rewards("pickscore:1.0,clipscore:0.5,aesthetic:0.1,hpsv2:1.0,imagereward:0.2", "cpu")
    scores = rewards(smooth_images(2), PROMPTS[:2])
    assert set(scores) == {"pickscore", "clipscore", "aesthetic", "hpsv2", "imagereward"}
    assert rewards.total(scores).shape == (2,)


@pytest.mark.slow
def test_tiny_training_run_on_hpsv2_and_imagereward(tiny_clip, tmp_path):
    """One GRPO epoch of the tiny model on hpsv2 + imagereward through the registry, as a user runs it: both rewards
    are logged and the evaluation scores them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "train.txt").write_text("a red circle\na blue square\n")
    env = os.environ | {
        "CLEANFLOW_HPSV2_MODEL": tiny_clip["clip"],
        imagereward.CKPT_ENV: tiny_clip["imagereward"],
        imagereward.TOKENIZER_ENV: tiny_clip["processor"],
    }
    argv = ["algos/grpo.py", "--num-epochs", "1", "--num-prompts", "2", "--group-size", "2", "--micro-batch", "2"]
    argv += ["--num-steps", "4", "--num-sde-steps", "1", "--eval-every", "1", "--reward", "hpsv2:1.0,imagereward:0.5"]
    argv += [
        "--train-prompts",
        tmp_path / "train.txt",
        "--test-prompts",
        tmp_path / "train.txt",
        "--output-dir",
        tmp_path / "out",
    ]
    run_script(argv, env=env)
    (events,) = (tmp_path / "out").rglob("events.out.tfevents*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"charts/hpsv2", "charts/imagereward", "eval/hpsv2", "eval/imagereward", "losses/policy_loss"} <= set(tags)
