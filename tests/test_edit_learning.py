"""Every algorithm learns the tiny edit task: a short run of each file on `assets/tiny-edit` (the shipped
FLUX.1-Kontext-style pipeline, its source images through the reference-image path), at its defaults but for the
batch (DPO: every ordered pair; GRPO: every weight, groups of 16), raises the edit reward on four seen instructions the
base often gets wrong, scored on fixed noise, so an update that does nothing scores exactly the start and one with the
wrong sign falls. The held-out results over seeds are benchmark/results/edit/README.md."""

import json

import numpy as np
import pytest

from tests.conftest import REPO, run_script, scalars

# seen instructions (assets/edit/train.jsonl) with a base edit reward of 0.25 over 4 noises, one of each kind the
# base struggles with: a recolour of a named object, a move of a named object, a recolour of the only square, a move
INSTRUCTIONS = ["make the red circle green", "move the red circle up", "make the square red", "move the triangle to the right"]

# eval/edit on the 4 instructions x 8 fixed noises (32 images) after 8 epochs of 4 x 8 rollouts, from 0.479 at the
# base, measured on one AMD EPYC core (2-4 min a run), seed 1 (the tests') / seed 2: crd 0.719 / 0.812, nft 0.875,
# dgpo 0.656 / 0.578 (0.63 / 0.69 at 4 epochs: on 4 instructions it overshoots), awm 0.906, elbo_grpo 0.865, dpo
# 0.875 (0.469 with its default best-worst pairs, 4 pairs an epoch). GRPO needs a larger group for its noisier step
# (benchmark/studies/gradient_noise.py): every weight at lr 1e-4 (as the others) with groups of 8 it ended at 0.562 /
# 0.490 / 0.406 over seeds 1-3; with groups of 16 (6 min) at 0.547 / 0.562 / 0.625. A no-op update scores exactly
# 0.479 again; each margin is about half the smallest gain measured, so that another CPU's rounding (or another seed)
# still clears it.
GAIN = {"crd": 0.1, "nft": 0.15, "dgpo": 0.05, "awm": 0.15, "elbo_grpo": 0.15, "dpo": 0.15, "grpo": 0.03}
# ELBO-GRPO at lr 1e-4, its former default: its default 3e-5 (for runs of thousands of images, convergence leg 15)
# gains 0.115 here in 8 epochs (0.479 -> 0.594, seed 1), too close to a margin that must hold on every CPU. AWM at
# KL 0.01, its default until convergence leg 16, where the gain above was measured (KL 0.1 not measured here).
FLAGS = {
    "dpo": "--pairs-per-group all",
    "grpo": "--full-finetune",
    "elbo_grpo": "--learning-rate 1e-4",
    "awm": "--kl-beta 0.01",
}
GROUP_SIZE = {"grpo": 16}  # the others 8


@pytest.fixture(scope="module")
def edit_prompts(tmp_path_factory):
    """The four instructions' lines of the shipped prompt file, their source images as absolute paths."""
    path = tmp_path_factory.mktemp("edit") / "prompts.jsonl"
    folder = REPO / "assets" / "edit"
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    rows = [{**r, "image": str(folder / r["image"])} for r in rows if r["prompt"] in INSTRUCTIONS]
    assert [r["prompt"] for r in rows] == INSTRUCTIONS
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# the runs of this file; the others' are in test_edit_learning_more.py, so that pytest-xdist (a file to a worker)
# runs the two halves on both cores (measured on 2 AMD EPYC cores: grpo 233 s, dpo 208, nft 187, the others 128-137)
HERE = ("grpo", "nft", "elbo_grpo")


@pytest.mark.slow
@pytest.mark.parametrize("algo", HERE)
def test_a_short_edit_run_raises_the_edit_reward(algo, edit_prompts, tmp_path):
    edit_run_gains(algo, edit_prompts, tmp_path)


def edit_run_gains(algo, edit_prompts, tmp_path):
    """One algorithm's short run on the four instructions raises eval/edit by GAIN[algo], and (but GRPO) its rollouts'
    reward rises too."""
    flags = (
        f"--model {REPO / 'assets' / 'tiny-edit'} --reward edit --train-prompts {edit_prompts} "
        f"--test-prompts {edit_prompts} --num-prompts 4 --group-size {GROUP_SIZE.get(algo, 8)} --num-epochs 8 "
        f"--eval-every 8 --eval-noises 8 --save-every 100 --output-dir {tmp_path / 'runs'} {FLAGS.get(algo, '')}"
    )
    run_script([f"algos/{algo}.py", *flags.split()])
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = scalars(run_dir)
    curve, train = logged["eval/edit"], logged["charts/reward_mean"]
    print(f"{algo}: eval/edit {[round(v, 3) for v in curve]}, rollout reward {[round(v, 3) for v in train]}")
    assert len(curve) == 2 and len(train) == 8  # eval/edit at the base and after epoch 8
    assert curve[-1] - curve[0] > GAIN[algo], curve
    if algo != "grpo":  # GRPO's SDE rollouts share one initial noise per group: its epoch means swing 0.0-0.88 by draw
        assert np.mean(train[-2:]) > np.mean(train[:2]), train  # the rollouts' reward rises too
