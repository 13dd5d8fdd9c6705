"""The `hpsv3` reward (rewards/hpsv3.py) on a tiny random HPSv3 checkpoint in the released layout (a Qwen2-VL state_dict
with transformers < 4.52 key names, one extra embedding row for <|Reward|>, the float32 rm_head) over a tiny Qwen2-VL
base folder (config, tokenizer with chat template, image processor): nothing is downloaded."""

import os

import pytest
import torch
from conftest import run_script
from PIL import Image
from safetensors.torch import save_file
from test_vlm import smooth_images, tiny_judge
from transformers import AutoConfig, AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

from common import UserError
from rewards import hpsv3, load_rewards

PROMPTS = ["a red circle", "three blue squares to the left of a circle", "a cat"]
PIXELS = 56 * 56  # the tests' min_pixels = max_pixels: 4 merged image tokens


def old_layout(state: dict) -> dict:
    """transformers < 4.52 names, as HPSv3.safetensors has them."""
    out = {}
    for key, value in state.items():
        if key.startswith("model.visual."):
            key = key[len("model.") :]
        elif key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model.") :]
        out[key] = value
    return out


@pytest.fixture(scope="module")
def tiny_hpsv3(tmp_path_factory):
    root = tmp_path_factory.mktemp("hpsv3")
    base = tiny_judge(root, "qwen2_vl")
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size += 1  # resize_token_embeddings(len(tokenizer)) after adding <|Reward|>
    torch.manual_seed(1)
    model = Qwen2VLForConditionalGeneration(config)
    head = hpsv3.head(config.text_config.hidden_size)
    for p in head.parameters():  # large enough that the scores spread
        torch.nn.init.normal_(p, std=0.5)
    state = old_layout(model.state_dict()) | {f"rm_head.{k}": v for k, v in head.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, root / "HPSv3.safetensors")
    return {"base": base, "ckpt": str(root / "HPSv3.safetensors"), "model": model.eval(), "head": head.eval()}


@pytest.fixture
def env(monkeypatch, tiny_hpsv3):
    monkeypatch.setenv(hpsv3.BASE_ENV, tiny_hpsv3["base"])
    monkeypatch.setenv(hpsv3.CKPT_ENV, tiny_hpsv3["ckpt"])
    return monkeypatch


def reference(tiny_hpsv3, image, prompt):
    """HPSv3's score the way its Qwen2VLRewardModelBT.forward computes it, on the processor's patches of the PIL image:
    image features scattered into the token embeddings, the decoder run with no position ids (sequential positions),
    the head on the <|Reward|> token's hidden state, mu = its first output."""
    model, head = tiny_hpsv3["model"], tiny_hpsv3["head"]
    tok = AutoTokenizer.from_pretrained(tiny_hpsv3["base"])
    tok.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_hpsv3["base"])
    pil = Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy())
    pixels = processor([pil], size={"shortest_edge": PIXELS, "longest_edge": PIXELS}, return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // 4
    text = hpsv3.INSTRUCTION.format(prompt=prompt) + hpsv3.RATE
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(chat.replace("<|image_pad|>", "<|image_pad|>" * n), return_tensors="pt").input_ids
    with torch.no_grad():
        embeds = model.model.get_input_embeddings()(ids)
        features = torch.cat(model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"]).pooler_output)
        embeds = embeds.masked_scatter((ids == model.config.image_token_id)[..., None].expand_as(embeds), features)
        hidden = model.model.language_model(inputs_embeds=embeds).last_hidden_state
        return head(hidden[ids == tok.convert_tokens_to_ids("<|Reward|>")])[0, 0].item()


def test_matches_the_original_forward_and_batching_changes_nothing(env, tiny_hpsv3):
    images = smooth_images(len(PROMPTS), 56, 56, seed=3)  # the pixel budget's own size: no resize kernel differs
    scores = hpsv3.hpsv3("cpu", pixels=PIXELS, batch_size=3)(images, PROMPTS)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    expected = torch.tensor([reference(tiny_hpsv3, im, p) for im, p in zip(images, PROMPTS)])
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    assert expected.std() > 1e-3  # the three differ by more than the tolerance
    # right padding of prompts of different lengths, and one at a time, give the same scores, twice
    one = hpsv3.hpsv3("cpu", pixels=PIXELS, batch_size=1)
    torch.testing.assert_close(one(images, PROMPTS), scores, atol=1e-5, rtol=1e-5)
    assert torch.equal(one(images, PROMPTS), one(images, PROMPTS))


def test_checkpoint_in_todays_key_layout_loads_the_same(env, tiny_hpsv3, tmp_path):
    from safetensors.torch import load_file

    state = hpsv3.current_keys(load_file(tiny_hpsv3["ckpt"]))
    assert "model.language_model.embed_tokens.weight" in state and "model.visual.merger.mlp.0.weight" in state
    save_file(state, tmp_path / "new.safetensors")
    images = smooth_images(2, 56, 56)
    old = hpsv3.hpsv3("cpu", pixels=PIXELS)(images, PROMPTS[:2])
    env.setenv(hpsv3.CKPT_ENV, str(tmp_path / "new.safetensors"))
    assert torch.equal(hpsv3.hpsv3("cpu", pixels=PIXELS)(images, PROMPTS[:2]), old)


def test_errors_are_one_line(env, tiny_hpsv3, tmp_path):
    env.setenv(hpsv3.CKPT_ENV, str(tmp_path / "missing.safetensors"))
    with pytest.raises(UserError, match=hpsv3.CKPT_ENV):
        hpsv3.hpsv3("cpu")
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    env.setenv(hpsv3.CKPT_ENV, str(tmp_path / "garbage.safetensors"))
    with pytest.raises(UserError, match="cannot read"):
        hpsv3.hpsv3("cpu")
    save_file({"rm_head.0.weight": torch.zeros(1024, 8)}, tmp_path / "other.safetensors")  # another model's head
    env.setenv(hpsv3.CKPT_ENV, str(tmp_path / "other.safetensors"))
    with pytest.raises(UserError, match="does not fit") as err:
        hpsv3.hpsv3("cpu")
    assert "\n" not in str(err.value)


def test_registry(env):
    rewards = load_rewards("hpsv3:1.0,jpeg_compressibility:0.1", "cpu")
    assert set(rewards(smooth_images(2), PROMPTS[:2])) == {"hpsv3", "jpeg_compressibility"}


@pytest.mark.slow
def test_tiny_training_run_on_hpsv3(tiny_hpsv3, tmp_path):
    """One GRPO epoch of the tiny model on hpsv3 through the registry: the reward is logged and the eval scores it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "train.txt").write_text("a red circle\na blue square\n")
    env = os.environ | {hpsv3.BASE_ENV: tiny_hpsv3["base"], hpsv3.CKPT_ENV: tiny_hpsv3["ckpt"]}
    argv = ["algos/grpo.py", "--num-epochs", "1", "--num-prompts", "2", "--group-size", "2", "--micro-batch", "2"]
    argv += ["--num-steps", "4", "--num-sde-steps", "1", "--eval-every", "1", "--reward", "hpsv3"]
    argv += ["--train-prompts", tmp_path / "train.txt", "--test-prompts", tmp_path / "train.txt"]
    run_script(argv + ["--output-dir", tmp_path / "out"], env=env)
    (events,) = (tmp_path / "out").rglob("events.out.tfevents*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"charts/hpsv3", "eval/hpsv3", "losses/policy_loss"} <= set(tags)
