"""Prompts with a reference image (prompt_files.Prompt, load_prompts, PromptEncoder.images, Cond.image) and the FLUX.1-Kontext
family against diffusers' FluxKontextPipeline, on tiny random Kontext pipelines (tiny_families.flux_kontext)."""

import copy
import json
import math
import pickle
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_families
import torch
from conftest import run_script, scalars
from PIL import Image

import common
import models
from harness import export, prompt_files, run
from harness.checkpoints import load_checkpoint
from models import flux, flux_kontext

CPU = torch.device("cpu")
HEIGHT, WIDTH = 32, 48  # not square: swapped rows and columns in the reference tokens' ids would show
TEXTS = ["make the circle red", "add a blue square", "remove the square"]


@pytest.fixture(scope="module")
def kontext_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kontext")
    return {"dev": tiny_families.flux_kontext(root / "dev"), "schnell": tiny_families.flux_kontext_schnell(root / "schnell")}


def write_scenes(folder: Path, size=(WIDTH, HEIGHT), count: int = 3) -> list:
    """`count` random RGB images (different seeds) in `folder`; returns their names."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for k in range(count):
        pixels = np.random.default_rng(k).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"scene{k}.png")
        names.append(f"scene{k}.png")
    return names


def write_prompt_file(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def edit_prompts(tmp_path):
    """A jsonl of three instructions, each on its own scene, the images in a subfolder (paths relative to the file)."""
    names = write_scenes(tmp_path / "scenes")
    rows = [{"prompt": t, "image": f"scenes/{n}"} for t, n in zip(TEXTS, names)]
    return write_prompt_file(tmp_path / "edit.jsonl", rows)


def test_prompt_records_are_unique_strings_that_keep_text_and_image(tmp_path, edit_prompts):
    prompts = prompt_files.load_prompts(edit_prompts)
    assert all(isinstance(p, prompt_files.Prompt) and isinstance(p, str) for p in prompts)
    assert [p.text for p in prompts] == TEXTS and [common.prompt_text(p) for p in prompts] == TEXTS
    assert [p.image for p in prompts] == [(tmp_path / "scenes" / f"scene{k}.png").resolve() for k in range(3)]
    assert all(p.size == (WIDTH, HEIGHT) for p in prompts)
    assert re.fullmatch(r"make the circle red \[scenes/scene0\.png [0-9a-f]{12}\]", prompts[0])
    # the same text on two images: two prompts; the same text and image content from another file: the same key
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "copy.png").write_bytes((tmp_path / "scenes" / "scene0.png").read_bytes())
    rows = [{"prompt": TEXTS[0], "image": "scenes/scene1.png"}, {"prompt": TEXTS[0], "image": "other/copy.png"}]
    same_text, same_content = prompt_files.load_prompts(write_prompt_file(tmp_path / "more.jsonl", rows))
    assert same_text != prompts[0] and same_text.text == prompts[0].text
    assert same_content.split(" [")[1].split()[1] == prompts[0].split(" [")[1].split()[1]  # the content's digest
    # copies and pickles are records, not bare strings; group_prompts hands the records on
    for twin in (copy.deepcopy(prompts[1]), pickle.loads(pickle.dumps(prompts[1]))):
        assert isinstance(twin, prompt_files.Prompt) and twin == prompts[1] and twin.image == prompts[1].image
    grouped = common.group_prompts(prompts, 2, 3, torch.Generator().manual_seed(0))
    assert all(isinstance(p, prompt_files.Prompt) for p in grouped) and len(set(grouped)) == 2
    # a text-only jsonl stays plain strings
    assert prompt_files.load_prompts(write_prompt_file(tmp_path / "text.jsonl", [{"prompt": "a"}])) == ["a"]
    assert type(prompt_files.load_prompts(tmp_path / "text.jsonl")[0]) is str


def test_images_are_read_as_load_image_reads_them(tmp_path):
    """RGB as diffusers.utils.load_image: alpha dropped, grey expanded; the pixels are the pipeline's x / 255 * 2 - 1."""
    from diffusers.utils import load_image

    rgba = np.random.default_rng(3).integers(0, 256, (8, 16, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    Image.fromarray(rgba[..., 0], "L").save(tmp_path / "grey.png")
    for name in ("rgba.png", "grey.png"):
        expected = np.asarray(load_image(str(tmp_path / name)))
        assert np.array_equal(np.asarray(prompt_files.load_image(tmp_path / name)), expected)
        pixels = prompt_files.image_pixels(tmp_path / name)
        assert pixels.shape == (1, 3, 8, 16)
        np.testing.assert_allclose(pixels[0].permute(1, 2, 0).numpy(), expected / 255.0 * 2 - 1, atol=1e-6)


def test_cond_indexes_its_image_like_its_other_fields():
    cond = common.Cond(torch.randn(4, 3, 2), torch.randn(4, 2), image=torch.randn(4, 4, 2, 2))
    part = cond[torch.tensor([2, 0])]
    torch.testing.assert_close(part.image, cond.image[[2, 0]], rtol=0, atol=0)
    torch.testing.assert_close(part.embeds, cond.embeds[[2, 0]], rtol=0, atol=0)
    assert cond[1:3].image.shape == (2, 4, 2, 2) and common.Cond(cond.embeds, cond.pooled)[1:].image is None


def test_kontext_is_its_own_family_though_it_shares_flux_transformer(kontext_dirs):
    pipe = models.load_pipeline(kontext_dirs["dev"], CPU)
    assert pipe.family is flux_kontext.FAMILY and common.family_of(pipe.transformer) is flux_kontext.FAMILY
    assert pipe.latent_shape == (4, 8, 8)  # the VAE's sample_size (32 pixels), factor 4
    assert common.family_of(copy.deepcopy(pipe.transformer)) is flux_kontext.FAMILY
    bare = type(pipe.transformer).from_config(pipe.transformer.config)  # not loaded by us: FLUX.1's, as before
    assert common.family_of(bare) is flux.FAMILY
    with pytest.raises(common.UserError, match="FLUX.1-Kontext's guidance is an embedding"):  # the library path too
        common.PromptEncoder(pipe, negative_prompt="blurry")
    assert models.pipeline_class("black-forest-labs/FLUX.1-Kontext-dev") == "FluxKontextPipeline"
    assert models.pipeline_class("black-forest-labs/FLUX.1-dev") == "FluxPipeline"


def test_reference_ids_are_the_sampled_ids_with_first_component_one():
    from diffusers import FluxKontextPipeline

    ids = flux_kontext.reference_ids(6, 4, CPU)
    expected = FluxKontextPipeline._prepare_latent_image_ids(1, 3, 2, CPU, torch.float32)
    expected[:, 0] = 1
    torch.testing.assert_close(ids, expected, rtol=0, atol=0)
    rows, cols = np.meshgrid(np.arange(3), np.arange(2), indexing="ij")  # (1, row, col), row-major
    np.testing.assert_array_equal(ids.numpy(), np.stack([np.ones(6), rows.ravel(), cols.ravel()], 1))


def stock_images(pipe, prompt, noise, steps, guidance_scale, max_sequence_length):
    """FluxKontextPipeline.__call__ on one prompt (its own image, or none), our noise packed, at our size unresized."""
    call = dict(
        prompt=[common.prompt_text(prompt)],
        image=prompt_files.load_image(prompt.image) if isinstance(prompt, prompt_files.Prompt) else None,
        latents=flux.pack_latents(noise[None]),
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        height=HEIGHT,
        width=WIDTH,
        max_area=HEIGHT * WIDTH,
        _auto_resize=False,
        max_sequence_length=max_sequence_length,
        output_type="pt",
    )
    return pipe.pipe(**call).images


@pytest.mark.parametrize("variant, guidance_scale", [("dev", 3.5), ("dev", 1.0), ("schnell", 1.0)])
@pytest.mark.parametrize("with_image", [True, False])
def test_ode_sampler_matches_flux_kontext_pipeline(kontext_dirs, edit_prompts, variant, guidance_scale, with_image):
    """Same noise: our batched sampler (each prompt its own image) equals the pipeline called per prompt with that
    image, sigmas too; without an image both sample from the text alone. Measured 0.0 (the pixels are built in the
    pipeline's memory layout, see `prompt_files.image_pixels`)."""
    pipe, steps = models.load_pipeline(kontext_dirs[variant], CPU, height=HEIGHT, width=WIDTH), 4
    prompts = prompt_files.load_prompts(edit_prompts) if with_image else TEXTS
    noise = torch.randn(len(prompts), *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    enc = common.PromptEncoder(pipe)
    cond = enc.cond(prompts, negative=False)
    assert (cond.image is not None) == with_image
    out = common.sample(pipe.transformer, pipe.scheduler, cond, num_steps=steps, guidance_scale=guidance_scale, noise=noise)
    ours = common.decode(pipe, out.latents)
    torch.testing.assert_close(out.sigmas, pipe.sigmas(steps), rtol=0, atol=0)
    ref = torch.cat([stock_images(pipe, p, z, steps, guidance_scale, enc.max_sequence_length) for p, z in zip(prompts, noise)])
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas.float(), atol=1e-6, rtol=0)  # what the pipeline set
    assert ours.shape == ref.shape == (3, 3, HEIGHT, WIDTH)
    assert (ours - ref.flip(0)).abs().max() > 1e-3  # the comparison can fail
    assert (ours - ref).abs().max().item() <= 1e-5


def test_the_reference_image_changes_the_velocity_and_only_the_sampled_tokens_come_back(kontext_dirs, edit_prompts):
    pipe = models.load_pipeline(kontext_dirs["dev"], CPU, height=HEIGHT, width=WIDTH)
    prompts = prompt_files.load_prompts(edit_prompts)
    enc = common.PromptEncoder(pipe)
    x = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(1))
    same_text = [prompts[0], prompt_files.Prompt("k", prompts[0].text, prompts[1].image, prompts[1].size)]
    with torch.no_grad():
        v = common.velocity(pipe.transformer, x, 0.6, enc.cond(same_text, negative=False), 2.5)
        v_text = common.velocity(pipe.transformer, x, 0.6, enc.cond([prompts[0].text] * 2, negative=False), 2.5)
    assert v.shape == x.shape and not torch.allclose(v[0], v[1]) and not torch.allclose(v, v_text)


def test_each_image_is_encoded_once_alone_and_cached(kontext_dirs, edit_prompts, monkeypatch):
    pipe = models.load_pipeline(kontext_dirs["dev"], CPU, height=HEIGHT, width=WIDTH)
    prompts = prompt_files.load_prompts(edit_prompts)
    calls, real = [], flux_kontext.encode_image
    monkeypatch.setattr(flux_kontext.FAMILY, "encode_image", lambda p, px: calls.append(px.shape) or real(p, px))
    enc = common.PromptEncoder(pipe)
    first = enc.cond(prompts + prompts[:1], negative=False).image
    again = enc.cond(prompts[::-1], negative=False).image
    assert calls == [(1, 3, HEIGHT, WIDTH)] * 3  # one call per image file, one image a call
    torch.testing.assert_close(again, first[:3].flip(0), rtol=0, atol=0)
    # the VAE's own encoding of the file, as FluxKontextPipeline._encode_vae_image makes it
    pixels = pipe.image_processor.preprocess(prompt_files.load_image(prompts[2].image), HEIGHT, WIDTH)
    torch.testing.assert_close(first[2], pipe.pipe._encode_vae_image(pixels, None)[0], rtol=0, atol=0)
    with pytest.raises(common.UserError, match="mixes prompts with and without a reference image"):
        enc.cond([prompts[0], "a red circle"])


def test_a_wrongly_sized_image_is_refused_by_the_encoder_too(kontext_dirs, tmp_path):
    """A hub id is not read before loading: `PromptEncoder` compares the latents with the model's."""
    pipe = models.load_pipeline(kontext_dirs["dev"], CPU)  # 32 x 32
    write_scenes(tmp_path, size=(WIDTH, HEIGHT), count=1)
    prompts = prompt_files.load_prompts(write_prompt_file(tmp_path / "p.jsonl", [{"prompt": "a", "image": "scene0.png"}]))
    with pytest.raises(common.UserError, match=r"its image \(48 x 32 pixels\) encodes to latents \(4, 8, 12\), not the "):
        common.PromptEncoder(pipe).cond(prompts)


def test_an_image_prompt_is_refused_by_a_text_family(random_pipeline_dir, edit_prompts):
    enc = common.PromptEncoder(models.load_pipeline(random_pipeline_dir, CPU))
    with pytest.raises(common.UserError, match="StableDiffusion3Pipeline takes no reference image"):
        enc.cond(prompt_files.load_prompts(edit_prompts))


KONTEXT_BAD_INPUTS = [  # (flags, a piece of the one error line), on the tiny Kontext (32 x 32) with 48 x 32 images
    ("", "edit.jsonl: prompt 'make the circle red [scenes/scene0.png "),
    ("", "its image is 48 x 32 pixels, but the model samples 32 x 32: resize the image, or train at its size"),
    ("--resolution 48", "its image is 48 x 32 pixels, but the model samples 48 x 48"),
    ("--height 48 --width 32", "its image is 48 x 32 pixels, but the model samples 32 x 48"),  # width x height
    ("--height 32 --width 48 --guidance-scale 2 --negative-prompt blurry", "FLUX.1-Kontext's guidance is an embedding"),
]


@pytest.mark.parametrize("flags, expected", KONTEXT_BAD_INPUTS)
def test_kontext_bad_inputs_are_one_line_before_the_model_loads(
    flags, expected, kontext_dirs, edit_prompts, tmp_path, capsys, monkeypatch
):
    from test_bad_inputs import TINY, assert_one_line, call

    loaded = []
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: loaded.append(a))
    prompts = ["--train-prompts", str(edit_prompts), "--test-prompts", str(edit_prompts)]
    argv = [*TINY, "--model", kontext_dirs["dev"], "--reward", "jpeg_compressibility", *prompts]
    rc, err = call("nft", [*argv, "--output-dir", str(tmp_path / "runs"), *flags.split()], capsys)
    assert_one_line(rc, err, expected)
    assert not loaded and not (tmp_path / "runs").exists()


def test_a_text_prompt_file_and_a_linked_image_are_accepted(kontext_dirs, tmp_path):
    """FluxKontextPipeline takes image=None: a text-only prompt file is fine for Kontext. An image behind a symbolic
    link is read (a run only refuses links where it writes)."""
    import tyro
    from test_models import load_algo

    write_scenes(tmp_path / "elsewhere", size=(32, 32), count=1)
    (tmp_path / "linked.png").symlink_to(tmp_path / "elsewhere" / "scene0.png")
    edit = write_prompt_file(tmp_path / "edit.jsonl", [{"prompt": "make the circle red", "image": "linked.png"}])
    (tmp_path / "text.txt").write_text("a red circle\n")
    assert prompt_files.load_prompts(edit)[0].image == (tmp_path / "elsewhere" / "scene0.png").resolve()
    module = load_algo("nft")
    for train_prompts, test_prompts in ((edit, tmp_path / "text.txt"), (tmp_path / "text.txt", edit)):
        argv = ["--model", kontext_dirs["dev"], "--train-prompts", str(train_prompts), "--test-prompts", str(test_prompts)]
        run.check_args(tyro.cli(module.Args, args=[*argv, "--output-dir", str(tmp_path / "runs")]))


def card_images(run_dir: Path, prompt, noise, tmp_path, pipeline_module) -> torch.Tensor:
    """Execute the export's model card snippet as written (its image: `prompt`'s, its prompt: `prompt`'s text, the
    pipeline's noise: `noise`); returns the saved image in [0, 255]."""
    card = re.search(r"```python\n(.*?)```", (run_dir / "lora" / "README.md").read_text(), re.S).group(1)
    assert 'load_image("image.png")' in card and "_auto_resize=False" in card and f"max_area={HEIGHT * WIDTH}" in card
    code = card.replace("<this folder>", str(run_dir / "lora")).replace('["a red circle"]', repr([prompt.text]))
    (tmp_path / "image.png").write_bytes(prompt.image.read_bytes())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline_module, "randn_tensor", lambda shape, **_: noise.reshape(shape))
        mp.chdir(tmp_path)
        exec(code, {})
    return torch.from_numpy(np.array(Image.open(tmp_path / "sample.png"))).permute(2, 0, 1).float()


def train(algo: str, model: str, prompts: Path, tmp_path: Path, *flags: str):
    """`algo` in-process (as `python algos/<algo>.py`) on a tiny Kontext with image prompts, with test_algos' flags
    for it (its reference models, EMAs, offloaded text encoders...); returns (run folder, the trained Model)."""
    import tyro
    from test_algos import FLAGS
    from test_models import load_algo

    module = load_algo(algo)
    argv = [
        *f"--model {model} --height {HEIGHT} --width {WIDTH} --guidance-scale 2.5 --reward jpeg_compressibility".split(),
        *"--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --num-epochs 1 --no-full-finetune".split(),
        *["--train-prompts", str(prompts), "--test-prompts", str(prompts), "--output-dir", str(tmp_path / "runs")],
        *FLAGS[algo].split(),
        *flags,
    ]
    args = tyro.cli(module.Args, args=argv)
    pipes, real_export = [], export.export_lora

    def recording_export(out_dir, pipe, *a, **k):
        pipes.append(pipe)
        return real_export(out_dir, pipe, *a, **k)

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "export_lora", recording_export)
        try:
            run.run_main(module.main, args, argv=argv)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir, pipes[-1]


def assert_finite_logs(logged: dict):
    """Losses, the rollout reward and the eval reward were logged, every value finite (not a correlation: CRD's
    implicit-reward correlation is NaN in the first epoch, whose policy is still its snapshot)."""
    losses = [tag for tag in logged if tag.startswith("losses/") and not tag.endswith("_corr")]
    tags = [*losses, "charts/reward_mean", "eval/jpeg_compressibility"]
    assert losses and all(logged[tag] and all(math.isfinite(v) for v in logged[tag]) for tag in tags), logged


@pytest.mark.slow
def test_crd_trains_on_image_prompts_and_the_export_reproduces_it_in_the_stock_pipeline(kontext_dirs, edit_prompts, tmp_path):
    """CRD end to end on image prompts: finite losses and rewards logged, a trained LoRA; the exported LoRA loaded
    into a fresh FluxKontextPipeline, called as the card says, gives our sampler's images with the trained weights."""
    from diffusers import FluxKontextPipeline

    run_dir, trained = train("crd", kontext_dirs["dev"], edit_prompts, tmp_path, "--num-epochs", "2")
    assert_finite_logs(scalars(run_dir))
    prompt = prompt_files.load_prompts(edit_prompts)[1]
    noise = torch.randn(1, *trained.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = common.PromptEncoder(trained).cond([prompt], negative=False)
    out = common.sample(trained.transformer, trained.scheduler, cond, num_steps=4, guidance_scale=2.5, noise=noise)
    ours = common.decode(trained, out.latents)
    stock = FluxKontextPipeline.from_pretrained(kontext_dirs["dev"])
    stock.set_progress_bar_config(disable=True)
    holder = type("Holder", (), {"pipe": stock})()
    length = trained.family.max_sequence_length(trained.pipe, None)
    without = (stock_images(holder, prompt, noise[0], 4, 2.5, length) - ours).abs().max().item()
    stock.load_lora_weights(str(run_dir / "lora"))
    diff = (stock_images(holder, prompt, noise[0], 4, 2.5, length) - ours).abs().max().item()
    print(f"exported LoRA in FluxKontextPipeline: max abs difference {diff:.2e} (without it {without:.2e})")
    assert diff <= 1e-5 + 1e-5 < without  # the family's tolerance and the LoRA's (test_models.LORA_TOL)
    card = card_images(run_dir, prompt, noise, tmp_path, sys.modules[FluxKontextPipeline.__module__])
    assert ((ours[0] * 255).round() - card).abs().max().item() <= 1  # both rounded to 8 bits


@pytest.mark.slow
def test_a_resumed_run_on_image_prompts_ends_bit_identical(kontext_dirs, edit_prompts, tmp_path):
    """2 epochs, against 1 epoch and `--resume` for one more: the resumed run starts with an empty cache and encodes
    each image again, alone, into the same latents (CPU)."""
    from test_algos import assert_same_state

    a_dir, _ = train("crd", kontext_dirs["dev"], edit_prompts, tmp_path / "a", "--num-epochs", "2")
    b_dir, _ = train("crd", kontext_dirs["dev"], edit_prompts, tmp_path / "b", "--num-epochs", "1")
    run_script(["algos/crd.py", "--resume", b_dir, "--num-epochs", "2"])
    assert_same_state(load_checkpoint(a_dir), load_checkpoint(b_dir), "crd")


ALGOS = ["awm", "dgpo", "dpo", "elbo_grpo", "grpo", "nft"]  # crd: above


@pytest.mark.parametrize("algo", ALGOS)  # ~1 s each on the tiny Kontext: in the fast suite
def test_every_algorithm_trains_on_image_prompts(algo, kontext_dirs, edit_prompts, tmp_path):
    run_dir, _ = train(algo, kontext_dirs["dev"], edit_prompts, tmp_path)
    assert_finite_logs(scalars(run_dir))
