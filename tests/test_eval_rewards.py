"""--eval-rewards: side metrics scored on the eval images only, logged as eval/<name> beside the training reward's eval
scores and in the final summary, kept by --resume. The tiny model in-process, so the images recomputed here come from
the same process (the same thread count) as the run's."""

import pytest
import torch
from conftest import run_in_process
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import common
import models
from algos import grpo
from harness import evaluation
from rewards.jpeg import jpeg_compressibility

TEST_PROMPTS = ["a red circle", "two squares", "a blue triangle"]


def logged(run_dir) -> dict:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"] if t.startswith("eval/")}


def eval_images(num_steps: int) -> torch.Tensor:
    """The eval images of the run's first eval (before any update: LoRA's B = 0, so the base model's), sampled here."""
    pipe = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"), torch.float32, None)
    encoder = common.PromptEncoder(pipe)
    images, _ = evaluation.evaluate(
        pipe, pipe.transformer, encoder, TEST_PROMPTS, lambda i, p: {}, num_steps=num_steps, guidance_scale=1.0, seed=0
    )
    return images


@pytest.mark.slow
def test_eval_rewards_are_logged_in_the_summary_and_kept_on_resume(tmp_path, capsys):
    (tmp_path / "test.txt").write_text("\n".join(TEST_PROMPTS) + "\n")
    (tmp_path / "train.txt").write_text("a blue square\nthree circles\n")
    flags = "--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --grad-steps-per-epoch 1 --num-sde-steps 1"
    argv = [
        *flags.split(),
        "--num-epochs",
        "1",
        "--train-prompts",
        tmp_path / "train.txt",
        "--test-prompts",
        tmp_path / "test.txt",
        "--output-dir",
        tmp_path / "runs",
        "--eval-rewards",
        "jpeg_compressibility",
    ]
    assert run_in_process(grpo, argv) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    (run_dir,) = (tmp_path / "runs").iterdir()
    scalars = logged(run_dir)
    assert set(scalars["eval/jpeg_compressibility"]) == set(scalars["eval/shapes_clean"]) == {0, 8}

    images = eval_images(num_steps=4)
    assert images.shape[0] == 2 * len(TEST_PROMPTS)  # each prompt with the eval's two noises
    direct = jpeg_compressibility()(images, TEST_PROMPTS * 2).mean().item()
    assert scalars["eval/jpeg_compressibility"][0] == pytest.approx(direct, rel=1e-6, abs=1e-6)

    # the final summary: the model card's eval table and the final eval line
    card = (run_dir / "lora" / "README.md").read_text()
    assert "eval/jpeg_compressibility" in card and "eval/shapes_clean" in card
    final = [line for line in out.splitlines() if line.startswith("final eval")]
    assert final and "jpeg_compressibility" in final[-1], out[-2000:]

    # a resume without the flag keeps the side metric
    assert run_in_process(grpo, ["--resume", run_dir, "--num-epochs", "2"]) == 0
    scalars = logged(run_dir)
    assert set(scalars["eval/jpeg_compressibility"]) == {0, 8, 16}
