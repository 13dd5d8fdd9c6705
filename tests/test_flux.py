"""The FLUX family in common.py against diffusers' FluxPipeline, on tiny random FLUX pipelines built from configs."""

import copy
import math

import numpy as np
import pytest
import torch
from conftest import ode_sample, run_script

import common
import models
from models import flux

PROMPTS = ["a red circle", "a blue square and a red circle", "a square"]


@pytest.fixture(scope="module")
def pipes(flux_pipeline_dirs):
    return {k: models.load_pipeline(v, torch.device("cpu")) for k, v in flux_pipeline_dirs.items()}


def test_load_pipeline_detects_flux_and_sets_the_unpacked_latent_shape(flux_pipeline_dirs, pipes):
    pipe = pipes["dev"]
    assert type(pipe.pipe).__name__ == "FluxPipeline" and pipe.family is flux.FAMILY
    assert pipe.latent_shape == (4, 16, 16)  # the VAE's layout; the transformer sees 8 x 8 tokens of 16 channels
    assert pipe.tokens == 64 and not hasattr(pipe.scheduler, "image_seq_len")  # the record holds it, not the scheduler
    small = models.load_pipeline(flux_pipeline_dirs["schnell"], torch.device("cpu"), resolution=32)
    assert small.latent_shape == (4, 8, 8) and small.tokens == 16
    with pytest.raises(common.UserError, match="multiple of 8"):  # VAE factor 4 x the 2x2 packing
        models.load_pipeline(flux_pipeline_dirs["schnell"], torch.device("cpu"), resolution=36)
    with pytest.raises(common.UserError, match="no such pipeline folder"):
        models.load_pipeline(flux_pipeline_dirs["dev"] + "-missing", torch.device("cpu"))


def test_pack_latents_matches_flux_pipeline_and_inverts():
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 6, 8)
    packed = flux.pack_latents(x)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(x, 2, 4, 6, 8), rtol=0, atol=0)
    torch.testing.assert_close(flux.unpack_latents(packed, 6, 8), x, rtol=0, atol=0)


@pytest.mark.parametrize("variant,guidance_scale", [("dev", 3.5), ("schnell", 1.0)])
def test_ode_sampler_matches_flux_pipeline(pipes, variant, guidance_scale):
    """Same initial noise (packed for the pipeline): same latents, same images, same sigma schedule. Not square, so that
    swapped row/column position ids or a wrong token count in the shift would show."""
    pipe, steps = pipes[variant], 4
    noise = torch.randn(len(PROMPTS), 4, 16, 8, generator=torch.Generator().manual_seed(0))
    out, enc = ode_sample(pipe, PROMPTS, noise, steps, guidance_scale)
    call = dict(
        prompt=PROMPTS,
        latents=flux.pack_latents(noise),
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        height=64,
        width=32,
        max_sequence_length=enc.max_sequence_length,
    )
    ref_latents = pipe(**call, output_type="latent").images
    torch.testing.assert_close(flux.pack_latents(out.latents), ref_latents, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.sigmas, pipe.scheduler.sigmas, atol=1e-6, rtol=0)  # the schedule the pipeline set
    ref = pipe(**call, output_type="pt").images
    ours = common.decode(pipe, out.latents)
    assert ours.shape == ref.shape == (3, 3, 64, 32)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_guidance_embedding_is_used_and_cfg_is_never_doubled(pipes):
    pipe = pipes["dev"]
    enc = common.PromptEncoder(pipe)
    cond, cond_neg = enc.cond(PROMPTS[:2], negative=False), enc.cond(PROMPTS[:2])
    x = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        v1 = common.velocity(pipe.transformer, x, 0.7, cond_neg, 1.0)
        v35 = common.velocity(pipe.transformer, x, 0.7, cond_neg, 3.5)
        v35_no_neg = common.velocity(pipe.transformer, x, 0.7, cond, 3.5)  # SD3 would need neg here
    assert not torch.allclose(v1, v35)
    torch.testing.assert_close(v35, v35_no_neg, rtol=0, atol=0)


def test_dynamic_shift_is_flux_time_shift_of_the_token_count(pipes):
    """sigma' = e^mu s / (e^mu s + 1 - s), mu linear in tokens: 0.5 at 256 (512 px), 1.15 at 4096 (1024 px)."""
    sched, s = pipes["dev"].scheduler, np.linspace(1.0, 0.1, 10)
    for tokens, mu in ((256, 0.5), (4096, 1.15), (64, 0.5 - 0.65 * 192 / 3840)):
        expected = np.append(math.exp(mu) * s / (math.exp(mu) * s + 1 - s), 0.0)
        got = common.sigma_schedule(sched, 10, mu=common.linear_mu(sched.config, tokens, 10))
        if tokens == 64:  # the model's own resolution (16 x 16 latents)
            torch.testing.assert_close(pipes["dev"].sigmas(10), got, rtol=0, atol=0)
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-6)


def test_sd3_lora_targets_exist_in_flux_and_reference_disables_them(pipes):
    pipe = pipes["dev"]
    transformer = copy.deepcopy(pipe.transformer)
    # the algos' default targets, named after SD3's joint attention
    targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    params = models.add_lora(transformer, rank=4, alpha=4, target_modules=targets)
    wrapped = {n.split(".lora_")[0] for n, _ in transformer.named_parameters() if "lora_A" in n}
    assert any(n.startswith("single_transformer_blocks.") for n in wrapped)  # single blocks: to_q/k/v (no to_out there)
    assert {n.rsplit("attn.", 1)[1] for n in wrapped} == set(targets)
    enc = common.PromptEncoder(pipe)
    cond = enc.cond(PROMPTS[:2], negative=False)
    x = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = common.velocity(pipe.transformer, x, 0.5, cond, 3.5)
        torch.testing.assert_close(common.velocity(transformer, x, 0.5, cond, 3.5), base)
        for p in params:
            p.add_(0.05)
        assert not torch.allclose(common.velocity(transformer, x, 0.5, cond, 3.5), base)
        with models.reference_model(transformer):
            torch.testing.assert_close(common.velocity(transformer, x, 0.5, cond, 3.5), base)


@pytest.mark.slow
def test_nft_runs_on_flux(flux_pipeline_dirs, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    flags = (
        "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --num-epochs 1 --num-train-timesteps 2 "
        "--kl-beta 0.01 --guidance-scale 3.5 --reward jpeg_compressibility"
    )  # kl-beta: the reference model too
    model = flux_pipeline_dirs["dev"]
    out = run_script(
        [
            "algos/nft.py",
            "--model",
            model,
            "--train-prompts",
            prompts,
            "--test-prompts",
            prompts,
            *flags.split(),
            "--output-dir",
            tmp_path / "runs",
        ]
    )
    assert "final eval" in out.stdout and list((tmp_path / "runs").glob("*/checkpoints/last/weights.safetensors"))
