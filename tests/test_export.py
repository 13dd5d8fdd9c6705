"""The trained model leaves the project: the exported LoRA folder loaded by stock diffusers pipelines (as a user would),
the model card and its snippet, --push-to-hub up to the upload call, and --track mirrored to an offline wandb run."""

import importlib.util
import json
import re
import signal
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ode_sample
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import common
import models
from harness import distributed, export, run
from models import flux

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a red circle", "a blue square and a red circle"]


def load_algo(name: str):
    spec = importlib.util.spec_from_file_location(f"cleanflow_{name}", REPO / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --track's wandb is an optional extra (requirements-track.txt), not in the README's install: without it the run below
# trains untracked and only the test of the wandb mirror is skipped
HAS_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One epoch of NFT on tiny-shapes, in-process, with --track (offline wandb, when installed) and --push-to-hub
    (upload faked); groups of 4, since a group of 2 equal rewards gives NFT a zero gradient and the LoRA would not move.
    The export is wrapped to keep the training pipeline, whose transformer holds the trained LoRA at the end."""
    import huggingface_hub

    tmp = tmp_path_factory.mktemp("export")
    (tmp / "test.txt").write_text("a red circle\ntwo squares\n")
    nft = load_algo("nft")
    args = nft.Args(
        full_finetune=False,  # a LoRA, as on a real model (the tiny model's default trains every weight)
        num_prompts=2,
        group_size=4,
        micro_batch=4,
        num_steps=2,
        num_train_timesteps=1,
        num_epochs=1,
        test_prompts=str(tmp / "test.txt"),
        output_dir=str(tmp / "runs"),
        track=HAS_WANDB,
        wandb_project_name="test",
        push_to_hub="someone/tiny-lora",
    )
    pipes, uploads, real_export = [], [], export.export_lora

    def recording_export(out_dir, pipe, *a, **k):
        pipes.append(pipe)
        return real_export(out_dir, pipe, *a, **k)

    def fake_upload(**kwargs):  # what would be sent: the folder's files at the time of the call
        uploads.append({**kwargs, "files": sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())})
        return f"https://example.invalid/{kwargs['repo_id']}"

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # the run installs its own
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(tmp))
        mp.setenv("WANDB_SILENT", "true")
        mp.setattr(export, "export_lora", recording_export)
        mp.setattr(huggingface_hub, "create_repo", lambda *a, **k: None)
        mp.setattr(huggingface_hub, "upload_folder", fake_upload)
        try:
            run.run_main(nft.main, args)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
    (run_dir,) = (tmp / "runs").iterdir()
    return SimpleNamespace(
        run_dir=run_dir, lora=run_dir / "lora", pipe=pipes[-1], exports=len(pipes), uploads=uploads, tmp=tmp
    )


def stock_sd3(lora_dir=None):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(common.TINY_MODEL, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    if lora_dir is not None:
        pipe.load_lora_weights(str(lora_dir))
    return pipe


@pytest.mark.slow
def test_exported_lora_in_a_stock_sd3_pipeline_equals_our_sampler(trained, tmp_path):
    """StableDiffusion3Pipeline.load_lora_weights(runs/<run>/lora) + __call__ with the same noise and sigmas gives our
    sampler's images with the trained weights (max abs diff 0.0 measured), and not the base model's, nor what the same
    weights give without the adapter metadata (diffusers then takes alpha = r: half our LoRA's strength)."""
    lora_a = [p for n, p in trained.pipe.transformer.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_a), "the run did not update the LoRA (B starts at zero)"
    steps, noise = 4, torch.randn(len(PROMPTS), 4, 16, 16, generator=torch.Generator().manual_seed(0))
    ours = common.decode(trained.pipe, ode_sample(trained.pipe, PROMPTS, noise, steps, 1.0)[0].latents)
    sigmas = np.linspace(1.0, 1.0 / steps, steps).tolist()  # our schedule (common.sigma_schedule) before the shift
    call = dict(
        prompt=PROMPTS, num_inference_steps=steps, guidance_scale=1.0, sigmas=sigmas, max_sequence_length=1, output_type="pt"
    )
    loaded = stock_sd3(trained.lora)(**call, latents=noise.clone()).images
    base = stock_sd3()(**call, latents=noise.clone()).images
    (tmp_path / "no-metadata").mkdir()
    save_file(load_file(trained.lora / export.LORA_WEIGHTS), tmp_path / "no-metadata" / export.LORA_WEIGHTS)
    halved = stock_sd3(tmp_path / "no-metadata")(**call, latents=noise.clone()).images
    # 1e-4: our encoder encodes each prompt alone (history-independent embeddings, exact resume), the pipeline all four
    # together, and CLIP's output differs between those in the last float bits (measured 1.2e-5 after 10 steps)
    assert (ours - loaded).abs().max().item() < 1e-4
    assert (ours - base).abs().max().item() > 1e-2  # so the equality above is the LoRA's, not the base's
    assert (ours - halved).abs().max().item() > 1e-2


def test_export_writes_the_adapter_metadata_or_diffusers_would_halve_the_lora(trained):
    with safe_open(str(trained.lora / export.LORA_WEIGHTS), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        keys = list(f.keys())
    # alpha / r = 2: without it diffusers would take alpha = r (metadata keys are prefixed by the pipeline component)
    assert meta["transformer.r"] == 16 and meta["transformer.lora_alpha"] == 32.0
    assert sorted(meta["transformer.target_modules"]) == sorted(common.FAMILIES["StableDiffusion3Pipeline"].lora_targets)
    assert keys and all(k.startswith("transformer.") for k in keys)


def test_model_card_and_folder(trained):
    assert sorted(p.name for p in trained.lora.iterdir()) == ["README.md", export.LORA_WEIGHTS, "samples.png"]
    assert not list(trained.run_dir.glob(".lora*"))  # no temp or old folder left by the atomic swap
    assert (trained.lora / export.LORA_WEIGHTS).stat().st_mode & 0o044 == (
        trained.run_dir / "args.json"
    ).stat().st_mode & 0o044
    assert trained.exports == 1  # save_every 10 > 1 epoch: only the final save
    card = (trained.lora / "README.md").read_text()
    config = json.loads((trained.run_dir / "args.json").read_text())
    for text in (
        "DiffusionNFT, Zheng et al. 2025, arXiv 2509.16117",
        "| reward | `shapes_clean` |",
        "the trained policy, after epoch 1",
        "| eval/shapes | ",
        "| eval/shapes_strict | ",
        "![samples](samples.png)",
        "| learning_rate | ",
        f"Git commit: `{config['git_commit']}`",
        "Command: `python ",
    ):
        assert text in card, text


def test_model_card_snippet_runs(trained, tmp_path, monkeypatch):
    snippet = re.search(r"```python\n(.*?)```", (trained.lora / "README.md").read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(snippet.replace("<this folder>", str(trained.lora)), {})
    assert (tmp_path / "sample.png").is_file()


def test_push_to_hub_uploads_the_exported_folder(trained):
    (upload,) = trained.uploads
    assert upload["repo_id"] == "someone/tiny-lora" and Path(upload["folder_path"]) == trained.lora
    assert upload["files"] == ["README.md", export.LORA_WEIGHTS, "samples.png"]


def test_bad_integration_flags_stop_before_main_with_one_line(monkeypatch, capsys):
    called = []
    bad = [SimpleNamespace(track=False, push_to_hub="not a repo id"), SimpleNamespace(track=True, push_to_hub=None)]
    monkeypatch.setitem(sys.modules, "wandb", None)  # wandb not installed: `import wandb` raises ImportError
    for args in bad:
        with pytest.raises(SystemExit) as e:
            run.run_main(called.append, args)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --")
    assert called == []
    assert "requirements-track.txt" in err[0]


def test_export_alternative_weights_and_atomic_replace(trained, tmp_path):
    """`weights` (an EMA) are exported instead of the live LoRA, which stays untouched; a second export replaces the
    folder whole; `samples` overrides the logger's grid."""
    transformer = trained.pipe.transformer
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    live = [p.detach().clone() for p in params]
    ema = [torch.full_like(p, 0.5) for p in params]
    args = SimpleNamespace(model="m", reward="shapes", run_name="r", lora_targets=("to_q",), lora_rank=16, lora_alpha=32.0)
    out = tmp_path / "lora"
    doc = "Algo, arXiv 1\n\nmore"
    export.export_lora(out, trained.pipe, transformer, args, doc, 3, weights=ema, weights_name="the eval EMA")
    (out / "stale.txt").write_text("from an older export")
    export.export_lora(
        out,
        trained.pipe,
        transformer,
        args,
        "Algo, arXiv 1",
        4,
        weights=ema,
        weights_name="the eval EMA",
        samples=torch.zeros(3, 4, 6),
    )
    assert sorted(p.name for p in out.iterdir()) == ["README.md", export.LORA_WEIGHTS, "samples.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]
    with safe_open(str(out / export.LORA_WEIGHTS), "pt") as f:
        assert all(torch.equal(f.get_tensor(k), torch.full_like(f.get_tensor(k), 0.5)) for k in f.keys())
    for p, v in zip(params, live):
        assert torch.equal(p, v)
    card = (out / "README.md").read_text()
    assert "| algorithm | Algo, arXiv 1 |" in card and "the eval EMA, after epoch 4" in card and "No evaluation logged" in card
    from PIL import Image

    assert Image.open(out / "samples.png").size == (6, 4)


@pytest.mark.slow
def test_exported_lora_in_a_stock_flux_pipeline_equals_our_sampler(flux_pipeline_dirs, tmp_path):
    """FLUX.1-dev layout (tiny, random): a LoRA with random non-zero B exported, loaded by FluxPipeline.load_lora_weights."""
    from diffusers import FluxPipeline

    pipe = models.load_pipeline(flux_pipeline_dirs["dev"], torch.device("cpu"))
    torch.manual_seed(0)
    params = models.add_lora(pipe.transformer, 4, 8.0, ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj"))
    with torch.no_grad():
        for n, p in pipe.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    assert params
    args = SimpleNamespace(
        model=flux_pipeline_dirs["dev"],
        reward="shapes",
        num_steps=3,
        guidance_scale=3.5,
        lora_targets=("to_q",),
        lora_rank=4,
        lora_alpha=8.0,
    )
    out = export.export_lora(tmp_path / "lora", pipe, pipe.transformer, args, "FLUX test", 0)
    assert "from diffusers import FluxPipeline" in (out / "README.md").read_text()

    steps, guidance = 3, 3.5
    noise = torch.randn(len(PROMPTS), 4, 16, 16, generator=torch.Generator().manual_seed(0))
    ours, enc = ode_sample(pipe, PROMPTS, noise, steps, guidance)
    stock = FluxPipeline.from_pretrained(flux_pipeline_dirs["dev"])
    stock.set_progress_bar_config(disable=True)
    call = dict(
        prompt=PROMPTS,
        latents=flux.pack_latents(noise),
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=64,
        width=64,
        max_sequence_length=enc.max_sequence_length,
        output_type="latent",
    )
    base = stock(**call).images
    stock.load_lora_weights(str(out))
    loaded = stock(**call).images
    assert (flux.pack_latents(ours.latents) - loaded).abs().max().item() < 1e-5
    assert (flux.pack_latents(ours.latents) - base).abs().max().item() > 1e-3


def read_wandb_history(path: Path) -> list:
    """The history rows of an offline wandb run file: a LevelDB-style log (7-byte file header, 32 KiB blocks of
    records with a 7-byte header crc32 / length / type FULL=1 FIRST=2 MIDDLE=3 LAST=4) of wandb Record protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, records, partial = path.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            records.append(partial)
    rows = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def test_track_mirrors_the_tensorboard_scalars_to_an_offline_wandb_run(trained):
    pytest.importorskip("wandb", reason="wandb is not installed (optional: pip install -r requirements-track.txt)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_file,) = trained.tmp.glob("wandb/offline-run-*/run-*.wandb")
    rows = read_wandb_history(run_file)
    tb = EventAccumulator(str(trained.run_dir))
    tb.Reload()
    for tag in ("eval/shapes", "charts/reward_mean", "losses/policy_loss"):
        ours = [(e.step, e.value) for e in tb.Scalars(tag)]
        mirrored = [(r["global_step"], r[tag]) for r in rows if tag in r]
        assert ours and [s for s, _ in mirrored] == [s for s, _ in ours], tag
        np.testing.assert_allclose([v for _, v in mirrored], [v for _, v in ours], rtol=1e-6)
    assert any(r.get("eval/images/_type") == "images/separated" for r in rows)  # the eval grid too
    config = json.loads((trained.run_dir / "args.json").read_text())
    assert config["track"] is True


@pytest.mark.parametrize(
    "omp,threads,load,hint", [(None, 2, 2.9, True), (None, 2, 0.3, False), ("1", 2, 2.9, False), (None, 1, 5.0, False)]
)
def test_busy_cpu_hint(monkeypatch, omp, threads, load, hint):
    """First-run help: a note when torch's threads share 2 cores with other work (load 2.9 = ~3 busy processes), none
    on an idle machine, with OMP_NUM_THREADS set, or at one thread."""
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(distributed.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    note = distributed.busy_cpu_hint()
    assert (note is not None) == hint
    if hint:
        assert "\n" not in note and "load 2.9 on 2 cores" in note and "OMP_NUM_THREADS" in note


def test_model_card_for_a_hub_model_lists_every_eval_metric(trained):
    args = SimpleNamespace(
        model="stabilityai/stable-diffusion-3.5-medium",
        reward="pickscore",
        num_steps=40,
        guidance_scale=4.5,
        resolution=512,
        exp_name="crd",
        lora_targets=("to_q",),
        lora_rank=32,
        lora_alpha=64.0,
    )
    evals = {"eval/pickscore": (0.91, 640), "eval/shapes_exact": (0.25, 640), "eval/ocr/colours": (0.5, 640)}
    card = export.model_card(trained.pipe, args, "CRD, arXiv 2603.14128", 7, evals, "the eval EMA (decay 0.9)", False)
    assert card.startswith("---\nlibrary_name: diffusers\n") and "base_model: stabilityai/stable-diffusion-3.5-medium" in card
    for k, (v, _) in evals.items():
        assert f"| {k} | {v:.4f} |" in card
    assert "after 640 training images" in card and "the eval EMA (decay 0.9), after epoch 7" in card
    assert "samples.png" not in card
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    compile(snippet, "card", "exec")
    assert 'dtype=torch.bfloat16).to("cuda")' in snippet and "height=512, width=512" in snippet


def test_a_failed_push_is_one_warning_line(trained, monkeypatch, capsys):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network\nsecond line")

    monkeypatch.setattr(huggingface_hub, "create_repo", offline)
    assert export.push_to_hub(trained.lora, "someone/tiny-lora") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --push-to-hub someone/tiny-lora failed (no network)")
    assert f"hf upload someone/tiny-lora {trained.lora} ." in err[0]


def test_eval_ema_is_what_gets_exported():
    """With --eval-ema-decay the scripts export the EMA (what their evals report); without it, the trained weights."""
    params = [torch.zeros(3, requires_grad=True)]
    ema = models.EvalEMA(params, 0.9)
    with torch.no_grad():
        params[0].fill_(1.0)
    ema.update(1000)
    kwargs = ema.export()
    assert kwargs["weights"][0].tolist() == pytest.approx([0.1] * 3) and kwargs["weights_name"] == "the eval EMA (decay 0.9)"
    assert models.EvalEMA(params, 0.0).export() == {}
