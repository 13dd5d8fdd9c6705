"""The paper commands in benchmark/sd35_*.sh parse with each script's flags and have a valid batch geometry on their
GPU count, for every TASK (they cannot be run here: no GPU, no hub)."""

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import tyro
from conftest import needs_ocr, run_script

from harness import distributed

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "benchmark").glob("sd35_*.sh"))
# stands in for torchrun: prints the GPU count, the script and every argument, one per line
FAKE_TORCHRUN = 'torchrun() { printf "%s\\n" "$@"; }; export -f torchrun; bash "$0"'


def parse_script(script: Path, task: str, with_flags: bool = False):
    """Run a paper script with a fake torchrun; returns (GPU count, algorithm name, the parsed Args[, its arguments])."""
    out = run_script(
        ["bash", "-c", FAKE_TORCHRUN, script], python=False, timeout=60, env={**os.environ, "TASK": task, "DATA": "/data"}
    )
    argv = out.stdout.splitlines()
    assert argv[0] == "--nproc-per-node"
    world, path, flags = int(argv[1]), argv[2], argv[3:]
    algo = importlib.import_module(f"algos.{Path(path).stem}")
    args = tyro.cli(algo.Args, args=flags)
    return (world, Path(path).stem, args, flags) if with_flags else (world, Path(path).stem, args)


@pytest.mark.parametrize("task", ["pickscore", "ocr"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_paper_command_parses_with_a_valid_geometry(script, task):
    world, name, args = parse_script(script, task)
    assert args.reward == task and args.model == "stabilityai/stable-diffusion-3.5-medium"
    distributed.batch_layout(args.num_prompts * args.group_size, args.grad_steps_per_epoch, world, args.micro_batch)
    if name in ("crd", "dgpo"):  # whole groups per micro-batch
        assert args.micro_batch % args.group_size == 0


def test_best_of_k_is_the_mean_over_all_k_subsets_of_noises():
    """convergence.best_of_k (the unbiased pass@k estimator) against enumerating every k-subset of the 8 noises."""
    import itertools

    import numpy as np

    from benchmark.convergence import best_of_k

    exact = (np.random.default_rng(0).random((8, 30)) < 0.2).astype(float)
    exact[:, 0], exact[:, 1] = 0, 1  # a prompt never exact, one always
    for k in (1, 4, 8):
        brute = np.mean([np.mean([exact[list(s), p].max() for s in itertools.combinations(range(8), k)]) for p in range(30)])
        assert abs(best_of_k(exact, k) - brute) < 1e-12
        each = [np.mean([exact[list(s), p].max() for s in itertools.combinations(range(8), k)]) for p in range(30)]
        assert np.allclose(best_of_k(exact, k, per_prompt=True), each, atol=1e-6)
    assert best_of_k(exact, 1) == exact.mean()
    assert best_of_k(exact, 4, per_prompt=True)[:2] == [0.0, 1.0]


def test_shuffled_advantages_control_permutes_grpos_advantages_the_same_way_for_the_same_batch():
    """The GRPO control run's advantages are exactly GRPO's, in another order: the same values (so the update has
    GRPO's size), not the same order (so no reward signal), and the same order again for the same rewards (resume)."""
    import torch

    from benchmark.studies import shuffled_advantages as control

    scores = {"shapes_clean": torch.rand(64, generator=torch.Generator().manual_seed(0))}
    real = control.real_advantages(scores, {"shapes_clean": 1.0}, 8)
    shuffled = control.grpo.aggregate_advantages(scores, {"shapes_clean": 1.0}, 8)
    assert torch.equal(shuffled.sort().values, real.sort().values)
    assert (shuffled != real).float().mean() > 0.5
    assert torch.equal(shuffled, control.grpo.aggregate_advantages(scores, {"shapes_clean": 1.0}, 8))


@pytest.mark.slow
def test_shuffled_advantages_takes_grpos_flags_with_their_one_line_errors():
    """The control parses grpo.py's flags with `run.cli`: a bad one is one line, exit 2 (tyro read the docstrings of a
    module it could not find and raised a 60-line traceback); --help lists them."""
    out = run_script(["benchmark/studies/shuffled_advantages.py", "--num-steps", "x"], check=False, timeout=300)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: --num-steps: invalid literal for int() with base 10: 'x' (--help lists the flags)"
    ], out.stderr[-2000:]
    out = run_script(["benchmark/studies/shuffled_advantages.py", "--help"], timeout=300)
    assert "--num-sde-steps" in out.stdout


def test_images_of_a_committed_export_come_from_its_model_card(tmp_path):
    from benchmark.convergence import images_in_card

    assert images_in_card(tmp_path) == 0
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "README.md").write_text("Held-out prompts, CFG 1.0, after 20480 training images:\n")
    assert images_in_card(tmp_path) == 20480


def test_efficiency_table_counts_images_to_the_first_eval_at_the_level_and_divides_grpo_by_them():
    """convergence.reach skips the base's own eval (0 images) and returns the first crossing; the ratio is GRPO's images
    over the run's, a lower bound when GRPO never got there, and nothing when GRPO did not run that long."""
    from benchmark.convergence import efficiency_table, reach

    def row(setting, exact, step=2560):
        images = [i * step for i in range(len(exact))]
        return {"setting": setting, "seed": 1, "device": "cpu", "images": images, "seconds": [i / 10 for i in images],
                "shapes_exact": exact}  # fmt: skip

    crd = row("crd_full_lr1e-4", [0.30, 0.20, 0.25, 0.21])
    assert reach(crd, 0.24) == (5120, 512.0) and reach(crd, 0.26) is None
    grpo = row("grpo_full_lr1e-4", [0.1, 0.1, 0.1, 0.1, 0.2, 0.3])  # reaches 0.24 at 12,800 images
    table = efficiency_table([crd, grpo], 0.24)
    assert "| 5,120 | 512 | 2.5x |" in table[2] and "| 12,800 | 1,280 | 1.0x |" in table[3]
    slow = row("grpo", [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])  # never reaches it in 20,480 images
    assert "> 4.0x (GRPO: not in 20,480)" in efficiency_table([crd, slow], 0.24)[2]
    assert "no GRPO run that long" in efficiency_table([crd, row("grpo", [0.1])], 0.24)[2]
    assert "not reached" in efficiency_table([row("nft", [0.1, 0.2])], 0.24)[2]


def test_working_seconds_leaves_out_the_pause_between_a_stop_and_its_resume():
    from benchmark.convergence import working_seconds

    times = [0.0, 10.0, 20.0, 3020.0, 3030.0]  # stopped after 20 s, resumed 50 minutes later
    assert working_seconds(times, 20.0) == 20.0 and working_seconds(times, 3030.0) == 30.0
    assert working_seconds(times, 5.0) == 0.0


def test_extracting_a_run_again_replaces_its_curve_row_and_keeps_the_others(tmp_path):
    from benchmark.convergence import read_jsonl, replace_run_row

    path = tmp_path / "curves.jsonl"
    for run, exact in (("a", [0.1]), ("b", [0.2]), ("a", [0.1, 0.3])):  # run a extracted again after a resume
        replace_run_row(path, {"run": run, "shapes_exact": exact})
    assert read_jsonl(path) == [{"run": "b", "shapes_exact": [0.2]}, {"run": "a", "shapes_exact": [0.1, 0.3]}]
    assert [p.name for p in tmp_path.iterdir()] == ["curves.jsonl"]  # no temporary file left


def test_seeds_table_gives_mean_and_standard_error_over_seeds():
    """The over-seeds row against a hand computation: SE = sample std (n - 1) / sqrt(n), one seed has no SE, and the
    CFG-1 and CFG-4.5 gains are averaged over the same seeds; the training-prompt rows stay out."""
    from benchmark.convergence import mean_se, seeds_table

    assert mean_se([0.25]) == "+0.250"
    # 0.2, 0.3, 0.4: mean 0.3, deviations -0.1 0 0.1, sample variance 0.02 / 2 = 0.01, SE = 0.1 / sqrt(3) = 0.0577
    assert mean_se([0.2, 0.3, 0.4]) == "+0.300 ± 0.058"
    assert mean_se([-0.01, -0.03]) == "-0.020 ± 0.010"

    def final(seed, exact, split="test"):
        gains = {"exact_gain_cfg1": exact - 0.15, "exact_gain_cfg4.5": exact - 0.20, "extra_gain_cfg4.5": 0.1 * seed}
        return {"sweep": "leg2", "setting": "crd_full", "seed": seed, "set": split, "images": 20480, "exact": exact, **gains}

    rows = seeds_table([final(1, 0.26), final(2, 0.24), final(1, 0.9, "train")])
    assert len(rows) == 3
    assert rows[2] == (
        "| leg2 | crd_full | 2 | 20,480/20,480 | 8 | 0.250 ± 0.010 | +0.100 ± 0.010 | +0.050 ± 0.010 | - | +0.150 ± 0.050 |"
    )
    # pooled over prompts: the seeds' per-prompt gains [.1 0 .2] and [0 0 .2] average to [.05 0 .2]: mean 0.0833, sample
    # std 0.1041, SE 0.1041 / sqrt(3) = 0.060
    one, two = final(1, 0.26), final(2, 0.24)
    one["exact_gain_cfg4.5_per_prompt"], two["exact_gain_cfg4.5_per_prompt"] = [0.1, 0.0, 0.2], [0.0, 0.0, 0.2]
    assert seeds_table([one, two])[2].split(" | ")[8] == "+0.083 ± 0.060"


def tiny_scales():
    """dry_run.Scale records for tiny Qwen-Image and FLUX.2 transformers (the real classes, small widths)."""
    import torch

    from benchmark.dry_run import Scale

    qwen = dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4),
    )
    flux2 = dict(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,
    )
    te = ("none", 0)
    return {
        "qwenimage": Scale(
            "tiny Qwen-Image", "QwenImageTransformer2DModel", qwen, "qwenimage", dict(num_layers=1),
            (("transformer_blocks", 0, 3),), (4, 32, 32), 2, 16, None, 8, te, te,
        ),
        "flux2": Scale(
            "tiny FLUX.2", "Flux2Transformer2DModel", flux2, "flux2", dict(num_layers=1, num_single_layers=1),
            (("transformer_blocks", 0, 2), ("single_transformer_blocks", 0, 3)), (16, 16, 16), 1, 48,
            lambda b: torch.zeros(b, 0), 8, te, te,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("family", ["qwenimage", "flux2"])
def test_meta_parameter_counts_equal_the_real_model(family):
    """dry_run.model_counts (built on the meta device) against the same config built for real, and the LoRA count
    against 8 D x D projections per double-stream block, each adding r (D + D)."""
    import diffusers
    import torch

    import models
    from benchmark.dry_run import model_counts

    s = tiny_scales()[family]
    c = model_counts(s, rank=4)
    torch.manual_seed(0)
    real = getattr(diffusers, s.cls)(**s.config)
    assert c["params"] == sum(p.numel() for p in real.parameters())
    attrs = [k[0] for k in s.kinds]
    assert c["root"] == sum(p.numel() for n, p in real.named_parameters() if n.split(".")[0] not in attrs)
    assert c["unit"] == max(sum(p.numel() for p in b.parameters()) for a in attrs for b in getattr(real, a))
    assert c["blocks"] == sum(len(getattr(real, a)) for a in attrs)
    models.add_lora(real, 4, 8, None)
    assert c["lora"] == sum(p.numel() for n, p in real.named_parameters() if "lora_" in n)
    double_blocks = s.config["num_layers"]  # FLUX.2's single-stream blocks have none of the family's targets
    assert c["lora"] == double_blocks * 8 * 4 * (32 + 32)


@pytest.mark.parametrize("family", ["qwenimage", "flux2"])
def test_one_more_block_extrapolation_equals_the_deeper_model(family):
    """dry_run.block_activations measures a one-block-per-kind model and one more block of each kind; activations()
    extrapolates to the config's block counts. Equal to the bytes measured on the deeper model itself."""
    import diffusers
    import torch

    import models
    from benchmark.dry_run import SavedTensorMeter, activations, block_activations

    s = tiny_scales()[family]
    a = block_activations(s, side_scale=2, text_tokens=s.text_tokens)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        deep = getattr(diffusers, s.cls)(**s.config).eval()
    finally:
        torch.set_default_dtype(default)
    c, h, w = s.latent
    family_ = importlib.import_module(f"models.{s.family}").FAMILY
    for mode in ("full", "lora"):
        if mode == "lora":
            deep.requires_grad_(False)
            for p in models.add_lora(deep, 32, 64, None):
                p.data = p.data.to(torch.bfloat16)  # as block_activations: the autocast copies are a separate term
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, c, h // 2, w // 2, generator=g)
        embeds = torch.randn(1, s.text_tokens, s.joint_dim, generator=g)
        extra = torch.ones(1, s.text_tokens, dtype=torch.long) if s.extra is None else s.extra(1)
        meter = SavedTensorMeter()
        meter.param_ptrs = {p.untyped_storage().data_ptr() for p in deep.parameters()}
        with (
            torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack),
            torch.autocast("cpu", torch.bfloat16, mode == "lora"),
        ):
            out = family_.velocity(deep, x, torch.full((1,), 0.5), embeds, extra, None, 1.0)
        del out
        assert meter.peak > 0
        assert activations(s, a, mode == "full", False, a["tokens"]) == meter.peak, mode


def test_per_gpu_terms_and_fewest_gpus_against_a_hand_computation():
    from benchmark.dry_run import activations, min_gpus, per_gpu

    c = dict(params=1000, lora=10, root=100, unit=50, te=300, vae=20, act=400, act_gc=40)
    total = lambda **kw: sum(per_gpu(c, **kw).values())  # noqa: E731
    # LoRA, replicated: bf16 base 2000 + LoRA 16 x 10 + its bf16 copy 2 x 10 + activations 400 + text encoder 600 +
    # VAE 40, whatever the ranks
    for ranks in (1, 8):
        assert total(ranks=ranks, fsdp=False, gc=False, full=False, text_encoder=True) == 3220
    # full, FSDP over 8, checkpointed: 16 x 1000 / 8 + reference 2 x 1000 / 8 + gathered 2 (100 + 2 x 50) + their grads
    # 2 (100 + 50) + activations 40 + VAE 40
    assert total(ranks=8, fsdp=True, gc=True, full=True, text_encoder=False) == 2000 + 250 + 400 + 300 + 40 + 40
    # full, replicated: + the bf16 compute copy, all weights (2000) or one block with checkpointing (100)
    assert total(ranks=8, fsdp=False, gc=False, full=True, text_encoder=False) == 16000 + 2000 + 2000 + 400 + 40
    assert total(ranks=8, fsdp=False, gc=True, full=True, text_encoder=False) == 16000 + 2000 + 100 + 40 + 40
    # 18000 / n + 780 <= 3030 first at n = 8; without FSDP no rank count fits
    assert min_gpus(c, budget=3030, fsdp=True, gc=True, full=True, text_encoder=False) == 8
    assert min_gpus(c, budget=3029, fsdp=True, gc=True, full=True, text_encoder=False) == 9
    assert min_gpus(c, budget=3030, fsdp=False, gc=True, full=True, text_encoder=False) is None

    class S:
        kinds = (("double", 0, 4), ("single", 0, 6))

    a = dict(tokens=100, block_input=10, lora=dict(base=1000, blocks={("double", 0): 300, ("single", 0): 200}))
    # 200 tokens = 2x: (1000 + 3 x 300 + 5 x 200) x 2; checkpointed: (outside 1000 - 500 + 10 blocks x 10 + 300) x 2
    assert activations(S, a, False, False, 200) == 5800
    assert activations(S, a, False, True, 200) == 1800


def test_memory_table_bad_out_folder_exits_2_writing_nothing(tmp_path):
    out = tmp_path / "missing" / "dry_run.md"
    r = run_script(["benchmark/dry_run.py", "--memory-table", "--out", out], check=False, timeout=120)
    assert r.returncode == 2 and not out.parent.exists()
    assert r.stderr.strip().splitlines() == [f"--out {out}: the folder {out.parent} does not exist"]


@pytest.mark.slow
def test_full_size_configs_have_the_published_sizes():
    """The configs the memory table uses, built on the meta device: Qwen-Image's 20,430,401,088 parameters are the
    40.86 GB of its released bf16 safetensors; FLUX.2-dev is BFL's "32B", its Mistral-Small encoder "24B", Qwen2.5-VL-7B
    the hub's 8.29B; SD3.5-M as the dry run built it for real (SD35_MEDIUM_PARAMS)."""
    from benchmark.dry_run import SCALES, SD35_MEDIUM_PARAMS, component_params, model_counts

    sd35, qwen, flux2 = SCALES
    assert model_counts(sd35)["params"] == SD35_MEDIUM_PARAMS
    assert model_counts(qwen)["params"] == 20_430_401_088
    assert 32.0e9 < model_counts(flux2)["params"] < 32.5e9
    assert round(component_params(qwen.text_encoder) / 1e9, 2) == 8.29
    assert 23.5e9 < component_params(flux2.text_encoder) < 24.5e9


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["final", "{tmp}/no_run"], "{tmp}/no_run: not a run folder (no args.json)"),
        (["final", "{export}", "--noises", "0"], "--noises 0: must be >= 1"),
        (["final", "{weightless}"], "{weightless}: its export has no weights (restore them as its README says)"),
        (["final", "{export}", "--guidance-scale", "-1"], "--guidance-scale -1: must be >= 0 (0: each run's own)"),
        (
            ["base", "--task", "ocr", "--model", "{tmp}/no_model"],
            "--model {tmp}/no_model: not a pipeline folder (no model_index.json)",
        ),
        (
            ["base", "--task", "ocr", "--sets", "unseen"],
            "--sets unseen: the unseen colour-attribution prompts are tiny-shapes prompts (not --task ocr)",
        ),
    ],
)
def test_convergence_bad_inputs_exit_2_writing_nothing(tmp_path, argv, message):
    export = REPO / "benchmark" / "results" / "convergence" / "leg2" / "crd_full_lr1e-4__s1"
    fill = {"tmp": tmp_path, "export": export, "weightless": export.with_name("crd_full_lr1e-4__s2")}
    results = tmp_path / "results"
    argv = ["benchmark/convergence.py", *(a.format(**fill) for a in argv), "--results", results]
    r = run_script(argv, check=False, timeout=120)
    assert r.returncode == 2 and not results.exists()
    assert r.stderr.strip().splitlines()[-1] == f"convergence.py: error: {message.format(**fill)}"


@pytest.mark.slow
def test_convergence_final_refuses_a_run_still_training(tmp_path):
    """`final` on a run whose .lock a training process holds would score the half-trained export of its last
    checkpoint: one line, rc 2, nothing written. Once the lock is released the same folder is past the guard."""
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(REPO / "benchmark" / "results" / "convergence" / "leg2" / "crd_full_lr1e-4__s1" / "args.json", run)
    results = tmp_path / "results"
    argv = ["benchmark/convergence.py", "final", str(run), "--results", results, "--model", str(tmp_path / "no_model")]
    with open(run / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: conflicts as the training process would
        r = run_script(argv, check=False, timeout=120)
    assert r.returncode == 2 and not results.exists()
    assert (
        r.stderr.strip().splitlines()[-1]
        == f"convergence.py: error: {run}: still training (its .lock is held); score its export when the run has ended"
    )
    r = run_script(argv, check=False, timeout=120)  # released: the next check (the missing model) is what stops it
    assert r.returncode == 2 and "not a pipeline folder" in r.stderr.strip().splitlines()[-1]


def test_stopped_short_reads_the_newest_checkpoint_against_num_epochs(tmp_path):
    from benchmark.convergence import stopped_short

    (tmp_path / "args.json").write_text(json.dumps({"num_epochs": 160}))
    assert stopped_short(tmp_path) == ""  # a committed copy: no checkpoints
    for epoch in (20, 40):
        (tmp_path / "checkpoints" / f"epoch_{epoch:06d}").mkdir(parents=True)
    assert stopped_short(tmp_path) == "epoch 40 of 160"
    (tmp_path / "checkpoints" / "epoch_000160").mkdir()
    assert stopped_short(tmp_path) == ""


def test_unseen_set_is_30_colour_attribution_prompts_of_the_world_in_neither_prompt_file():
    """`--sets unseen` (convergence.UNSEEN): every prompt a colour-attribution caption of the grammar, none a training
    or held-out caption, each asking for a colour-shape pair no training caption names, in test.jsonl's fields."""
    import json

    import common
    from benchmark.convergence import UNSEEN, prompt_sets
    from harness import prompt_files
    from rewards.worlds import shapes as world

    sets = prompt_sets(unseen_file=UNSEEN)
    assert set(prompt_sets()) == {"test", "train"}  # without the file, the sets of before
    rows = [json.loads(line) for line in Path(UNSEEN).read_text().splitlines()]
    assert sets["unseen"] == [r["prompt"] for r in rows] and len(set(sets["unseen"])) == 30
    test_keys = set(json.loads((REPO / "assets" / "test.jsonl").read_text().splitlines()[0]))
    grammar = {prompt: (cat, spec) for cat, prompt, spec in world.all_prompts()}
    train, test = set(prompt_files.load_prompts(common.TRAIN_PROMPTS)), set(prompt_files.load_prompts(common.TEST_PROMPTS))
    trained_pairs = {tuple(o) for p in train for o in grammar[p][1]}
    for r in rows:
        assert set(r) == test_keys and r["category"] == "color_attr" and r["held_out"]
        assert grammar[r["prompt"]][0] == "color_attr"
        assert r["prompt"] not in train | test
        assert any(tuple(o) not in trained_pairs for o in grammar[r["prompt"]][1])


def test_base_row_gives_best_of_k_only_up_to_its_noises():
    import numpy as np

    from benchmark.convergence import base_row, best_of_k

    rng = np.random.default_rng(0)
    m = {k: (rng.random((4, 30)) < 0.3).astype(float) for k in ("exact", "strict", "extra", "gap", "score")}
    row = base_row(m, 4.5, "test")
    assert (row["noises"], row["prompts"], row["guidance_scale"]) == (4, 30, 4.5)
    assert row["exact"] == m["exact"].mean() and row["best_of_4"] == best_of_k(m["exact"], 4)
    assert "best_of_8" not in row
    # per prompt, in the set's order: exact over the noises and best-of-4 (all 4 noises: any of them exact)
    assert np.allclose(row["exact_per_prompt"], m["exact"].mean(0))
    assert row["best_of_4_per_prompt"] == m["exact"].max(0).tolist()
    assert "best_of_4_per_prompt" not in base_row({k: v[:2] for k, v in m.items()}, 1.0, "test")


@pytest.mark.slow
@needs_ocr
def test_ocr_metrics_read_rendered_words_and_score_them_against_the_next_word():
    """convergence.ocr_metrics on rendered words (read back exactly): exact is the reward's 1.0, the gap is the score
    minus the same image's reward for the next prompt, computed here with the reward itself."""
    import torch

    from benchmark.convergence import ocr_metrics
    from rewards import ocr
    from rewards.worlds import text as text_world

    _, test = text_world.splits()
    captions, images = text_world.make_dataset(test[:6], 6, seed=3)
    images = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    m = ocr_metrics(images, captions)
    reward = ocr.ocr()
    right, wrong = reward(images, captions), reward(images, captions[1:] + captions[:1])
    assert torch.equal(m["exact"], (right == 1).float()) and m["exact"].mean() >= 5 / 6
    assert torch.allclose(m["score"], right) and torch.allclose(m["gap"], right - wrong)
    # an exactly read image scores below 1 for a different word, and its gap is 0 where the next prompt is the same
    differs = torch.tensor([a != b for a, b in zip(captions, captions[1:] + captions[:1])])
    assert (m["gap"][(m["exact"] == 1) & differs] > 0).all() and (m["gap"][~differs] == 0).all()


@pytest.mark.parametrize("algo", ["crd", "grpo"])
def test_ocr_task_runs_the_file_defaults_on_tiny_text(tmp_path, algo):
    """`convergence.py train --task ocr`: the algorithm's own defaults (every weight, or GRPO's LoRA) on tiny-text
    with the OCR reward and the text prompt files, evaluated on 4 noises; the shapes task keeps its 8 noises and
    the LoRA its old settings trained; `--task edit` is the file defaults on tiny-edit as OCR's are."""
    from benchmark.convergence import TASKS, run_flags

    mod = importlib.import_module(f"algos.{algo}")
    args = tyro.cli(mod.Args, args=run_flags(TASKS["ocr"], algo, 1, 100, 20, tmp_path))
    default = mod.Args()
    # paths inside the repository relative to it (the runs start there): no machine's folder in args.json or model card
    assert args.model == "assets/tiny-text" and args.reward == "ocr" and args.eval_noises == 4
    assert (args.train_prompts, args.test_prompts) == ("assets/text_train.jsonl", "assets/text_test.jsonl")
    assert (args.full_finetune, args.learning_rate) == (default.full_finetune, default.learning_rate)
    assert (args.num_epochs, args.eval_every, args.save_every, args.output_dir) == (100, 20, 20, str(tmp_path))
    shapes = tyro.cli(mod.Args, args=run_flags(TASKS["shapes"], algo, 1, 100, 20, tmp_path))
    assert Path(shapes.model).resolve() == Path(default.model).resolve() and shapes.reward == default.reward
    assert (shapes.model, shapes.train_prompts, shapes.test_prompts) == (
        "assets/tiny-shapes",
        "assets/train.jsonl",
        "assets/test.jsonl",
    )
    assert shapes.eval_noises == 8
    assert shapes.full_finetune is False
    other = tyro.cli(mod.Args, args=run_flags(TASKS["shapes"], algo, 1, 100, 20, tmp_path, str(tmp_path / "tiny-8l")))
    assert other.model == str(tmp_path / "tiny-8l") and other.reward == default.reward  # another shapes testbed
    edit = tyro.cli(mod.Args, args=run_flags(TASKS["edit"], algo, 1, 100, 20, tmp_path))
    assert (edit.model, edit.reward, edit.train_prompts) == ("assets/tiny-edit", "edit", "assets/edit/train.jsonl")
    assert (edit.full_finetune, edit.learning_rate, edit.eval_noises) == (default.full_finetune, default.learning_rate, 4)


def test_categories_table_gives_each_kinds_exact_for_the_base_and_the_seeds_mean_export():
    """convergence.categories_table from base rows and finals (as `final` writes them) against the same means taken by
    hand: the base's per-prompt exact and best-of-4 at both CFGs, and an export's exact = base CFG 1 + its paired
    per-prompt gain, averaged over its two seeds, per kind and over all prompts."""
    import itertools

    import numpy as np

    from benchmark.convergence import base_row, categories_table

    subsets = list(itertools.combinations(range(8), 4))
    rng = np.random.default_rng(1)
    kinds = ["counting", "position", "counting", "colors", "position", "counting"]
    m = {
        cfg: {k: (rng.random((8, 6)) < 0.4).astype(float) for k in ("exact", "strict", "extra", "gap", "score")}
        for cfg in (1.0, 4.5)
    }
    base = [base_row(m[cfg], cfg, "train") for cfg in (1.0, 4.5)]
    models = [(rng.random((8, 6)) < 0.5).astype(float) for _ in range(2)]
    finals = [
        {
            "sweep": "leg",
            "setting": "crd",
            "set": "train",
            "noises": 8,
            "exact_gain_cfg1_per_prompt": list((x - m[1.0]["exact"]).mean(0)),
        }
        for x in models
    ]
    rows = categories_table(base, finals, {"train": ["p"] * 6}, {"train": kinds})
    cells = {r.split(" | ")[2]: r.strip("| ").split(" | ") for r in rows[2:]}
    assert set(cells) == {"colors", "counting", "position", "all"}
    for kind, pick in (("counting", [0, 2, 5]), ("all", list(range(6)))):
        want = [m[1.0]["exact"][:, pick].mean(), m[4.5]["exact"][:, pick].mean()]
        for cfg in (1.0, 4.5):  # best-of-4 by enumerating every 4 of the 8 noises
            want.append(np.mean([[m[cfg]["exact"][list(s), p].max() for s in subsets] for p in pick]))
        want += [np.mean([x[:, pick].mean() for x in models])]
        got = [float(c) for c in cells[kind][4:8]] + [float(cells[kind][9])]
        assert cells[kind][3] == str(len(pick)) and cells[kind][8] == "leg/crd (2)"
        assert np.allclose(got, want, atol=6e-4), (kind, got, want)


@pytest.mark.slow
def test_categories_without_per_prompt_base_rows_is_one_line_rc_2(tmp_path):
    """`categories` on a folder with no base row carrying per-prompt lists says so in one line, exits 2."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "benchmark/convergence.py", "categories", "--results", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"convergence.py: error: --results {tmp_path / 'none'}: no base row with per-prompt exact (run `final` there)"
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--groups", "12"], "error: --groups must be a positive multiple of 8 (got 12)"),
        (["--prompts", "missing.jsonl"], "error: prompt file 'missing.jsonl' not found"),
    ],
)
def test_group_spread_bad_inputs_are_one_line_rc_2(argv, message):
    """benchmark/studies/group_spread.py answers a bad flag in one line, exit 2, before loading a model."""
    r = run_script(["benchmark/studies/group_spread.py", *argv], check=False, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [message]


def test_gradient_noise_scale_against_every_pair_of_steps():
    """gradient_noise.noise_scale (from the Gram matrix of per-epoch sums) against the mean of g_i . g_j over every
    pair of steps from different epochs, computed pair by pair; and on many steps it recovers a known |G|^2 and
    tr(Sigma_B)."""
    import numpy as np

    from benchmark.studies.gradient_noise import jackknife, noise_scale

    rng = np.random.default_rng(0)
    d, epochs, per_epoch, batch = 500, 6, 3, 32.0
    true_g = rng.normal(size=d) * 0.05  # |G|^2 ~ 1.25
    g = true_g + rng.normal(size=(epochs, per_epoch, d)) * 0.1  # tr(Sigma_B) = 5
    steps = g.reshape(-1, d)
    epoch_of = np.repeat(np.arange(epochs), per_epoch)
    pairs = [steps[i] @ steps[j] for i in range(len(steps)) for j in range(len(steps)) if epoch_of[i] != epoch_of[j]]
    sums = g.sum(1)
    out = noise_scale(sums @ sums.T, float((steps**2).sum()), np.full(epochs, per_epoch, dtype=float), batch)
    assert abs(out["signal"] - np.mean(pairs)) < 1e-9
    assert abs(out["noise"] - ((steps**2).sum(1).mean() - np.mean(pairs))) < 1e-9
    assert abs(out["b_noise"] - batch * out["noise"] / out["signal"]) < 1e-6

    epochs = 400
    g = true_g + rng.normal(size=(epochs, per_epoch, d)) * 0.1
    sums = g.sum(1)
    sq = (g**2).sum((1, 2))
    est = jackknife(sums @ sums.T, sq, np.full(epochs, per_epoch, dtype=float), batch)
    signal, noise = true_g @ true_g, d * 0.01
    assert abs(est["signal"] - signal) < 3 * est["signal_se"] and est["signal_se"] < 0.1 * signal
    assert abs(est["noise"] - noise) < 0.02 * noise
    assert abs(est["b_noise"] - batch * noise / signal) < 3 * est["b_noise_se"]


def test_gradient_noise_adam_scaling_and_ranges_against_each_step():
    """adam_scaled (from per-epoch sums) against dividing every step's gradient by the coordinates' RMS over all steps
    and taking the cross-epoch pairs one by one; b_noise_range against its definition."""
    import numpy as np
    import torch

    from benchmark.studies.gradient_noise import adam_scaled, b_noise_range, noise_scale

    rng = np.random.default_rng(1)
    epochs, per_epoch, d = 5, 2, 40
    g = rng.normal(size=(epochs, per_epoch, d)) * rng.uniform(0.1, 10, size=d) + 0.3
    g[..., 0] = 0.0  # a coordinate without gradient is left out
    steps = g.reshape(-1, d)
    rms = np.sqrt((steps**2).mean(0))
    scaled = np.divide(steps, rms, out=np.zeros_like(steps), where=rms > 0)
    epoch_of = np.repeat(np.arange(epochs), per_epoch)
    n = len(scaled)
    pairs = [scaled[i] @ scaled[j] for i in range(n) for j in range(n) if epoch_of[i] != epoch_of[j]]
    gram, sq = adam_scaled(torch.tensor(g.sum(1)), torch.tensor((g**2).sum(1)), n)
    out = noise_scale(gram, sq.sum(), np.full(epochs, per_epoch, dtype=float), 8.0)
    assert abs(out["signal"] - np.mean(pairs)) < 1e-9
    assert abs(out["noise"] - ((scaled**2).sum(1).mean() - np.mean(pairs))) < 1e-9
    assert abs(sq.sum() / n - (d - 1)) < 1e-9  # every used coordinate scaled to mean square 1
    assert b_noise_range({"signal": 2.0, "signal_se": 0.5, "noise": 6.0}, 8.0) == (8.0 * 6 / 3.0, 8.0 * 6 / 1.0)
    assert b_noise_range({"signal": 0.5, "signal_se": 0.5, "noise": 6.0}, 8.0) == (8.0 * 6 / 1.5, float("inf"))


@pytest.mark.slow
def test_gradient_noise_keeps_the_base_and_records_every_step(tmp_path):
    """A 3-epoch GRPO run through benchmark/studies/gradient_noise.py on the tiny model: 6 steps recorded, and the final eval
    equals the eval before training to the digit (AdamW never moved a weight)."""
    import json

    out = tmp_path / "g.json"
    r = run_script(["benchmark/studies/gradient_noise.py", "grpo", "--num-epochs", "3", "--out", out], timeout=600)
    evals = [line.split(": ", 1)[1] for line in r.stdout.splitlines() if "eval after" in line]
    assert len(evals) == 2 and evals[0] == evals[1]
    result = json.loads(out.read_text())
    assert result["steps"] == 6 and result["images_per_step"] == 32 and result["flags"] == ["--num-epochs", "3"]
    assert result["plain"]["noise"] > 0 and result["params"] > 0
    rows = run_script(["benchmark/studies/gradient_noise.py", "table", tmp_path], timeout=120).stdout.splitlines()
    assert len(rows) == 3 and rows[2].startswith("| g | grpo | tiny-shapes | shapes_clean | 32 x 6 |")


def test_gradient_noise_shuffles_dpo_pairs():
    """--shuffled-advantages on DPO permutes the rewards its pairs are chosen from: the pairs are select_pairs' on
    the permuted rewards (the same permutation drawn independently), not on the images' own rewards."""
    import torch

    from benchmark.studies.gradient_noise import shuffle_rewards

    spec = importlib.util.spec_from_file_location("dpo_shuffled", REPO / "algos" / "dpo.py")
    dpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dpo)
    real = dpo.select_pairs
    rewards = torch.arange(16, dtype=torch.float32)  # two groups of 8: best = last, worst = first
    assert real(rewards, 8, "best-worst").tolist() == [[7, 0], [15, 8]]
    shuffle_rewards(dpo, "dpo", seed=0)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    shuffled = rewards[perm].tolist()
    expected = [
        [8 * g + max(range(8), key=lambda i: shuffled[8 * g + i]), 8 * g + min(range(8), key=lambda i: shuffled[8 * g + i])]
        for g in range(2)
    ]
    assert dpo.select_pairs(rewards, 8, "best-worst").tolist() == expected != [[7, 0], [15, 8]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["sft"],
            "usage: gradient_noise.py {grpo,grpo_variants,dgpo,nft,awm,crd,dpo,elbo_grpo} [--out FILE] "
            "[--shuffled-advantages] [flags] | table FOLDER",
        ),
        (
            ["grpo", "--out", "no/such/folder/g.json"],
            "gradient_noise.py: --out no/such/folder/g.json: the folder no/such/folder does not exist",
        ),
        (["grpo", "--out"], "gradient_noise.py: argument --out: expected one argument"),
        (["table"], "gradient_noise.py table: the following arguments are required: folder"),
        (["table", "no/such/folder"], "gradient_noise.py table: no/such/folder: not a folder"),
        (
            ["table", "tests", "--plot", "no/such/g.png"],
            "gradient_noise.py table: --plot no/such/g.png: the folder no/such does not exist",
        ),
        (["crd", "--num-epochs", "2"], "gradient_noise.py: needs --num-epochs >= 3 (pairs of steps from different epochs)"),
    ],
)
def test_gradient_noise_bad_inputs_are_one_line_rc_2(argv, message):
    """benchmark/studies/gradient_noise.py answers a bad argument in one line, exit 2, before loading a model."""
    r = run_script(["benchmark/studies/gradient_noise.py", *argv], check=False, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [message]


@pytest.mark.slow
@pytest.mark.parametrize("study", sorted(p.name for p in (REPO / "benchmark" / "studies").glob("*.py")))
def test_every_study_answers_help(study):
    """The finished studies moved to benchmark/studies/ still find the repository: `--help` works, exit 0."""
    r = run_script([f"benchmark/studies/{study}", "--help"], timeout=300)
    assert r.returncode == 0 and "usage" in r.stdout.lower()


def test_the_studies_index_lists_every_study():
    index = (REPO / "benchmark" / "studies" / "README.md").read_text()
    for study in (REPO / "benchmark" / "studies").glob("*.py"):
        assert f"]({study.name})" in index, f"{study.name} is not in benchmark/studies/README.md"


def test_every_committed_export_has_its_weights_or_a_readme_that_restores_and_remakes_them():
    """The checkout keeps the exports the README's results table cites (at most one per algorithm and testbed); every
    other export folder keeps its args.json, model card and samples, and a README.md that restores the weights from the
    history and retrains the run with its own setting and seed."""
    import json

    from benchmark.results_table import RESULTS, ROWS

    cited = {export for *_, export in ROWS if export}
    kept, removed = set(), set()
    for args_file in sorted(RESULTS.rglob("args.json")):
        folder = args_file.parent
        if "runs" in folder.relative_to(RESULTS).parts:  # a convergence run in progress here (git ignores runs/)
            continue
        for kind in ("transformer", "lora"):
            if not (folder / kind).is_dir():
                continue
            rel = folder.relative_to(RESULTS).as_posix()
            assert (folder / kind / "README.md").is_file() and (folder / kind / "samples.png").is_file(), rel
            if list((folder / kind).glob("*.safetensors")):
                kept.add(rel)
                continue
            removed.add(rel)
            args = json.loads(args_file.read_text())
            note = (folder / "README.md").read_text()
            path = folder.relative_to(REPO).as_posix()
            assert f"git checkout 3ab1242 -- {path}/{kind}\n" in note, rel
            assert f"python benchmark/convergence.py train {args['exp_name']} --seeds {args['seed']} " in note, rel
    assert kept == cited, f"exports in the tree that the table does not cite, or cited and missing: {kept ^ cited}"
    per_testbed = [(testbed, algo) for testbed, algo, *_, export in ROWS if export]
    assert len(per_testbed) == len(set(per_testbed)), "more than one export of an algorithm on a testbed"
    assert len(removed) >= 16  # the exports removed to keep the checkout small, each still restorable


def test_the_learning_figure_reads_three_seeds_of_every_algorithm_from_one_base():
    """benchmark/learning_figure.py's curves: every algorithm file at its defaults, 3 seeds each, evaluated at the same
    images, every run starting from the same base evaluation (the figure's CFG-1 line)."""
    from benchmark import learning_figure

    algos = {name.lower().replace("-", "_") for name, _, _ in learning_figure.CURVES}
    # the distillation files learn no reward from the base (their tables compare them with their teachers), and TDM-R1
    # starts from a few-step model
    assert algos == {p.stem for p in (REPO / "algos").glob("*.py")} - {"grpo_variants", "opd", "dmd2", "tdm_r1"}
    firsts = set()
    for _, folder, setting in learning_figure.CURVES:
        images, exact = learning_figure.seed_curves(folder, setting)
        assert exact.shape == (3, len(images)) and images[0] == 0 and len(images) >= 3, (setting, exact.shape)
        firsts |= {round(float(v), 6) for v in exact[:, 0]}
    assert len(firsts) == 1, firsts


@pytest.mark.slow
def test_pairs_from_base_writes_each_prompts_best_and_worst_and_refuses_what_exists(tmp_path, capsys):
    """benchmark/pairs_from_base.py: a pair per prompt whose samples differ, the best as chosen, the worst as rejected
    (their rewards recomputed here from the written images, by the same reward), the SFT file with the chosen images
    alone, both read by dpo.py's own pairs loader; an existing folder, or a bad flag, is one line, rc 2, nothing new."""
    import torch

    from benchmark import pairs_from_base
    from harness import pair_files
    from rewards import load_rewards

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\ntwo blue squares\na green triangle\n")
    out = tmp_path / "pairs"
    argv = [str(out), "--prompts", str(prompts), "--samples-per-prompt", "3", "--num-steps", "2"]
    assert pairs_from_base.main(argv) == 0
    rows = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    sft = [json.loads(line) for line in (out / "chosen.jsonl").read_text().splitlines()]
    assert 1 <= len(rows) <= 3 and [r["chosen"] for r in rows] == [r["chosen"] for r in sft]
    names, chosen, rejected = pair_files.load_pairs(out / "pairs.jsonl", 64, 64)
    assert names == [r["prompt"] for r in rows] and rejected is not None
    reward = load_rewards("shapes_clean", "cpu")
    for side, images in (("chosen", chosen), ("rejected", rejected)):
        pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
        rescored = reward.total(reward(pixels, names)).tolist()
        assert rescored == pytest.approx([r["rewards"][0 if side == "chosen" else 1] for r in rows], abs=0.02)
    assert all(r["rewards"][0] > r["rewards"][1] for r in rows)
    assert pair_files.load_pairs(out / "chosen.jsonl", 64, 64)[2] is None  # SFT
    assert pairs_from_base.best_and_worst(torch.tensor([1.0, 3.0, 2.0, 5.0, 5.0, 5.0]), 3) == [(1, 0), None]
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    for bad in (argv, [str(tmp_path / "new"), "--samples-per-prompt", "1"], [str(tmp_path / "new"), "--reward", "nope"]):
        assert pairs_from_base.main(bad) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("doc", ["opd.md", "dmd2.md", "tdm_r1.md"])
def test_the_distillation_docs_tables_are_the_scripts_output(doc):
    """Every table row of the distillation docs' results is a row `python benchmark/few_step_table.py` prints from the
    committed scores (so their numbers are the committed ones)."""
    import contextlib
    import io

    from benchmark import few_step_table

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        few_step_table.main([])
    rows = set(printed.getvalue().splitlines())
    text = (REPO / "docs" / doc).read_text().split("## Results on tiny-shapes")[1].split("\n## ")[0]
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert table and set(table) <= rows, set(table) - rows
