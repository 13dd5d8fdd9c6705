"""--full-finetune: every transformer weight trained (fp32) instead of a LoRA, in all five scripts; the reference model
is the untouched base, a resume is exact, and the exported transformer folder loads into the stock pipeline."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import kernel_environ, ode_sample, run_in_process, run_script
from safetensors.torch import load_file
from test_algos import FLAGS, assert_same_state, script_argv, write_prompts

import common
import models
from algos import crd
from harness import checkpoints, export, run

BASE_WEIGHTS = Path(common.TINY_MODEL) / "transformer" / "diffusion_pytorch_model.safetensors"
# weight decay 0: a weight that moved was moved by a gradient, not by AdamW's decay alone
FULL = ["--full-finetune", "--weight-decay", "0"]
PROMPTS = ["a red circle", "a blue square and a red circle"]


@pytest.fixture(scope="module")
def prompt_dir(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts"))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, prompt_dir):
    """algo -> the folder of its 2-epoch --full-finetune run (the tiny flags of tests/test_algos.py), run once."""
    runs = {}

    def get(algo):
        if algo not in runs:
            out = tmp_path_factory.mktemp(f"full-{algo}")
            run_script(script_argv(algo, prompt_dir, out, *FULL, "--num-epochs", "2"), env=kernel_environ("native"))
            (runs[algo],) = out.iterdir()
        return runs[algo]

    return get


def tiny(dtype=torch.float32):
    return models.load_pipeline(common.TINY_MODEL, torch.device("cpu"), dtype)


# crd in the fast tests, every algorithm in the slow ones (the same code path, another loss)
@pytest.mark.parametrize("algo", [a if a == "crd" else pytest.param(a, marks=pytest.mark.slow) for a in sorted(FLAGS)])
def test_every_algorithm_trains_every_transformer_weight(algo, full_run):
    """The checkpoint holds every transformer parameter under its own name (no LoRA), and weights no LoRA targets (the
    feed-forward layers, the output projection) moved away from the base."""
    ckpt = checkpoints.load_checkpoint(full_run(algo))
    base = load_file(str(BASE_WEIGHTS))
    names = {n for n, _ in tiny().transformer.named_parameters()}
    assert set(ckpt["params"]) == names and not any("lora_" in n for n in names)
    assert ckpt["step"] >= 2 and all(v.dtype == torch.float32 for v in ckpt["params"].values())
    for name in ("transformer_blocks.0.ff.net.2.weight", "proj_out.weight", "pos_embed.proj.weight"):
        assert not torch.equal(ckpt["params"][name], base[name]), name
    moved = [n for n in names if not torch.equal(ckpt["params"][n], base[n])]
    assert len(moved) > 0.9 * len(names), f"only {len(moved)} of {len(names)} tensors moved"
    assert (full_run(algo) / "transformer" / "config.json").is_file() and not (full_run(algo) / "lora").exists()


def test_reference_model_is_the_untouched_base_after_training():
    """After optimizer steps on every weight, `reference_model` gives the velocity of a freshly loaded base exactly,
    and the trained weights are back afterwards. It also runs between a forward and its backward (GRPO's KL) without
    changing the gradient."""
    fresh, pipe = tiny(), tiny()
    transformer = pipe.transformer
    params = models.trainable_params(transformer, crd.Args(full_finetune=True))
    assert len(params) == len(list(fresh.transformer.parameters())) and all(p.requires_grad for p in params)
    cond = common.PromptEncoder(pipe).cond(PROMPTS, negative=False)
    x = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = common.velocity(fresh.transformer, x, 0.5, cond)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(3):
        (common.velocity(transformer, x, 0.5, cond) - target).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        trained = common.velocity(transformer, x, 0.5, cond)
        assert (trained - base).abs().max() > 1e-3
        with models.reference_model(transformer):
            assert torch.equal(common.velocity(transformer, x, 0.5, cond), base)
        assert torch.equal(common.velocity(transformer, x, 0.5, cond), trained)

    def grads(with_reference: bool):
        loss = (common.velocity(transformer, x, 0.5, cond) - target).pow(2).mean()
        if with_reference:
            with torch.no_grad(), models.reference_model(transformer):
                common.velocity(transformer, x, 0.5, cond)
        loss.backward()
        out = [p.grad.clone() for p in params]
        optimizer.zero_grad()
        return out

    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))


def test_a_bf16_base_trains_fp32_master_weights_and_keeps_its_bf16_reference():
    """--base-dtype bfloat16: the trained weights become fp32 (master weights), the frozen base stays the bf16 weights
    as loaded, so the reference is exactly the loaded bf16 base computed in fp32, and under --mixed-precision's
    autocast exactly the LoRA scripts' reference (the bf16 model as loaded, under autocast)."""
    pipe = tiny(torch.bfloat16)
    params = models.trainable_params(pipe.transformer, crd.Args(full_finetune=True))
    assert all(p.dtype == torch.float32 for p in params) and common.model_dtype(pipe.transformer) == torch.float32
    loaded = tiny(torch.bfloat16).transformer.float()
    cond = common.PromptEncoder(pipe).cond(PROMPTS, negative=False)
    x = torch.randn(2, *pipe.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in params:
            p.add_(1e-3)
        with models.reference_model(pipe.transformer):
            ref = common.velocity(pipe.transformer, x, 0.5, cond)
        expected = loaded(
            hidden_states=x,
            timestep=torch.full((2,), 500.0),
            encoder_hidden_states=cond.embeds.float(),
            pooled_projections=cond.pooled.float(),
            return_dict=False,
        )[0]
    assert torch.equal(ref, expected)
    with torch.no_grad(), common.autocast(torch.device("cpu"), True):
        with models.reference_model(pipe.transformer):
            ref = common.velocity(pipe.transformer, x, 0.5, cond)
        expected = common.velocity(tiny(torch.bfloat16).transformer, x, 0.5, cond)
    assert torch.equal(ref, expected)


@pytest.mark.slow
def test_resume_is_bit_exact(full_run, prompt_dir, tmp_path):
    """CRD (an old and a sampling snapshot, both of every weight): 1 epoch + --resume for one more ends bit-identical to
    the uninterrupted 2-epoch run: weights, both snapshots, AdamW's moments."""
    run_script(script_argv("crd", prompt_dir, tmp_path, *FULL, "--num-epochs", "1"), env=kernel_environ("native"))
    (b_dir,) = tmp_path.iterdir()
    run_script(["algos/crd.py", "--resume", b_dir, "--num-epochs", "2"], env=kernel_environ("native"))
    a, b = checkpoints.load_checkpoint(full_run("crd")), checkpoints.load_checkpoint(b_dir)
    assert set(a["snapshots"]) == {"old", "sampling"} and len(a["snapshots"]["old"]) == len(a["params"])
    assert_same_state(a, b, "crd")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, expected",
    [
        ("--full-finetune", "is of a LoRA run; resume it without --full-finetune"),
        ("--no-full-finetune", "is of a full fine-tuning run; resume it with --full-finetune"),
    ],
)
def test_resume_of_the_other_kind_is_one_line(flags, expected, full_run, prompt_dir, tmp_path, capsys):
    """A LoRA checkpoint resumed with --full-finetune, and a full one with --no-full-finetune: one line, exit 2, the
    run folder untouched."""
    if flags == "--full-finetune":
        run_script(script_argv("crd", prompt_dir, tmp_path, "--num-epochs", "1"))
        (target,) = tmp_path.iterdir()
    else:
        target = full_run("crd")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in target.rglob("*"))
    capsys.readouterr()
    assert run_in_process(crd, ["--resume", str(target), "--num-epochs", "3", flags]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert line.startswith("error: ") and expected in line, line
    assert sorted((p.name, p.stat().st_mtime_ns) for p in target.rglob("*")) == before


def test_exported_transformer_in_the_stock_pipeline_equals_our_sampler(full_run, tmp_path, monkeypatch):
    """runs/<run>/transformer loaded with SD3Transformer2DModel.from_pretrained into the stock StableDiffusion3Pipeline
    samples what our sampler samples with the checkpoint's weights (and not the base's); the card's snippet runs."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    run_dir = full_run("crd")
    ckpt = checkpoints.load_checkpoint(run_dir)
    exported = load_file(str(run_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(exported[n], v) for n, v in ckpt["params"].items())  # the final weights, bit for bit
    config = json.loads((run_dir / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "SD3Transformer2DModel" and "_name_or_path" not in config  # no machine path

    ours = tiny()
    models.trainable_params(ours.transformer, crd.Args(full_finetune=True))
    checkpoints.load_trainable_state(dict(ours.transformer.named_parameters()), ckpt["params"])
    steps, noise = 4, torch.randn(len(PROMPTS), 4, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = common.decode(ours, ode_sample(ours, PROMPTS, noise, steps, 1.0)[0].latents)
    call = dict(
        prompt=PROMPTS,
        num_inference_steps=steps,
        guidance_scale=1.0,
        sigmas=np.linspace(1.0, 1.0 / steps, steps).tolist(),  # our schedule (common.sigma_schedule) before the shift
        max_sequence_length=1,
        output_type="pt",
    )
    stock = {}
    for name, transformer in (("trained", SD3Transformer2DModel.from_pretrained(run_dir / "transformer")), ("base", None)):
        extra = {"transformer": transformer} if transformer is not None else {}
        pipe = StableDiffusion3Pipeline.from_pretrained(common.TINY_MODEL, text_encoder_3=None, tokenizer_3=None, **extra)
        pipe.set_progress_bar_config(disable=True)
        stock[name] = pipe(**call, latents=noise.clone()).images
    # 1e-4: as tests/test_export.py's LoRA test (our encoder encodes each prompt alone, the pipeline both together)
    assert (mine - stock["trained"]).abs().max().item() < 1e-4
    assert (mine - stock["base"]).abs().max().item() > 1e-2

    card = (run_dir / "transformer" / "README.md").read_text()
    assert "every transformer weight" in card and "lora_rank" not in card
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert "SD3Transformer2DModel.from_pretrained" in snippet and "transformer=transformer" in snippet
    monkeypatch.chdir(tmp_path)
    exec(snippet.replace("<this folder>", str(run_dir / "transformer")), {})
    assert (tmp_path / "sample.png").is_file()


@pytest.mark.slow
def test_two_ranks_match_one_process(full_run, prompt_dir, tmp_path):
    """CRD with --full-finetune on 2 gloo ranks ends bit-identical to one process (tests/test_algos.py's LoRA test, here
    with every weight's gradient all-reduced)."""
    argv = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run_script([*argv, *script_argv("crd", prompt_dir, tmp_path, *FULL, "--num-epochs", "2")], env=kernel_environ("native"))
    (two_dir,) = tmp_path.iterdir()
    assert_same_state(checkpoints.load_checkpoint(full_run("crd")), checkpoints.load_checkpoint(two_dir), "crd")


def test_export_of_other_weights_leaves_the_live_ones(tmp_path):
    """`weights` (the eval EMA under --eval-ema-decay) is what the transformer folder holds, in `trainable_params`'
    order; the live weights are untouched, and the card names what was exported."""
    pipe = tiny()
    args = crd.Args(full_finetune=True)
    params = models.trainable_params(pipe.transformer, args)
    live = [p.detach().clone() for p in params]
    other = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    out = export.export_lora(
        tmp_path / "transformer", pipe, pipe.transformer, args, crd.__doc__, 3, weights=other, weights_name="X"
    )
    saved = load_file(str(out / "diffusion_pytorch_model.safetensors"))
    names = [n for n, _ in pipe.transformer.named_parameters()]
    assert all(torch.equal(saved[n], w) for n, w in zip(names, other))
    assert all(torch.equal(p, w) for p, w in zip(params, live))
    assert "| weights | X, after epoch 3 |" in (out / "README.md").read_text()


def test_reference_model_refuses_parameters_replaced_after_trainable_params():
    """A wrapper that replaces the parameter objects after `trainable_params` (FSDP's fully_shard does) would leave the
    frozen base keyed by tensors the model no longer uses, and the reference silently the trained model: it raises."""
    pipe = tiny()
    models.trainable_params(pipe.transformer, crd.Args(full_finetune=True))
    layer = pipe.transformer.proj_out
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
    with pytest.raises(RuntimeError, match="frozen base no longer matches"):
        with models.reference_model(pipe.transformer):
            pass


def decided(args_class, argv, transformer, monkeypatch=None, below=None):
    """What a fresh run decides for --full-finetune and its learning rate: `run.check_args` on the parsed `argv`, then
    `models.trainable_params` on `transformer` (with FULL_FINETUNE_BELOW set to `below` when given)."""
    import tyro

    args = tyro.cli(args_class, args=argv)
    args.argv = tuple(argv)  # as `run.run_main` fills it
    run.check_args(args)
    if below is not None:
        monkeypatch.setattr(models, "FULL_FINETUNE_BELOW", below)
    params = models.trainable_params(transformer, args)
    return args.full_finetune, sum(p.numel() for p in params)


@pytest.mark.parametrize(
    ("argv", "below", "full"),
    [
        ([], None, True),  # the tiny model (2.3M weights): every weight
        ([], 1_000_000, False),  # a transformer over the threshold (SD3.5-M's 2.5B over 50M): a LoRA
        (["--full-finetune"], 1_000_000, True),  # asked for: every weight whatever the size
        (["--no-full-finetune"], None, False),
        (["--lora-rank", "8"], None, False),  # a LoRA flag asks for a LoRA
    ],
)
def test_default_trains_every_weight_of_a_small_transformer_and_a_lora_of_a_large_one(argv, below, full, monkeypatch):
    total = sum(p.numel() for p in tiny().transformer.parameters())
    assert models.FULL_FINETUNE_BELOW > total  # the embedded tiny models are under it
    got, trained = decided(crd.Args, argv, tiny().transformer, monkeypatch, below)
    assert got is full and (trained == total) is full


def test_grpo_trains_a_lora_by_default():
    from algos import grpo

    assert decided(grpo.Args, [], tiny().transformer) == (
        False,
        decided(grpo.Args, ["--lora-rank", "16"], tiny().transformer)[1],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algo", "full_lr", "lora_lr"),
    [("crd", 1e-4, 1e-3), ("nft", 1e-4, 3e-3), ("dgpo", 1e-4, 1e-3), ("awm", 1e-4, 1e-3), ("elbo_grpo", 3e-5, 1e-3)],
)
def test_default_learning_rate_follows_what_is_trained(algo, full_lr, lora_lr, prompt_dir, tmp_path):
    """A run left at the defaults records what it decided in args.json (a resume reads it back): every weight at the
    file's full learning rate on the tiny model, its LoRA learning rate with --no-full-finetune; an explicit rate wins."""
    import importlib

    module = importlib.import_module(f"algos.{algo}")
    for flags, full, lr in (
        ([], True, full_lr),
        (["--no-full-finetune"], False, lora_lr),
        (["--learning-rate", "3e-4"], True, 3e-4),
    ):
        out = tmp_path / "-".join(flags or ["default"])
        argv = script_argv(algo, prompt_dir, out, "--num-epochs", "1", "--eval-every", "100", *flags)[1:]
        argv = [a for a in argv if a != "--no-full-finetune"] + flags  # the tiny flags ask for a LoRA: the default here
        assert run_in_process(module, argv) in (0, None)
        (run_dir,) = out.iterdir()
        saved = json.loads((run_dir / "args.json").read_text())
        assert (saved["full_finetune"], saved["learning_rate"]) == (full, lr)
        assert (run_dir / ("transformer" if full else "lora")).is_dir()
