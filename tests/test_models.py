"""Each model family (models/) against its diffusers pipeline, on tiny random pipelines built offline (tiny_families):
our ODE sampler with the family adapter equals `Pipeline.__call__` with the same initial noise and sigmas (CFG on
where the family has it); NFT and GRPO train a LoRA on it; the exported LoRA loads into the stock pipeline."""

import importlib.util
import inspect
import signal
import types

import numpy as np
import pytest
import tiny_families
import torch
from conftest import ode_sample
from safetensors.torch import load_file

import common
import models
from models import flux, wan

PROMPTS = ["a red circle", "two blue squares", "a square"]
CPU = torch.device("cpu")


@pytest.fixture(scope="session", autouse=True)
def few_frames():
    """Wan videos of 5 frames (3 latent frames with the tiny VAE's temporal factor 2) instead of 33."""
    frames, wan.NUM_FRAMES = wan.NUM_FRAMES, 5
    yield
    wan.NUM_FRAMES = frames


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """Each family's tiny pipeline, built and saved once per test session (the build is lazy: per family asked)."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(name):
        if name not in built:
            built[name] = getattr(tiny_families, name)(root / name)
        return built[name]

    return get


# peft's LoRA layer (ours, fp32 master weights) against diffusers' loaded one: the same weights, summed in another order
LORA_TOL = 1e-5
# family -> (builder, pixels, CFG scale, max abs tolerance on images in [0, 1], pipeline call keywords)
FAMILIES = {
    # the same transformer calls in the same order (two CFG passes, as the pipeline), the same BatchNorm un-normalisation:
    # measured 0.0 here; 1e-5 leaves room for other BLAS kernels
    "flux2_klein": ("flux2_klein", 32, 4.0, 1e-5, {}),
    # one call with the guidance embedding, as the pipeline (the negative prompt unused): measured 0.0
    "flux2_dev": ("flux2_dev", 32, 4.0, 1e-5, {}),
    # the same calls in the same order, the CFG renormalisation included; our prompts are encoded alone (history-independent
    # embeddings) where the pipeline encodes the batch at once, which moves the text encoder's output ~1e-7: measured 2.4e-7
    "qwen_image": (
        "qwen_image",
        32,
        4.0,
        1e-5,
        dict(latents=flux.pack_latents, guidance_scale=None, true_cfg_scale=4.0, negative_prompt=[""] * len(PROMPTS)),
    ),
    # the same batched 2B call and the pipeline's own CFG expression (its guidance_scale is ours - 1); prompts encoded alone
    # as for Qwen-Image: measured 6.3e-7
    "z_image": ("z_image", 32, 4.0, 1e-5, dict(guidance_scale=3.0, negative_prompt=[""] * len(PROMPTS))),
    # the same two CFG passes; WanPipeline takes no sigmas (the test sets its scheduler's grid to ours) and returns
    # video [B, F, 3, H, W]; prompts encoded alone as for Qwen-Image: measured 7.2e-7
    # one batched 2B call, as the pipeline; the negative prompt without the instruction, as the pipeline: measured 0.0
    "sana": ("sana", 32, 4.0, 1e-5, dict(use_resolution_binning=False)),
    # the same two calls and the pipeline's CFG renormalisation; the negative prompt without the system prompt: measured 0.0
    "lumina2": ("lumina2", 64, 4.0, 1e-5, {}),
    # the same two calls; the pipeline is given our (unshifted) grid as its integer timesteps (4 steps: 1000, 750, 500,
    # 250) and prompts truncated to 16 tokens, so that its batch padding equals ours; the shift inverted in float32 gives
    # back these times exactly: measured 0.0
    "cogview4": ("cogview4", 64, 4.0, 1e-5, dict(timesteps=lambda _: [1000, 750, 500, 250])),
    "wan": ("wan", 32, 4.0, 1e-5, dict(num_frames=lambda _: wan.NUM_FRAMES, negative_prompt="")),
}


def compare_with_pipeline(pipe, stock, family, steps: int = 4) -> float:
    """Max abs difference between our ODE sampler's images and `stock.__call__`'s with the same noise and sigmas."""
    _, pixels, guidance, tol, extra = FAMILIES[family]
    noise = torch.randn(len(PROMPTS), *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    out, enc = ode_sample(pipe, PROMPTS, noise, steps, guidance)
    ours = common.decode(pipe, out.latents)
    call = dict(
        prompt=list(PROMPTS),
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=pixels,
        width=pixels,
        sigmas=np.linspace(1.0, 1.0 / steps, steps).tolist(),
        output_type="pt",
    )
    # the family's own keywords and layouts; lists copied: ZImagePipeline rewrites its prompt lists in place
    call.update({k: v(call.get(k)) if callable(v) else list(v) if isinstance(v, list) else v for k, v in extra.items()})
    if "max_sequence_length" in inspect.signature(pipe.pipe.__call__).parameters:
        call["max_sequence_length"] = enc.max_sequence_length
    if type(stock.scheduler) is not type(pipe.scheduler):  # released with a multistep solver: step it with our Euler one
        stock.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    if type(stock).__name__ == "WanPipeline":  # no sigmas argument: fix its scheduler's grid to ours
        call.pop("sigmas")
        set_timesteps = stock.scheduler.set_timesteps
        stock.scheduler.set_timesteps = lambda n, device=None: set_timesteps(
            sigmas=np.linspace(1.0, 1.0 / n, n).tolist(), device=device
        )
        ref = stock(**call).frames
        del stock.scheduler.set_timesteps
    else:
        ref = stock(**call).images
    torch.testing.assert_close(out.sigmas, stock.scheduler.sigmas.float(), atol=1e-6, rtol=0)  # the schedule the pipeline set
    assert ours.shape == ref.shape
    assert (ours - ref.flip(0)).abs().max().item() > 1e-3  # the comparison can fail: other prompts give other images
    return (ours - ref).abs().max().item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ode_sampler_matches_the_pipeline(family, family_dirs):
    builder, pixels, _, tol, _ = FAMILIES[family]
    pipe = common.load_pipeline(family_dirs(builder), CPU, resolution=pixels)
    diff = compare_with_pipeline(pipe, pipe.pipe, family)
    print(f"{family}: max abs difference {diff:.2e}")
    assert diff <= tol


def load_algo(name: str):
    spec = importlib.util.spec_from_file_location(f"cleanflow_{name}", common.REPO / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(algo: str, family: str, family_dirs, tmp_path):
    """One epoch of `algo` on the family's tiny pipeline, in-process; returns (run folder, the trained pipeline, the
    algorithm's module)."""
    builder, pixels, guidance, _, _ = FAMILIES[family]
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS))
    module = load_algo(algo)
    per_algo = {"nft": dict(num_train_timesteps=1), "grpo": dict(grad_steps_per_epoch=1, num_sde_steps=1)}[algo]
    args = module.Args(
        model=family_dirs(builder),
        resolution=pixels,
        guidance_scale=guidance,
        reward="jpeg_compressibility",
        num_prompts=2,
        group_size=4,
        micro_batch=4,
        num_steps=3,
        num_epochs=1,
        train_prompts=str(tmp_path / "prompts.txt"),
        test_prompts=str(tmp_path / "prompts.txt"),
        output_dir=str(tmp_path / "runs"),
        **per_algo,
    )
    pipes, export = [], common.export_lora

    def recording_export(out_dir, pipe, *a, **k):
        pipes.append(pipe)
        return export(out_dir, pipe, *a, **k)

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # the run installs its own
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "export_lora", recording_export)
        try:
            common.run_main(module.main, args)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir, pipes[-1], module


@pytest.mark.parametrize("algo", ["nft", "grpo"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_changes_the_lora(family, algo, family_dirs, tmp_path):
    run_dir, trained, module = train(algo, family, family_dirs, tmp_path)
    weights = load_file(run_dir / "checkpoints" / "last" / "weights.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)  # B starts at 0: any non-zero entry is a trained update
    # the scripts' shared default targets attach to exactly the family's own list (peft skips names a model lacks)
    targets = {
        t for t in module.Args.lora_targets if any(k.split(".lora_B")[0].endswith("." + t) for k in weights if "lora_B" in k)
    }
    assert targets == set(trained.family.lora_targets)
    if algo == "nft" and hasattr(trained.pipe, "load_lora_weights"):  # the export loads into the stock pipeline
        stock = type(trained.pipe).from_pretrained(family_dirs(FAMILIES[family][0]))
        stock.set_progress_bar_config(disable=True)
        without = compare_with_pipeline(trained, stock, family)  # the trained LoRA against the base model
        stock.load_lora_weights(str(run_dir / "lora"))
        diff = compare_with_pipeline(trained, stock, family)
        print(f"{family}: exported LoRA in the stock pipeline, max abs difference {diff:.2e} (without it {without:.2e})")
        assert diff <= FAMILIES[family][3] + LORA_TOL < without


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
        ("Qwen/Qwen-Image-2512", "QwenImagePipeline"),
        ("Tongyi-MAI/Z-Image-Turbo", "ZImagePipeline"),
        ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "WanPipeline"),
        ("stabilityai/stable-diffusion-3.5-medium", "StableDiffusion3Pipeline"),
        ("Efficient-Large-Model/Sana_1600M_1024px_diffusers", "SanaPipeline"),
        ("Alpha-VLLM/Lumina-Image-2.0", "Lumina2Pipeline"),
        ("THUDM/CogView4-6B", "CogView4Pipeline"),
    ],
)
def test_hub_ids_without_a_folder_map_to_their_family(hub_id, expected):
    import diffusers

    assert common.pipeline_class(hub_id) == expected and expected in common.FAMILIES
    family = common.FAMILIES[expected]
    assert hasattr(diffusers, expected) and hasattr(diffusers, family.transformer)  # names diffusers really has
    with pytest.raises(common.UserError, match="cannot tell its family"):
        common.pipeline_class("someone/unknown-model")


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
    pipe = common.load_pipeline(family_dirs("sana"), CPU, resolution=32)
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
