"""Every bad input ends as one line on stderr and exit code 2, before the model loads where it can be known, and
writes nothing: no run folder appears, an existing run stays byte for byte as it was.

The scripts run in-process (`run.run_main` on tyro-parsed flags, as `python algos/<algo>.py` does), so the whole
table takes seconds; only what needs a process of its own (a signal) runs as a subprocess."""

import dataclasses
import fcntl
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import tyro
from conftest import REPO, needs_ocr, run_in_process, run_script
from PIL import Image

import common
import models
from algos import awm, crd, dgpo, dmd2, dpo, elbo_grpo, grpo, grpo_variants, nft, opd, tdm_r1
from harness import checkpoints, export, pair_files, prompt_files, run

ALGOS = {
    "awm": awm,
    "crd": crd,
    "dgpo": dgpo,
    "dmd2": dmd2,
    "dpo": dpo,
    "elbo_grpo": elbo_grpo,
    "grpo": grpo,
    "grpo_variants": grpo_variants,
    "nft": nft,
    "opd": opd,
    "tdm_r1": tdm_r1,
}
TINY = (
    "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --num-epochs 1 --grad-steps-per-epoch 1 --no-full-finetune"
)
TINY = TINY.split()  # a LoRA, as on a real model (the tiny models' default trains every weight)
# what makes TINY valid for a script (GRPO's default 4 SDE steps do not fit the window of 4 steps): only the case's own
# flag may be wrong
VALID = {
    "grpo": ["--num-sde-steps", "1"],
    "grpo_variants": ["--num-sde-steps", "1"],
    "opd": ["--teachers", common.TINY_MODEL],  # a pipeline folder: its transformer teaches
    # RL on dmd2.py's committed 2-step export, every weight trained
    "tdm_r1": ["--generator", "benchmark/results/convergence/few_step/dmd2__s1", "--num-steps", "2", "--full-finetune"],
}
LONG = "a red circle " + "and " * 2500  # 10,000 characters the reward cannot parse

# flags -> a piece of the one error line; {tmp} is the test's folder. Shared checks: run for every script.
SHARED = {
    "--num-prompts 0": "--num-prompts 0: must be > 0",
    "--micro-batch 0": "--micro-batch 0: must be > 0",
    "--grad-steps-per-epoch 0": "--grad-steps-per-epoch 0: must be > 0",
    "--learning-rate=-1": "--learning-rate -1.0: must be >= 0",
    "--learning-rate nan": "--learning-rate nan: must be a finite number",
    "--num-steps 0": "--num-steps 0: must be > 0",
    "--eta=-1": "--eta -1.0: must be >= 0",
    "--num-epochs=-1": "--num-epochs -1: must be > 0",
    "--save-every 0": "--save-every 0: must be > 0",
    "--eval-every 0": "--eval-every 0: must be > 0",
    "--keep-checkpoints=-1": "--keep-checkpoints -1: must be >= 0",
    "--lora-rank 0": "--lora-rank 0: must be > 0",
    "--max-grad-norm 0": "--max-grad-norm 0.0: must be > 0",
    "--device cuda:99": "--device cuda:99",
    "--device gpu": "--device 'gpu' is not a torch device",
    "--output-dir {tmp}/a-file/runs": "cannot create a run folder there",
    "--reward shapes:nan": "bad weight 'nan' for reward 'shapes'",
    "--reward shapes:inf": "bad weight 'inf' for reward 'shapes'",
    "--reward nosuchreward": "unknown reward 'nosuchreward'",
    "--reward ocr": "the ocr reward needs the text to write in double quotes",
    "--train-prompts {tmp}/latin1.txt": "is not UTF-8 text",
    "--train-prompts {tmp}/long.txt": "the shapes reward cannot score the prompt 'a red circle and and",
    "--resolution 50": "resolution 50 must be a multiple of 8",
    "--model {tmp}/no-model": "no such pipeline folder",
    "--group-size 1": "group_size must be >= 2",
    "--grad-steps-per-epoch 3": "grad_steps_per_epoch x world size (3 x 1)",
    "--eval-num-steps 0": "--eval-num-steps 0: must be > 0",
    "--eval-guidance-scale 0.5": "--eval-guidance-scale 0.5: must be >= 1",
    "--eval-ema-decay 1": "--eval-ema-decay 1.0: must be in [0, 1)",
    "--eval-ema-interval 0": "--eval-ema-interval 0: must be >= 1",
    "--eval-ema-repeats 0": "--eval-ema-repeats 0: must be >= 1",
    "--eval-ema-interval 5": "--eval-ema-interval sets the eval EMA's updates: pass --eval-ema-decay > 0 too",
    "--eval-ema-repeats 2 --eval-ema-decay 0": "--eval-ema-repeats sets the eval EMA's updates: pass --eval-ema-decay",
    "--push-to-hub not/a/repo": "is not a hub repo id",
    "--reward shapes_clean:2,shapes:nan": "bad weight 'nan' for reward 'shapes'",
    "--height 50": "height 50 must be a multiple of 8",
    "--width=-8": "--width -8: must be > 0",
    "--num-frames 5": "StableDiffusion3Pipeline makes images, not videos",
    "--negative-prompt blurry": "--negative-prompt is used by CFG only",
    "--max-sequence-length 0": "--max-sequence-length 0: must be > 0",
    "--max-sequence-length 100000": "--max-sequence-length 100000: SD3's T5 takes at most 512 tokens",
    "--max-sequence-length 77": "has no T5 (text_encoder_3), whose length it sets: drop the flag",
    "--reward shapes:1,shapes:2": "reward 'shapes' is named twice",
    "--eval-rewards nosuchreward": "--eval-rewards: unknown reward 'nosuchreward'",
    "--eval-rewards jpeg_compressibility jpeg_compressibility": "--eval-rewards: 'jpeg_compressibility' is named twice",
    "--eval-rewards shapes_clean": "--eval-rewards: 'shapes_clean' is the training reward",
    "--reward shapes:0": "a zero weight trains nothing",
    "--seed=-1": "--seed -1: must be >= 0",
    "--exp-name /../../../escaped": "--exp-name '/../../../escaped': must be a plain name",
    "--exp-name ..": "--exp-name '..': must be a plain name",
    "--resolution 512": "--resolution 512: beyond the transformer's position embeddings (16 patches per side",
    "--model {tmp}/bad-json": "model_index.json is not valid JSON",
    "--model {tmp}/custom-module": "model_index.json's vae is 'MyVAE' from the module 'my_vae', not from diffusers",
    "--model {tmp}/flux-over-sd3": "names FluxPipeline, whose transformer is FluxTransformer2DModel, but the folder holds SD3",
    # root passes os.access on any folder; only trying to write there shows /proc takes no run folder
    "--output-dir /proc/cleanflow-runs": "cannot create a run folder there (/proc is not a writable folder)",
    "--full-finetune --lora-rank 8": "--lora-rank: a LoRA setting, but --full-finetune trains every transformer weight",
    "--fsdp-cpu-offload": "--fsdp-cpu-offload offloads the shards of --fsdp: pass --fsdp too",
    "--fsdp --fsdp-cpu-offload --device cpu": "--fsdp-cpu-offload moves the shards off the GPU",
    # a server URL is saved in args.json and every checkpoint: no credentials or token in it, none printed (masked)
    "--reward http://user:secret@127.0.0.1:9/shapes": "URL 'http://user:***@127.0.0.1:9/shapes' holds credentials",
    "--eval-rewards http://user:secret@127.0.0.1:9/shapes": "--eval-rewards: reward server URL 'http://user:***@127.0",
    "--eval-rewards http://127.0.0.1:9/shapes?token=secret": "URL 'http://127.0.0.1:9/shapes?***': a query or fragment",
    "--eval-rewards http://127.0.0.1:99999/shapes": "Port out of range 0-65535",
    "--eval-rewards http://127.0.0.1:9/shapes:0.5": "--eval-rewards http://127.0.0.1:9/shapes:0.5: a side metric takes no",
    "--eval-rewards shapes": "--eval-rewards: 'shapes' logs eval/shapes, which the training reward's eval (shapes_clean)",
    # prompts with a reference image (an edit family's): read and checked before the model loads
    "--train-prompts {tmp}/image-missing.jsonl": "image-missing.jsonl:1: image 'nope.png' not found",
    "--test-prompts {tmp}/image.jsonl": "its prompts carry reference images, but StableDiffusion3Pipeline takes none",
}
# the flags that need the model loaded to be judged; every other case must stop before `load_pipeline`
NEEDS_MODEL = {
    "--lora-targets nosuchmodule",
    "--teachers {tmp}/bad-teacher",
    "--generator {tmp}/bad-generator",
    "--generator {tmp}/bad-generator-args",
}
# single-script checks (and shared ones run once: they cost a model load or are covered by the table above)
SPECIFIC = [
    ("grpo", "--dynamics ODE", "Flow-GRPO needs per-step log-probs"),
    ("grpo", "--num-sde-steps 9", "num_sde_steps (9) must be between 1 and the SDE window size"),
    ("grpo", "--dynamics CPS --eta 2", "CPS needs eta in [0, 1]"),
    ("grpo_variants", "--window-mode sliding --window-shift 0 1", "--window-shift 0 1: tau and s must be >= 1"),
    (
        "grpo_variants",
        "--window-mode sliding --num-sde-steps 5",
        "num_sde_steps (5) must be between 1 and the SDE window size",
    ),
    ("grpo_variants", "--window-mode sliding --dynamics ODE", "Flow-GRPO needs per-step log-probs"),
    ("grpo_variants", "--noise-weight=-1", "--noise-weight -1.0: must be >= 0"),
    ("grpo_variants", "--kl-mask=-1e-5", "--kl-mask -1e-05: must be >= 0"),
    (
        "grpo_variants",
        "--win-rate-reward --advantage-aggregation gdpo",
        "--win-rate-reward ranks the weighted sum of the rewards",
    ),
    ("grpo_variants", "--kl-mask 1e-5 --grpo-guard", "--kl-mask replaces the ratio clip that --grpo-guard normalises"),
    ("grpo_variants", "--kl-mask 1e-5 --clip-high 1e-4", "--clip-low/--clip-high: --kl-mask replaces PPO's clip"),
    ("grpo_variants", "--noise-weight 2.25 --grpo-guard", "--noise-weight and --grpo-guard's --guard-reweight both weight"),
    ("nft", "--nft-beta 0", "nft_beta (0.0) must be > 0"),
    ("nft", "--old-decay-max 2", "--old-decay-max 2.0: must be in [0, 1]"),
    ("crd", "--micro-batch 2", "must hold whole groups"),
    ("crd", "--sampling-decay-ramp -0.1", "--sampling-decay-ramp -0.1: must be >= 0"),
    ("dgpo", "--ema-ref-decay-start 1.5", "--ema-ref-decay-start 1.5: must be in [0, 1]"),
    ("dgpo", "--micro-batch 2", "must hold whole groups"),
    ("dpo", "--micro-batch 2", "must hold whole groups"),
    ("dpo", "--dpo-beta 0", "--dpo-beta 0.0: must be > 0"),
    ("dpo", "--logit-std -1", "--logit-std -1.0: must be > 0"),
    ("dpo", "--ref-update-every -1", "--ref-update-every -1: must be >= 0 (0: the frozen base)"),
    ("dpo", "--pairs {tmp}/missing.jsonl", "--pairs {tmp}/missing.jsonl: cannot be read"),
    ("dmd2", "--min-sigma 0", "--min-sigma 0.0 / --max-sigma 0.98: need 0 < min <= max < 1"),
    ("dmd2", "--max-sigma 1", "--min-sigma 0.02 / --max-sigma 1.0: need 0 < min <= max < 1"),
    ("dmd2", "--fake-updates 0", "--fake-updates 0: must be >= 1"),
    ("dmd2", "--fsdp", "--fsdp: dmd2.py keeps a second trained network"),
    ("tdm_r1", "--generator {tmp}", "--generator {tmp}: no transformer/ or lora/ export in it"),
    ("tdm_r1", "--no-full-finetune", "--no-full-finetune: --generator benchmark/results/convergence/few_step/dmd2__s1 holds"),
    ("tdm_r1", "--micro-batch 2", "must hold whole groups"),
    # crafted few-step exports: a cut weights file, an args.json that is not JSON
    ("tdm_r1", "--generator {tmp}/bad-generator", "--generator {tmp}/bad-generator: its transformer weights cannot be read"),
    ("tdm_r1", "--generator {tmp}/bad-generator-args", "--generator {tmp}/bad-generator-args: its args.json cannot be read"),
    ("tdm_r1", "--max-sigma 1", "--min-sigma 0.02 / --max-sigma 1.0: need 0 < min <= max < 1"),
    ("opd", "--teachers {tmp}", "--teachers {tmp}: no transformer/ or lora/ export in it"),
    ("opd", "--teachers {tmp}/bad-teacher", "--teachers {tmp}/bad-teacher: its transformer export does not load"),
    ("opd", "--teacher-prompts {tmp}/test.txt {tmp}/test.txt", "--teacher-prompts: 2 files for 1 teachers"),
    ("opd", "--teacher-prompts {tmp}/missing.txt", "not found"),
    ("opd", "--timestep-fraction 0", "--timestep-fraction 0.0: must be in (0, 1]"),
    ("opd", "--num-train-timesteps 4", "--num-train-timesteps 4: must be in [1, 3]"),
    ("dgpo", "--num-train-timesteps 11", "--num-train-timesteps 11: only"),
    ("dgpo", "--off-policy-after=-5", "--off-policy-after -5: must be >= 0"),
    ("nft", "--timesteps-per-image --num-train-timesteps 11", "--num-train-timesteps 11: --timesteps-per-image draws"),
    ("nft", "--micro-batch 3", "micro_batch (3) must divide"),
    ("nft", "--lora-targets nosuchmodule", "--lora-targets nosuchmodule: no LoRA could be attached"),
    ("nft", "--lora-alpha 0", "--lora-alpha 0.0: must be > 0"),
    ("crd", "--full-finetune --lora-targets attn.to_q", "--lora-targets: a LoRA setting, but --full-finetune"),
    ("grpo", "--lora-alpha 32 --full-finetune", "--lora-alpha: a LoRA setting"),  # given, even at its default
    ("nft", "--train-prompts {tmp}/empty.txt", "has no prompts"),
    ("nft", "--train-prompts {tmp}/bad.jsonl", "bad.jsonl:1: expected a JSON object"),
    ("crd", "--train-prompts {tmp}/null.jsonl", "null.jsonl:2: 'prompt' is 'null', expected a string"),
    ("grpo", "--test-prompts {tmp}/list.jsonl", "list.jsonl:1: 'prompt' is '[\"a\", \"b\"]', expected a string"),
    ("nft", "--train-prompts {tmp}/missing.txt", "not found"),
    ("nft", "--train-prompts {tmp}", "is a folder"),
    ("nft", "--train-prompts /dev/null", "is not a regular file"),
    ("nft", "--test-prompts {tmp}", "is a folder"),
    ("nft", "--test-prompts {tmp}/missing.txt", "not found"),
    ("grpo", "--test-prompts /dev/null", "is not a regular file"),
    ("nft", "--reward shapes:heavy", "bad weight 'heavy'"),
    ("awm", "--num-train-timesteps 0", "--num-train-timesteps 0: must be > 0"),
    ("elbo_grpo", "--timestep-range=-1", "--timestep-range -1.0: must be in (0, 1]"),
    ("nft", "--train-prompts {tmp}/image-number.jsonl", "image-number.jsonl:1: 'image' is '3', expected an image file's"),
    ("grpo", "--train-prompts {tmp}/image-null.jsonl", "image-null.jsonl:2: 'image' is 'null', expected an image file's"),
    ("crd", "--train-prompts {tmp}/image-empty.jsonl", "image-empty.jsonl:1: 'image' is '\"\"', expected an image file's"),
    ("dgpo", "--train-prompts {tmp}/image-text.jsonl", "image-text.jsonl:1: image 'a-file' cannot be read as an image"),
    ("dpo", "--train-prompts {tmp}/image-cut.jsonl", "image-cut.jsonl:1: image 'cut.png' cannot be read as an image"),
    ("awm", "--test-prompts {tmp}/image-folder.jsonl", "image-folder.jsonl:1: image 'bad-json' is not a regular file"),
    ("elbo_grpo", "--train-prompts {tmp}/image-mixed.jsonl", "image-mixed.jsonl:2: every line of a prompt file carries an"),
    ("nft", "--train-prompts {tmp}/image.jsonl", "--train-prompts {tmp}/image.jsonl: its prompts carry reference images"),
    # every image a script reads goes through one loader (prompt_files.load_image): size cap from the header, FIFOs
    (
        "nft",
        "--train-prompts {tmp}/image-bomb.jsonl",
        "image 'bomb.png' declares over 178,956,970 pixels, more than the 16,777,216",
    ),
    (
        "dpo",
        "--pairs {tmp}/pairs-bomb.jsonl",
        "chosen image {tmp}/big.png declares 5000 x 5000 pixels, more than the 16,777,216 an image may have",
    ),
    ("dpo", "--pairs {tmp}/pairs-fifo-image.jsonl", "chosen image {tmp}/fifo.png is not a regular file"),
    ("dpo", "--pairs {tmp}/fifo.png", "--pairs {tmp}/fifo.png: not a regular file"),
    ("dpo", "--pairs {tmp}/pairs-latin1.jsonl", "--pairs {tmp}/pairs-latin1.jsonl: not UTF-8 text (byte"),
    ("dpo", "--pairs {tmp}/pairs-1x1.jsonl", "chosen image is 1x1; sizes must be multiples of 8 pixels"),
    ("dpo", "--pairs {tmp}/pairs-same.jsonl", "every pair's chosen and rejected images are the same; DPO learns nothing"),
    # a mistyped local folder (one "/", like a hub id) is a folder not found, with the near names, not a hub id
    ("nft", "--model assets/tiny-shape", "no such pipeline folder (expected assets/tiny-shape/model_index.json); did you"),
    # range checks
    ("awm", "--clip-low=-1", "--clip-low -1.0: must be >= 0"),
    ("grpo", "--clip-high=-0.1", "--clip-high -0.1: must be >= 0"),
    ("crd", "--adv-clip 0", "--adv-clip 0.0: must be > 0"),
    ("nft", "--num-steps 1000000000", "--num-steps 1000000000: at most 1000 sampler steps"),
    ("grpo_variants", "--window-shift 25 1", "--window-shift moves the sliding window: pass --window-mode sliding too"),
]
CASES = [(algo, flags, msg) for flags, msg in SHARED.items() for algo in ALGOS] + SPECIFIC
# the ocr reward's prompt check runs its engine's package: without the extra, the case is its install line instead
CASES = [pytest.param(a, f, m, marks=needs_ocr if "--reward ocr" in f else (), id=f"{a}:{f}") for a, f, m in CASES]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "test.txt").write_text("a red circle\ntwo squares\n")
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "latin1.txt").write_bytes("a red circle\ntwo squares caf\xe9\n".encode("latin-1"))
    (tmp_path / "long.txt").write_text(f"a red circle\n{LONG}\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a red circle"}\n')
    (tmp_path / "null.jsonl").write_text('{"prompt": "a red circle"}\n{"prompt": null}\n')
    (tmp_path / "list.jsonl").write_text('{"prompt": ["a", "b"]}\n')
    for name, args in (("bad-generator", "{}"), ("bad-generator-args", "{bad")):  # a cut safetensors file
        (tmp_path / name / "transformer").mkdir(parents=True)
        (tmp_path / name / "args.json").write_text(args)
        good = REPO / "benchmark" / "results" / "convergence" / "few_step" / "dmd2__s1" / "transformer"
        (tmp_path / name / "transformer" / "config.json").write_bytes((good / "config.json").read_bytes())
        weights = (good / "diffusion_pytorch_model.safetensors").read_bytes()
        cut = weights[:1000] if name == "bad-generator" else weights
        (tmp_path / name / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(cut)
    (tmp_path / "bad-teacher" / "transformer").mkdir(parents=True)  # an export whose weights are not a model's
    (tmp_path / "bad-teacher" / "transformer" / "config.json").write_text('{"_class_name": "SD3Transformer2DModel"}')
    scene = tmp_path / "scene.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(scene)
    (tmp_path / "cut.png").write_bytes(scene.read_bytes()[: scene.stat().st_size // 2])  # a truncated download
    edit = '{"prompt": "make the circle red", "image": %s}\n'
    (tmp_path / "image.jsonl").write_text(edit % '"scene.png"')
    (tmp_path / "image-missing.jsonl").write_text(edit % '"nope.png"')
    (tmp_path / "image-number.jsonl").write_text(edit % "3")
    (tmp_path / "image-null.jsonl").write_text(edit % '"scene.png"' + edit % "null")
    (tmp_path / "image-empty.jsonl").write_text(edit % '""')
    (tmp_path / "image-text.jsonl").write_text(edit % '"a-file"')
    (tmp_path / "image-cut.jsonl").write_text(edit % '"cut.png"')
    (tmp_path / "image-folder.jsonl").write_text(edit % '"bad-json"')
    (tmp_path / "image-mixed.jsonl").write_text(edit % '"scene.png"' + '{"prompt": "a red circle"}\n')
    png_header(tmp_path / "bomb.png", 30000, 30000)  # a few bytes that declare 900M pixels
    (tmp_path / "image-bomb.jsonl").write_text(edit % '"bomb.png"')
    os.mkfifo(tmp_path / "fifo.png")  # an open() for reading would wait for a writer forever
    pair = '{"prompt": "a red circle", "chosen": "%s", "rejected": "%s"}\n'
    png_header(tmp_path / "big.png", 5000, 5000)  # past our cap, under PIL's own
    (tmp_path / "pairs-bomb.jsonl").write_text(pair % ("big.png", "scene.png"))
    (tmp_path / "pairs-fifo-image.jsonl").write_text(pair % ("fifo.png", "scene.png"))
    (tmp_path / "pairs-latin1.jsonl").write_bytes(('{"prompt": "caf\xe9"}\n').encode("latin-1"))
    Image.new("RGB", (1, 1)).save(tmp_path / "dot.png")
    (tmp_path / "pairs-1x1.jsonl").write_text(pair % ("dot.png", "dot.png"))
    (tmp_path / "pairs-same.jsonl").write_text(pair % ("scene.png", "scene.png") * 2)
    (tmp_path / "bad-json").mkdir()
    (tmp_path / "bad-json" / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline",')
    (tmp_path / "custom-module").mkdir()  # a component whose class is code in the folder (my_vae.py)
    custom = json.loads((Path(common.TINY_MODEL) / "model_index.json").read_text()) | {"vae": ["my_vae", "MyVAE"]}
    (tmp_path / "custom-module" / "model_index.json").write_text(json.dumps(custom))
    (tmp_path / "flux-over-sd3").mkdir()  # the tiny SD3 folder's index under FLUX.1's class (the parts are not read)
    index = (Path(common.TINY_MODEL) / "model_index.json").read_text()
    (tmp_path / "flux-over-sd3" / "model_index.json").write_text(index.replace("StableDiffusion3Pipeline", "FluxPipeline"))
    return tmp_path


def png_header(path: Path, width: int, height: int):
    """A PNG whose header declares `width` x `height` 8-bit RGB pixels, with no pixel data: what a decompression bomb
    shows a reader before it decodes."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def call(algo: str, argv: list, capsys) -> tuple:
    """`python algos/<algo>.py *argv` in-process -> (exit code, stderr); fails if the script does not exit."""
    mod = ALGOS[algo]
    args = tyro.cli(mod.Args, args=argv)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run.run_main(mod.main, args, argv=argv)
    return e.value.code, capsys.readouterr().err


def assert_error_is_last_line(rc, err, expected):
    """For a run that stopped while training (its progress bars are on stderr too): one error line, the last."""
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert [x for x in lines if x.startswith("error")] == lines[-1:] and expected in lines[-1], lines[-3:]
    return lines[-1]


def assert_one_line(rc, err, expected):
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.strip() and "Loading " not in x]  # from_pretrained's progress bars
    assert line.startswith("error: ") and expected in line, line
    assert len(line) < 1000  # a 10,000-character prompt is cut
    return line


@pytest.mark.parametrize("algo, flags, expected", CASES)
def test_bad_input_one_line_exit_2_nothing_written(algo, flags, expected, files, capsys, monkeypatch):
    loaded, load = [], models.load_pipeline
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: loaded.append(a) or load(*a, **k))
    argv = [
        *TINY,
        *VALID.get(algo, []),
        "--test-prompts",
        str(files / "test.txt"),
        "--output-dir",
        str(files / "runs"),
        *flags.format(tmp=files).split(),
    ]
    rc, err = call(algo, argv, capsys)
    assert_one_line(rc, err, expected.format(tmp=files))
    assert "secret" not in err  # a password or token given in a URL is never printed
    assert not (files / "runs").exists() and not (files / "a-file").is_dir()
    assert not list(files.parent.glob("escaped*")) and not list(Path("/proc").glob("cleanflow*"))
    assert bool(loaded) == (flags in NEEDS_MODEL), "a check that needs no model ran after the model loaded"


# ----------------------------------------------------------------------------------------------------------------
# resume: the run's flags come from its checkpoint; a bad resume changes nothing
# ----------------------------------------------------------------------------------------------------------------
def snapshot(folder: Path) -> dict:
    """Every file's bytes (and every symlink's target) under `folder`."""
    return {
        str(p.relative_to(folder)): (p.readlink() if p.is_symlink() else p.read_bytes() if p.is_file() else None)
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="module")
def nft_run(tmp_path_factory):
    """One finished 1-epoch nft run, made in-process; tests copy it before they may touch it."""
    tmp = tmp_path_factory.mktemp("nftrun")
    (tmp / "test.txt").write_text("a red circle\ntwo squares\n")
    argv = [
        *TINY,
        "--num-train-timesteps",
        "1",
        "--eval-every",
        "5",
        "--test-prompts",
        str(tmp / "test.txt"),
        "--output-dir",
        str(tmp / "runs"),
    ]
    run.run_main(nft.main, tyro.cli(nft.Args, args=argv), argv=argv)
    (run_dir,) = (tmp / "runs").iterdir()
    return run_dir


@pytest.fixture
def run_copy(nft_run, tmp_path):
    dst = tmp_path / "runs" / nft_run.name
    shutil.copytree(nft_run, dst, symlinks=True)
    return dst


def _truncate(run):
    state = (run / "checkpoints" / "last" / "state.pt").resolve()
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])


def _edit_state(edit):
    """A damage function: `edit(state)` applied to the run's last state.pt, saved back as a crafted checkpoint would be."""

    def damage(run):
        path = (run / "checkpoints" / "last" / "state.pt").resolve()
        state = torch.load(path, weights_only=True)
        edit(state)
        torch.save(state, path)

    return damage


def _edit_weights(edit):
    """A damage function: `edit(tensors)` applied to the last checkpoint's safetensors file."""
    from safetensors.torch import load_file, save_file

    def damage(run_dir):
        path = (run_dir / "checkpoints" / "last" / "weights.safetensors").resolve()
        tensors = load_file(str(path))
        edit(tensors)
        save_file(tensors, str(path), metadata={"format": checkpoints.CHECKPOINT_FORMAT})

    return damage


def _first_param(tensors, change):
    name = sorted(k for k in tensors if k.startswith("params/"))[0]
    tensors[name] = change(tensors[name])


RESUME_CASES = {  # (script, extra flags, what to do to the run first) -> a piece of the one line
    "changed flag": ("nft", "--learning-rate 0.1", None, "--learning-rate is 0.003 in the run being resumed, 0.1 given"),
    "flag given at its default": ("nft", "--num-prompts 8", None, "--num-prompts is 2 in the run being resumed, 8 given"),
    "changed bool flag": ("nft", "--no-torch-deterministic", None, "--torch-deterministic is True in the run being resumed"),
    "changed model": ("nft", "--model assets/tiny-text", None, "--model is"),
    "wrong script": ("grpo", "", None, "was written by nft.py; resume it with algos/nft.py, not grpo.py"),
    "already finished": ("nft", "--num-epochs 1", None, "is at epoch 1; pass --num-epochs > 1"),
    "truncated state": ("nft", "", _truncate, "cannot be read"),
    "empty weights": (
        "nft",
        "",
        lambda run: (run / "checkpoints" / "last" / "weights.safetensors").resolve().write_bytes(b""),
        "weights.safetensors cannot be read",
    ),
    "missing state": (
        "nft",
        "",
        lambda run: (run / "checkpoints" / "last" / "state.pt").resolve().unlink(),
        "state.pt is missing",
    ),
    "no checkpoint": ("nft", "", lambda run: shutil.rmtree(run / "checkpoints"), "the run folder has no checkpoint"),
    "old pickle": (
        "nft",
        "",
        lambda run: torch.save({"epoch": 1}, run / "last.pt"),
        "a pickled checkpoint of an older cleanflow",
    ),
    # a crafted epoch would retrain from there and overwrite the run's epoch folders
    "negative epoch": (
        "nft",
        "",
        _edit_state(lambda st: st.update(epoch=-5)),
        "epoch is -5, expected a whole number in [1, 2^53]",
    ),
    "epoch not its folder's": ("nft", "--num-epochs 9", _edit_state(lambda st: st.update(epoch=3)), "it says epoch 3"),
    "float counter": ("nft", "", _edit_state(lambda st: st.update(images_seen=2.5)), "images_seen is 2.5"),
    "unknown entry": ("nft", "", _edit_state(lambda st: st.update(hook="x")), "unknown entries hook"),
    "unknown setting": ("nft", "", _edit_state(lambda st: st["args"].update(bogus=1)), "include bogus, which nft.py lacks"),
    "setting of the wrong type": (
        "nft",
        "",
        _edit_state(lambda st: st["args"].update(num_steps="4")),
        "the checkpoint's num_steps is '4'; --num-steps takes int",
    ),
    "setting outside its choices": (
        "nft",
        "",
        _edit_state(lambda st: st["args"].update(dynamics="Magic")),
        "the checkpoint's dynamics is 'Magic'; --dynamics takes Literal",
    ),
    "setting out of range": ("nft", "", _edit_state(lambda st: st["args"].update(num_steps=0)), "--num-steps 0: must be > 0"),
    "wrong-shaped weight": (
        "nft",
        "",
        _edit_weights(lambda t: _first_param(t, lambda v: v.reshape(-1)[:-1].clone())),
        "does not fit this run",
    ),
    "wrong dtype": (
        "nft",
        "",
        _edit_weights(lambda t: _first_param(t, lambda v: v.double())),
        "torch.float64, expected",
    ),
    "missing weight": ("nft", "", _edit_weights(lambda t: _first_param(t, lambda v: v[:0])), "does not fit this run"),
    # every saved number checked finite and in range before training
    "NaN weight": ("nft", "", _edit_weights(lambda t: _first_param(t, lambda v: v * float("nan"))), "holds NaN or inf"),
    "huge counter": ("nft", "", _edit_state(lambda st: st.update(images_seen=2**80)), "expected a whole number in [0, 2^53]"),
    "endless sampler": (
        "nft",
        "",
        _edit_state(lambda st: st["args"].update(num_steps=10**9)),
        "--num-steps 1000000000: at most 1000 sampler steps",
    ),
    "missing moment": (
        "nft",
        "",
        _edit_state(lambda st: st["optimizer"]["state"][0].pop("exp_avg")),
        "its optimizer state of parameter 0 is not AdamW's (at exp_avg)",
    ),
    "string moment": (
        "nft",
        "",
        _edit_state(lambda st: st["optimizer"]["state"][0].update(exp_avg_sq="big")),
        "its optimizer exp_avg_sq of parameter 0 is str, not a float tensor",
    ),
    "NaN moment": (
        "nft",
        "",
        _edit_state(lambda st: st["optimizer"]["state"][0]["exp_avg"].fill_(float("nan"))),
        "its optimizer exp_avg of parameter 0 holds NaN or inf",
    ),
    "foreign parameter groups": (
        "nft",
        "",
        _edit_state(lambda st: st["optimizer"]["param_groups"].append(dict(st["optimizer"]["param_groups"][0]))),
        "its optimizer's parameter groups are not this run's",
    ),
    # run-folder entries that are not what they seem: each would hang the resume, fail it after it wrote, or write
    # outside the folder
    ".lock a FIFO": (
        "nft",
        "",
        lambda run: (run / ".lock").unlink() or os.mkfifo(run / ".lock"),
        ".lock is not a regular file (a FIFO",
    ),
    "resumes.jsonl a FIFO": ("nft", "", lambda run: os.mkfifo(run / "resumes.jsonl"), "resumes.jsonl is not a regular"),
    "samples a file": (
        "nft",
        "",
        lambda run: shutil.rmtree(run / "samples", ignore_errors=True) or (run / "samples").write_text("x"),
        "samples is a file, where the run keeps a folder",
    ),
    "hard-linked resumes.jsonl": (
        "nft",
        "",
        lambda run: (run / "resumes.jsonl").write_text("") or os.link(run / "resumes.jsonl", run.parent / "elsewhere"),
        "resumes.jsonl is a hard link (2 names for one file)",
    ),
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_bad_resume_one_line_run_unchanged(case, run_copy, capsys):
    algo, flags, damage, expected = RESUME_CASES[case]
    target = run_copy
    if damage is not None:
        damage(run_copy)
        if case == "old pickle":
            target = run_copy / "last.pt"
    before = snapshot(run_copy)
    rc, err = call(algo, ["--resume", str(target), "--num-epochs", "2", *flags.split()], capsys)
    assert_one_line(rc, err, expected)
    assert snapshot(run_copy) == before


def test_copied_out_checkpoint_is_refused(run_copy, tmp_path, capsys):
    """A checkpoint folder copied out of its run (/x/a/b/e) must not make /x/a the run folder."""
    loose = tmp_path / "x" / "a" / "b" / "e"
    shutil.copytree((run_copy / "checkpoints" / "last").resolve(), loose)
    (tmp_path / "x" / "a" / "args.json").write_text("{}")
    before = snapshot(tmp_path / "x")
    rc, err = call("nft", ["--resume", str(loose), "--num-epochs", "2"], capsys)
    assert_one_line(rc, err, "this checkpoint is not inside a run folder")
    assert snapshot(tmp_path / "x") == before


def test_second_writer_is_refused(run_copy, capsys):
    """While a process holds the run (its .lock), a resume of it stops with one line and writes nothing."""
    with open(run_copy / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: conflicts as another process would
        before = snapshot(run_copy)
        rc, err = call("nft", ["--resume", str(run_copy), "--num-epochs", "2"], capsys)
        assert_one_line(rc, err, "is in use by another process")
        assert snapshot(run_copy) == before
    assert not run._LOCKS  # run_main let go of what it held


def test_resume_restores_the_saved_flags(run_copy, capsys):
    """Only --resume (here one checkpoint folder of the run) and --num-epochs given: the run continues with its own flags
    (not the defaults), and the resume
    is appended to resumes.jsonl while args.json stays as the run began."""
    args_json = (run_copy / "args.json").read_bytes()
    argv = ["--resume", str(run_copy / "checkpoints" / "epoch_000001"), "--num-epochs", "2"]  # one checkpoint of the run
    args = tyro.cli(nft.Args, args=argv)
    run.run_main(nft.main, args, argv=argv)
    assert args.num_prompts == 2 and args.num_steps == 4 and args.num_train_timesteps == 1 and args.eval_every == 5
    # the run's test prompts are outside the repository's assets: the resume shows what it reads
    test_prompts = json.loads(args_json)["test_prompts"]
    assert f"note: the resumed run reads --test-prompts {test_prompts!r}, as its checkpoint says" in capsys.readouterr().out
    assert checkpoints.load_checkpoint(run_copy)["epoch"] == 2
    assert (run_copy / "args.json").read_bytes() == args_json
    assert len((run_copy / "resumes.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow
def test_a_checkpoint_never_sets_the_optimizer_hyper_parameters(run_copy, tmp_path):
    """A crafted state.pt's param_groups (lr 1e30, maximize, NaN weight decay) are not loaded: the resumed run steps
    with its flags' hyper-parameters and ends bit for bit where a resume of the untouched run ends."""
    clean = tmp_path / "clean" / run_copy.name
    shutil.copytree(run_copy, clean, symlinks=True)
    crafted = dict(lr=1e30, maximize=True, weight_decay=float("nan"), betas=(0.0, 0.0))
    _edit_state(lambda st: st["optimizer"]["param_groups"][0].update(crafted))(run_copy)
    for folder in (run_copy, clean):
        argv = ["--resume", str(folder), "--num-epochs", "2"]
        run.run_main(nft.main, tyro.cli(nft.Args, args=argv), argv=argv)
    a, b = checkpoints.load_checkpoint(run_copy), checkpoints.load_checkpoint(clean)
    (group,) = a["optimizer"]["param_groups"]
    assert group["lr"] == 0.003 and group["maximize"] is False and group == b["optimizer"]["param_groups"][0]
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def test_a_resume_may_evaluate_on_other_test_prompts(run_copy, tmp_path, capsys):
    """--test-prompts sets only what is evaluated: a resume may name another file (recorded in resumes.jsonl), and then
    shows no checkpoint path for it."""
    other = tmp_path / "other.txt"
    other.write_text("a blue square\n")
    argv = ["--resume", str(run_copy), "--num-epochs", "2", "--test-prompts", str(other)]
    args = tyro.cli(nft.Args, args=argv)
    capsys.readouterr()
    run.run_main(nft.main, args, argv=argv)
    assert args.test_prompts == str(other) and "--test-prompts" not in capsys.readouterr().out
    (record,) = [json.loads(line) for line in (run_copy / "resumes.jsonl").read_text().splitlines()]
    assert record["overrides"]["test_prompts"]["now"] == str(other)


def test_one_image_loader_converts_16_bit_and_applies_exif_orientation(tmp_path):
    """16-bit greyscale is scaled to 8 bits (PIL's convert clips it to white); a pairs file's images are turned by
    their EXIF orientation as prompt images are; both through the one loader."""
    grey = np.arange(64, dtype=np.uint16).reshape(8, 8) * 4
    Image.fromarray(grey * 257).save(tmp_path / "deep.png")  # 16-bit PNG of the 8-bit values grey
    assert Image.open(tmp_path / "deep.png").mode.startswith("I")
    loaded = np.asarray(prompt_files.load_image(tmp_path / "deep.png"))
    assert np.array_equal(loaded, np.repeat(grey.astype(np.uint8)[..., None], 3, axis=2))
    wide = np.random.default_rng(1).integers(0, 256, (8, 16, 3), dtype=np.uint8)  # 16 wide, 8 high
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: turn 90 degrees clockwise to view
    Image.fromarray(wide).save(tmp_path / "turned.png", exif=exif)
    Image.fromarray(np.rot90(wide, -1).copy()).save(tmp_path / "upright.png")
    Image.fromarray(np.zeros((16, 8, 3), np.uint8)).save(tmp_path / "other.png")  # upright size
    line = '{"prompt": "a red circle", "chosen": "%s", "rejected": "other.png"}\n'
    (tmp_path / "pairs.jsonl").write_text(line % "turned.png" + line % "upright.png")
    _, chosen, _ = pair_files.load_pairs(str(tmp_path / "pairs.jsonl"), None, None)
    assert chosen.shape == (2, 16, 8, 3) and np.array_equal(chosen[0], chosen[1])
    assert np.array_equal(chosen[0], np.rot90(wide, -1))


def test_a_fresh_run_of_an_unfinished_runs_flags_says_how_to_resume(run_copy, capsys):
    """Re-running the command of a run stopped before its export (Ctrl-C, a kill) starts a new run, and says that the
    unfinished one exists and how to go on with it; a finished run, or other flags, say nothing."""
    saved = json.loads((run_copy / "args.json").read_text())
    fields = {f.name for f in dataclasses.fields(nft.Args)}
    flags = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields}

    def start(**changes):
        args = nft.Args(**{**flags, "output_dir": str(run_copy.parent), **changes})
        run.start_run(args, nft.__file__)
        return capsys.readouterr().out

    assert start() == ""  # finished: it exported
    shutil.rmtree(run_copy / "lora")
    assert f"note: {run_copy} is an unfinished run of these flags; `--resume {run_copy}` goes on with it" in start()
    assert start(num_epochs=5) != ""  # a longer run of the same flags is the same run, gone on
    assert start(seed=2) == "" and start(learning_rate=0.1) == ""
    assert sorted(p.name for p in run_copy.parent.iterdir()) == [run_copy.name]  # nothing written


def test_fresh_run_names_are_unique(files):
    """Two runs of the same reward, exp and seed started in the same second get different folders."""
    names = set()
    for _ in range(2):
        args = nft.Args(output_dir=str(files / "runs"), test_prompts=str(files / "test.txt"))
        names.add(run.start_run(args, nft.__file__)[0])
    assert len(names) == 2 and not (files / "runs").exists()


INTERRUPT = """
import os, signal, sys, time
# Ctrl-C as in a terminal: a process that inherits SIGINT ignored (as from some test harnesses) never raises on it
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path[:0] = [{repo!r}, {repo!r} + "/algos"]
import common, nft, tyro
from harness import run
import models
from harness import pair_files
def loading(*args, **kwargs):  # Ctrl-C arrives while the model loads
    os.kill(os.getpid(), signal.SIGINT)
    # short sleeps in a loop: a process-directed SIGINT may land on one of torch's threads, which does not cut the main
    # thread's sleep short; the loop's jumps are where the main thread then runs the handler (a single sleep(30)
    # returned None to load_model instead, and the run failed on it, once, on a loaded machine)
    for _ in range(300):
        time.sleep(0.1)
models.load_pipeline = loading
run.run_main(nft.main, tyro.cli(nft.Args))
"""


@pytest.mark.slow
def test_ctrl_c_while_the_model_loads_is_one_line(files):
    script = files / "interrupt.py"
    script.write_text(INTERRUPT.format(repo=str(common.REPO)))
    out = run_script([script, "--test-prompts", files / "test.txt", "--output-dir", files / "runs"], check=False, timeout=120)
    assert out.returncode == 130 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == ["error: interrupted (Ctrl-C); nothing was saved since the last checkpoint"]
    assert not (files / "runs").exists()


def test_bad_cli_choice_exits_2(files):
    out = run_script(["algos/nft.py", "--dynamics", "Foo"], check=False, timeout=120, env={**os.environ, "COLUMNS": "40"})
    assert_one_line(out.returncode, out.stderr, "invalid choice 'Foo' for argument '--dynamics'. Expected one of")


LONG_VALUE = "9" * 60 + "x"  # longer than a 40-column box: tyro cuts it across two lines
TYRO_ERRORS = {  # a flag tyro refuses (before any of our checks) -> the one line, whole
    "--num-steps x": "--num-steps: invalid literal for int() with base 10: 'x'",
    "--dynamics Foo": "invalid choice 'Foo' for argument '--dynamics'. Expected one of ('ODE', 'Flow-SDE', 'Dance-SDE', "
    "'CPS').",
    "--nosuch 1": "Unrecognized options: --nosuch, 1",
    "--num-steps": "Missing value for argument '--num-steps'. Expected 1 values.",
    "--num-steps 1 2": "Unrecognized options: 2",
    "--no-full-finetune 3": "Unrecognized options: 3",
    f"--learning-rate {LONG_VALUE}": "--learning-rate: no type matching {None}|FLOAT could be instantiated from "
    f"['{LONG_VALUE}'].",
}


@pytest.mark.parametrize("box", ["ascii", "utf8", "ansi"])
@pytest.mark.parametrize("flags", TYRO_ERRORS)
def test_a_flag_tyro_refuses_is_one_line_exit_2(flags, box, capsys, monkeypatch):
    """tyro's own errors (a box of 5-9 lines, wrapped at the terminal's width) are one line, at a narrow terminal too,
    however tyro draws the box (ASCII when stdout is not UTF-8, as under pytest; colours on a terminal); --help still
    prints the help."""
    import tyro._fmtlib

    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setattr(tyro._fmtlib, "_FORCE_UTF8_BOXES", box != "ascii")
    monkeypatch.setattr(tyro._fmtlib, "_FORCE_ANSI", box == "ansi")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run.cli(grpo.Args, flags.split())
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == ""
    assert out.err == f"error: {TYRO_ERRORS[flags]} (--help lists the flags)\n"
    assert os.environ["COLUMNS"] == "40"
    with pytest.raises(SystemExit) as e:
        run.cli(grpo.Args, ["--help"])
    out = capsys.readouterr()
    assert e.value.code == 0 and "--num-steps INT" in re.sub(r"\x1b\[[0-9;]*m", "", out.out) and out.err == ""


def test_saved_state_loads_without_pickle(nft_run):
    state = torch.load(nft_run / "checkpoints" / "last" / "state.pt", weights_only=True)
    assert state["algo"] == "nft" and state["args"]["num_prompts"] == 2 and sys.modules["common"] is common


def test_a_checkpoint_never_sets_where_the_model_or_data_go(run_copy, capsys, monkeypatch):
    """A crafted state.pt naming a hub repo, a wandb project/entity and --track: a plain --resume uploads nothing and
    tracks nothing, says what the run had, and asks for it again. Also cleans the temps of a kill during the export."""
    import huggingface_hub

    _edit_state(
        lambda st: st["args"].update(
            push_to_hub="attacker/stolen-lora", track=True, wandb_project_name="theirs", wandb_entity="attacker"
        )
    )(run_copy)
    (run_copy / ".lora.tmp4242").mkdir()  # what a kill inside export_lora leaves
    (run_copy / ".lora.tmp4242" / "README.md").write_text("half")
    (run_copy / ".lora.old").mkdir()
    uploads = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda *a, **k: uploads.append(("create", a, k)))
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda *a, **k: uploads.append(("upload", a, k)))
    monkeypatch.setitem(sys.modules, "wandb", None)  # had --track been restored, the run would stop: wandb missing
    argv = ["--resume", str(run_copy), "--num-epochs", "2"]
    args = tyro.cli(nft.Args, args=argv)
    capsys.readouterr()
    run.run_main(nft.main, args, argv=argv)
    err = capsys.readouterr().err
    assert uploads == [] and args.push_to_hub is None and args.track is False and args.wandb_entity is None
    assert args.wandb_project_name == nft.Args.wandb_project_name
    for flag in ("--push-to-hub attacker/stolen-lora", "--track;", "--wandb-project-name theirs", "--wandb-entity attacker"):
        assert f"note: the run had {flag}" in err, err
    assert checkpoints.load_checkpoint(run_copy)["epoch"] == 2
    assert not list(run_copy.glob(".lora.*")) and (run_copy / "lora" / export.LORA_WEIGHTS).is_file()


@pytest.mark.slow
def test_a_reward_that_raises_names_itself_and_the_epoch_and_the_run_resumes(files, capsys, monkeypatch):
    """A reward raising inside epoch 2 (in the worker thread): one line naming the reward and the epoch and how to go
    on; the checkpoint of epoch 1 is whole, and --resume (the reward fixed) finishes the run."""
    import rewards

    (files / "train.txt").write_text("a blue square\nthree circles\n")
    training_calls = []

    def flaky(device):
        def fn(images, prompts):
            if prompts[0] in ("a blue square", "three circles"):
                training_calls.append(len(prompts))
                if len(training_calls) == 3:  # two chunks of 4 per epoch: the first chunk of epoch 2
                    raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
            return images.mean((1, 2, 3))

        return fn

    monkeypatch.setitem(rewards.REWARDS, "flaky", flaky)
    argv = [*TINY, "--num-train-timesteps", "1", "--num-epochs", "3", "--save-every", "1", "--eval-every", "10"]
    argv += ["--reward", "flaky", "--train-prompts", str(files / "train.txt"), "--test-prompts", str(files / "test.txt")]
    rc, err = call("nft", [*argv, "--output-dir", str(files / "runs")], capsys)
    (run_dir,) = (files / "runs").iterdir()
    line = assert_error_is_last_line(rc, err, "reward 'flaky' failed (RuntimeError: CUDA error: an illegal memory access was")
    assert line.endswith(f"in epoch 2; --resume {run_dir} goes on from its last checkpoint (epoch_000001)"), line
    assert checkpoints.load_checkpoint(run_dir)["epoch"] == 1
    assert run_in_process(nft, ["--resume", run_dir]) == 0  # training_calls is past 3: the reward works now
    assert checkpoints.load_checkpoint(run_dir)["epoch"] == 3


def test_the_run_folder_removed_while_the_run_goes_is_one_line(files, capsys, monkeypatch):
    import rewards

    (files / "train.txt").write_text("a blue square\nthree circles\n")
    calls = []

    def remover(device):
        def fn(images, prompts):
            calls.append(1)
            if len(calls) == 3:  # inside epoch 1's rollout: the user deletes the run
                shutil.rmtree(next((files / "runs").iterdir()))
            return images.mean((1, 2, 3))

        return fn

    monkeypatch.setitem(rewards.REWARDS, "remover", remover)
    argv = [*TINY, "--num-train-timesteps", "1", "--num-epochs", "3", "--eval-every", "10", "--reward", "remover"]
    argv += ["--train-prompts", str(files / "train.txt"), "--test-prompts", str(files / "test.txt")]
    rc, err = call("nft", [*argv, "--output-dir", str(files / "runs")], capsys)
    assert_error_is_last_line(rc, err, "was removed or moved while the run was going; stopped")
    assert list((files / "runs").iterdir()) == []  # nothing re-created


@pytest.mark.slow
def test_sigterm_saves_then_exits_143(files):
    """A scheduler's SIGTERM: the epoch finishes, a checkpoint is saved, and the exit code says "killed by SIGTERM"
    (128 + 15), so Slurm or Kubernetes do not take the run for finished."""
    import signal
    import time

    from conftest import HANG_S, kill_group, start_script

    argv = ["algos/nft.py", *TINY, "--num-train-timesteps", "1", "--num-epochs", "50", "--save-every", "1"]
    proc = start_script([*argv, "--eval-every", "100", "--test-prompts", files / "test.txt", "--output-dir", files / "runs"])
    try:
        state = None
        while state is None:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            state = next(iter((files / "runs").glob("*/checkpoints/last/state.pt")), None)
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        kill_group(proc)
    assert proc.returncode == 143 and "Traceback" not in err, err[-2000:]
    (run_dir,) = (files / "runs").iterdir()
    epoch = checkpoints.load_checkpoint(run_dir)["epoch"]
    assert 1 <= epoch < 50 and f"stopped before epoch {epoch}; continue with --resume {run_dir}" in out


NO_SPACE = """
set -e
mount -t tmpfs -o size={size} tmpfs {out}
exec {python} algos/nft.py {flags} --output-dir {out}/runs
"""


@pytest.mark.slow
def test_a_full_disk_is_named(files):
    """The run folder on a 400 KB tmpfs (a private mount in a user namespace): the run stops with one line that says
    "no space left on device" (torch.save alone says only "file write failed")."""
    if run_script(["unshare", "-rm", "true"], python=False, check=False).returncode != 0:
        pytest.skip("needs `unshare -rm` (unprivileged user namespaces) to mount a small tmpfs")
    (files / "full").mkdir()
    flags = " ".join([*TINY, "--num-train-timesteps", "1", "--eval-every", "100", "--test-prompts", str(files / "test.txt")])
    script = NO_SPACE.format(size="400k", out=files / "full", python=sys.executable, flags=flags)
    out = run_script(["unshare", "-rm", "bash", "-c", script], python=False, check=False)
    line = assert_error_is_last_line(out.returncode, out.stderr, "")
    assert "no space left on device" in line.lower(), line


def test_track_without_a_wandb_login_is_one_line(files):
    """--track with wandb installed but no login (no API key, no netrc, not offline): one line before anything loads,
    instead of wandb.init's traceback after the run folder exists."""
    pytest.importorskip("wandb", reason="wandb is not installed (optional: pip install -r requirements-track.txt)")
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "NETRC"))}
    env.update(HOME=str(files), WANDB_DIR=str(files), OMP_NUM_THREADS="1")
    argv = ["algos/nft.py", *TINY, "--track", "--test-prompts", files / "test.txt", "--output-dir", files / "runs"]
    out = run_script(argv, check=False, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [x for x in out.stderr.splitlines() if x.startswith("error")]
    assert errors == [errors[-1]] and "--track: wandb has no login here" in errors[-1]
    assert not (files / "runs").exists() and not (files / "wandb").exists()


TORCHRUN_ENVS = {  # an environment left over from torchrun (or set by hand) -> a piece of the one line
    "WORLD_SIZE=2 RANK=0": "WORLD_SIZE=2 in the environment but no MASTER_ADDR or MASTER_PORT: launch with `torchrun",
    "WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1": "but no MASTER_PORT",
    "WORLD_SIZE=2 RANK=2": "RANK=2, WORLD_SIZE=2, LOCAL_RANK=0 in the environment: expected 0 <= RANK < WORLD_SIZE",
    "RANK=-1": "RANK=-1, WORLD_SIZE=1",
    "WORLD_SIZE=0": "WORLD_SIZE=0",
    "LOCAL_RANK=-1": "LOCAL_RANK=-1 in the environment",
    "RANK=zero": "RANK='zero' in the environment is not a whole number",
    "WORLD_SIZE=2.0": "WORLD_SIZE='2.0' in the environment is not a whole number",
}


@pytest.mark.parametrize("env", TORCHRUN_ENVS)
def test_a_torchrun_environment_without_torchrun_is_one_line(env, files, capsys, monkeypatch):
    """`WORLD_SIZE=2 RANK=0 python algos/crd.py` (torch's init_process_group raised a 25-line traceback): one line,
    exit code 2, before the model loads, nothing written."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for pair in env.split():
        monkeypatch.setenv(*pair.split("="))
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("the model loads"))
    argv = [*TINY, "--test-prompts", str(files / "test.txt"), "--output-dir", str(files / "runs")]
    assert_one_line(*call("crd", argv, capsys), TORCHRUN_ENVS[env])
    assert not (files / "runs").exists()


@pytest.mark.slow
def test_a_torchrun_environment_without_torchrun_is_one_line_as_a_script(files):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    out = run_script(
        ["algos/crd.py", *TINY, "--output-dir", files / "runs"],
        check=False,
        timeout=300,
        env={**env, "WORLD_SIZE": "2", "RANK": "0"},
    )
    assert_one_line(out.returncode, out.stderr, TORCHRUN_ENVS["WORLD_SIZE=2 RANK=0"])
    assert not (files / "runs").exists()
