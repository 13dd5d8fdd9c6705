"""The convergence protocol: held-out exact against images trained, next to the base model's ceilings.

    python benchmark/convergence.py train SETTING [...] --seeds 1 2 3 --jobs 2   # train (or resume) the runs
    python benchmark/convergence.py base                                   # base at CFG 1 / 4.5, best-of-k, both prompt sets
    python benchmark/convergence.py final RUN [RUN ...]                    # each run's exported LoRA, both prompt sets
    python benchmark/convergence.py final RUN [...] --sets unseen train    # ... on never-trained colour attribution too
    python benchmark/convergence.py table  [--results DIR]                 # tables + plots from the jsonl files
    python benchmark/convergence.py roundtrip                              # rendered scenes through the VAE and the scorer
    python benchmark/convergence.py categories [--results DIR]             # exact per kind of prompt, base and exports
    python benchmark/convergence.py train crd nft --task ocr --epochs 100  # the same protocol on tiny-text OCR

Runs are trained by the algorithm files with `--keep-checkpoints` large enough to keep every save (the commands are in
benchmark/results/convergence/README.md). `curves` loads each checkpoint's trainable weights (the eval EMA when the run
kept one, as its export does) into the base pipeline and samples, ODE 10 steps at the run's own guidance scale:

- `test`: the 30 held-out prompts x 8 fixed noises (240 images),
- `train`: a fixed sample of 30 training prompts x 8 fixed noises,

with the same noises as `base`, so every number is paired with the base on the same noise. Metrics: exact (the asked
objects and nothing else), strict (GenEval's all requirements met), extra objects per image and the prompt-specific gap.
`base` also gives best-of-k: the chance that at least one of k noises is exact (unbiased from 8 noises per prompt), the
ceiling that RL turning "sometimes" into "every time" should approach.

Results are appended to benchmark/results/convergence/{base,curves}.jsonl (one JSON row per model x checkpoint x set).

`--task ocr` runs the same protocol on tiny-text with the `ocr` reward (the file defaults plus the model, reward and
prompt files of `TASKS`), into benchmark/results/convergence/ocr/: there "exact" is the word read exactly (the
in-run `ocr_strict`), "score" the OCR reward (1 - edit distance / length), "gap" the score minus the score of the
same image against another test word; the test set is the 64 held-out words x 4 noises in-run. `--model DIR` runs
every command on another build of the task's model (a larger tiny-shapes, say; use its own `--results`).
"""

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402,F401  (registers the model families with common)
import rewards  # noqa: E402
from harness import evaluation, prompt_files  # noqa: E402
from rewards import shapes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "convergence"
NOISES = 8
NUM_TRAIN_SAMPLE = 30
REPO = Path(__file__).resolve().parents[1]
# colour-attribution captions no run trained on (written by benchmark/testbeds/unseen_colors.py): does RL's colour
# binding transfer?
UNSEEN = str(REPO / "assets" / "unseen_colors.jsonl")
# every evaluation of a convergence run: the 30 held-out prompts x 8 noises (240 images) every 40 epochs (2,560 images)
OCR_RESULTS = RESULTS / "ocr"

ATTN = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
FF = ["--lora-targets", *ATTN, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
STEPS8 = ["--grad-steps-per-epoch", "8", "--micro-batch", "8"]

# name -> (algorithm file, flags beyond its defaults). Every setting tried stays here, with its numbers in the results.
OPD_TEACHERS = [f"assets/opd/teachers/{d}" for d in ("attr", "rest")]  # the two teachers above, seed 1
OPD_PROMPTS = [f"assets/opd/{d}_train.jsonl" for d in ("attr", "rest")]
TDM_R1 = ["--full-finetune", "--generator", "benchmark/results/convergence/few_step/dmd2__s1"]  # DMD2's seed 1
SETTINGS = {
    "crd": ("crd", []),
    "crd_kl0.1": ("crd", ["--kl-beta", "0.1"]),
    "crd_kl0.1_p16": ("crd", ["--kl-beta", "0.1", "--num-prompts", "16", "--grad-steps-per-epoch", "4"]),
    "crd_kl0.1_lr3e-4": ("crd", ["--kl-beta", "0.1", "--learning-rate", "3e-4"]),
    "nft": ("nft", []),
    "nft_lr1e-3": ("nft", ["--learning-rate", "1e-3"]),
    "nft_p16": ("nft", ["--num-prompts", "16", "--grad-steps-per-epoch", "2"]),
    "awm": ("awm", ["--kl-beta", "0.01"]),  # the default until leg 16: OCR (leg 6) and tiny-edit ran at it
    "awm_lr3e-3": ("awm", ["--learning-rate", "3e-3", "--kl-beta", "0.01"]),
    "dgpo": ("dgpo", []),
    "dgpo_kl0.1": ("dgpo", ["--kl-beta", "0.1"]),
    "grpo": ("grpo", []),
    # each file's defaults on the tiny models (every weight: --full-finetune is their default under 50M weights, and
    # naming it keeps run_flags from adding the old LoRA settings' --no-full-finetune)
    "dpo_full": ("dpo", ["--full-finetune"]),
    # every ordered pair of a group (28 at K=8) instead of best vs worst: on 4 tiny-edit instructions only this one learns
    "dpo_full_all_pairs": ("dpo", ["--full-finetune", "--pairs-per-group", "all"]),
    # issue dpo-learns (results/convergence/dpo_learns/): each group's images share one noise from c9989c4 on, so every
    # pair of --pairs-per-group all costs K forwards a group; then the reference renewed every 2 steps (TR-DPO), and
    # what the follow-ups add on top: RPO's SFT term, the velocity KL to the base (at CFG 1 or CRD's 4.5)
    "dpo_all": ("dpo", ["--full-finetune", "--pairs-per-group", "all"]),
    "dpo_all_b500": ("dpo", ["--full-finetune", "--pairs-per-group", "all", "--dpo-beta", "500"]),
    **{
        f"dpo_all_b{b}_ref2{name}": (
            "dpo",
            ["--full-finetune", "--pairs-per-group", "all", "--dpo-beta", b, "--ref-update-every", "2", *extra],
        )
        for b, name, extra in [
            ("500", "", []),
            ("5000", "", []),
            ("500", "_sft1", ["--sft-weight", "1"]),
            ("500", "_kl0.1", ["--kl-beta", "0.1"]),
            ("500", "_kl1_cfg4.5", ["--kl-beta", "1", "--kl-cfg", "4.5"]),
        ]
    },
    # lr 1e-4 was ELBO-GRPO's default until leg 15: pinned so that these names remake their committed rows
    "elbo_grpo_full": ("elbo_grpo", ["--full-finetune", "--learning-rate", "1e-4"]),
    "elbo_grpo_full_lr3e-5": ("elbo_grpo", ["--full-finetune", "--learning-rate", "3e-5"]),
    "elbo_grpo_full_kl0.1": ("elbo_grpo", ["--full-finetune", "--learning-rate", "1e-4", "--kl-beta", "0.1"]),
    # Flow-GRPO's recipe: rollouts (and evaluation) at CFG 4.5, KL 0.04 to the reference
    "grpo_cfg4.5_kl0.04": ("grpo", ["--guidance-scale", "4.5", "--kl-beta", "0.04"]),
    "grpo_cfg4.5_kl0.04_lr1e-4": ("grpo", ["--guidance-scale", "4.5", "--kl-beta", "0.04", "--learning-rate", "1e-4"]),
    "grpo_cfg4.5_kl0.04_g16": ("grpo", ["--guidance-scale", "4.5", "--kl-beta", "0.04", "--group-size", "16"]),
    # more optimizer steps per rollout, LoRA on the feed-forward layers too, a larger rank
    "crd_steps8": ("crd", STEPS8),
    "crd_lr3e-3": ("crd", ["--learning-rate", "3e-3"]),
    "crd_ff": ("crd", FF),
    "crd_ff_steps8": ("crd", [*FF, *STEPS8]),
    "crd_kl0.1_ff_steps8": ("crd", ["--kl-beta", "0.1", *FF, *STEPS8]),
    "crd_r64": ("crd", ["--lora-rank", "64", "--lora-alpha", "128"]),
    "nft_steps4": ("nft", ["--grad-steps-per-epoch", "4"]),
    "nft_ff": ("nft", FF),
    "nft_ff_steps4": ("nft", [*FF, "--grad-steps-per-epoch", "4"]),
    "nft_lr1e-3_ff_steps4": ("nft", ["--learning-rate", "1e-3", *FF, "--grad-steps-per-epoch", "4"]),
    "awm_steps8": ("awm", [*STEPS8, "--kl-beta", "0.01"]),
    "awm_ff": ("awm", [*FF, "--kl-beta", "0.01"]),
    "dgpo_steps8": ("dgpo", STEPS8),
    "dgpo_ff": ("dgpo", FF),
    "grpo_cfg4.5_kl0.04_lr2e-3": ("grpo", ["--guidance-scale", "4.5", "--kl-beta", "0.04", "--learning-rate", "2e-3"]),
    "grpo_cfg4.5_kl0.04_ff": ("grpo", ["--guidance-scale", "4.5", "--kl-beta", "0.04", *FF]),
    # the evaluated weights an EMA of the trained ones, as every paper reports (the base itself is an EMA)
    "crd_ff_ema0.95": ("crd", [*FF, "--eval-ema-decay", "0.95"]),
    # every transformer weight instead of a LoRA: is the LoRA's capacity the plateau?
    "crd_full_lr1e-4": ("crd", ["--full-finetune", "--learning-rate", "1e-4"]),
    "crd_full_lr3e-4": ("crd", ["--full-finetune", "--learning-rate", "3e-4"]),
    # DiffusionOPD (issue few-step): a teacher per prompt domain (colour attribution; the other kinds), CRD at its
    # defaults on that domain's training prompts; the student distilled from both; CRD on every prompt, the RL run of the
    # same images (benchmark/results/convergence/few_step)
    "opd_teacher_attr": ("crd", ["--full-finetune", "--train-prompts", "assets/opd/attr_train.jsonl"]),
    "opd_teacher_rest": ("crd", ["--full-finetune", "--train-prompts", "assets/opd/rest_train.jsonl"]),
    "opd_crd_all": ("crd", ["--full-finetune"]),
    # DMD2 (issue few-step): a 2-step generator from the 10-step base, towards the base at CFG 4.5 (the default) or 1
    "dmd2": ("dmd2", ["--full-finetune"]),
    "dmd2_real_cfg1": ("dmd2", ["--full-finetune", "--real-guidance-scale", "1.0"]),
    # TDM-R1 (issue few-step): RL with shapes_clean on the 2-step DMD2 model (its seed 1, committed)
    "tdm_r1": ("tdm_r1", TDM_R1),
    "tdm_r1_rl0": (
        "tdm_r1",
        [*TDM_R1, "--rl-weight", "0"],
    ),
    "tdm_r1_rcfg1": (
        "tdm_r1",
        [*TDM_R1, "--reward-guidance-scale", "1"],
    ),
    "tdm_r1_rkl0.1": (
        "tdm_r1",
        [*TDM_R1, "--reward-kl", "0.1"],
    ),
    # the first default, the authors' surrogate KL
    "tdm_r1_rkl0.001": (
        "tdm_r1",
        [*TDM_R1, "--reward-kl", "0.001"],
    ),
    "opd": ("opd", ["--full-finetune", "--teachers", *OPD_TEACHERS, "--teacher-prompts", *OPD_PROMPTS]),
    "nft_full_lr1e-4": ("nft", ["--full-finetune", "--learning-rate", "1e-4"]),
    "dgpo_full_lr1e-4": ("dgpo", ["--full-finetune", "--learning-rate", "1e-4"]),
    "awm_full_lr1e-4": ("awm", ["--full-finetune", "--learning-rate", "1e-4", "--kl-beta", "0.01"]),
    "grpo_full_lr1e-4": ("grpo", ["--full-finetune", "--learning-rate", "1e-4"]),
    # GRPO-Guard's RatioNorm (arXiv 2510.22319): its remedy for a reward that falls under Flow-GRPO's biased ratios
    "grpo_full_guard_lr1e-4": ("grpo_variants", ["--full-finetune", "--learning-rate", "1e-4", "--grpo-guard"]),
    "grpo_cfg4.5_kl0.04_full_lr1e-4": (
        "grpo",
        ["--guidance-scale", "4.5", "--kl-beta", "0.04", "--full-finetune", "--learning-rate", "1e-4"],
    ),
    # why GRPO with every weight falls: a lower learning rate, a KL to the base, and a control whose advantages are
    # shuffled across the batch (no reward signal, the same update noise; benchmark/studies/shuffled_advantages.py)
    "grpo_full_lr1e-5": ("grpo", ["--full-finetune", "--learning-rate", "1e-5"]),
    "grpo_full_kl0.04_lr1e-4": ("grpo", ["--full-finetune", "--learning-rate", "1e-4", "--kl-beta", "0.04"]),
    "grpo_full_shuffled_lr1e-4": ("grpo", ["--full-finetune", "--learning-rate", "1e-4"]),
    # 4x the images per optimizer step (16 prompts x 16 images): less noise per step; run with --epochs 40 --eval-every 10
    "grpo_full_p16_g16_lr1e-4": (
        "grpo",
        ["--full-finetune", "--learning-rate", "1e-4", "--num-prompts", "16", "--group-size", "16"],
    ),
    # Flow-GRPO's GenEval sampling (`same_latent = False`, `global_std = True`): each image of a group its own initial
    # noise, advantages z-scored with the batch's std instead of the group's
    "grpo_indep_globalstd": ("grpo", ["--no-shared-group-noise", "--advantage-std", "global"]),
    # a 5x lower learning rate for 4x the images: the same summed step size, less random walk (tiny-shapes-8, leg 10)
    "grpo_lr1e-4": ("grpo", ["--learning-rate", "1e-4"]),
    # AWM's collapse on tiny-shapes-8 past ~5,000 images (leg 10): its KL to the base at 0.01 balances the advantage
    # term only when v drifts ~17 from v_ref (the ghuber gradient at the base's FM error); 10x and 100x (leg 12)
    "awm_full_kl0.1_lr1e-4": ("awm", ["--full-finetune", "--learning-rate", "1e-4", "--kl-beta", "0.1"]),
    "awm_full_kl1_lr1e-4": ("awm", ["--full-finetune", "--learning-rate", "1e-4", "--kl-beta", "1.0"]),
    # AWM's default KL since leg 16 (0.1) with the file's other defaults: leg 16's OCR row (tiny-edit's stays at 0.01)
    "awm_kl0.1": ("awm", ["--kl-beta", "0.1"]),
    # learning-2's long GRPO run toward the length its noise scale predicts (leg 11: every SDE step trained halves
    # B_noise, ~48,000 images; cos 0.9 at ~4.3 B_noise ~ 206,000 images), at a learning rate 25x under the default so
    # that the summed noise walk of ~6,500 steps stays below the one leg 10's 10,240-image run already drifted with
    "grpo_long_sde8_lr2e-5": ("grpo", ["--num-sde-steps", "8", "--learning-rate", "2e-5"]),
    # with KL 0.1 the held-out exact fluctuates by +-0.05 between evaluations (a noise walk held by the KL): an EMA of
    # the weights (exported, as the papers evaluate) averages it (leg 12)
    "awm_full_kl0.1_ema0.99_lr1e-4": (
        "awm",
        ["--full-finetune", "--learning-rate", "1e-4", "--kl-beta", "0.1", "--eval-ema-decay", "0.99"],
    ),
    # the same KL at the default length on the 4-layer model, beside leg 16's 0.01 and 0.1 (would it be the default?)
    "awm_full_kl0.03_lr1e-4": ("awm", ["--full-finetune", "--learning-rate", "1e-4", "--kl-beta", "0.03"]),
    # KL 0.1 holds AWM at the CFG-4.5 level, 0.01 lets it come apart past ~5,000 images (leg 12): 0.03 allows more
    # drift toward the reward, the exported EMA averages the wander that comes with it (leg 18)
    "awm_full_kl0.03_ema0.99_lr1e-4": (
        "awm",
        ["--full-finetune", "--learning-rate", "1e-4", "--kl-beta", "0.03", "--eval-ema-decay", "0.99"],
    ),
    # issue algorithms-2's GRPO variants, each one flag on GRPO's defaults (docs/grpo.md item 11), with the value its
    # paper or code uses: MixGRPO's sliding window, TempFlow-GRPO's noise weight, Flow-DPPO's KL mask, Pref-GRPO's
    # win rate
    "grpo_mixgrpo": ("grpo_variants", ["--window-mode", "sliding", "--window-shift", "25", "1"]),
    "grpo_tempflow": ("grpo_variants", ["--noise-weight", "2.25"]),
    "grpo_flow_dppo": ("grpo_variants", ["--kl-mask", "1e-5"]),
    "grpo_pref": ("grpo_variants", ["--win-rate-reward"]),
}
# settings that run an algorithm file through a wrapper script instead of directly
SCRIPTS = {"grpo_full_shuffled_lr1e-4": REPO / "benchmark" / "studies" / "shuffled_advantages.py"}


def shapes_metrics(images, prompts):
    m = shapes.evaluate(images, prompts, [shapes.wrong_prompt(p) for p in prompts])
    return {
        "exact": m["exact"],
        "strict": m["strict"],
        "extra": m["extra"],
        "gap": m["score"] - m["wrong"],
        "score": m["score"],
    }


def ocr_metrics(images, prompts, reward={}):  # noqa: B006 - a deliberate cache of the OCR model
    """exact: the word read exactly; score: the OCR reward; gap: score minus the same image's score for the next
    prompt's word (an image that spells any word scores on both)."""
    if "ocr" not in reward:
        reward["ocr"] = rewards.load_rewards("ocr", torch.device("cpu"))
    prompts = list(prompts)
    score = reward["ocr"].evaluate(images, prompts)["ocr"].float()
    wrong = reward["ocr"].evaluate(images, prompts[1:] + prompts[:1])["ocr"].float()
    return {"exact": (score == 1).float(), "score": score, "gap": score - wrong}


# what differs between the tiny-shapes protocol and tiny-text OCR: the model, prompt files and run flags, the metrics,
# the in-run eval tags a curve is read from (metric -> TensorBoard tag), and where the results go
TASKS = {
    "shapes": {
        "model": common.TINY_MODEL,
        "train": common.TRAIN_PROMPTS,
        "test": common.TEST_PROMPTS,
        "unseen": UNSEEN,
        "flags": [],
        "eval_noises": "8",
        "metrics": shapes_metrics,
        "tags": {
            "shapes_exact": "shapes_exact",
            "shapes_strict": "shapes_strict",
            "objects_extra": "objects_extra",
            "prompt_specific_gap": "prompt_specific_gap",
        },
        "results": RESULTS,
    },
    "ocr": {
        "model": str(REPO / "assets" / "tiny-text"),
        "train": str(REPO / "assets" / "text_train.jsonl"),
        "test": str(REPO / "assets" / "text_test.jsonl"),
        "unseen": None,
        "flags": ["--reward", "ocr"],
        "eval_noises": "4",
        "metrics": ocr_metrics,
        "tags": {"exact": "ocr_strict", "score": "ocr"},
        "results": OCR_RESULTS,
    },
    # tiny-edit (FLUX.1-Kontext style): training only; benchmark/edit.py scores the exports with the stock edit pipeline
    "edit": {
        "model": str(REPO / "assets" / "tiny-edit"),
        "train": str(REPO / "assets" / "edit" / "train.jsonl"),
        "test": str(REPO / "assets" / "edit" / "test.jsonl"),
        "unseen": None,
        "flags": ["--reward", "edit"],
        "eval_noises": "4",
        "metrics": None,
        "tags": {"exact": "edit_exact", "asked": "edit_asked", "rest": "rest_unchanged", "extra": "objects_extra"},
        "results": RESULTS.parent / "edit",
    },
}


def prompt_sets(train_file: str = common.TRAIN_PROMPTS, test_file: str = common.TEST_PROMPTS, unseen_file: str = None) -> dict:
    """The held-out prompts, a fixed sample of 30 training prompts, evenly spaced (every 6th of the 188 shapes
    prompts, so all categories), and with `unseen_file` (tiny-shapes: `UNSEEN`) the prompts of that file."""
    train = prompt_files.load_prompts(train_file)
    step = max(1, len(train) // NUM_TRAIN_SAMPLE)
    sets = {"test": prompt_files.load_prompts(test_file), "train": train[::step][:NUM_TRAIN_SAMPLE]}
    if unseen_file:
        sets["unseen"] = prompt_files.load_prompts(unseen_file)
    return sets


def score(
    pipe, encoder, prompts, guidance_scale: float, noises: int = NOISES, metrics=shapes_metrics, num_steps: int = 10
) -> dict:
    """{metric: [noises, prompts] array}; noise n is seed 1000 n + chunk index, the same for every model. A few-step
    model (dmd2.py's) is sampled at its own step count."""
    out = defaultdict(list)
    for n in range(noises):
        _, s = evaluation.evaluate(
            pipe,
            pipe.transformer,
            encoder,
            prompts,
            metrics,
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            seed=1000 * n,
            repeats=1,
            progress=False,
        )
        for k in s:
            out[k].append(s[k].float().numpy())
    return {k: np.stack(v) for k, v in out.items()}


def best_of_k(exact: np.ndarray, k: int, per_prompt: bool = False):
    """Mean over prompts of P(at least one of k noises exact), unbiased from n noises (the pass@k estimator); with
    `per_prompt`, the list of each prompt's."""
    n = exact.shape[0]
    each = [1.0 - math.comb(n - int(ci), k) / math.comb(n, k) for ci in exact.sum(0)]
    return [round(v, 6) for v in each] if per_prompt else float(np.mean(each))


def summary(m: dict, bases: dict = ()) -> dict:
    """Means, and for each base ({tag: scores}) the paired gain and its standard error over prompts (the difference
    on the same noise, averaged over noises per prompt)."""
    row = {k: float(v.mean()) for k, v in m.items()}
    for tag, base in dict(bases).items():
        for k in m:
            d = (m[k] - base[k]).mean(0)
            row[f"{k}_gain_{tag}"] = float(d.mean())
            row[f"{k}_gain_{tag}_se"] = float(d.std(ddof=1) / math.sqrt(len(d)))
    return row


def append(path: Path, row: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def replace_run_row(path: Path, row: dict):
    """Write `row` in place of path's row of the same run (extracting a run again, e.g. after it was resumed, keeps one
    curve per run), else append it; atomic, so a kill leaves the old file or the new one."""
    rows = [line for line in path.read_text().splitlines() if json.loads(line)["run"] != row["run"]] if path.exists() else []
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in [*rows, json.dumps(row)]))
    os.replace(tmp, path)


def base_scores(
    model: str,
    sets: dict,
    guidance_scale: float,
    noises: int = NOISES,
    metrics=shapes_metrics,
    num_steps: int = 10,
    cache: dict = {},  # noqa: B006 - a deliberate cache
) -> dict:
    key = (model, guidance_scale, noises, tuple(sets), num_steps)
    if key not in cache:
        pipe = models.load_pipeline(model, torch.device("cpu"))
        encoder = common.PromptEncoder(pipe)
        cache[key] = {name: score(pipe, encoder, p, guidance_scale, noises, metrics, num_steps) for name, p in sets.items()}
    return cache[key]


def base_row(m: dict, guidance_scale: float, name: str) -> dict:
    """The base's row of base.jsonl: its means on one prompt set and best-of-k for every k up to its noises."""
    prompts, noises = m["exact"].shape[1], m["exact"].shape[0]
    row = {"model": "base", "guidance_scale": guidance_scale, "set": name, "prompts": prompts, "noises": noises}
    row.update(summary(m))
    row.update({f"best_of_{k}": best_of_k(m["exact"], k) for k in (1, 4, 8) if k <= noises})
    # per prompt (in the set's order), so that a model's per-prompt exact (this + its exact_gain_cfg1_per_prompt)
    # can be set against the base's best-of-4 prompt by prompt, e.g. per kind of prompt
    row["exact_per_prompt"] = m["exact"].mean(0).round(6).tolist()
    if noises >= 4:
        row["best_of_4_per_prompt"] = best_of_k(m["exact"], 4, per_prompt=True)
    return row


def cmd_base(args, sets):
    sets = {name: prompts for name, prompts in sets.items() if name in args.sets}
    for cfg in (1.0, 4.5):
        for name, m in base_scores(args.model, sets, cfg, metrics=args.task["metrics"]).items():
            row = base_row(m, cfg, name)
            append(args.results / "base.jsonl", row)
            print(json.dumps(row))


def images_trained(run: Path) -> int:
    """Images the exported LoRA was trained on: the newest train/reward step in the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return (
        max((e.step for e in acc.Scalars("charts/reward_mean")), default=0)
        if "charts/reward_mean" in acc.Tags()["scalars"]
        else 0
    )


def images_in_card(run: Path) -> int:
    """Images the export was trained on, from its model card ("... after 20480 training images"); 0 if none says."""
    for card in (run / "transformer" / "README.md", run / "lora" / "README.md"):
        found = re.search(r"after (\d+) training images", card.read_text()) if card.exists() else None
        if found:
            return int(found.group(1))
    return 0


def cmd_final(args, sets):
    """Each run's export (runs/<run>/lora, or runs/<run>/transformer after --full-finetune: what a user loads; or a
    committed copy of it, a folder with args.json next to it) in a fresh base pipeline, at the run's own eval guidance
    scale, on both prompt sets (`--sets`), `--noises` noises each, paired with the base at CFG 1 and at CFG 4.5 on the
    same noises. Each row keeps the per-prompt paired exact gains, so that gains can be pooled over seeds per prompt."""
    from diffusers.utils import logging

    logging.set_verbosity_error()  # the LoRA has no text-encoder part, which load_lora_weights mentions
    done = set()
    if (args.results / "final.jsonl").exists():
        done = {json.loads(line)["run"] for line in (args.results / "final.jsonl").read_text().splitlines()}
    sets = {name: prompts for name, prompts in sets.items() if name in args.sets}
    cfgs = (("cfg1", 1.0), ("cfg4.5", 4.5))
    bases = {tag: base_scores(args.model, sets, cfg, args.noises, args.task["metrics"]) for tag, cfg in cfgs}
    for name in sets:  # the base's own means on these noises, once per results folder
        if not any(r.get("model") == "base" and r["set"] == name for r in read_jsonl(args.results / "base.jsonl")):
            for tag, cfg in (("cfg1", 1.0), ("cfg4.5", 4.5)):
                append(args.results / "base.jsonl", base_row(bases[tag][name], cfg, name))
    for run in map(Path, args.runs):
        if run.name in done or not any((run / d).is_dir() for d in ("lora", "transformer")):
            continue
        run_args = json.loads((run / "args.json").read_text())
        cfg = args.guidance_scale or run_args.get("eval_guidance_scale") or run_args.get("guidance_scale", 1.0)
        pipe = models.load_pipeline(args.model, torch.device("cpu"))
        if (run / "transformer").is_dir():
            pipe.transformer = type(pipe.transformer).from_pretrained(str(run / "transformer"))
        else:
            pipe.load_lora_weights(str(run / "lora"))
        encoder = common.PromptEncoder(pipe)
        images = images_trained(run) or images_in_card(run)  # a committed copy has no TensorBoard events
        short = stopped_short(run)  # a legitimate row (the images column says where), not the run's planned length
        if short:
            print(f"{run}: stopped at {short}; scoring its export at {images:,} images", file=sys.stderr)
        steps = run_args.get("num_steps", 10)
        run_bases = dict(bases)
        if steps != 10:  # a few-step model: also against the base at its own step count
            run_bases[f"cfg1_{steps}steps"] = base_scores(args.model, sets, 1.0, args.noises, args.task["metrics"], steps)
        for name, prompts in sets.items():
            m = score(pipe, encoder, prompts, cfg, args.noises, args.task["metrics"], steps)
            row = {"run": run.name, "setting": run_args["exp_name"], "seed": run_args["seed"]}
            row.update({"images": images, "guidance_scale": cfg, "set": name, "noises": args.noises, "num_steps": steps})
            row.update(summary(m, {tag: b[name] for tag, b in run_bases.items()}))
            for tag, b in run_bases.items():
                row[f"exact_gain_{tag}_per_prompt"] = (m["exact"] - b[name]["exact"]).mean(0).round(6).tolist()
            append(args.results / "final.jsonl", row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)


def export_weights(run: Path) -> bool:
    """Whether a run's export folder holds weights; True for a run with no export yet (`final` skips it)."""
    if (run / "transformer").is_dir():
        return (run / "transformer" / "config.json").is_file()
    if (run / "lora").is_dir():
        return any((run / "lora").glob("*.safetensors"))
    return True


def in_training(run: Path) -> bool:
    """Whether a training process holds the run now (its .lock, taken by `run.lock_run` for the process's life): the
    export of such a run is the last checkpoint's, a half-trained one."""
    import fcntl

    if not (run / ".lock").is_file():
        return False
    with open(run / ".lock") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def stopped_short(run: Path) -> str:
    """'epoch E of N' for a run whose newest checkpoint is short of its --num-epochs (stopped by --stop-after or a
    kill: its export is the weights at the stop), else ''. A committed copy (no checkpoints/) says nothing."""
    epochs = [int(d.name[6:]) for d in (run / "checkpoints").glob("epoch_*") if d.name[6:].isdigit()]
    planned = json.loads((run / "args.json").read_text()).get("num_epochs")
    if epochs and isinstance(planned, int) and max(epochs) < planned:
        return f"epoch {max(epochs)} of {planned}"
    return ""


def working_seconds(times: list, until: float, pause: float = 300.0) -> float:
    """Seconds a run worked up to wall time `until`, from the sorted wall times of its logged events: a gap longer than
    `pause` between two events (a stop and a later --resume) is left out."""
    gaps = np.diff([t for t in times if t <= until])
    return float(gaps[gaps <= pause].sum())


def cmd_extract(args, sets):
    """One JSON row per run into curves.jsonl (in place of the run's earlier row, if any): its setting, seed, device,
    and every held-out evaluation (images trained, wall-clock seconds, exact, strict, extra objects, gap, the training
    reward) read from its TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for run in map(Path, args.runs):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        run_args = json.loads((run / "args.json").read_text())
        times = sorted(e.wall_time for t in tags for e in acc.Scalars(t))
        # a resumed run evaluates its checkpoint again: one eval per step, the newest
        evals = {k: list({e.step: e for e in acc.Scalars(f"eval/{tag}")}.values()) for k, tag in args.task["tags"].items()}
        first = next(iter(evals.values()))
        reward = [(e.step, e.value) for e in acc.Scalars("charts/reward_mean")]
        row = {
            "run": run.name,
            "setting": run_args["exp_name"],
            "seed": run_args["seed"],
            "device": run_args.get("device") or "cpu",
            "eval_noises": run_args.get("eval_noises", 2),
            "images": [e.step for e in first],
            "seconds": [round(working_seconds(times, e.wall_time), 1) for e in first],
            **{k: [round(e.value, 4) for e in v] for k, v in evals.items()},
            # the training reward, averaged over each stretch between two evaluations
            "train_reward": [
                round(float(np.mean([v for s, v in reward if lo < s <= hi] or [np.nan])), 4)
                for lo, hi in zip([-1] + [e.step for e in first], [e.step for e in first])
            ],
            "images_per_sec": round(float(np.median([e.value for e in acc.Scalars("charts/images_per_sec")])), 1),
        }
        args.results.mkdir(parents=True, exist_ok=True)
        replace_run_row(args.results / "curves.jsonl", row)
        print(row["setting"], row["seed"], list(zip(row["images"], exact_curve(row))), flush=True)


def exact_curve(row: dict) -> list:
    """A curve row's held-out exact at each eval (`shapes_exact` on tiny-shapes, `exact` on OCR)."""
    return row["shapes_exact"] if "shapes_exact" in row else row["exact"]


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def base_rows(results: Path) -> list:
    """The base's rows of a results folder and of its sweep folders (`final` scores the base into the folder it writes)."""
    return [r for path in [results / "base.jsonl", *sweep_files(results, "base.jsonl")] for r in read_jsonl(path)]


def sweep_files(results: Path, name: str) -> list:
    """results/<sweep>/<name> for every sweep folder; the OCR task's folder sits inside the shapes results and is
    not a shapes sweep."""
    return [path for path in sorted(results.glob(f"*/{name}")) if path.parent != OCR_RESULTS]


def cmd_table(args, sets):
    """Markdown tables (base ceilings; every run's held-out exact curve) and the exact-vs-images plot, from the jsonl."""
    base = read_jsonl(args.results / "base.jsonl")
    print("| model | prompts | exact | strict | extra objects/img | gap | score | best-of-4 exact | best-of-8 exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    # the base scored by `final --noises N` into a sweep folder of its own comes after the protocol's 8-noise rows
    for r in base + [r for path in sweep_files(args.results, "base.jsonl") for r in read_jsonl(path)]:
        strict, extra, best4, best8 = (r.get(k, math.nan) for k in ("strict", "extra", "best_of_4", "best_of_8"))
        print(
            f"| base, CFG {r['guidance_scale']:g} | {r['set']} ({r['prompts']} x {r['noises']} noises) | {r['exact']:.3f} | "
            f"{strict:.3f} | {extra:.2f} | {r['gap']:.3f} | {r['score']:.3f} | {best4:.3f} | {best8:.3f} |"
        )
    rows = []
    for sweep in sweep_files(args.results, "curves.jsonl"):
        rows += [dict(r, sweep=sweep.parent.name) for r in read_jsonl(sweep)]
    print("\n| sweep | setting | seed | device | images | exact at each eval (in-run; first = the base) | last - base |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ex = exact_curve(r)
        print(
            f"| {r['sweep']} | {r['setting']} | {r['seed']} | {r['device']} | {r['images'][-1]} | "
            f"{' '.join(f'{v:.3f}' for v in ex)} | {ex[-1] - ex[0]:+.3f} |"
        )
    finals = []
    for sweep in sweep_files(args.results, "final.jsonl"):
        finals += [dict(r, sweep=sweep.parent.name) for r in read_jsonl(sweep)]
    print("\n" + "\n".join(finals_table(finals)))
    print("\n" + "\n".join(seeds_table(finals)))
    cpu = [r for r in rows if r["device"] == "cpu" and len(r["images"]) > 1]
    level = next((exact_curve(r)[0] for r in rows if "cfg4.5" in r["setting"]), None)
    if level is None:  # no run sampled at CFG 4.5: the CFG-4.5 base of `base` or `final`, on other noises
        level = next((r["exact"] for r in base_rows(args.results) if r["set"] == "test" and r["guidance_scale"] == 4.5), None)
    if level is not None:
        print("\n" + "\n".join(efficiency_table([r for r in rows if len(r["images"]) > 1], level)))
    if rows:
        base = base or base_rows(args.results)
        # a run copied into a later sweep and trained on (`train --epochs` resumes it) repeats its first evaluations:
        # plot each run once, at its longest
        longest = {r.get("run", id(r)): r for r in sorted(rows, key=lambda r: r["images"][-1])}
        plot_rows = [r for r in rows if longest[r.get("run", id(r))] is r]
        plot(plot_rows, base, args.results / "exact_vs_images.png", level=level)
        first = {("cfg4.5" in r["setting"]): exact_curve(r)[0] for r in rows}
        plot(
            [r for r in cpu if r in plot_rows],
            base,
            args.results / "exact_vs_seconds.png",
            x="seconds",
            first=first,
            level=level,
        )


def mean_se(values) -> str:
    v = np.asarray(values, dtype=float)
    se = v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else float("nan")
    return f"{v.mean():+.3f} ± {se:.3f}" if len(v) > 1 else f"{v.mean():+.3f}"


def finals_table(finals: list) -> list:
    """Every exported model on both prompt sets, paired with the base on the same noises (± standard error over
    prompts)."""
    out = [
        "| sweep | setting | seed | images | prompts | exact | vs base CFG 1 | vs base CFG 4.5 | strict | extra objects/img "
        "| gap | score (the reward's; OCR: 1 - edit distance / length) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(finals, key=lambda r: (r["sweep"], r["setting"], r["seed"], r["set"] != "test")):
        gains = [f"{r[f'exact_gain_{t}']:+.3f} ± {r[f'exact_gain_{t}_se']:.3f}" for t in ("cfg1", "cfg4.5")]
        out.append(
            f"| {r['sweep']} | {r['setting']} | {r['seed']} | {r['images']:,} | {r['set']} | {r['exact']:.3f} | "
            f"{gains[0]} | {gains[1]} | {r.get('strict', math.nan):.3f} | {r.get('extra', math.nan):.2f} | {r['gap']:.3f} | "
            f"{r['score']:.3f} |"
        )
    return out


def seeds_table(finals: list) -> list:
    """Each setting's exported weights on the held-out prompts, over its seeds: mean ± standard error over seeds (the
    issue's test: a gain beyond two standard errors over seeds), next to the gains over the base on the same noises."""
    out = [
        "| sweep | setting | seeds | images | noises | exact | vs base CFG 1 | vs base CFG 4.5 | vs base CFG 4.5, ± over "
        "prompts | extra objects/img vs CFG 4.5 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = defaultdict(list)
    for r in finals:
        if r["set"] == "test":
            groups[(r["sweep"], r["setting"])].append(r)
    for (sweep, setting), rs in groups.items():
        exact = mean_se([r["exact"] for r in rs]).lstrip("+")
        cells = [mean_se([r[f"{k}_gain_{t}"] for r in rs]) for k, t in (("exact", "cfg1"), ("exact", "cfg4.5"))]
        extra = mean_se([r.get("extra_gain_cfg4.5", math.nan) for r in rs])
        images = "/".join(f"{r['images']:,}" for r in rs)
        # the same gain with its standard error over prompts of the seeds' mean per-prompt gain: it carries the noise
        # of the base's own estimate on these images, which the error over seeds (one base for every seed) leaves out
        pooled = "-"
        if all("exact_gain_cfg4.5_per_prompt" in r for r in rs):
            pooled = mean_se(list(np.mean([r["exact_gain_cfg4.5_per_prompt"] for r in rs], axis=0)))
        noises = rs[0].get("noises", NOISES)
        out.append(
            f"| {sweep} | {setting} | {len(rs)} | {images} | {noises} | {exact} | {cells[0]} | {cells[1]} | {pooled} | "
            f"{extra} |"
        )
    return out


def prompt_kinds(task: dict, prompts: list) -> list:
    """Each prompt's category from the task's prompt files (tiny-shapes: single_object, two_object, counting, colors,
    color_attr, position); "all" where a file has none (OCR)."""
    kind = {}
    for path in (task["train"], task["test"], task["unseen"]):
        if str(path).endswith(".jsonl"):
            for line in Path(path).read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    kind[row["prompt"]] = row.get("category", "all")
    return [kind.get(p, "all") for p in prompts]


def categories_table(base: list, finals: list, sets: dict, kinds: dict) -> list:
    """Exact per kind of prompt: the base at CFG 1 and 4.5 and its best-of-4 (from the per-prompt lists `final` keeps
    in base.jsonl), and each setting's exports (the base's per-prompt exact at CFG 1 plus each export's paired
    per-prompt gain, on the same noises), averaged over its seeds."""
    out = [
        "| set | noises | kind | prompts | base CFG 1 | base CFG 4.5 | best-of-4 CFG 1 | best-of-4 CFG 4.5 "
        "| sweep/setting (seeds) | exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sets:
        by_noises = defaultdict(dict)  # noises -> CFG -> base row with per-prompt lists
        for r in base:
            if r["set"] == name and "best_of_4_per_prompt" in r:
                by_noises[r["noises"]].setdefault(r["guidance_scale"], r)
        for noises, rows in sorted(by_noises.items()):
            if set(rows) != {1.0, 4.5}:
                continue
            groups = defaultdict(list)
            for r in finals:
                if r["set"] == name and r["noises"] == noises and "exact_gain_cfg1_per_prompt" in r:
                    groups[f"{r['sweep']}/{r['setting']}"].append(
                        np.add(rows[1.0]["exact_per_prompt"], r["exact_gain_cfg1_per_prompt"])
                    )
            kind = np.array(kinds[name])
            for k in sorted(set(kind)) + ["all"]:
                pick = np.ones(len(kind), bool) if k == "all" else kind == k
                cells = [
                    np.mean(np.array(rows[g][key])[pick])
                    for key in ("exact_per_prompt", "best_of_4_per_prompt")
                    for g in (1.0, 4.5)
                ]
                lead = f"| {name} | {noises} | {k} | {pick.sum()} | " + " | ".join(f"{c:.3f}" for c in cells)
                models = [
                    f"{setting} ({len(v)}) | {np.mean(np.array(v)[:, pick]):.3f}" for setting, v in sorted(groups.items())
                ]
                out += [f"{lead} | {m} |" for m in models] or [f"{lead} | - | - |"]
    return out


def cmd_categories(args, sets):
    """Exact per kind of prompt (`categories_table`) for the results folder and its sweep folders."""
    if not any("best_of_4_per_prompt" in r for r in base_rows(args.results)):
        print(
            f"convergence.py: error: --results {args.results}: no base row with per-prompt exact (run `final` there)",
            file=sys.stderr,
        )
        sys.exit(2)
    paths = [args.results / "final.jsonl", *sweep_files(args.results, "final.jsonl")]
    finals = [dict(r, sweep=path.parent.name) for path in paths for r in read_jsonl(path)]
    kinds = {name: prompt_kinds(args.task, prompts) for name, prompts in sets.items()}
    print("\n".join(categories_table(base_rows(args.results), finals, sets, kinds)))


def reach(row: dict, level: float):
    """(images, seconds) at a run's first evaluation with held-out exact >= level, or None if it never got there."""
    for images, seconds, exact in zip(row["images"], row["seconds"], exact_curve(row)):
        if images > 0 and exact >= level:
            return images, seconds
    return None


def efficiency_table(rows: list, level: float) -> list:
    """Images and wall-clock seconds each run took to reach the CFG-4.5 base's in-run held-out exact, and GRPO's images
    over these (a lower bound where GRPO never reached it). Seconds compare only within one sweep: each sweep ran on
    its own machine with its own number of runs sharing it."""
    grpo = [reach(r, level) for r in rows if SETTINGS.get(r["setting"], ("",))[0] == "grpo" and "cfg4.5" not in r["setting"]]
    grpo_images = [g[0] for g in grpo if g] or None
    grpo_bound = max((r["images"][-1] for r in rows if SETTINGS.get(r["setting"], ("",))[0] == "grpo"), default=None)
    out = [
        f"| sweep | setting | seed | device | images trained | images to reach {level:.3f} | seconds to reach | "
        "GRPO's images / these |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "cfg4.5" in r["setting"]:
            continue  # sampled at CFG 4.5: it starts at the level
        hit = reach(r, level)
        head = f"{r.get('sweep', '')} | {r['setting']} | {r['seed']} | {r['device']} | {r['images'][-1]:,}"
        if hit is None:
            out.append(f"| {head} | not reached | - | - |")
            continue
        if grpo_images:
            ratio = f"{np.median(grpo_images) / hit[0]:.1f}x"
        elif grpo_bound and grpo_bound > hit[0]:
            ratio = f"> {grpo_bound / hit[0]:.1f}x (GRPO: not in {grpo_bound:,})"
        else:
            ratio = "no GRPO run that long"
        out.append(f"| {head} | {hit[0]:,} | {hit[1]:,.0f} | {ratio} |")
    return out


def plot(rows: list, base: list, path: Path, x: str = "images", first: dict = None, level: float = None):
    """One panel per algorithm: every run's held-out exact against images trained (or wall-clock seconds), with the base
    model on the same noises (a CFG-1 run's first eval; a CFG-4.5 run's first eval) and the base's best-of-4 (8 other
    noises)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = sorted({SETTINGS.get(r["setting"], (r["setting"].split("_")[0],))[0] for r in rows})
    fig, axes = plt.subplots(1, len(algos), figsize=(4 * len(algos), 4.2), sharey=True, squeeze=False)
    first = first or {("cfg4.5" in r["setting"]): exact_curve(r)[0] for r in rows}
    first.setdefault(True, level)  # no CFG-4.5 run: the CFG-4.5 base's level
    best4 = next((x["best_of_4"] for x in base if x["set"] == "test" and x["guidance_scale"] == 1.0), None)
    for ax, algo in zip(axes[0], algos):
        for r in rows:
            if SETTINGS.get(r["setting"], (r["setting"].split("_")[0],))[0] == algo and len(r["images"]) > 1:
                ax.plot(r[x], exact_curve(r), marker=".", lw=1, label=f"{r['setting']} s{r['seed']}")
        for cfg45, style, name in ((False, ":", "base CFG 1"), (True, "--", "base CFG 4.5")):
            if first.get(cfg45) is not None:
                ax.axhline(first[cfg45], color="k", ls=style, lw=1, label=name)
        if best4 is not None:
            ax.axhline(best4, color="r", ls="-.", lw=1, label="base best-of-4")
        ax.set_title(algo)
        ax.set_xlabel("images trained" if x == "images" else "wall-clock seconds (one CPU core a run)")
        ax.legend(fontsize=6)
    noises = rows[0].get("eval_noises", NOISES)
    axes[0][0].set_ylabel(f"held-out exact (test prompts x {noises} noises)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def find_run(out: Path, setting: str, seed: int):
    found = sorted(out.glob(f"*__{setting}__{seed}__*"))
    return found[-1] if found else None


def run_flags(task: dict, name: str, seed: int, epochs: int, eval_every: int, out: Path, model: str = None) -> list:
    """A new run's flags: the protocol's evaluation and saving, the setting's flags, the task's model (or `model`, a
    testbed of the same task, e.g. a larger tiny-shapes build) and reward."""
    algo, flags = SETTINGS[name]
    every = ["--eval-every", str(eval_every), "--save-every", str(eval_every)]
    protocol = ["--eval-noises", task["eval_noises"], "--keep-checkpoints", "2"]
    # the shapes LoRA settings ran when a LoRA was every file's default; they still train one (the OCR runs are at
    # the files' defaults of today, as are the edit runs)
    lora = (
        []
        if "--full-finetune" in flags or algo in ("grpo", "grpo_variants") or task is not TASKS["shapes"]
        else ["--no-full-finetune"]
    )
    cmd = [*protocol, *every, *lora, *flags, "--seed", str(seed), "--num-epochs", str(epochs)]
    cmd += ["--exp-name", name, "--output-dir", in_repo(out)]
    # the files' defaults are absolute paths (so that they run from any folder): pass the task's own, relative
    cmd += ["--model", in_repo(model or task["model"])]
    cmd += [] if "--train-prompts" in flags else ["--train-prompts", in_repo(task["train"])]  # a setting's own prompts
    cmd += ["--test-prompts", in_repo(task["test"])]
    return cmd + task["flags"]


def in_repo(path) -> str:
    """A path inside the repository relative to it (runs start there), so that no machine's folder ends up in a run's
    args.json or in its export's model card; any other path as it is."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def cmd_train(args, sets):
    """Start (or resume from its newest checkpoint) one run per setting x seed, `--jobs` at a time; after
    `--stop-after` seconds every run gets one SIGINT: it finishes its epoch, checkpoints and exits, to be resumed."""
    out = args.results / "runs"
    queue = []
    for item in args.runs:  # SETTING (every --seeds) or SETTING@SEED
        name, _, one_seed = item.partition("@")
        if name not in SETTINGS:
            raise SystemExit(f"unknown setting {name!r}; known: {', '.join(SETTINGS)}")
        algo = SETTINGS[name][0]
        for seed in [int(one_seed)] if one_seed else args.seeds:
            run = find_run(out, name, seed)
            if run is not None and (run / "checkpoints" / "last").exists():
                cmd = ["--resume", str(run), "--num-epochs", str(args.epochs)]
            else:
                cmd = run_flags(args.task, name, seed, args.epochs, args.eval_every, out, args.model)
            script = SCRIPTS.get(name, REPO / "algos" / f"{algo}.py")
            queue.append((f"{name}__{seed}", [sys.executable, str(script), *cmd]))
    (args.results / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}
    t0, running, stopping = time.time(), [], False
    devices = args.devices.split(",")
    started = 0
    while queue or running:
        while queue and len(running) < args.jobs and not stopping:
            tag, cmd = queue.pop(0)
            cmd = [*cmd, "--device", devices[started % len(devices)]]
            started += 1
            print(f"[{time.time() - t0:6.0f}s] start {tag}: {' '.join(cmd[1:])}", flush=True)
            log = open(args.results / "logs" / f"{tag}.log", "a")
            running.append((tag, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)))
        if args.stop_after and time.time() - t0 > args.stop_after and not stopping:
            stopping = True
            queue.clear()
            print(f"[{time.time() - t0:6.0f}s] stop: SIGINT to {len(running)} runs", flush=True)
            for _, p in running:
                p.send_signal(signal.SIGINT)
        for tag, p in list(running):
            if p.poll() is not None:
                print(f"[{time.time() - t0:6.0f}s] done {tag} rc {p.returncode}", flush=True)
                running.remove((tag, p))
        time.sleep(2)


def cmd_roundtrip(args, sets):
    """The pipeline's own limit: rendered scenes of every prompt (the pretraining data, exact by construction), 4 per
    prompt, through the VAE (encode, decode) and the scorer. Anything below 1.0 is the VAE's or the scorer's, not the
    transformer's. Appends one row per prompt split to roundtrip.jsonl."""
    import random

    from rewards.worlds import shapes as world

    pipe = models.load_pipeline(args.model, torch.device("cpu"))
    vae = pipe.pipe.vae
    for name, specs in zip(("train", "test"), world.splits()):
        rng = random.Random(0)
        rows = [spec for spec in specs for _ in range(4)]
        images = torch.from_numpy(np.stack([world.render(world.sample_scene(rng, *spec)) for spec in rows]))
        images = images.permute(0, 3, 1, 2).float() / 255
        with torch.no_grad():
            decoded = (vae.decode(vae.encode(images * 2 - 1).latent_dist.mode()).sample.clamp(-1, 1) + 1) / 2
        prompts = [spec[1] for spec in rows]
        row = {"set": name, "images": len(rows)}
        for label, x in (("rendered", images), ("vae_roundtrip", decoded)):
            m = shapes.evaluate(x, prompts, prompts)
            row[label] = {k: round(float(torch.as_tensor(m[k]).float().mean()), 4) for k in ("exact", "strict", "extra")}
        append(args.results / "roundtrip.jsonl", row)
        print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["train", "base", "final", "extract", "table", "roundtrip", "categories"])
    ap.add_argument("runs", nargs="*", help="settings (train) or run folders (curves)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--epochs", type=int, default=320, help="train: epochs of each run (320 x 64 = 20,480 images)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=40, help="train: epochs between evaluations (and saves)")
    ap.add_argument("--devices", default="cpu", help="train: comma list cycled over the runs, e.g. cpu,cuda")
    ap.add_argument("--stop-after", type=float, default=0, help="train: seconds, then every run checkpoints and stops")
    ap.add_argument("--task", choices=list(TASKS), default="shapes", help="tiny-shapes, tiny-text (OCR) or tiny-edit")
    ap.add_argument("--model", default=None, help="default: the task's tiny model")
    ap.add_argument("--results", type=Path, default=None, help="default: the task's results folder")
    ap.add_argument("--noises", type=int, default=NOISES, help="final: noises per prompt (noise n: seed 1000 n)")
    ap.add_argument("--guidance-scale", type=float, default=0, help="final: sample at this CFG (default: the run's own)")
    ap.add_argument(
        "--sets",
        nargs="+",
        default=["test", "train"],
        choices=["test", "train", "unseen"],
        help="final, base: prompt sets (unseen: assets/unseen_colors.jsonl, tiny-shapes only)",
    )
    args = ap.parse_args()
    if args.noises < 1:
        ap.error(f"--noises {args.noises}: must be >= 1")
    if args.guidance_scale < 0:
        ap.error(f"--guidance-scale {args.guidance_scale:g}: must be >= 0 (0: each run's own)")
    if args.command in ("final", "extract"):
        missing = [r for r in args.runs if not (Path(r) / "args.json").is_file()]
        if missing:
            ap.error(f"{missing[0]}: not a run folder (no args.json)")
        # a committed export may keep only its README (the weights restored or remade from it): say so before any work
        weightless = [r for r in args.runs if not export_weights(Path(r))]
        if args.command == "final" and weightless:
            ap.error(f"{weightless[0]}: its export has no weights (restore them as its README says)")
        training = [r for r in args.runs if in_training(Path(r))]
        if args.command == "final" and training:
            ap.error(f"{training[0]}: still training (its .lock is held); score its export when the run has ended")
    torch.set_num_threads(1)
    args.task = TASKS[args.task]
    args.model = args.model or args.task["model"]
    if args.command not in ("table", "categories") and not (Path(args.model) / "model_index.json").is_file():
        ap.error(f"--model {args.model}: not a pipeline folder (no model_index.json)")
    args.results = args.results or args.task["results"]
    if args.task["metrics"] is None and args.command not in ("train", "extract"):
        ap.error(f"{args.command} --task edit: score edit runs with benchmark/edit.py")
    if "unseen" in args.sets and not args.task["unseen"]:
        ap.error("--sets unseen: the unseen colour-attribution prompts are tiny-shapes prompts (not --task ocr)")
    sets = prompt_sets(args.task["train"], args.task["test"], args.task["unseen"])
    commands = {"train": cmd_train, "base": cmd_base, "final": cmd_final, "extract": cmd_extract, "table": cmd_table}
    commands["roundtrip"] = cmd_roundtrip
    commands["categories"] = cmd_categories
    commands[args.command](args, sets)


if __name__ == "__main__":
    main()
