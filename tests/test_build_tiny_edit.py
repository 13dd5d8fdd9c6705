"""The tiny-edit recipe (`benchmark/testbeds/build_tiny_edit.py`): its training inputs are laid out as the stock
FluxKontextPipeline lays out its transformer inputs (tokens, position ids, timestep, text), a tiny build runs, is
deterministic and loads in the stock pipeline, and bad flags fail with one line before any work."""

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image
from safetensors.torch import load_file

from benchmark.testbeds import build_tiny_edit as recipe
from benchmark.testbeds.build_tiny_shapes import build_tokenizer, build_vae
from rewards.worlds import edit as edit_world
from rewards.worlds import shapes as world
from tests.conftest import REPO, run_script, scalars

SCRIPT = "benchmark/testbeds/build_tiny_edit.py"


@pytest.fixture(scope="module")
def random_pipe():
    """An untrained pipeline from the recipe's parts, with scaled latents as a build leaves them."""
    tok = build_tokenizer(sorted({w for i in edit_world.all_instructions() for w in i.split()}), recipe.MAX_TOKENS)
    clip, t5 = recipe.build_text_encoders(tok, seed=0)
    vae = build_vae(seed=1)
    vae.register_to_config(shift_factor=0.1, scaling_factor=1.7)
    pipe = FluxKontextPipeline(
        scheduler=recipe.build_scheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=tok,
        text_encoder_2=t5,
        tokenizer_2=tok,
        transformer=recipe.build_transformer(seed=2, layers=1, single_layers=1, heads=2),
    )
    pipe.set_progress_bar_config(disable=True)
    for module in (clip, t5, vae, pipe.transformer):
        module.eval().requires_grad_(False)
    return pipe


def test_training_inputs_are_the_pipelines(random_pipe):
    """One stock step with a hook on the transformer: its hidden states are [noise tokens, reference tokens] as
    `pack` writes them, its position ids `kontext_ids`, its timestep sigma, its text `text_embeddings`."""
    pipe, seen = random_pipe, {}
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    instructions = ["make the circle red", "move the blue square to the left"]
    scenes = [edit_world.task(i)[0] for i in instructions]
    noise = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    try:
        pipe(
            image=[Image.fromarray(world.render(list(s))) for s in scenes],
            prompt=instructions,
            latents=recipe.pack(noise),
            height=64,
            width=64,
            max_area=64 * 64,
            _auto_resize=False,
            max_sequence_length=recipe.MAX_TOKENS,
            num_inference_steps=2,
            output_type="latent",
        )
    finally:
        hook.remove()
    images = torch.from_numpy(np.stack([world.render(list(s)) for s in scenes])).permute(0, 3, 1, 2).float() / 127.5 - 1
    reference = (pipe.vae.encode(images).latent_dist.mode() - 0.1) * 1.7
    assert torch.allclose(seen["hidden_states"][:, 64:], recipe.pack(reference), atol=1e-5)
    assert seen["hidden_states"].shape == (2, 128, 16)
    assert torch.equal(seen["img_ids"], recipe.kontext_ids(16, 16))
    assert torch.equal(recipe.kontext_ids(4, 4)[:, 0], torch.tensor([0.0] * 4 + [1.0] * 4))
    assert torch.equal(recipe.kontext_ids(4, 4)[:4, 1:], torch.tensor([[0.0, 0], [0, 1], [1, 0], [1, 1]]))
    # the second step's timestep: sigma of the shifted schedule, mu = log 2 at 64 tokens, so shift 2 (0.5 -> 2/3)
    assert torch.allclose(seen["timestep"], torch.full((2,), 2 / 3))
    ids = pipe.tokenizer(instructions, padding="max_length", max_length=recipe.MAX_TOKENS, return_tensors="pt").input_ids
    embeds, pooled = recipe.text_embeddings(pipe, ids)
    assert torch.equal(seen["encoder_hidden_states"], embeds) and torch.equal(seen["pooled_projections"], pooled)
    assert seen["guidance"] is None


def test_pack_is_the_pipelines():
    x = torch.randn(2, 4, 16, 16)
    assert torch.equal(recipe.pack(x), FluxKontextPipeline._pack_latents(x, 2, 4, 16, 16))
    # a token is one 2x2 patch, channels outermost: token (r, c) holds x[:, ch, 2r + i, 2c + j] at ch * 4 + i * 2 + j
    assert torch.equal(recipe.pack(x)[:, 1 * 8 + 3, 2 * 4 + 1 * 2 + 0], x[:, 2, 2 * 1 + 1, 2 * 3 + 0])


def build(out, *extra):
    return run_script(
        [SCRIPT, "--num-pairs", "32", "--vae-steps", "2", "--flow-steps", "2", "--batch", "4", "--layers", "1"]
        + ["--single-layers", "1", "--heads", "2", "--threads", "1", "--out", out, *extra],
        check=False,
    )


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-edit") / "a"
    return out, build(out, "--eval-steps", "1")


@pytest.mark.slow
def test_tiny_build_runs_and_loads(tiny_build):
    out, result = tiny_build
    assert result.returncode == 0, result.stderr[-2000:]
    assert "held-out (28 instructions): edit " in result.stdout and "s per step, ~" in result.stdout
    pipe = FluxKontextPipeline.from_pretrained(out)
    assert pipe.transformer.config.guidance_embeds is False and pipe.tokenizer_2.model_max_length == recipe.MAX_TOKENS


@pytest.mark.slow
def test_an_rl_run_on_the_build_logs_the_edit_metrics(tiny_build, tmp_path):
    """The recipe's pipeline, the edit prompt files and the edit reward in a training script (GRPO, one epoch)."""
    out, _ = tiny_build
    edit = REPO / "assets" / "edit"
    run_script(
        ["algos/grpo.py", "--model", out, "--reward", "edit", "--train-prompts", edit / "train.jsonl"]
        + ["--test-prompts", edit / "test.jsonl", "--num-prompts", "2", "--group-size", "4", "--micro-batch", "4"]
        + ["--num-steps", "4", "--num-sde-steps", "2", "--num-epochs", "1", "--output-dir", tmp_path / "runs"]
    )
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = scalars(run_dir)
    for name in ("edit", "edit_exact", "edit_asked", "rest_unchanged", "objects_extra"):
        assert len(logged[f"eval/{name}"]) == 2, name  # before and after training
    assert logged["eval/edit_exact"][0] <= logged["eval/edit_asked"][0]


@pytest.mark.slow
def test_tiny_build_is_deterministic(tiny_build, tmp_path):
    out, _ = tiny_build
    assert build(tmp_path / "b", "--eval-steps", "0").returncode == 0
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        name = "diffusion_pytorch_model.safetensors" if part in ("transformer", "vae") else "model.safetensors"
        a, b = load_file(out / part / name), load_file(tmp_path / "b" / part / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-pairs", "0"], "--num-pairs 0: must be > 0"),
        (["--flow-steps", "-1"], "--flow-steps -1: must be >= 0"),
        (["--lr", "nan"], "--lr nan: must be a positive number"),
        (["--layers", "two"], "argument --layers: invalid int value: 'two'"),
        (["--vae-from", "assets/edit"], "--vae-from assets/edit: not a pipeline folder"),
        (["--out", "README.md"], "exists and is not a folder"),
        (["--out", "no/such/folder/x"], "does not exist"),
    ],
)
def test_bad_flags_fail_in_one_line(tmp_path, flags, message):
    out = tmp_path / "out"
    result = run_script([SCRIPT, "--out", out, *flags], check=False)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()


def test_a_stopped_flow_stage_resumes_to_the_same_weights(random_pipe, tmp_path):
    """The flow stage saves its whole state (weights, optimizer, EMA, sampling generator) every `every` steps; a stage
    started again from that file ends with the weights of the stage that was never stopped."""
    import copy

    gen = torch.Generator().manual_seed(0)
    sources, targets = torch.randn(8, 4, 8, 8, generator=gen), torch.randn(8, 4, 8, 8, generator=gen)
    instructions = ["make the circle red", "remove the square", ""]
    instruction_idx = torch.tensor([0, 1] * 4)
    checkpoint = tmp_path / "flow.checkpoint.pt"

    def stage(pipe, log=lambda msg: None):
        recipe.train_flow(
            pipe, sources, targets, instruction_idx, instructions, 4, 4, 1e-3, log, False, checkpoint, 2, {"x": 1}
        )
        return [p.detach().clone() for m in (pipe.transformer, pipe.text_encoder_2) for p in m.parameters()]

    whole = stage(copy.deepcopy(random_pipe))  # leaves its step-2 state in `checkpoint` (the last save is at 2 of 4)
    assert torch.load(checkpoint, weights_only=True)["step"] == 2
    logs = []
    resumed = stage(copy.deepcopy(random_pipe), logs.append)  # a fresh pipeline: everything must come from the file
    assert any("resumed" in line and "step 2/4" in line for line in logs)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("content", ["garbage", "other"])
def test_a_bad_checkpoint_fails_in_one_line(tmp_path, content):
    out = tmp_path / "out"
    checkpoint = tmp_path / "out.checkpoint.pt"
    if content == "garbage":
        checkpoint.write_text("not a checkpoint")
        message = "not a readable build checkpoint"
    else:  # a checkpoint of a build with another learning rate
        flags = recipe.parse_args(["--out", str(out), "--lr", "0.5"])
        torch.save({"config": {k: getattr(flags, k) for k in recipe.BUILD_FLAGS}}, checkpoint)
        message = "is from another build (--lr 0.5 (now 0.001))"
    result = run_script([SCRIPT, "--out", out], check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists() and checkpoint.exists()


@pytest.mark.slow
def test_edit_benchmark_pairs_every_export_with_the_base_on_the_same_noises(tiny_build, tmp_path):
    """benchmark/edit.py score / table / grid on the tiny build: an export that is the base's own transformer scores
    the base's numbers exactly (same noises, steps and CFG through the stock pipeline), so its paired gains are 0."""
    import json
    import shutil

    from PIL import Image

    out, _ = tiny_build
    run = tmp_path / "runs" / "same"
    shutil.copytree(out / "transformer", run / "transformer")
    (run / "args.json").write_text(json.dumps({"exp_name": "same", "seed": 1, "num_steps": 2, "guidance_scale": 1.0}))
    results = tmp_path / "results"
    flags = ["--model", out, "--results", results, "--noises", "2"]
    run_script(["benchmark/edit.py", "score", run, *flags])
    (base1, base45) = [json.loads(line) for line in (results / "base.jsonl").read_text().splitlines()]
    (final,) = [json.loads(line) for line in (results / "final.jsonl").read_text().splitlines()]
    assert (base1["guidance_scale"], base45["guidance_scale"], final["steps"], final["set"]) == (1.0, 4.5, 2, "test")
    for k in ("exact", "edit_asked", "rest_unchanged", "extra", "edit"):
        assert final[k] == base1[k], k
    assert final["exact_gain_cfg1_per_prompt"] == [0.0] * 28 and len(final["exact_gain_cfg4.5_per_prompt"]) == 28
    table = run_script(["benchmark/edit.py", "table", *flags]).stdout
    assert "| same | 1 | 0 |" in table and "+0.000 ± 0.000" in table and "| base, CFG 4.5, 2 steps |" in table
    run_script(["benchmark/edit.py", "grid", run, *flags, "--out", tmp_path / "grid.png", "--every", "14"])
    assert Image.open(tmp_path / "grid.png").size == (3 * (128 + 4) + 4, 14 + 2 * (128 + 14 + 4) + 4)


@pytest.mark.slow
def test_edit_benchmark_bad_inputs_are_one_line(tmp_path):
    result = run_script(["benchmark/edit.py", "score", tmp_path], check=False)
    assert result.returncode == 2 and "not a run folder (no args.json)" in result.stderr.strip().splitlines()[-1]
    text_only = tmp_path / "p.jsonl"
    text_only.write_text('{"prompt": "make the circle red"}\n')
    result = run_script(["benchmark/edit.py", "table", "--prompts", text_only], check=False)
    assert result.returncode == 2 and "not an edit prompt file with image and source" in result.stderr.strip().splitlines()[-1]
    result = run_script(["benchmark/edit.py", "table", "--results", tmp_path / "none"], check=False)
    assert (
        result.returncode == 2 and result.stderr.strip() == f"edit.py: error: no rows with --noises 8 in {tmp_path / 'none'}"
    )
