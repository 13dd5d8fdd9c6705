"""Each model family (models/) against its diffusers pipeline, on tiny random pipelines built offline (tiny_families):
our ODE sampler with the family adapter equals `Pipeline.__call__` with the same initial noise and sigmas (CFG on
where the family has it); NFT and GRPO train a LoRA on it; the exported LoRA loads into the stock pipeline."""

import importlib.util
import re
import signal
import types
from pathlib import Path

import numpy as np
import pytest
import tiny_families
import torch
from safetensors.torch import load_file

import common
import models
from harness import export, run
from models import flux

FRAMES = 5  # videos of 5 frames (3 latent frames with Wan's and LTX's tiny VAEs, temporal ratio 2; 2 with HunyuanVideo's, 4)

PROMPTS = ["a red circle", "two blue squares", "a square"]
CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, random_pipeline_dir, flux_pipeline_dirs):
    """Each family's tiny pipeline, built and saved once per test session (the build is lazy: per family asked); SD3's
    and FLUX.1's are conftest's."""
    root, built = tmp_path_factory.mktemp("families"), {"sd3": random_pipeline_dir, "flux_dev": flux_pipeline_dirs["dev"]}

    def get(name):
        if name not in built:
            built[name] = getattr(tiny_families, name)(root / name)
        return built[name]

    return get


# peft's LoRA layer (ours, fp32 master weights) against diffusers' loaded one: the same weights, summed in another order
LORA_TOL = 1e-5
# family -> (builder, pixels, max abs tolerance on images in [0, 1]); the pipeline is called as the exported model card
# says (`export.card_call`: each family's guidance keyword, scheduler and grid)
FAMILIES = {
    # one batched 2B call, as the pipeline; the pipeline's default grid is not ours: the card passes our sigmas: measured 0.0
    "sd3": ("sd3", 64, 1e-5),
    # one call with the guidance embedding, as the pipeline (no negative prompt): measured 0.0
    "flux_dev": ("flux_dev", 32, 1e-5),
    # the same transformer calls in the same order (two CFG passes, as the pipeline), the same BatchNorm un-normalisation:
    # measured 0.0 here; 1e-5 leaves room for other BLAS kernels
    "flux2_klein": ("flux2_klein", 32, 1e-5),
    # one call with the guidance embedding, as the pipeline (no negative prompt): measured 0.0
    "flux2_dev": ("flux2_dev", 32, 1e-5),
    # the same calls in the same order, the CFG renormalisation included (the pipeline's true_cfg_scale); our prompts are
    # encoded alone (history-independent embeddings) where the pipeline encodes the batch at once, which moves the text
    # encoder's output ~1e-7: measured 2.4e-7
    "qwen_image": ("qwen_image", 32, 1e-5),
    # the same batched 2B call and the pipeline's own CFG expression (its guidance_scale is ours - 1); prompts encoded alone
    # as for Qwen-Image: measured 6.3e-7
    "z_image": ("z_image", 32, 1e-5),
    # one batched 2B call, as the pipeline; the negative prompt without the instruction, as the pipeline: measured 0.0
    "sana": ("sana", 32, 1e-5),
    # the same two calls and the pipeline's CFG renormalisation; the negative prompt without the system prompt: measured 0.0
    "lumina2": ("lumina2", 64, 1e-5),
    # the same two calls; the pipeline is given our (unshifted) grid as its integer timesteps (4 steps: 1000, 750, 500,
    # 250); the prompts (13, 17 and 9 tokens) padded to the batch's longest rounded up to 16 (32), the negative prompt to
    # its own 16, as the pipeline; the shift inverted in float32 gives back these times exactly: measured 0.0
    "cogview4": ("cogview4", 64, 1e-5),
    # the same two CFG passes; WanPipeline takes no sigmas (the card's scheduler sets our grid) and returns video
    # [B, F, 3, H, W]; prompts encoded alone as for Qwen-Image: measured 7.2e-7
    "wan": ("wan", 32, 1e-5),
    # the same two passes (conditional first) with the pipeline's float text mask and its first visible padding token;
    # FLUX.1's packing and ids
    "chroma": ("chroma", 32, 1e-5),
    # one batched 2B call, as the pipeline; zeroed padding tokens, no mask; the card passes our grid as SD3's does
    "auraflow": ("auraflow", 32, 1e-5),
    # one batched 2B call with the text masks, as the pipeline, which sets the same grid itself; fp32 latents as ours;
    # decoded at its default decode timestep 0
    "ltx": ("ltx", 32, 1e-5),
    # one call with the guidance embedding (x 1000), as the pipeline, which passes our grid itself (no negative prompt)
    "hunyuan_video": ("hunyuan_video", 32, 1e-5),
}
# the settings each family is compared in; the prompts (8 to 16 characters) always differ in length
SETTINGS = {
    "cfg": dict(guidance_scale=4.0),
    "no_cfg": dict(guidance_scale=1.0),
    "negative_prompt": dict(guidance_scale=4.0, negative_prompt="blurry, low quality"),
    "non_square": dict(guidance_scale=4.0, wide=True),  # width = 2 x height
}
NO_NEGATIVE = {
    "flux_dev",
    "flux2_dev",
    "hunyuan_video",
}  # guidance embedding, one pass: a negative prompt is refused (FAMILY_BAD_INPUTS)
CASES = [(f, s) for f in sorted(FAMILIES) for s in SETTINGS if not (s == "negative_prompt" and f in NO_NEGATIVE)]


def pipeline_latents(pipe, noise):
    """Our initial noise in the layout the pipeline's `latents` argument takes (FLUX.1, Qwen-Image: 2x2 tokens)."""
    if pipe.family.name == "ltx":
        return models.ltx.pack_latents(noise, 1, 1)
    return flux.pack_latents(noise) if pipe.family.name in ("flux", "qwenimage", "chroma") else noise


def load(family, family_dirs, setting="cfg"):
    builder, pixels, _ = FAMILIES[family]
    wide = SETTINGS[setting].get("wide")
    return models.load_pipeline(
        family_dirs(builder), CPU, resolution=pixels, width=2 * pixels if wide else None, num_frames=frames(family)
    )


def card_settings(pipe, steps, guidance_scale, negative_prompt, max_sequence_length):
    """`export.card_call`'s settings for the size `pipe` was loaded at."""
    size = common.decode(pipe, torch.zeros(1, *pipe.latent_shape)).shape[-2:]  # pixels, whatever the latent layout
    return dict(
        num_steps=steps,
        guidance_scale=guidance_scale,
        negative_prompt=negative_prompt,
        max_sequence_length=max_sequence_length,
        height=size[0],
        width=size[1],
        num_frames=pipe.family.num_frames and FRAMES,
    )


def compare_with_pipeline(pipe, stock, family, setting="cfg", steps: int = 4) -> float:
    """Max abs difference between our ODE sampler's images and `stock.__call__`'s, called as the model card says
    (`export.card_call`), with the same noise."""
    guidance, negative = SETTINGS[setting]["guidance_scale"], SETTINGS[setting].get("negative_prompt", "")
    noise = torch.randn(len(PROMPTS), *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    enc = common.PromptEncoder(pipe, negative_prompt=negative)
    out = common.sample(
        pipe.transformer,
        pipe.scheduler,
        enc.cond(PROMPTS, guidance > 1),
        num_steps=steps,
        guidance_scale=guidance,
        noise=noise,
    )
    ours = common.decode(pipe, out.latents)
    setup, call, output = export.card_call(pipe, card_settings(pipe, steps, guidance, negative, enc.max_sequence_length))
    scope = {"pipe": stock, "np": np, "torch": torch, "prompt": list(PROMPTS)}  # ZImagePipeline rewrites its lists: copies
    exec("\n".join(setup), scope)
    kwargs = {**{k: eval(v, scope) for k, v in call.items()}, "output_type": "pt"}  # the card's (LTX: "np") replaced
    ref = getattr(stock(prompt=scope["prompt"], latents=pipeline_latents(pipe, noise.clone()), **kwargs), output)
    torch.testing.assert_close(out.sigmas, stock.scheduler.sigmas.float(), atol=1e-6, rtol=0)  # the schedule the pipeline set
    assert ours.shape == ref.shape
    assert (ours - ref.flip(0)).abs().max().item() > 1e-3  # the comparison can fail: other prompts give other images
    return (ours - ref).abs().max().item()


@pytest.mark.parametrize("family, setting", CASES)
def test_ode_sampler_matches_the_pipeline(family, setting, family_dirs):
    pipe = load(family, family_dirs, setting)
    diff = compare_with_pipeline(pipe, pipe.pipe, family, setting)
    print(f"{family} {setting}: max abs difference {diff:.2e}")
    assert diff <= FAMILIES[family][2]


def frames(family):
    return FRAMES if family in ("wan", "ltx", "hunyuan_video") else None


def load_algo(name: str):
    spec = importlib.util.spec_from_file_location(f"cleanflow_{name}", common.REPO / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(algo: str, family: str, family_dirs, tmp_path, **overrides):
    """One epoch of `algo` on the family's tiny pipeline, in-process; returns (run folder, the trained pipeline, the
    run's Args). `overrides`: other Args fields (another folder of the family, more epochs, a resume)."""
    builder, pixels, _ = FAMILIES[family]
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS))
    module = load_algo(algo)
    per_algo = {"nft": dict(num_train_timesteps=1), "grpo": dict(grad_steps_per_epoch=1, num_sde_steps=1)}[algo]
    fields = dict(
        model=family_dirs(builder),
        resolution=pixels,
        num_frames=frames(family),
        guidance_scale=4.0,
        negative_prompt="" if family in NO_NEGATIVE else "blurry, low quality",
        reward="jpeg_compressibility",
        num_prompts=2,
        group_size=4,
        micro_batch=4,
        num_steps=4,  # CogView4's pipeline takes integer timesteps: 1000 / 4
        num_epochs=1,
        train_prompts=str(tmp_path / "prompts.txt"),
        test_prompts=str(tmp_path / "prompts.txt"),
        output_dir=str(tmp_path / "runs"),
        full_finetune=False,  # the tiny families stand in for the real ones, which train a LoRA by default
    )
    args = module.Args(**{**fields, **per_algo, **overrides})
    pipes, real_export = [], export.export_lora

    def recording_export(out_dir, pipe, *a, **k):
        pipes.append(pipe)
        return real_export(out_dir, pipe, *a, **k)

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # the run installs its own
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "export_lora", recording_export)
        try:
            run.run_main(module.main, args)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
    (run_dir,) = (tmp_path / "runs").iterdir() if args.resume is None else [Path(args.resume)]
    return run_dir, pipes[-1], args


@pytest.mark.parametrize("algo", ["nft", "grpo"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_changes_the_lora(family, algo, family_dirs, tmp_path):
    run_dir, trained, args = train(algo, family, family_dirs, tmp_path)
    weights = load_file(run_dir / "checkpoints" / "last" / "weights.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)  # B starts at 0: any non-zero entry is a trained update
    # the scripts' default (None) attaches to the family's own list: every name adapts a module, and only those do
    adapted = {k.split(".lora_B")[0] for k in weights if "lora_B" in k}
    assert args.lora_targets is None
    for t in trained.family.lora_targets:
        assert any(m.endswith("." + t) for m in adapted), (family, t)
    assert all(any(m.endswith("." + t) for t in trained.family.lora_targets) for m in adapted)
    if algo == "nft" and hasattr(trained.pipe, "load_lora_weights"):  # the export loads into the stock pipeline
        path = family_dirs(FAMILIES[family][0])
        stock = type(trained.pipe).from_pretrained(path, **trained.family.load_kwargs(Path(path)))
        stock.set_progress_bar_config(disable=True)
        without = compare_with_pipeline(trained, stock, family)  # the trained LoRA against the base model
        stock.load_lora_weights(str(run_dir / "lora"))
        diff = compare_with_pipeline(trained, stock, family)
        print(f"{family}: exported LoRA in the stock pipeline, max abs difference {diff:.2e} (without it {without:.2e})")
        assert diff <= FAMILIES[family][2] + LORA_TOL < without
        card = run_card(run_dir, trained, args, tmp_path)
        print(f"{family}: the model card's snippet, max abs difference {card:.2e}")


def run_card(run_dir, trained, args, tmp_path) -> float:
    """Execute the exported model card's snippet as written (its one prompt swapped for PROMPTS, the pipeline's noise
    for ours) and return its images' max abs difference from our sampler's with the run's settings."""
    import re
    import sys

    import diffusers.utils

    card = re.search(r"```python\n(.*?)```", (run_dir / "lora" / "README.md").read_text(), re.S).group(1)
    assert card.count('prompt = ["a red circle"]') == 1 and "<this folder>" in card
    code = card.replace("<this folder>", str(run_dir / "lora")).replace('prompt = ["a red circle"]', f"prompt = {PROMPTS!r}")
    noise = torch.randn(len(PROMPTS), *trained.latent_shape, generator=torch.Generator().manual_seed(0))
    enc = common.PromptEncoder(trained, negative_prompt=args.negative_prompt)
    cond = enc.cond(PROMPTS)
    out = common.sample(
        trained.transformer, trained.scheduler, cond, num_steps=args.num_steps, guidance_scale=4.0, noise=noise
    )
    ours = common.decode(trained, out.latents)
    scope, saved = {}, []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules[type(trained.pipe).__module__], "randn_tensor", lambda shape, **_: noise.reshape(shape))
        # no video writer (imageio, opencv) is installed here: record the frames it is given
        mp.setattr(diffusers.utils, "export_to_video", lambda frames, path, fps: saved.append((frames, path)))
        mp.chdir(tmp_path)
        exec(code, scope)
    if "videos" in scope:  # WanPipeline's default output: float frames [B, F, H, W, 3]
        assert saved and np.array_equal(saved[0][0], scope["videos"][0]) and saved[0][1] == "sample.mp4"
        diff = (ours - torch.from_numpy(scope["videos"]).permute(0, 1, 4, 2, 3)).abs().max().item()
        assert diff <= FAMILIES["wan"][2] + LORA_TOL
        return diff
    assert (tmp_path / "sample.png").is_file()
    ref = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1) for im in scope["images"]]).float()
    diff = ((ours * 255).round() - ref).abs().max().item()
    assert diff <= 1  # both rounded to 8 bits: equal up to a value that lands on the other side of a rounding boundary
    return diff


def test_sd3_lora_targets_skip_the_second_self_attention_of_sd35_medium():
    """SD3.5-M's block layout (24 joint blocks, dual attention in blocks 0-12, the last block context_pre_only) at tiny
    width. Counted by hand: each block's `attn` has to_q/k/v, to_out.0 and add_q/k/v_proj, and to_add_out in all but the
    last block: 24 x 7 + 23 = 191 modules, as flow_grpo's `attn.*` targets; bare names would add the 13 `attn2` x 4."""
    from diffusers import SD3Transformer2DModel

    def build():
        torch.manual_seed(0)
        return SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=24,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=16,
            pos_embed_max_size=8,
            dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm",
        )

    def adapted(t):
        return {n.rsplit(".lora_A", 1)[0] for n, _ in t.named_parameters() if ".lora_A" in n}

    t = build()
    params = models.add_lora(t, 4, 8.0, None)  # the scripts' default: the family's list
    ours = adapted(t)
    assert len(ours) == 24 * 7 + 23 and len(params) == 2 * len(ours)
    assert not any(".attn2." in m for m in ours)
    assert sum(p.numel() for p in params) == len(ours) * 4 * (16 + 16)  # every projection here is 16 -> 16
    bare = build()
    models.add_lora(bare, 4, 8.0, [t.split("attn.", 1)[1] for t in models.sd3.FAMILY.lora_targets])
    assert len(adapted(bare)) == len(ours) + 13 * 4 and adapted(bare) - ours == {
        f"transformer_blocks.{b}.attn2.{p}" for b in range(13) for p in ("to_q", "to_k", "to_v", "to_out.0")
    }


def test_per_frame_video_reward_is_the_mean_over_frames():
    """rewards.video.per_frame against a loop over frames with each frame's own prompt."""
    from rewards import jpeg
    from rewards.video import per_frame

    fn = jpeg.jpeg_compressibility(CPU)
    videos = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    videos[1, 2] = 0.5  # a flat frame compresses far better: the mean must move
    got = per_frame(fn)(videos, ["a", "b"])
    expected = torch.stack(
        [torch.stack([fn(videos[i, f : f + 1], [p])[0] for f in range(3)]).mean() for i, p in enumerate("ab")]
    )
    torch.testing.assert_close(got, expected.float())
    assert got.shape == (2,)


@pytest.mark.parametrize(
    "hub_id,expected",
    [
        ("black-forest-labs/FLUX.2-klein-4B", "Flux2KleinPipeline"),
        ("black-forest-labs/FLUX.2-dev", "Flux2Pipeline"),
        ("black-forest-labs/FLUX.1-dev", "FluxPipeline"),
        ("black-forest-labs/FLUX.1-Kontext-dev", "FluxKontextPipeline"),
        ("Qwen/Qwen-Image-2512", "QwenImagePipeline"),
        ("Qwen/Qwen-Image-Edit", "QwenImageEditPipeline"),
        ("Tongyi-MAI/Z-Image-Turbo", "ZImagePipeline"),
        ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "WanPipeline"),
        ("stabilityai/stable-diffusion-3.5-medium", "StableDiffusion3Pipeline"),
        ("Efficient-Large-Model/Sana_1600M_1024px_diffusers", "SanaPipeline"),
        ("Alpha-VLLM/Lumina-Image-2.0", "Lumina2Pipeline"),
        ("THUDM/CogView4-6B", "CogView4Pipeline"),
        ("lodestones/Chroma1-HD", "ChromaPipeline"),
        ("fal/AuraFlow-v0.3", "AuraFlowPipeline"),
        ("Lightricks/LTX-Video", "LTXPipeline"),
        ("hunyuanvideo-community/HunyuanVideo", "HunyuanVideoPipeline"),
    ],
)
def test_hub_ids_without_a_folder_map_to_their_family(hub_id, expected):
    import diffusers

    assert models.pipeline_class(hub_id) == expected and expected in common.FAMILIES
    family = common.FAMILIES[expected]
    assert hasattr(diffusers, expected) and hasattr(diffusers, family.transformer)  # names diffusers really has
    with pytest.raises(common.UserError, match="cannot tell its family"):
        models.pipeline_class("someone/unknown-model")


def test_euler_scheduler_replaces_a_multistep_solver_at_its_flow_shift():
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    unipc = UniPCMultistepScheduler(flow_shift=5.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    euler = common.euler_scheduler(types.SimpleNamespace(scheduler=unipc))
    s = np.linspace(1.0, 0.25, 4)
    expected = np.append(5 * s / (1 + 4 * s), 0.0)  # the static shift sigma' = k s / (1 + (k - 1) s)
    np.testing.assert_allclose(common.sigma_schedule(euler, 4).numpy(), expected, atol=1e-6)
    own = FlowMatchEulerDiscreteScheduler(shift=3.0)
    assert common.euler_scheduler(types.SimpleNamespace(scheduler=own)) is own


def test_cogview4_time_is_the_unshifted_sigma():
    """The scheduler shifts sigma linearly with mu (sigma' = mu / (mu + 1/sigma - 1)); the transformer gets 1000 sigma."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from models import cogview4

    sched = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="linear", base_shift=0.25, max_shift=0.75
    )
    mu = cogview4.mu(sched.config, 1024, 10)
    assert mu == pytest.approx(0.75 * 2 + 0.25)  # 1024 tokens = 4 x 256
    sigmas = common.sigma_schedule(sched, 10, mu=mu)[:-1].double()
    unshifted = 1 / (1 + mu * (1 / sigmas - 1))
    torch.testing.assert_close(unshifted, torch.linspace(1, 0.1, 10, dtype=torch.float64), atol=1e-6, rtol=0)


def test_sana_negative_prompt_is_encoded_without_the_instruction_and_cached(family_dirs):
    """SanaPipeline encodes the negative prompt without its complex human instruction; so does `negative`, cached
    apart from the same text used as a prompt (precompute fills both, e.g. before the encoders are offloaded)."""
    pipe = models.load_pipeline(family_dirs("sana"), CPU, resolution=32)
    enc = common.PromptEncoder(pipe, max_sequence_length=16)
    enc.precompute(["a square"])
    assert ("negative", "") in enc.cache and "" in enc.cache
    neg, mask = enc.negative(2)
    _, _, ref, ref_mask = pipe.encode_prompt(
        ["a square"] * 2,
        do_classifier_free_guidance=True,
        negative_prompt="",
        max_sequence_length=16,
        complex_human_instruction=models.sana.instruction(pipe.pipe),
    )
    # we encode "" once (a batch of 1) and the pipeline twice (a batch of 2): a CPU kernel may round the two batch
    # sizes apart in the last bits (bit-identical here, not on every CPU); the mask is integers and exact
    torch.testing.assert_close(neg, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mask, ref_mask, rtol=0, atol=0)
    as_prompt = enc([""])[0][0]  # as a prompt "" gets the instruction: other embeddings of the same shape
    assert as_prompt.shape == neg[0].shape and (as_prompt - neg[0]).abs().max() > 1e-3


@pytest.mark.parametrize("max_sequence_length", [None, 10])
def test_cogview4_text_is_padded_as_the_pipeline_pads_its_batch(family_dirs, max_sequence_length):
    """CogView4Pipeline pads a batch to its longest prompt (cut at max_sequence_length) rounded up to 16 and GLM sees
    that padding: PromptEncoder gives each prompt the embedding it has in the pipeline's batch, and the negative prompt
    the one of [""] * B."""
    pipe = models.load_pipeline(family_dirs("cogview4"), CPU, resolution=64)
    enc = common.PromptEncoder(pipe, max_sequence_length=max_sequence_length)
    cond = enc.cond(PROMPTS)
    ref, ref_neg = pipe.encode_prompt(
        list(PROMPTS), negative_prompt="", max_sequence_length=enc.max_sequence_length, device=CPU
    )
    assert cond.embeds.shape[1] == (32 if max_sequence_length is None else 16)  # 17 tokens -> 32; cut at 10 -> 16
    torch.testing.assert_close(cond.embeds, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(cond.neg_embeds, ref_neg, rtol=0, atol=1e-6)
    alone = enc(["a square"])[0]  # 9 tokens alone: padded to 16, another embedding than in the batch above
    torch.testing.assert_close(
        alone, pipe.encode_prompt(["a square"], do_classifier_free_guidance=False)[0], rtol=0, atol=1e-6
    )
    if max_sequence_length is None:
        assert alone.shape[1] == 16 and (alone[0, -9:] - cond.embeds[2, -9:]).abs().max() > 1e-4


@pytest.fixture(scope="session")
def distilled_klein(family_dirs, tmp_path_factory):
    """The tiny klein marked `is_distilled`, as the released FLUX.2-klein-4B/-9B are."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("klein") / "distilled"
    shutil.copytree(family_dirs("flux2_klein"), path)
    index = json.loads((path / "model_index.json").read_text())
    (path / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    return str(path)


FAMILY_BAD_INPUTS = [  # (tiny pipeline, flags, a piece of the one error line)
    ("distilled_klein", "--guidance-scale 4", "is a distilled FLUX.2-klein, which samples without CFG"),
    ("distilled_klein", "--eval-guidance-scale 2", "--eval-guidance-scale 2.0: "),
    ("flux2_dev", "--guidance-scale 4 --negative-prompt blurry", "FLUX.2-dev's guidance is an embedding"),
    ("wan", "--num-frames 4", "--num-frames 4 must be 2 k + 1"),
    ("cogview4", "--num-frames 5", "CogView4Pipeline makes images, not videos"),
    ("lumina2", "--height 64 --width 60", "width 60 must be a multiple of 16"),
    ("wan", "--max-sequence-length 100", "--max-sequence-length 100: this model's tokenizer takes at most 32 tokens"),
    ("chroma", "--gradient-checkpointing", "drops the text mask in its checkpointed single-stream blocks"),
    ("chroma", "--resolution 34", "resolution 34 must be a multiple of 4"),  # VAE factor 2 x FLUX.1's 2x2 packing
    ("auraflow", "--width 96", "(16 patches per side, at most 64 pixels)"),  # its table: 256 patches, a 16 x 16 grid
    ("ltx", "--num-frames 4", "--num-frames 4 must be 2 k + 1 (the VAE's temporal ratio 2)"),
    ("ltx", "--height 31", "height 31 must be a multiple of 2"),
    ("hunyuan_video", "--guidance-scale 4 --negative-prompt blurry", "HunyuanVideo's guidance is an embedding"),
    ("hunyuan_video", "--num-frames 7", "--num-frames 7 must be 4 k + 1 (the VAE's temporal ratio 4)"),
    ("hunyuan_video", "--width 36", "width 36 must be a multiple of 8"),  # spatial ratio 4 x patch 2
    ("wan", "--guidance-scale 4 --guidance-scale-2 2", "--guidance-scale-2 2.0: only Wan2.2-A14B has a second"),
    ("sd3", "--guidance-scale 4 --guidance-scale-2 2", "--guidance-scale-2 2.0: only Wan2.2-A14B has a second"),
    ("a14b", "--guidance-scale-2 2", "--guidance-scale-2 is used by CFG only: pass --guidance-scale > 1"),
    ("a14b", "--full-finetune", "--full-finetune of Wan2.2-A14B's two experts is not supported"),
    ("a14b", "--fsdp", "--fsdp of Wan2.2-A14B's two experts is not supported"),
    ("a14b_without_expert", "", "boundary_ratio 0.875 needs a second expert transformer_2 (WanTransformer3DModel)"),
]


@pytest.mark.parametrize("model, flags, expected", FAMILY_BAD_INPUTS)
def test_family_flags_are_refused_in_one_line_before_anything_is_written(
    model, flags, expected, family_dirs, distilled_klein, wan22_dirs, tmp_path, capsys
):
    from test_bad_inputs import TINY, assert_one_line, call

    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS))
    path = {"distilled_klein": distilled_klein, **wan22_dirs}.get(model) or family_dirs(model)
    prompts = ["--train-prompts", str(tmp_path / "prompts.txt"), "--test-prompts", str(tmp_path / "prompts.txt")]
    argv = [*TINY, "--model", path, "--reward", "jpeg_compressibility", *prompts, "--output-dir", str(tmp_path / "runs")]
    rc, err = call("nft", argv + flags.split(), capsys)
    assert_one_line(rc, err, expected)
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="session")
def wan22_dirs(family_dirs, tmp_path_factory):
    """The tiny Wan made into Wan2.2-A14B (a second expert, other random weights, below boundary_ratio 0.875) and marked
    as Wan2.2-TI2V (per-token timesteps), as their released model_index.json say; an A14B index without its expert."""
    import json
    import shutil

    from diffusers import WanTransformer3DModel

    dirs = {}
    for name, extra in (
        ("a14b", {"boundary_ratio": 0.875, "transformer_2": ["diffusers", "WanTransformer3DModel"]}),
        ("ti2v", {"expand_timesteps": True}),
        ("a14b_without_expert", {"boundary_ratio": 0.875}),  # WanPipeline would fail at the first low-noise step
    ):
        path = tmp_path_factory.mktemp("wan22") / name
        shutil.copytree(family_dirs("wan"), path)
        if "transformer_2" in extra:  # the same config, its own weights: each expert's samples differ from the other's
            torch.manual_seed(2)
            WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(path / "transformer")).save_pretrained(
                path / "transformer_2"
            )
        index = json.loads((path / "model_index.json").read_text())
        (path / "model_index.json").write_text(json.dumps({**index, **extra}))
        dirs[name] = str(path)
    return dirs


@pytest.mark.parametrize("setting", ["cfg", "no_cfg", "non_square"])
def test_wan22_ti2v_sampler_matches_the_pipeline(setting, wan22_dirs):
    """WanPipeline with expand_timesteps gives every token the step's timestep; one per sample, as we pass it, is the
    same computation: equal (measured 1e-6)."""
    from diffusers import WanPipeline

    assert WanPipeline.from_pretrained(wan22_dirs["ti2v"]).config.expand_timesteps  # the stock pipeline's TI2V path
    pixels = FAMILIES["wan"][1]
    wide = 2 * pixels if setting == "non_square" else None
    pipe = models.load_pipeline(wan22_dirs["ti2v"], CPU, resolution=pixels, width=wide, num_frames=FRAMES)
    diff = compare_with_pipeline(pipe, pipe.pipe, "wan", setting)
    print(f"Wan2.2-TI2V {setting}: max abs difference {diff:.2e}")
    assert diff <= FAMILIES["wan"][2]


def test_wan22_ti2v_lora_loads_in_the_pipeline_and_the_card_runs(wan22_dirs, family_dirs, tmp_path):
    run_dir, trained, args = train("nft", "wan", family_dirs, tmp_path, model=wan22_dirs["ti2v"])
    stock = type(trained.pipe).from_pretrained(wan22_dirs["ti2v"])
    stock.set_progress_bar_config(disable=True)
    without = compare_with_pipeline(trained, stock, "wan")
    stock.load_lora_weights(str(run_dir / "lora"))
    diff = compare_with_pipeline(trained, stock, "wan")
    print(f"Wan2.2-TI2V: exported LoRA in the stock pipeline {diff:.2e} (without it {without:.2e})")
    assert diff <= FAMILIES["wan"][2] + LORA_TOL < without
    print(f"Wan2.2-TI2V: the model card's snippet, max abs difference {run_card(run_dir, trained, args, tmp_path):.2e}")


@pytest.mark.parametrize(
    "hub_id, guidance_scale_2, expected",
    [
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", 3.0, None),
        ("Wan-AI/Wan2.1-T2V-14B-Diffusers", 3.0, "only Wan2.2-A14B has a second (low-noise) expert"),
        ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", None, "image-to-video checkpoints (WanImageToVideoPipeline)"),
        ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", None, None),
    ],
)
def test_wan_hub_ids_are_checked_by_name_before_download(hub_id, guidance_scale_2, expected):
    args = types.SimpleNamespace(model=hub_id, guidance_scale_2=guidance_scale_2, num_frames=None)
    assert models.pipeline_class(hub_id) == "WanPipeline"
    if expected is None:
        models.wan.check({"_class_name": "WanPipeline"}, args)
    else:
        with pytest.raises(common.UserError, match=re.escape(expected)):
            models.wan.check({"_class_name": "WanPipeline"}, args)


def load_a14b(wan22_dirs, guidance_scale_2=None):
    return models.load_pipeline(
        wan22_dirs["a14b"], CPU, resolution=FAMILIES["wan"][1], num_frames=FRAMES, guidance_scale_2=guidance_scale_2
    )


# (CFG scale, the low-noise expert's, steps): at 4 steps the timesteps are 1000, 900 | 750, 500 (shift 3), at 3 steps
# 1000 | 857, 600: the boundary 875 falls between two steps, after the second or after the first
A14B_CASES = {"cfg": (4.0, None, 4), "no_cfg": (1.0, None, 4), "guidance_scale_2": (4.0, 2.0, 4), "3_steps": (4.0, 2.0, 3)}


@pytest.mark.parametrize("case", sorted(A14B_CASES))
def test_wan22_a14b_sampler_matches_the_pipeline(case, wan22_dirs):
    """Both experts, switched at boundary_ratio x 1000 with the second guidance scale on the low-noise one, equal
    WanPipeline.__call__ called as the card says; the high-noise expert alone, or one guidance scale, does not."""
    guidance, guidance_2, steps = A14B_CASES[case]
    pipe = load_a14b(wan22_dirs, guidance_2)
    assert isinstance(pipe.transformer, models.wan.Experts) and pipe.transformer.boundary == 875.0
    setting = "cfg" if guidance > 1 else "no_cfg"
    diff = compare_with_pipeline(pipe, pipe.pipe, "wan", setting, steps)
    print(f"Wan2.2-A14B {case}: max abs difference {diff:.2e}")
    assert diff <= FAMILIES["wan"][2]
    noise = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = common.PromptEncoder(pipe).cond(PROMPTS[:2], guidance > 1)

    def sample(transformer):
        return common.sample(transformer, pipe.scheduler, cond, num_steps=steps, guidance_scale=guidance, noise=noise).latents

    both = sample(pipe.transformer)
    assert (both - sample(pipe.pipe.transformer)).abs().max() > 1e-3  # the low-noise expert was used
    if guidance_2 is not None:
        pipe.transformer.guidance_scale_2 = None
        assert (both - sample(pipe.transformer)).abs().max() > 1e-3  # and guided at its own scale


def test_wan22_a14b_rows_on_both_sides_of_the_boundary_take_their_own_expert(wan22_dirs):
    """Training asks for per-sample times: a batch with rows on both sides of the boundary gives each row what its
    expert (and its CFG scale) gives that row alone, gradients included."""
    pipe = load_a14b(wan22_dirs, guidance_scale_2=2.0)
    experts = pipe.transformer
    params = models.add_lora(experts, 4, 8.0, None)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking LoRA (B is 0 at init)
        for p in params:
            p.normal_(0, 0.1, generator=gen)
    cond = common.PromptEncoder(pipe).cond(PROMPTS)
    x = torch.randn(3, *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.95, 0.5, 0.875])  # 950 -> transformer, 500 -> transformer_2, 875 (= boundary) -> transformer
    with torch.enable_grad():
        v = common.velocity(experts, x, sigma, cond, 4.0)
        v.square().sum().backward()
    grads = [p.grad.clone() for p in params]
    names = [n for n, p in experts.named_parameters() if p.requires_grad]
    assert {n.split(".")[0] for n in names} == {"transformer", "transformer_2"}
    for p in params:
        p.grad = None
    for i, (expert, g) in enumerate([(experts.transformer, 4.0), (experts.transformer_2, 2.0), (experts.transformer, 4.0)]):
        with torch.enable_grad():
            alone = common.velocity(expert, x[i : i + 1], sigma[i : i + 1], cond[i : i + 1], g)
            alone.square().sum().backward()
        # rows 0 and 2 ran as a batch of 2: other kernel rounding than alone, times CFG 4 (measured 2.6e-6)
        torch.testing.assert_close(v[i : i + 1], alone, rtol=0, atol=1e-5)
    for name, p, g in zip(names, params, grads):  # the sum of the rows' gradients, in both experts (measured 1e-6 rel.)
        assert g.abs().max() > 0 and (p.grad - g).abs().max() <= 1e-5 * g.abs().max(), name
    with models.reference_model(experts):  # the reference model: both experts without their adapters
        v_ref = common.velocity(experts, x, sigma, cond, 4.0)
    base = load_a14b(wan22_dirs, guidance_scale_2=2.0).transformer
    torch.testing.assert_close(v_ref, common.velocity(base, x, sigma, cond, 4.0), rtol=0, atol=1e-6)
    assert (v_ref - v).abs().max() > 1e-3


@pytest.mark.slow
def test_wan22_a14b_lora_trains_both_experts_loads_in_the_pipeline_and_resumes_exactly(wan22_dirs, family_dirs, tmp_path):
    """NFT, one epoch on the tiny A14B: one LoRA set over both experts, each one's update non-zero; exported as two
    diffusers files that WanPipeline loads (the second with load_into_transformer_2=True) and that then samples what we
    sample; the card's snippet runs. Then 1 epoch + --resume for a second equals 2 epochs straight, bit for bit."""
    from test_algos import assert_same_state

    from harness.checkpoints import load_checkpoint

    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    # every step trained: both experts' times; the low-noise expert at its own CFG scale (the card passes it)
    a14b = dict(model=wan22_dirs["a14b"], num_train_timesteps=4, guidance_scale_2=2.0)
    run_dir, trained, args = train("nft", "wan", family_dirs, tmp_path / "one", **a14b)
    weights = load_file(run_dir / "checkpoints" / "last" / "weights.safetensors")
    for expert in ("transformer", "transformer_2"):
        lora_b = [v for k, v in weights.items() if k.startswith(f"params/{expert}.blocks") and "lora_B" in k]
        assert lora_b and any(v.abs().max() > 0 for v in lora_b), expert  # B starts at 0: non-zero is a trained update
    files = export.lora_files(trained.transformer)
    assert files == {"transformer": export.LORA_WEIGHTS, "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}
    assert sorted(p.name for p in (run_dir / "lora").iterdir()) == sorted(["README.md", "samples.png", *files.values()])
    stock = type(trained.pipe).from_pretrained(wan22_dirs["a14b"])
    stock.set_progress_bar_config(disable=True)
    without = compare_with_pipeline(trained, stock, "wan")
    stock.load_lora_weights(str(run_dir / "lora"))
    high_only = compare_with_pipeline(trained, stock, "wan")  # the low-noise expert's LoRA is still missing
    stock.load_lora_weights(str(run_dir / "lora"), weight_name=files["transformer_2"], load_into_transformer_2=True)
    diff = compare_with_pipeline(trained, stock, "wan")
    print(
        f"Wan2.2-A14B: exported LoRA in the stock pipeline {diff:.2e} (transformer only {high_only:.2e}, none {without:.2e})"
    )
    assert diff <= FAMILIES["wan"][2] + LORA_TOL < min(without, high_only)
    card = run_card(run_dir, trained, args, tmp_path)
    print(f"Wan2.2-A14B: the model card's snippet, max abs difference {card:.2e}")

    straight, _, _ = train("nft", "wan", family_dirs, tmp_path / "two", **a14b, num_epochs=2)
    resumed, _, _ = train("nft", "wan", family_dirs, tmp_path / "one", **a14b, resume=str(run_dir), num_epochs=2)
    assert_same_state(load_checkpoint(straight), load_checkpoint(resumed), "nft")


@pytest.mark.parametrize("family", ["chroma", "auraflow"])
def test_t5_families_encode_the_test_prompts_whole_with_the_pipelines_padding(family, family_dirs):
    """Chroma and AuraFlow pad T5's output to max_sequence_length (the tiny tokenizer's 32: no prompt of the tests is
    cut). Chroma's mask shows each prompt's tokens and the first padding token; AuraFlow's padding tokens are zeros."""
    pipe = models.load_pipeline(family_dirs(family), CPU, resolution=32)
    enc = common.PromptEncoder(pipe, negative_prompt="blurry, low quality")
    texts = [*PROMPTS, "blurry, low quality", ""]
    lengths = [len(pipe.tokenizer(t).input_ids) for t in texts]
    assert enc.max_sequence_length == 32 and max(lengths) < 32
    embeds, extra = enc(texts)
    assert embeds.shape[1] == 32
    if family == "chroma":
        expected = torch.arange(32)[None] <= torch.tensor(lengths)[:, None]  # ChromaPipeline: one padding token visible
        assert torch.equal(extra, expected.float())
    else:
        assert extra.shape == (len(texts), 0)
        nonzero = embeds.abs().sum(-1) > 0
        assert torch.equal(nonzero, torch.arange(32)[None] < torch.tensor(lengths)[:, None])


def test_chroma_checkpointed_blocks_lose_the_mask_so_checkpointing_is_refused(family_dirs):
    """Why models/chroma.py refuses --gradient-checkpointing: diffusers' checkpointed single-stream blocks run without
    the text mask, so the same weights give another velocity with grad on (2.3e-2 here). When diffusers passes the mask
    this fails, and the refusal can go."""
    pipe = models.load_pipeline(family_dirs("chroma"), CPU, resolution=32)
    cond = common.PromptEncoder(pipe).cond(PROMPTS[:2], negative=False)
    x = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.enable_grad():
        plain = common.velocity(pipe.transformer, x, torch.tensor(0.5), cond)
        pipe.transformer.enable_gradient_checkpointing()
        try:
            checkpointed = common.velocity(pipe.transformer, x, torch.tensor(0.5), cond)
        finally:
            pipe.transformer.disable_gradient_checkpointing()
    assert (plain - checkpointed).abs().max() > 1e-3


def test_a_custom_component_module_is_refused_by_the_loader_too(tmp_path):
    """A model_index.json naming a component from a module of the folder (code from_pretrained would import) is one
    line from `load_pipeline` itself, so the benchmark scripts, which call it without the scripts' flag checks, refuse
    it too; the module is never imported."""
    import json

    tiny = Path(common.TINY_MODEL)
    for part in tiny.iterdir():
        if part.is_dir():
            (tmp_path / part.name).symlink_to(part.resolve())
    index = json.loads((tiny / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "vae": ["my_vae", "MyVAE"]}))
    marker = tmp_path / "imported"
    (tmp_path / "my_vae.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass MyVAE: pass\n")
    with pytest.raises(common.UserError, match=r"vae is 'MyVAE' from the module 'my_vae', not from diffusers or transformers"):
        models.load_pipeline(str(tmp_path), CPU)
    assert not marker.exists()
    (tmp_path / "model_index.json").write_text(json.dumps(index))  # the same folder with the stock index loads
    assert models.load_pipeline(str(tmp_path), CPU).family.name == "sd3"


def test_sd3_max_sequence_length_needs_t5_and_at_most_512(tmp_path):
    """--max-sequence-length sets T5's token count: refused on an SD3 folder without T5 (it changed nothing) and above
    StableDiffusion3Pipeline's 512; a folder with T5 takes up to 512."""
    import json

    from models import sd3

    index = json.loads((Path(common.TINY_MODEL) / "model_index.json").read_text())  # no T5: [null, null]
    (tmp_path / "model_index.json").write_text(json.dumps(index))

    def check(config, n):
        sd3.check(config, types.SimpleNamespace(model=str(tmp_path), max_sequence_length=n))

    check(index, None)
    with pytest.raises(common.UserError, match="--max-sequence-length 77: .* has no T5 .*: drop the flag"):
        check(index, 77)
    with_t5 = {**index, "text_encoder_3": ["transformers", "T5EncoderModel"]}
    (tmp_path / "text_encoder_3").mkdir()
    check(with_t5, 512)
    with pytest.raises(common.UserError, match="--max-sequence-length 513: SD3's T5 takes at most 512 tokens"):
        check(with_t5, 513)
    with pytest.raises(common.UserError, match="has no T5"):  # the folder without the index entry loads without T5 too
        check(index, 256)


@pytest.mark.parametrize("family", ["hunyuan_video", "flux_dev", "flux2_dev", "distilled_klein"])
def test_what_a_pipeline_cannot_guide_is_refused_on_the_library_path(family, family_dirs, distilled_klein, tmp_path, capsys):
    """Outside the scripts' flag checks (a benchmark script, a notebook): the sampler refuses CFG on a distilled
    FLUX.2-klein, whose pipeline ignores the scale (our two-pass CFG would sample other images), and `PromptEncoder`
    a negative prompt for a family guided by an embedding, which the sampler would drop without a word."""
    path = distilled_klein if family == "distilled_klein" else family_dirs(FAMILIES[family][0])
    pipe = models.load_pipeline(path, CPU, resolution=32, num_frames=frames(family))
    noise = torch.randn(1, *pipe.latent_shape, generator=torch.Generator().manual_seed(0))

    def sample(encoder, guidance_scale):
        cond = encoder.cond(PROMPTS[:1], guidance_scale > 1)
        return common.sample(pipe.transformer, pipe.scheduler, cond, num_steps=2, guidance_scale=guidance_scale, noise=noise)

    if family == "distilled_klein":
        encoder = common.PromptEncoder(pipe, negative_prompt="blurry")  # klein takes a negative prompt (its base CFG)
        with pytest.raises(common.UserError, match=r"guidance scale 4.0: .* is a distilled FLUX.2-klein, which samples"):
            sample(encoder, 4.0)
        assert sample(encoder, 1.0).latents.isfinite().all()
        from test_bad_inputs import TINY, assert_one_line, call

        # CRD's KL reference at --kl-cfg 4.5 (its default) is refused before the model loads
        (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS))
        prompts = ["--train-prompts", str(tmp_path / "prompts.txt"), "--test-prompts", str(tmp_path / "prompts.txt")]
        argv = [*TINY, "--model", path, "--reward", "jpeg_compressibility", *prompts, "--output-dir", str(tmp_path / "r")]
        assert_one_line(*call("crd", argv, capsys), "--kl-cfg 4.5: ")
        assert not (tmp_path / "r").exists()
        return
    reason = {"hunyuan_video": "HunyuanVideo's", "flux_dev": "FLUX.1's", "flux2_dev": "FLUX.2-dev's"}[family]
    with pytest.raises(common.UserError, match=f"negative prompt 'blurry': {reason} guidance is an embedding"):
        common.PromptEncoder(pipe, negative_prompt="blurry")
    assert sample(common.PromptEncoder(pipe), 4.0).latents.isfinite().all()  # the scale goes into the embedding
