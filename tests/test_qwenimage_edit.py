"""The Qwen-Image-Edit family (models/qwenimage_edit.py) against diffusers' QwenImageEditPipeline, on a tiny random
build (tiny_families.qwen_image_edit): the VL encoder sees the image, the negative prompt is encoded on each image, the
reference latents follow the sampled ones. The stock pipeline is loaded with the family's processor
(`qwenimage_edit.load_processor`): Qwen2VLProcessor's own loader needs torchvision for a video part editing never uses."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_families
import torch
from conftest import scalars
from PIL import Image
from test_flux_kontext import assert_finite_logs, write_prompt_file, write_scenes

import common
import models
from harness import prompt_files
from models import flux, qwenimage, qwenimage_edit

CPU = torch.device("cpu")
HEIGHT, WIDTH = 64, 96  # sampled: not square, and not the reference's 832 x 1248 (the pipeline's copy of a 3:2 image)
TEXTS = ["make the circle red", "add a blue square", "remove the square"]


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory):
    return tiny_families.qwen_image_edit(tmp_path_factory.mktemp("qwen-edit") / "model")


@pytest.fixture
def edit_prompts(tmp_path):
    """A jsonl of three instructions, each on its own 48 x 32 scene (3:2, as the sampled size; any size would do)."""
    names = write_scenes(tmp_path / "scenes", size=(48, 32))
    return write_prompt_file(tmp_path / "edit.jsonl", [{"prompt": t, "image": f"scenes/{n}"} for t, n in zip(TEXTS, names)])


def stock_pipeline(folder):
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline.from_pretrained(folder, processor=qwenimage_edit.load_processor(Path(folder) / "processor"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_reference_size_is_the_pipelines_calculate_dimensions():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    rng = np.random.default_rng(0)
    sizes = [(48, 32), (32, 48), (64, 64), (1, 300), (1000, 7), *map(tuple, rng.integers(1, 5000, (300, 2)).tolist())]
    for width, height in sizes:
        expected = calculate_dimensions(1024 * 1024, width / height)[:2]
        assert qwenimage_edit.reference_size((width, height)) == expected, (width, height)
    # by hand: a square image is 1024 x 1024; 3:2 is sqrt(1024^2 * 1.5) = 1254.1 -> 1248 wide, 836.1 -> 832 high
    assert qwenimage_edit.reference_size((64, 64)) == (1024, 1024)
    assert qwenimage_edit.reference_size((48, 32)) == (1248, 832)
    assert all(side % 32 == 0 for size in sizes for side in qwenimage_edit.reference_size(size))


def test_qwen_image_edit_is_its_own_family_though_it_shares_qwen_images_transformer(edit_dir):
    pipe = models.load_pipeline(edit_dir, CPU, height=HEIGHT, width=WIDTH)
    assert pipe.family is qwenimage_edit.FAMILY and common.family_of(pipe.transformer) is qwenimage_edit.FAMILY
    assert pipe.latent_shape == (4, HEIGHT // 16, WIDTH // 16)
    bare = type(pipe.transformer).from_config(pipe.transformer.config)  # not loaded by us: Qwen-Image's, as before
    assert common.family_of(bare) is qwenimage.FAMILY
    assert models.pipeline_class("Qwen/Qwen-Image-Edit") == "QwenImageEditPipeline"
    assert models.pipeline_class("Qwen/Qwen-Image-Edit-2509") == "QwenImageEditPlusPipeline"  # not supported
    assert models.pipeline_class("Qwen/Qwen-Image") == "QwenImagePipeline"


def stock_images(pipe, prompt, noise, steps, guidance_scale, negative_prompt):
    """QwenImageEditPipeline.__call__ on one prompt and its image, our noise packed, at the sampled size; true CFG on
    with a scale > 1 and a negative prompt, as the model card calls it."""
    negative = {"negative_prompt": [negative_prompt]} if guidance_scale > 1 else {}
    return pipe(
        image=prompt_files.load_image(prompt.image),
        prompt=[prompt.text],
        true_cfg_scale=guidance_scale,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=steps,
        latents=flux.pack_latents(noise[None]),
        output_type="pt",
        **negative,
    ).images


@pytest.mark.slow
@pytest.mark.parametrize("guidance_scale, negative_prompt", [(1.0, ""), (3.0, "blurry"), (2.0, "")])
def test_ode_sampler_matches_qwen_image_edit_pipeline(edit_dir, edit_prompts, guidance_scale, negative_prompt):
    """Same noise: our batched sampler (each prompt its own image) equals the pipeline called per prompt with that
    image, true CFG off and on (an empty negative prompt turns it on too, as in the pipeline). Measured ~1e-6."""
    pipe, steps = models.load_pipeline(edit_dir, CPU, height=HEIGHT, width=WIDTH), 3
    prompts = prompt_files.load_prompts(edit_prompts)[:2]
    noise = torch.randn(len(prompts), *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = common.PromptEncoder(pipe, negative_prompt=negative_prompt).cond(prompts, negative=guidance_scale > 1)
    assert cond.image.shape == (2, 4, 832 // 16, 1248 // 16)  # the pipeline's ~1024^2 copy, not the sampled size
    out = common.sample(pipe.transformer, pipe.scheduler, cond, num_steps=steps, guidance_scale=guidance_scale, noise=noise)
    ours = common.decode(pipe, out.latents)
    stock = stock_pipeline(edit_dir)
    ref = torch.cat([stock_images(stock, p, z, steps, guidance_scale, negative_prompt) for p, z in zip(prompts, noise)])
    torch.testing.assert_close(out.sigmas, stock.scheduler.sigmas.float(), atol=1e-6, rtol=0)  # what the pipeline set
    assert ours.shape == ref.shape == (2, 3, HEIGHT, WIDTH)
    assert (ours - ref.flip(0)).abs().max() > 1e-3  # the comparison can fail
    assert (ours - ref).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_the_image_reaches_both_encoders(edit_dir, edit_prompts):
    """The same text on two images: different embeddings (the VL encoder sees the image), different reference
    latents, and a different velocity; the negative prompt too is encoded on each image."""
    pipe = models.load_pipeline(edit_dir, CPU, height=HEIGHT, width=WIDTH)
    a, b = prompt_files.load_prompts(edit_prompts)[:2]
    same_text = [a, prompt_files.Prompt("k", a.text, b.image, b.size)]
    enc = common.PromptEncoder(pipe, negative_prompt="blurry")
    cond = enc.cond(same_text)
    n = int(cond.pooled[0].sum())
    assert cond.embeds.shape[1] > 144  # the image's 144 vision tokens are in the sequence
    assert not torch.allclose(cond.embeds[0, :n], cond.embeds[1, :n]) and not torch.allclose(cond.image[0], cond.image[1])
    assert not torch.allclose(cond.neg_embeds[0], cond.neg_embeds[1])
    x = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        v = common.velocity(
            pipe.transformer, x, 0.6, common.Cond(cond.embeds[[0, 0]], cond.pooled[[0, 0]], image=cond.image), 1.0
        )
    assert v.shape == x.shape and not torch.allclose(v[0], v[1])


@pytest.mark.slow
def test_each_image_is_encoded_once_and_the_negative_once_per_image(edit_dir, edit_prompts, monkeypatch):
    """The VAE sees each image once, at the pipeline's resized copy; the VL encoder each (text, image) once, the
    negative prompt once per image; each equal to the pipeline's own encoding."""
    pipe = models.load_pipeline(edit_dir, CPU, height=HEIGHT, width=WIDTH)
    prompts = prompt_files.load_prompts(edit_prompts)
    images, texts = [], []
    real_image, real_encode = qwenimage_edit.encode_image, qwenimage_edit.encode
    monkeypatch.setattr(qwenimage_edit.FAMILY, "encode_image", lambda p, px: images.append(px.shape) or real_image(p, px))
    monkeypatch.setattr(
        qwenimage_edit.FAMILY,
        "encode",
        lambda p, r, *a: texts.extend((x.text, x.image.name) for x in r) or real_encode(p, r, *a),
    )
    enc = common.PromptEncoder(pipe, negative_prompt="blurry")
    first = enc.cond(prompts + prompts[:1])
    again = enc.cond(prompts[::-1])
    assert images == [(1, 3, 832, 1248)] * 3  # one call per image file, one image a call, the pipeline's copy
    names = [f"scene{k}.png" for k in range(3)]
    assert sorted(texts) == sorted([*zip(TEXTS, names), *zip(["blurry"] * 3, names)])  # each once
    torch.testing.assert_close(again.image, first.image[:3].flip(0), rtol=0, atol=0)
    torch.testing.assert_close(again.neg_embeds, first.neg_embeds[:3].flip(0), rtol=0, atol=0)
    # the pipeline's own encodings of prompt 2's image: its VAE latents, its prompt and its negative prompt
    stock = pipe.pipe
    copy = qwenimage_edit.reference_image(stock, prompts[2])
    assert copy.size == (1248, 832)
    pixels = stock.image_processor.preprocess(copy, 832, 1248).unsqueeze(2)
    torch.testing.assert_close(first.image[2], stock._encode_vae_image(pixels, None)[0, :, 0], rtol=0, atol=0)
    for embeds, mask, text in ((first.embeds, first.pooled, TEXTS[2]), (first.neg_embeds, first.neg_pooled, "blurry")):
        e, m = stock.encode_prompt(text, image=copy, device=CPU)
        assert m is None and int(mask[2].sum()) == e.shape[1]  # nothing padded for one prompt
        torch.testing.assert_close(embeds[2, : e.shape[1]], e[0], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_precompute_encodes_the_negative_on_each_image_and_no_bare_one(edit_dir, edit_prompts, monkeypatch):
    pipe = models.load_pipeline(edit_dir, CPU, height=HEIGHT, width=WIDTH)
    prompts = prompt_files.load_prompts(edit_prompts)
    enc = common.PromptEncoder(pipe, negative_prompt="blurry")
    enc.precompute(prompts)
    keys = {k for k in enc.cache if isinstance(k, str)}
    assert keys == set(prompts) | {p.with_text("blurry") for p in prompts} and "blurry" not in keys
    assert all(p.with_text("blurry").image == p.image and p.with_text("blurry").text == "blurry" for p in prompts)
    assert prompts[0].with_text("blurry") == "blurry [scenes/scene0.png " + prompts[0].split(" [scenes/scene0.png ")[1]
    enc.offload()
    monkeypatch.setattr(qwenimage_edit.FAMILY, "encode", lambda *a: pytest.fail("encoded again"))
    assert enc.cond(prompts).neg_embeds.shape[0] == 3


@pytest.mark.slow
def test_the_library_path_refuses_text_prompts_and_mixed_sizes(edit_dir, edit_prompts, tmp_path):
    enc = common.PromptEncoder(models.load_pipeline(edit_dir, CPU, height=HEIGHT, width=WIDTH))
    with pytest.raises(common.UserError, match="QwenImageEditPipeline edits an image: every prompt needs one"):
        enc.cond(["a red circle"])
    with pytest.raises(common.UserError, match="--max-sequence-length 64: QwenImageEditPipeline encodes the whole"):
        common.PromptEncoder(models.load_pipeline(edit_dir, CPU), max_sequence_length=64)
    write_scenes(tmp_path / "square", size=(32, 32), count=1)
    square = prompt_files.load_prompts(
        write_prompt_file(tmp_path / "sq.jsonl", [{"prompt": "a", "image": "square/scene0.png"}])
    )
    with pytest.raises(common.UserError, match=r"reference latents \(4, 64, 64\) differ from those of .* \(4, 52, 78\)"):
        enc.cond([prompt_files.load_prompts(edit_prompts)[0], square[0]], negative=False)


@pytest.fixture
def bad_files(tmp_path):
    """Prompt files for the family's checks: text only, two aspect ratios, an image too thin for the VL processor."""
    write_scenes(tmp_path / "wide", size=(48, 32), count=1)
    write_scenes(tmp_path / "square", size=(32, 32), count=1)
    Image.fromarray(np.zeros((300, 1, 3), dtype=np.uint8)).save(tmp_path / "thin.png")
    write_prompt_file(tmp_path / "text.jsonl", [{"prompt": "a red circle"}])
    two = [{"prompt": "a", "image": "wide/scene0.png"}, {"prompt": "b", "image": "square/scene0.png"}]
    write_prompt_file(tmp_path / "two.jsonl", two)
    write_prompt_file(tmp_path / "thin.jsonl", [{"prompt": "a", "image": "thin.png"}])
    return tmp_path


QWEN_EDIT_BAD_INPUTS = [  # (flags, a piece of the one error line), on the tiny Qwen-Image-Edit
    ("--train-prompts {tmp}/text.jsonl", "text.jsonl: QwenImageEditPipeline edits an image: every prompt needs one"),
    (
        "--test-prompts {tmp}/two.jsonl",
        "its image resizes to 1024 x 1024 for Qwen-Image-Edit, the first prompt's to 1248 x 832",
    ),
    (
        "--train-prompts {tmp}/thin.jsonl",
        "its image (1 x 300 pixels) resizes to 64 x 17728 for Qwen-Image-Edit, beyond the VL",
    ),
    ("--height 40", "height 40 must be a multiple of 32"),
    (
        "--max-sequence-length 64",
        "--max-sequence-length 64: QwenImageEditPipeline encodes the whole prompt template",
    ),  # the VAE factor 16 x the 2x2 patches
]


@pytest.mark.parametrize("flags, expected", QWEN_EDIT_BAD_INPUTS)
def test_qwen_edit_bad_inputs_are_one_line_before_the_model_loads(
    flags, expected, edit_dir, edit_prompts, bad_files, capsys, monkeypatch
):
    from test_bad_inputs import TINY, assert_one_line, call

    loaded = []
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: loaded.append(a))
    prompts = ["--train-prompts", str(edit_prompts), "--test-prompts", str(edit_prompts)]
    argv = [*TINY, "--model", edit_dir, "--reward", "jpeg_compressibility", "--width", str(WIDTH), *prompts]
    out = bad_files / "runs"
    rc, err = call("nft", [*argv, "--output-dir", str(out), *flags.replace("{tmp}", str(bad_files)).split()], capsys)
    assert_one_line(rc, err, expected)
    assert not loaded and not out.exists()


def test_a_hub_id_of_qwen_image_edit_plus_is_refused_before_downloading():
    """Qwen-Image-Edit-2509/2511 are QwenImageEditPlusPipeline (several images, another template): not this family."""
    with pytest.raises(common.UserError, match="'QwenImageEditPlusPipeline' is not a supported family"):
        models.load_pipeline("Qwen/Qwen-Image-Edit-2509", CPU)


def train(algo: str, model: str, prompts: Path, tmp_path: Path, *flags: str):
    """test_flux_kontext.train on the tiny Qwen-Image-Edit at the sampled size, true CFG on (scale 2.5, a negative
    prompt)."""
    import test_flux_kontext

    flags = ("--negative-prompt", "blurry", *flags)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_flux_kontext, "HEIGHT", HEIGHT)
        mp.setattr(test_flux_kontext, "WIDTH", WIDTH)
        return test_flux_kontext.train(algo, model, prompts, tmp_path, *flags)


def card_images(run_dir: Path, prompt, noise, tmp_path, pipeline_module, folder) -> torch.Tensor:
    """Execute the export's model card snippet as written (its image: `prompt`'s, its prompt: `prompt`'s text, the
    pipeline's noise: `noise`; from_pretrained given the family's processor, see the module's docstring); returns
    the saved image in [0, 255]."""
    from diffusers import QwenImageEditPipeline

    card = re.search(r"```python\n(.*?)```", (run_dir / "lora" / "README.md").read_text(), re.S).group(1)
    assert 'load_image("image.png")' in card and f"height={HEIGHT}" in card and f"width={WIDTH}" in card
    assert "true_cfg_scale=2.5" in card and 'negative_prompt=["blurry"] * len(prompt)' in card
    code = card.replace("<this folder>", str(run_dir / "lora")).replace('["a red circle"]', repr([prompt.text]))
    (tmp_path / "image.png").write_bytes(prompt.image.read_bytes())
    load = QwenImageEditPipeline.from_pretrained.__func__
    processor = qwenimage_edit.load_processor(Path(folder) / "processor")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline_module, "randn_tensor", lambda shape, **_: noise.reshape(shape))
        mp.setattr(
            QwenImageEditPipeline, "from_pretrained", classmethod(lambda c, *a, **k: load(c, *a, processor=processor, **k))
        )
        mp.chdir(tmp_path)
        exec(code, {})
    return torch.from_numpy(np.array(Image.open(tmp_path / "sample.png"))).permute(2, 0, 1).float()


@pytest.mark.slow
def test_crd_trains_on_image_prompts_and_the_export_reproduces_it_in_the_stock_pipeline(edit_dir, edit_prompts, tmp_path):
    """CRD end to end with true CFG: finite losses and rewards logged, a trained LoRA; the exported LoRA loaded into a
    fresh QwenImageEditPipeline, called as the card says, gives our sampler's images with the trained weights."""
    from diffusers import QwenImageEditPipeline

    run_dir, trained = train("crd", edit_dir, edit_prompts, tmp_path, "--num-epochs", "2")
    assert_finite_logs(scalars(run_dir))
    prompt = prompt_files.load_prompts(edit_prompts)[1]
    noise = torch.randn(1, *trained.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = common.PromptEncoder(trained, negative_prompt="blurry").cond([prompt])
    out = common.sample(trained.transformer, trained.scheduler, cond, num_steps=4, guidance_scale=2.5, noise=noise)
    ours = common.decode(trained, out.latents)
    stock = stock_pipeline(edit_dir)
    without = (stock_images(stock, prompt, noise[0], 4, 2.5, "blurry") - ours).abs().max().item()
    stock.load_lora_weights(str(run_dir / "lora"))
    diff = (stock_images(stock, prompt, noise[0], 4, 2.5, "blurry") - ours).abs().max().item()
    print(f"exported LoRA in QwenImageEditPipeline: max abs difference {diff:.2e} (without it {without:.2e})")
    assert diff <= 1e-5 + 1e-5 < without  # the family's tolerance and the LoRA's (test_models.LORA_TOL)
    card = card_images(run_dir, prompt, noise, tmp_path, sys.modules[QwenImageEditPipeline.__module__], edit_dir)
    assert ((ours[0] * 255).round() - card).abs().max().item() <= 1  # both rounded to 8 bits


@pytest.mark.slow
def test_a_resumed_run_on_image_prompts_ends_bit_identical(edit_dir, edit_prompts, tmp_path):
    """2 epochs, against 1 epoch and `--resume` for one more (its own process, which loads the processor as
    `load_kwargs` does): the resumed run encodes each image, prompt and per-image negative prompt again."""
    from conftest import run_script
    from test_algos import assert_same_state

    from harness.checkpoints import load_checkpoint

    a_dir, _ = train("crd", edit_dir, edit_prompts, tmp_path / "a", "--num-epochs", "2")
    b_dir, _ = train("crd", edit_dir, edit_prompts, tmp_path / "b", "--num-epochs", "1")
    run_script(["algos/crd.py", "--resume", b_dir, "--num-epochs", "2"])
    assert_same_state(load_checkpoint(a_dir), load_checkpoint(b_dir), "crd")


ALGOS = ["awm", "dgpo", "dpo", "elbo_grpo", "grpo", "nft"]  # crd: above


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_every_algorithm_trains_on_image_prompts(algo, edit_dir, edit_prompts, tmp_path):
    run_dir, _ = train(algo, edit_dir, edit_prompts, tmp_path)
    assert_finite_logs(scalars(run_dir))
