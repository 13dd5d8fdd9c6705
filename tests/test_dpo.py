"""Diffusion-DPO: the loss against a plain numpy loop, the pairs against a hand enumeration, the offline pairs file (bad
inputs, a DPO and an SFT run from tiny-shapes renders, an exact resume), and the online script learning."""

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_in_process, run_script, scalars
from PIL import Image

import common
import models
from algos import dpo
from harness import checkpoints, prompt_files
from rewards.worlds import shapes as world

TINY = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --grad-steps-per-epoch 1 --num-train-timesteps 1".split()


def test_fm_error_matches_numpy():
    g = torch.Generator().manual_seed(0)
    v, u = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    out = dpo.fm_error(v, u)
    for i in range(3):
        assert out[i].item() == pytest.approx(np.mean((v[i].numpy() - u[i].numpy()) ** 2), rel=1e-6)


def test_dpo_loss_matches_a_numpy_loop():
    """Eq. (14) per pair, written out with numpy scalars: -log sigmoid(-beta ((ew - erw) - (el - erl)))."""
    rng = np.random.default_rng(0)
    ew, el, erw, erl = (rng.uniform(0.2, 1.5, 6) for _ in range(4))
    beta = 50.0
    loss, z = dpo.dpo_loss(*(torch.tensor(a, dtype=torch.float64) for a in (ew, el, erw, erl)), beta)
    for i in range(6):
        inside = -beta * ((ew[i] - erw[i]) - (el[i] - erl[i]))
        assert loss[i].item() == pytest.approx(-math.log(1 / (1 + math.exp(-inside))), rel=1e-10)
        assert z[i].item() == pytest.approx(inside, rel=1e-10)
    # the implicit accuracy's sign: lowering the policy's error on the chosen image (vs the base) makes z > 0
    _, z = dpo.dpo_loss(torch.tensor([0.9]), torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([1.0]), beta)
    assert z.item() > 0


def test_dpo_loss_gradient_lowers_the_chosen_error_and_raises_the_rejected():
    err_w = torch.tensor([0.5, 0.7], requires_grad=True)
    err_l = torch.tensor([0.6, 0.4], requires_grad=True)
    loss, _ = dpo.dpo_loss(err_w, err_l, torch.tensor([0.5, 0.7]), torch.tensor([0.6, 0.4]), 10.0)
    loss.sum().backward()
    # at the reference (z = 0): dL/d err_w = beta sigmoid(0) = 5, dL/d err_l = -5
    assert err_w.grad.tolist() == [5.0, 5.0] and err_l.grad.tolist() == [-5.0, -5.0]


def test_select_pairs_against_a_hand_enumeration():
    rewards = torch.tensor([0.5, 1.0, 0.5, 0.0, 0.3, 0.3, 0.3, 0.3, 1.0, 0.0, 1.0, 0.0])
    # group 0: best 1, worst 3; group 1 all equal: no pair; group 2: the first best (8) and first worst (9)
    assert dpo.select_pairs(rewards, 4, "best-worst").tolist() == [[1, 3], [8, 9]]
    # every (i, j) with r_i > r_j, in (i, j) order; equal rewards (0 and 2, 8 and 10, 9 and 11, group 1) never pair
    assert dpo.select_pairs(rewards, 4, "all").tolist() == [
        [0, 3], [1, 0], [1, 2], [1, 3], [2, 3],
        [8, 9], [8, 11], [10, 9], [10, 11],
    ]  # fmt: skip
    assert dpo.select_pairs(torch.ones(8), 4, "all").shape == (0, 2)
    with pytest.raises(common.UserError, match="unknown pairs mode"):
        dpo.select_pairs(rewards, 4, "best")


def test_train_sigma_indexes_the_grid_with_u():
    grid = torch.linspace(1.0, 0.001, 1000)
    for mode in ("uniform", "logit-normal"):
        for seed in range(20):
            g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            sigma = dpo.train_sigma(g1, grid, mode, 0.5, 2.0)
            u = torch.sigmoid(0.5 + 2.0 * torch.randn(1, generator=g2)) if mode != "uniform" else torch.rand(1, generator=g2)
            assert sigma == float(grid[min(int(u * 1000), 999)])


def test_group_noise_is_one_keyed_draw_per_group_shared_by_its_images():
    """Each group of `unit` consecutive samples gets one (sigma, eps): sigma from train_sigma, then eps, from the
    generator keyed by (key, group), drawn here independently; any subset of the samples (a rank's, a micro-batch's)
    gets the same rows, so every pair's two images share their noise (Eq. 14) however the batch is split."""
    grid, key, shape = torch.linspace(1.0, 0.001, 1000), (3, 7, "train", 1), (2, 4, 4)
    samples = [0, 3, 5, 8, 9, 15]
    sigma, eps = dpo.group_noise(samples, 8, shape, key, grid, "logit-normal", 0.0, 1.0)
    for row, s in enumerate(samples):
        gen = common.keyed_generator(*key, s // 8)
        u = torch.sigmoid(torch.randn(1, generator=gen))
        assert sigma[row].item() == pytest.approx(float(grid[min(int(u * 1000), 999)]), abs=0)
        assert torch.equal(eps[row], torch.randn(shape, generator=gen))
    assert torch.equal(eps[0], eps[1]) and torch.equal(eps[3], eps[5]) and not torch.equal(eps[0], eps[3])
    part_sigma, part_eps = dpo.group_noise([5, 15], 8, shape, key, grid, "logit-normal", 0.0, 1.0)
    assert torch.equal(part_sigma, sigma[[2, 5]]) and torch.equal(part_eps, eps[[2, 5]])
    one_sigma, one_eps = dpo.group_noise([0, 1], 1, shape, key, grid, "uniform", 0.0, 1.0)  # SFT: a sample alone
    assert not torch.equal(one_eps[0], one_eps[1])


def test_regularizer_matches_numpy():
    """RPO's chosen-image term and the velocity KL to the base, against numpy; without a base velocity no KL."""
    g = torch.Generator().manual_seed(0)
    err_w, v, v_base = torch.rand(5, generator=g), torch.randn(4, 2, 3, 3, generator=g), torch.randn(4, 2, 3, 3, generator=g)
    expected = 0.7 * err_w.numpy().mean() + 0.3 * ((v.numpy() - v_base.numpy()) ** 2).mean()
    assert dpo.regularizer(err_w, v, v_base, 0.7, 0.3).item() == pytest.approx(expected, rel=1e-6)
    assert dpo.regularizer(err_w, v, None, 0.7, 0.3).item() == pytest.approx(0.7 * err_w.numpy().mean(), rel=1e-6)


def test_offline_lines_cycle_without_replacement():
    lines = dpo.draw_lines(3, 7, torch.Generator().manual_seed(0))
    assert sorted(lines[:3]) == sorted(lines[3:6]) == [0, 1, 2] and len(lines) == 7


# ---------------------------------------------------------------------------------------------------------------------
# offline pairs files
# ---------------------------------------------------------------------------------------------------------------------
def write_pairs(folder: Path, n: int = 4, sft: bool = False, seed: int = 0) -> Path:
    """A pairs file of tiny-shapes renders: the chosen image is a scene of the prompt (world.sample_scene), the rejected
    one a scene of another training prompt. Paths relative to the file's folder, in a subfolder."""
    rng = random.Random(seed)
    train, _ = world.splits()
    rows = rng.sample(train, 2 * n)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    with open(folder / "pairs.jsonl", "w") as f:
        for k in range(n):
            good, bad = rows[2 * k], rows[2 * k + 1]
            Image.fromarray(world.render(world.sample_scene(rng, *good))).save(folder / "img" / f"{k}_w.png")
            line = {"prompt": good[1], "chosen": f"img/{k}_w.png"}
            if not sft:
                Image.fromarray(world.render(world.sample_scene(rng, *bad))).save(folder / "img" / f"{k}_l.png")
                line["rejected"] = f"img/{k}_l.png"
            f.write(json.dumps(line) + "\n")
    return folder / "pairs.jsonl"


def offline_argv(tmp_path, pairs, *flags):
    (tmp_path / "test.txt").write_text("a red circle\ntwo squares\n")
    return [*TINY, "--pairs", pairs, "--test-prompts", tmp_path / "test.txt", "--output-dir", tmp_path / "runs", *flags]


def bad_files(folder: Path) -> dict:
    """name -> (pairs file, a piece of the one error line)."""
    good = write_pairs(folder / "good")
    lines = good.read_text().splitlines()
    first = json.loads(lines[0])
    cases = {
        "missing": ("nothere.jsonl", "cannot be read"),
        "not json": ("{not json\n", "line 1: not JSON"),
        "no prompt": (json.dumps({"chosen": first["chosen"]}), 'line 1: needs an object with a non-empty "prompt"'),
        "a list": ("[1, 2]", 'line 1: needs an object with a non-empty "prompt"'),
        "no chosen": (json.dumps({"prompt": "a red circle", "rejected": first["rejected"]}), 'needs a "chosen" image path'),
        "missing image": (json.dumps({**first, "rejected": "img/nothere.png"}), "rejected image"),
        "not an image": (json.dumps({**first, "chosen": "pairs.jsonl"}), "chosen image"),
        "mixed": ("\n".join([lines[0], json.dumps({k: v for k, v in first.items() if k != "rejected"})]), "or none does"),
        "sizes": ("\n".join([lines[0], json.dumps({**first, "chosen": "img/small.png"})]), "differ in size"),
        "empty": ("\n\n", "no lines"),
    }
    Image.new("RGB", (32, 32)).save(folder / "good" / "img" / "small.png")
    out = {}
    for name, (text, message) in cases.items():
        path = folder / "good" / f"{name.replace(' ', '_')}.jsonl"
        if name != "missing":
            path.write_text(text + "\n")
        out[name] = (path, message)
    return out


@pytest.mark.parametrize(
    "case",
    ["missing", "not json", "no prompt", "a list", "no chosen", "missing image", "not an image", "mixed", "sizes", "empty"],
)
def test_bad_pairs_file_one_line_before_the_model_loads(case, tmp_path, capsys, monkeypatch):
    loaded, load = [], models.load_pipeline
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: loaded.append(a) or load(*a, **k))
    path, message = bad_files(tmp_path)[case]
    capsys.readouterr()
    rc = run_in_process(dpo, offline_argv(tmp_path, path))
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and line.startswith("error: --pairs") and message in line, line
    assert not loaded and not (tmp_path / "runs").exists()


def test_pairs_of_the_wrong_size_for_the_model_or_flags(tmp_path, capsys):
    """Images of another size than --resolution: before the model loads; than the model's native size: after it loads,
    still before anything is written."""
    pairs = write_pairs(tmp_path)
    for flags, message in ((["--resolution", "32"], "not 32x32"), ([], "the model samples 64x64")):
        capsys.readouterr()
        small = tmp_path / "small"
        if not flags:  # the tiny model's native 64x64, and a file of 32x32 images
            small.mkdir(exist_ok=True)
            Image.new("RGB", (32, 32)).save(small / "a.png")
            Image.new("RGB", (32, 32), (255, 255, 255)).save(small / "b.png")
            (small / "pairs.jsonl").write_text(json.dumps({"prompt": "a red circle", "chosen": "a.png", "rejected": "b.png"}))
            pairs = small / "pairs.jsonl"
        rc = run_in_process(dpo, offline_argv(tmp_path, pairs, *flags))
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "Loading" not in x]
        assert rc == 2 and message in line, line
        assert not (tmp_path / "runs").exists()


def test_online_flags_with_pairs_are_refused(tmp_path, capsys):
    rc = run_in_process(dpo, offline_argv(tmp_path, write_pairs(tmp_path), "--pairs-per-group", "all"))
    assert rc == 2 and "--pairs-per-group: an online setting" in capsys.readouterr().err


@pytest.mark.slow
def test_offline_dpo_runs_and_resumes_exactly(tmp_path):
    """Offline DPO from tiny-shapes renders: 2 epochs write the usual artifacts and the DPO metrics; 1 epoch then
    --resume to 2 ends bit for bit where the uninterrupted run did (the file is read and encoded again on resume)."""
    pairs = write_pairs(tmp_path)
    run_script(["algos/dpo.py", *offline_argv(tmp_path, pairs, "--num-epochs", "2", "--eval-every", "1")])
    (a_dir,) = (tmp_path / "runs").iterdir()
    assert (a_dir / "transformer" / "diffusion_pytorch_model.safetensors").is_file()  # the export (every weight trained)
    logged = scalars(a_dir)
    for tag in ("losses/policy_loss", "losses/implicit_acc", "losses/margin", "losses/grad_norm", "eval/shapes_clean"):
        assert tag in logged, tag
    assert logged["charts/pairs"] == [4.0, 4.0]  # M K / 2 pairs per epoch
    # the chosen renders match their prompts, the rejected ones another prompt's: the data's own reward gap
    assert all(g > 0 for g in logged["charts/pair_reward_gap"])
    b_out = tmp_path / "b"
    run_script(["algos/dpo.py", *offline_argv(tmp_path, pairs, "--num-epochs", "1", "--output-dir", b_out)])
    (b_dir,) = b_out.iterdir()
    run_script(["algos/dpo.py", "--resume", b_dir, "--num-epochs", "2"])
    a, b = checkpoints.load_checkpoint(a_dir), checkpoints.load_checkpoint(b_dir)
    assert a["step"] == b["step"] == 2 and a["images_seen"] == b["images_seen"] == 16
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), name


@pytest.mark.slow
def test_offline_chosen_only_is_sft(tmp_path):
    """Lines without "rejected": the plain flow-matching loss on the chosen images, no reference and no DPO metrics."""
    pairs = write_pairs(tmp_path, sft=True)
    out = run_script(["algos/dpo.py", *offline_argv(tmp_path, pairs, "--num-epochs", "1", "--eval-every", "5")])
    assert "offline SFT (4 lines)" in out.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = scalars(run_dir)
    assert "losses/policy_loss" in logged and "losses/implicit_acc" not in logged and logged["charts/pairs"] == [0.0]
    # the flow-matching loss of a pretrained model on its own world's images: well below the loss of a zero velocity
    assert 0 < logged["losses/policy_loss"][0] < 1.0
    assert checkpoints.load_checkpoint(run_dir)["step"] == 1


# ---------------------------------------------------------------------------------------------------------------------
# offline edits: pairs lines with the image to edit, on a tiny FLUX.1-Kontext (tests/test_flux_kontext.py)
# ---------------------------------------------------------------------------------------------------------------------
EDIT_HEIGHT, EDIT_WIDTH = 32, 48  # not square, as test_flux_kontext's


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    import tiny_families

    return tiny_families.flux_kontext(tmp_path_factory.mktemp("kontext") / "dev")


def write_edit_pairs(folder: Path, n: int = 3, sft: bool = False, out=(EDIT_WIDTH, EDIT_HEIGHT), size=None) -> Path:
    """An edit pairs file: line k has its own random scene ("image", of `size`, default `out`) and random chosen /
    rejected images of the sampled size `out` (width, height), paths relative to the file's folder (in subfolders)."""
    size = size or out
    rng = np.random.default_rng(0)
    for sub in ("scenes", "img"):
        (folder / sub).mkdir(parents=True, exist_ok=True)

    def save(path, wh):
        Image.fromarray(rng.integers(0, 256, (wh[1], wh[0], 3), dtype=np.uint8)).save(folder / path)
        return path

    rows = []
    for k in range(n):
        row = {"prompt": ["make the circle red", "add a blue square", "remove the square"][k % 3]}
        row["image"] = save(f"scenes/{k}.png", size)
        row["chosen"] = save(f"img/{k}_w.png", out)
        if not sft:
            row["rejected"] = save(f"img/{k}_l.png", out)
        rows.append(row)
    (folder / "edits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "edits.jsonl"


def edit_argv(tmp_path, model, pairs, *flags, out=(EDIT_WIDTH, EDIT_HEIGHT)):
    """A tiny offline run on `model` (--height/--width `out`, the chosen images'), the train and test prompts two of
    the scenes (Qwen-Image-Edit needs an image in every prompt file)."""
    test = Path(pairs).parent / "test.jsonl"
    rows = [
        {"prompt": "make the circle red", "image": "scenes/0.png"},
        {"prompt": "add a blue square", "image": "scenes/1.png"},
    ]
    test.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        *TINY,
        *["--model", model, "--height", out[1], "--width", out[0], "--reward", "jpeg_compressibility", "--pairs", pairs],
        *["--train-prompts", test, "--test-prompts", test, "--output-dir", tmp_path / "runs", "--num-epochs", "1"],
        *flags,
    ]


def recorded_velocity(monkeypatch) -> list:
    """common.velocity recorded: the Cond of every call with gradients on (the training forwards)."""
    calls, velocity = [], common.velocity

    def recording(transformer, x, sigma, cond, *a, **k):
        if torch.is_grad_enabled():
            calls.append((x.shape[0], cond))
        return velocity(transformer, x, sigma, cond, *a, **k)

    monkeypatch.setattr(common, "velocity", recording)
    return calls


def test_offline_dpo_on_edit_pairs_trains_kontext_on_each_lines_image(kontext_dir, tmp_path, capsys, monkeypatch):
    """Offline DPO on a tiny FLUX.1-Kontext from edit pairs: finite DPO losses and the implicit accuracy logged, and
    every training forward conditioned on the reference latents of the pair's own line: a pair's chosen and rejected
    rows share them, the lines' different scenes give different ones, and they are the family's encoding of the
    line's image file (encoded again here, by the VAE of the same tiny model)."""
    from models import flux_kontext

    pairs = write_edit_pairs(tmp_path)
    calls = recorded_velocity(monkeypatch)
    assert run_in_process(dpo, edit_argv(tmp_path, kontext_dir, pairs, "--eval-every", "1")) == 0
    assert "offline DPO (3 lines)" in capsys.readouterr().out
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = scalars(run_dir)
    for tag in ("losses/policy_loss", "losses/implicit_acc", "losses/margin", "eval/jpeg_compressibility"):
        assert tag in logged and all(math.isfinite(v) for v in logged[tag]), tag
    assert 0 <= logged["losses/implicit_acc"][0] <= 1 and logged["charts/pairs"] == [4.0]
    assert calls and all(cond.image is not None and cond.image.shape[0] == b for b, cond in calls)
    pipe = models.load_pipeline(str(kontext_dir), torch.device("cpu"), height=EDIT_HEIGHT, width=EDIT_WIDTH)
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    with torch.no_grad():
        scenes = [flux_kontext.encode_image(pipe.pipe, prompt_files.image_pixels(pairs.parent / r["image"]))[0] for r in rows]
    assert not torch.equal(scenes[0], scenes[1])
    for b, cond in calls:  # the micro-batch's samples in order: offline, pair i is samples (2i, 2i + 1)
        chosen, rejected = cond.image[0::2], cond.image[1::2]
        assert torch.equal(chosen, rejected)
        for z in chosen:
            assert any(torch.allclose(z, s, atol=1e-6) for s in scenes)


def test_offline_sft_on_edit_lines_without_rejected(kontext_dir, tmp_path, capsys, monkeypatch):
    """Edit lines with only a chosen image: SFT on a tiny FLUX.1-Kontext, the flow-matching loss finite, no DPO
    metrics, every training forward with reference latents."""
    pairs = write_edit_pairs(tmp_path, sft=True)
    calls = recorded_velocity(monkeypatch)
    assert run_in_process(dpo, edit_argv(tmp_path, kontext_dir, pairs, "--eval-every", "5")) == 0
    assert "offline SFT (3 lines)" in capsys.readouterr().out
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = scalars(run_dir)
    assert math.isfinite(logged["losses/policy_loss"][0]) and logged["losses/policy_loss"][0] > 0
    assert "losses/implicit_acc" not in logged and logged["charts/pairs"] == [0.0]
    assert calls and all(cond.image is not None and cond.image.shape[0] == b for b, cond in calls)


def bad_edit_files(folder: Path) -> dict:
    """name -> (pairs file, a piece of the one error line, model: "kontext" or the default text-only tiny-shapes)."""
    good = write_edit_pairs(folder / "good")
    lines = good.read_text().splitlines()
    first = json.loads(lines[0])
    no_image = {k: v for k, v in first.items() if k != "image"}
    Image.new("RGB", (EDIT_HEIGHT, EDIT_HEIGHT)).save(folder / "good" / "scenes" / "square.png")
    cases = {
        "missing image": (json.dumps({**first, "image": "scenes/nothere.png"}), "image 'scenes/nothere.png' not found"),
        "not an image": (json.dumps({**first, "image": "edits.jsonl"}), "cannot be read as an image"),
        "not a path": (json.dumps({**first, "image": 3}), "'image' is '3', expected an image file's path"),
        "mixed": ("\n".join([lines[0], json.dumps(no_image)]), 'every line carries an "image"'),
        "mixed first without": ("\n".join([json.dumps(no_image), lines[0]]), 'every line carries an "image"'),
        "wrong size": (
            json.dumps({**first, "image": "scenes/square.png"}),
            f"its image is {EDIT_HEIGHT} x {EDIT_HEIGHT} pixels, but the model samples {EDIT_WIDTH} x {EDIT_HEIGHT}",
        ),
        "text family": (lines[0], "its lines carry an image to edit, but StableDiffusion3Pipeline takes none"),
    }
    out = {}
    for name, (text, message) in cases.items():
        path = folder / "good" / f"{name.replace(' ', '_')}.jsonl"
        path.write_text(text + "\n")
        out[name] = (path, message)
    return out


@pytest.mark.parametrize(
    "case", ["missing image", "not an image", "not a path", "mixed", "mixed first without", "wrong size", "text family"]
)
def test_bad_edit_pairs_one_line_before_the_model_loads(case, kontext_dir, tmp_path, capsys, monkeypatch):
    loaded, load = [], models.load_pipeline
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: loaded.append(a) or load(*a, **k))
    path, message = bad_edit_files(tmp_path)[case]
    argv = edit_argv(tmp_path, kontext_dir, path)
    if case == "text family":  # the tiny SD3 (64 x 64): its own size, so only the image is wrong
        argv = offline_argv(tmp_path, path, "--height", EDIT_HEIGHT, "--width", EDIT_WIDTH)
    capsys.readouterr()
    rc = run_in_process(dpo, argv)
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and line.startswith("error: --pairs") and message in line, line
    assert not loaded and not (tmp_path / "runs").exists()


QWEN_OUT = (96, 64)  # test_qwenimage_edit's sampled size; the scenes 48 x 32 (3:2), resized by the family


@pytest.fixture(scope="module")
def qwen_edit_dir(tmp_path_factory):
    import tiny_families

    return tiny_families.qwen_image_edit(tmp_path_factory.mktemp("qwen-edit") / "model")


@pytest.mark.slow
def test_offline_dpo_on_edit_pairs_trains_qwen_image_edit(qwen_edit_dir, tmp_path, capsys, monkeypatch):
    """The other edit family: its reference images resized (any size of one aspect ratio), the chosen and rejected
    images encoded by its `encode_image` (its latents are not the VAE's own): finite DPO losses, reference latents in
    every training forward."""
    pairs = write_edit_pairs(tmp_path, out=QWEN_OUT, size=(48, 32))
    calls = recorded_velocity(monkeypatch)
    assert run_in_process(dpo, edit_argv(tmp_path, qwen_edit_dir, pairs, "--eval-every", "5", out=QWEN_OUT)) == 0
    assert "offline DPO (3 lines)" in capsys.readouterr().out
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = scalars(run_dir)
    for tag in ("losses/policy_loss", "losses/implicit_acc", "losses/margin"):
        assert tag in logged and all(math.isfinite(v) for v in logged[tag]), tag
    assert calls and all(cond.image is not None and cond.image.shape[0] == b for b, cond in calls)


@pytest.mark.parametrize("case", ["text only", "two aspect ratios"])
def test_bad_qwen_edit_pairs_one_line_before_the_model_loads(case, qwen_edit_dir, tmp_path, capsys, monkeypatch):
    """Qwen-Image-Edit's own checks on the pairs file: every line needs an image, all of one resized size."""
    loaded, load = [], models.load_pipeline
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: loaded.append(a) or load(*a, **k))
    pairs = write_edit_pairs(tmp_path / "data", out=QWEN_OUT, size=(48, 32))
    argv = edit_argv(tmp_path, qwen_edit_dir, pairs, out=QWEN_OUT)  # writes the (good) prompt files
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    if case == "text only":
        rows, message = [{k: v for k, v in r.items() if k != "image"} for r in rows], "edits an image: every prompt needs one"
    else:
        Image.new("RGB", (32, 32)).save(pairs.parent / "scenes" / "square.png")
        rows[1]["image"], message = "scenes/square.png", "its image resizes to 1024 x 1024 for Qwen-Image-Edit"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    rc = run_in_process(dpo, argv)
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and line.startswith("error: --pairs") and message in line, line
    assert not loaded and not (tmp_path / "runs").exists()


# measured (6 epochs, 4 prompts x 8, CFG 1, 40-60 s each on one core): compressibility -0.739 -> -0.524 (+0.22),
# incompressibility 0.739 -> 1.02 (+0.28); with fixed eval noise a no-op update gives exactly 0 and a wrong sign a loss
# in one of the two directions
MIN_GAIN = {"jpeg_compressibility": 0.1, "jpeg_incompressibility": 0.1}


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["jpeg_compressibility", "jpeg_incompressibility"])
def test_online_dpo_learns_both_directions(reward, tmp_path):
    """Deterministic on CPU: a few epochs of online DPO (best-worst pairs) raise the held-out reward well past
    run-to-run noise in either direction of the JPEG task, so an update that does nothing or has the wrong sign fails
    one of the two."""
    (tmp_path / "test.txt").write_text("a red circle\ntwo blue squares\na green triangle above a yellow circle\n")
    cmd = (
        f"algos/dpo.py --reward {reward} --num-epochs 6 --eval-every 6 --save-every 100 --num-prompts 4 --group-size 8 "
        f"--micro-batch 16 --grad-steps-per-epoch 2 --num-train-timesteps 2 "
        f"--test-prompts {tmp_path / 'test.txt'} --output-dir {tmp_path / 'runs'}"
    )
    run_script(cmd.split())
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = scalars(run_dir)
    curve, train = logged[f"eval/{reward}"], logged["charts/reward_mean"]
    assert len(curve) == 2 and len(train) == 6
    assert curve[1] - curve[0] > MIN_GAIN[reward], curve
    assert np.mean(train[-2:]) > np.mean(train[:2]), train  # the training reward (the rollouts') rises too
