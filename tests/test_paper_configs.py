"""Config parity: every benchmark/sd35_<algo>.sh, for every TASK, sets the official config's values, or names the
difference with its reason in a "# DIFF[task] --flag: reason" line of its header.

The tables hold the official values in cleanflow's flag units, each with the file and line of the official repository
it comes from (commits: flow_grpo ac4c86e = the fetched snapshot, 54809b5 / 74db691 = the stored index copies of the
newer Fast code, which hold `pickscore_sd3_fast` without a line-numbered snapshot; DiffusionNFT 24af555; AWM be51372;
DGPO 01ceb4b; Flow-Factory a0b2bc5 for CRD, whose authors restated the paper's Table 3 there)."""

import re
from pathlib import Path

import pytest
from test_benchmark_scripts import REPO, parse_script

FG = "yifan123/flow_grpo@ac4c86e "
FAST = "yifan123/flow_grpo@54809b5 config/grpo.py::pickscore_sd3_fast "
NFT = "NVlabs/DiffusionNFT@24af555 "
AWM = "scxue/advantage_weighted_matching@be51372 advantage_weighted_matching/config/dgx_awm.py "
DGPO = "Luo-Yihong/DGPO@01ceb4b "
FF = "X-GenGroup/Flow-Factory@a0b2bc5 examples/crd/lora/sd3_5/default.yaml "
AWM_PIPE = (
    "scxue/advantage_weighted_matching@be51372 "
    "advantage_weighted_matching/flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py:243-247 (sigmas None)"
)

# {script: {task: {Args field: (official value in cleanflow's units, where it comes from)}}}
OFFICIAL = {
    "grpo": {
        "pickscore": {
            "num_steps": (10, FAST + "sample.num_steps"),
            "eval_num_steps": (40, FAST + "sample.eval_num_steps"),
            "guidance_scale": (4.5, FAST + "sample.guidance_scale"),
            "eval_guidance_scale": (4.5, FG + "scripts/train_sd3.py:254 (eval uses sample.guidance_scale)"),
            "eval_ema_decay": (0.9, FG + "scripts/train_sd3.py:445 (decay 0.9, update_step_interval 8)"),
            "eval_ema_interval": (8, FG + "scripts/train_sd3.py:445 (update_step_interval 8)"),
            "eval_ema_repeats": (8, FG + "scripts/train_sd3.py:955 (ema.step per micro-batch; 8 per step: FAST on 8 GPUs)"),
            "resolution": (512, FAST + "resolution"),
            "num_prompts": (48, FAST + "num_batches_per_epoch = 48 / (gpus x 9 / 24)"),
            "group_size": (24, FAST + "sample.num_image_per_prompt"),
            "micro_batch": (9, FAST + "train.batch_size = mini_num_image_per_prompt"),
            "grad_steps_per_epoch": (2, FAST + "gradient_accumulation_steps = num_batches_per_epoch // 2"),
            "dynamics": ("Flow-SDE", FG + "flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:47"),
            "eta": (0.8, FAST + "sample.noise_level"),
            "num_sde_steps": (2, FAST + "sample.train_num_steps"),
            "window_mode": ("contiguous", "yifan123/flow_grpo@74db691 scripts/train_sd3_fast.py (sde_window_size)"),
            "sde_window": (
                (0, 5),
                "yifan123/flow_grpo@54809b5 config/grpo.py::pickscore_sd3_fast_nocfg sde_window_range = (0, num_steps // 2)",
            ),
            "clip_low": (1e-5, FAST + "train.clip_range"),
            "clip_high": (1e-5, FAST + "train.clip_range"),
            "kl_beta": (0.0, FAST + "train.beta"),
            "kl_form": ("official", FG + "scripts/train_sd3.py:895"),
            "zero_adv_filter": (True, FG + "scripts/train_sd3.py:797-817"),
            "advantage_std": ("global", FAST + "sample.global_std"),
            "adv_clip": (5.0, FG + "config/base.py:84"),
            "learning_rate": (3e-4, FG + "config/base.py:63"),
            "weight_decay": (1e-4, FG + "config/base.py:69"),
            "max_grad_norm": (1.0, FG + "config/base.py:76"),
            "num_inner_epochs": (1, FG + "config/base.py:79"),
            "lora_rank": (32, FG + "scripts/train_sd3.py:430"),
            "lora_alpha": (64.0, FG + "scripts/train_sd3.py:431"),
            "sigma_schedule": (
                "scheduler",
                FG + "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py:121-127 (sigmas None)",
            ),
        },
        "ocr": {
            "num_steps": (10, FG + "config/grpo.py:36"),
            "eval_num_steps": (40, FG + "config/grpo.py:37"),
            "guidance_scale": (4.5, FG + "config/grpo.py:38"),
            "eval_guidance_scale": (4.5, FG + "scripts/train_sd3.py:254"),
            "eval_ema_decay": (0.9, FG + "config/grpo.py:55 + scripts/train_sd3.py:445"),
            "eval_ema_interval": (8, FG + "scripts/train_sd3.py:445 (update_step_interval 8)"),
            "eval_ema_repeats": (8, FG + "scripts/train_sd3.py:955 + config/grpo.py:43-48 (16 batches / 2 on 8 GPUs)"),
            "resolution": (512, FG + "config/grpo.py:40"),
            "micro_batch": (9, FG + "config/grpo.py:41"),
            "group_size": (24, FG + "config/grpo.py:42"),
            "num_prompts": (48, FG + "config/grpo.py:43"),
            "grad_steps_per_epoch": (2, FG + "config/grpo.py:48"),
            "num_sde_steps": (9, FG + "config/grpo.py:50 (timestep_fraction 0.99: int(10 x 0.99) trained steps)"),
            "sde_window": ((0, 9), FG + "scripts/train_sd3.py (trains steps 0 .. num_train_timesteps - 1)"),
            "kl_beta": (0.04, FG + "config/grpo.py:52"),
            "kl_form": ("official", FG + "scripts/train_sd3.py:895"),
            "advantage_std": ("global", FG + "config/grpo.py:54"),
            "eta": (0.7, FG + "config/base.py:54"),
            "clip_low": (1e-4, FG + "config/base.py:86"),
            "clip_high": (1e-4, FG + "config/base.py:86"),
            "zero_adv_filter": (True, FG + "scripts/train_sd3.py:797-817"),
            "learning_rate": (3e-4, FG + "config/base.py:63"),
            "lora_rank": (32, FG + "scripts/train_sd3.py:430"),
            "sigma_schedule": (
                "scheduler",
                FG + "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py:121-127 (sigmas None)",
            ),
        },
    },
    "nft": {
        "pickscore": {
            "num_steps": (10, NFT + "config/nft.py:20"),
            "eval_num_steps": (40, NFT + "config/nft.py:21"),
            "resolution": (512, NFT + "config/nft.py:23"),
            "kl_beta": (1e-4, NFT + "config/nft.py:24"),
            "micro_batch": (9, NFT + "config/nft.py:26 (bsz 9 passes the search at :31-47)"),
            "group_size": (24, NFT + "config/nft.py:28"),
            "num_prompts": (48, NFT + "config/nft.py:29"),
            "grad_steps_per_epoch": (1, NFT + "config/nft.py:104"),
            "nft_beta": (1.0, NFT + "config/nft.py:61"),
            "old_decay_flat_steps": (0, NFT + "config/nft.py:60 decay_type 1 -> scripts/train_nft_sd3.py:175"),
            "old_decay_ramp": (0.001, NFT + "scripts/train_nft_sd3.py:176"),
            "old_decay_max": (0.5, NFT + "scripts/train_nft_sd3.py:177"),
            "guidance_scale": (1.0, NFT + "config/nft.py:64"),
            "eval_guidance_scale": (1.0, NFT + "config/nft.py:64 (eval passes sample.guidance_scale, train_nft_sd3.py:274)"),
            "dynamics": ("dpm2", NFT + "config/nft.py:65-66 (deterministic, solver dpm2)"),
            "eval_ema_decay": (0.9, NFT + "scripts/train_nft_sd3.py:567 (update_step_interval 1)"),
            "eval_ema_interval": (1, NFT + "scripts/train_nft_sd3.py:567"),
            "eval_ema_repeats": (1, NFT + "scripts/train_nft_sd3.py:1024-1029 (once per gradient step)"),
            "learning_rate": (3e-4, NFT + "config/base.py:66"),
            "timestep_range": (0.99, NFT + "config/base.py:87"),
            "num_train_timesteps": (9, NFT + "config/base.py:87 (int(10 x 0.99))"),
            "lora_rank": (32, "docs/nft.md (official LoRA r 32, alpha 64)"),
            "sigma_schedule": ("scheduler", NFT + "flow_grpo/diffusers_patch/pipeline_with_logprob.py:179-183 (sigmas=None)"),
        },
        "ocr": {
            "nft_beta": (0.1, NFT + "config/nft.py:77"),
            "old_decay_flat_steps": (75, NFT + "config/nft.py:78 decay_type 2 -> scripts/train_nft_sd3.py:179"),
            "old_decay_ramp": (0.0075, NFT + "scripts/train_nft_sd3.py:180"),
            "old_decay_max": (0.999, NFT + "scripts/train_nft_sd3.py:181"),
            "grad_steps_per_epoch": (2, NFT + "config/nft.py:75"),
            "eval_num_steps": (40, NFT + "config/nft.py:21"),
            "eval_ema_decay": (0.9, NFT + "scripts/train_nft_sd3.py:567"),
            "kl_beta": (1e-4, NFT + "config/nft.py:24"),
            "group_size": (24, NFT + "config/nft.py:28"),
            "num_prompts": (48, NFT + "config/nft.py:29"),
            "dynamics": ("dpm2", NFT + "config/nft.py:65-66"),
            "sigma_schedule": ("scheduler", NFT + "flow_grpo/diffusers_patch/pipeline_with_logprob.py:179-183 (sigmas=None)"),
        },
    },
    "awm": {
        "pickscore": {
            "num_steps": (14, AWM + ":315"),
            "eval_num_steps": (40, AWM + ":316"),
            "guidance_scale": (1.0, AWM + ":317"),
            "eval_guidance_scale": (1.0, AWM + ":317 (eval uses sample.guidance_scale)"),
            "num_prompts": (24, AWM + ":320-324 (8 GPUs x 6 x 12 batches / 24 images)"),
            "group_size": (24, AWM + ":323"),
            "kl_beta": (1e-4, AWM + ":333"),
            "num_train_timesteps": (6, AWM + ":334"),
            "timestep_range": (0.65, AWM + ":338 (the first 90% of the 14 indices = sigma >= 0.357 on its schedule)"),
            "sigma_schedule": ("scheduler", AWM_PIPE),
            "learning_rate": (3e-4, AWM + ":340"),
            "weighting": ("ghuber", AWM + ":341"),
            "ghuber_power": (0.25, AWM + ":342"),
            "ema_decay_max": (0.3, AWM + ":344"),
            "ema_kl_beta": (1.0, AWM + ":345"),
            "dynamics": ("SA-Solver", AWM + ":349 (use_sa_solver)"),
            "advantage_std": ("global", AWM + ":350"),
            "clip_low": (1.0, AWM + ":365"),
            "clip_high": (1.0, AWM + ":365"),
            "skip_pure_noise": (False, AWM + ":367 (time_type discrete)"),
            "eval_ema_decay": (0.99, AWM + ":370"),
        },
        "ocr": {
            "num_steps": (14, AWM + ":176"),
            "eval_num_steps": (40, AWM + ":177"),
            "guidance_scale": (1.0, AWM + ":178"),
            "num_prompts": (72, AWM + ":181-185 (8 GPUs x 6 x 36 batches / 24 images)"),
            "group_size": (24, AWM + ":184"),
            "eta": (0.4, AWM + ":187 (SA-Solver noise)"),
            "kl_beta": (3e-3, AWM + ":194"),
            "num_train_timesteps": (6, AWM + ":195"),
            "timestep_range": (0.65, AWM + ":199"),
            "sigma_schedule": ("scheduler", AWM_PIPE),
            "skip_pure_noise": (True, AWM + ":228 (time_type discrete_wo_init)"),
            "eval_ema_decay": (0.99, AWM + ":231"),
            "dynamics": ("SA-Solver", AWM + "ocr_sd3_no_cfg_1node (use_sa_solver)"),
        },
    },
    "dgpo": {
        "pickscore": {
            "num_train_timesteps": (4, DGPO + "config/dgpo.py:28"),
            "timestep_range": (0.4, DGPO + "config/dgpo.py:29 (trunc_steps 6: indices 0..6, sigma >= 0.602)"),
            "sigma_schedule": (
                "scheduler",
                DGPO + "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py:123-127 (sigmas None)",
            ),
            "switch_ema_ref": (200, DGPO + "config/dgpo.py:31"),
            "clip_range": (5e-2, DGPO + "config/dgpo.py:33"),
            "clip_dsm": (True, DGPO + "config/dgpo.py:39"),
            "dynamics": ("DPM-Solver", DGPO + "config/dgpo.py:24 (use_dpm)"),
            "num_steps": (10, DGPO + "config/dgpo.py:147"),
            "eval_num_steps": (14, DGPO + "config/dgpo.py:148"),
            "guidance_scale": (4.5, DGPO + "config/dgpo.py:149"),
            "eval_guidance_scale": (4.5, DGPO + "scripts/train_sd3_dgpo.py:427"),
            "group_size": (24, DGPO + "config/dgpo.py:153"),
            "num_prompts": (8, DGPO + "config/dgpo.py:154"),
            "grad_steps_per_epoch": (1, DGPO + "config/dgpo.py:159"),
            "kl_beta": (1e-3, DGPO + "config/dgpo.py:163"),
            "dpo_beta": (10.0, DGPO + "config/dgpo.py:164"),
            "advantage_std": ("global", DGPO + "config/dgpo.py:166"),
            "eval_ema_decay": (0.9, DGPO + "scripts/train_sd3_dgpo.py:627 (update_step_interval 8)"),
            "eval_ema_interval": (8, DGPO + "scripts/train_sd3_dgpo.py:627"),
            "eval_ema_repeats": (4, DGPO + "scripts/train_sd3_dgpo.py:1215 (per micro-batch) + config/dgpo.py:152-159 (4)"),
            "ema_ref_decay_max": (0.3, DGPO + "scripts/train_sd3_dgpo.py:629"),
            "kl_cfg": (1.0, DGPO + "config/base.py:29"),
            "learning_rate": (3e-4, DGPO + "config/base.py:68"),
        },
        "ocr": {
            "num_train_timesteps": (4, DGPO + "config/dgpo.py:28"),
            "timestep_range": (0.4, DGPO + "config/dgpo.py:29 (trunc_steps 6, not overridden for OCR)"),
            "sigma_schedule": (
                "scheduler",
                DGPO + "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py:123-127 (sigmas None)",
            ),
            "dpo_beta": (100.0, DGPO + "config/dgpo.py:32 (not overridden for OCR)"),
            "dynamics": ("DPM-Solver", DGPO + "config/dgpo.py:24"),
            "eval_num_steps": (14, DGPO + "config/dgpo.py:104"),
            "guidance_scale": (4.5, DGPO + "config/dgpo.py:105"),
            "clip_range": (1e-2, DGPO + "config/dgpo.py:107"),
            "group_size": (16, DGPO + "config/dgpo.py:110"),
            "num_prompts": (8, DGPO + "config/dgpo.py:111"),
            "kl_beta": (0.02, DGPO + "config/dgpo.py:115"),
            "advantage_std": ("global", DGPO + "config/dgpo.py:124"),
            "eval_ema_decay": (0.9, DGPO + "scripts/train_sd3_dgpo.py:627"),
            "eval_ema_interval": (8, DGPO + "scripts/train_sd3_dgpo.py:627"),
            "eval_ema_repeats": (2, DGPO + "scripts/train_sd3_dgpo.py:1215 + config/dgpo.py:108-119 (8 groups x 16 / 4 x 16)"),
        },
    },
    "crd": {
        task: {
            "crd_beta": (1.0, FF + ":47"),
            "old_decay_start": (0.25, FF + ":55 (old_model_decay 0-0.25-0.005-0.999)"),
            "old_decay_flat_steps": (0, FF + ":55"),
            "old_decay_ramp": (0.005, FF + ":55"),
            "old_decay_max": (0.999, FF + ":55"),
            "sampling_decay_start": (0.0, FF + ":56 (sampling_model_decay 75-0.0-0.0075-0.999)"),
            "sampling_decay_flat_steps": (75, FF + ":56"),
            "sampling_decay_ramp": (0.0075, FF + ":56"),
            "sampling_decay_max": (0.999, FF + ":56"),
            "num_train_timesteps": (20, FF + ":60"),
            "timestep_range": (0.99, FF + ":63"),
            "kl_beta": (0.1, FF + ":67"),
            "kl_cfg": (4.5, FF + ":68"),
            "adv_clip": (5.0, FF + ":73"),
            "resolution": (512, FF + ":76"),
            "num_steps": (10, FF + ":77"),
            "guidance_scale": (1.0, FF + ":78"),
            "micro_batch": (8, FF + ":81"),
            "group_size": (24, FF + ":82"),
            "num_prompts": (48, FF + ":84"),
            "grad_steps_per_epoch": (2, FF + ":85"),
            "learning_rate": (3e-4, FF + ":89"),
            "weight_decay": (1e-4, FF + ":90"),
            "max_grad_norm": (1.0, FF + ":93"),
            "eval_guidance_scale": (1.0, FF + ":109"),
            "eval_num_steps": (40, FF + ":110"),
            "eval_ema_decay": (0.0, FF + "(no EMA in the eval settings :105-112)"),
            "sigma_schedule": (
                "pipeline",
                "X-GenGroup/Flow-Factory@a0b2bc5 src/flow_factory/scheduler/flow_match_euler_discrete.py:57",
            ),
        }
        for task in ("pickscore", "ocr")
    },
}
DIFF = re.compile(r"^# DIFF(?:\[(\w+)\])? --([\w-]+): (.+)$")


def listed_differences(script: Path, task: str) -> dict:
    """{Args field: reason} of the script header's "# DIFF --flag: reason" (every task) and "# DIFF[task] ..." lines."""
    out = {}
    for line in script.read_text().splitlines():
        m = DIFF.match(line)
        if m and m.group(1) in (None, task):
            out[m.group(2).replace("-", "_")] = m.group(3)
    return out


def same(ours, official) -> bool:
    if isinstance(official, float) and isinstance(ours, (int, float)):
        return abs(ours - official) <= 1e-12 * max(1.0, abs(official))
    if isinstance(official, tuple):
        return tuple(ours) == official
    return ours == official


def silent_differences(script: Path, algo: str, task: str) -> dict:
    """{field: (ours, official, source)} for the table entries the script misses without a DIFF line."""
    _, name, args = parse_script(script, task)
    assert name == algo
    diffs = listed_differences(script, task)
    for field in diffs:  # a DIFF line must name a real flag (no stale or misspelt entries)
        assert hasattr(args, field), f"{script.name}: DIFF names --{field.replace('_', '-')}, which {algo}.py does not have"
    return {
        field: (getattr(args, field, "<no such flag>"), official, where)
        for field, (official, where) in OFFICIAL[algo][task].items()
        if field not in diffs and not same(getattr(args, field, None), official)
    }


@pytest.mark.parametrize("task", ["pickscore", "ocr"])
@pytest.mark.parametrize("algo", sorted(OFFICIAL))
def test_script_sets_the_official_config_or_says_why_not(algo, task):
    silent = silent_differences(REPO / "benchmark" / f"sd35_{algo}.sh", algo, task)
    assert not silent, f"sd35_{algo}.sh TASK={task} differs from the official config without a DIFF line: {silent}"


def test_a_silent_difference_is_caught(tmp_path):
    """The check can fail: a copy of the GRPO script with the exact KL form and no DIFF line is flagged."""
    script = tmp_path / "sd35_grpo.sh"
    script.write_text((REPO / "benchmark" / "sd35_grpo.sh").read_text().replace("--kl-form official", "--kl-form exact"))
    assert set(silent_differences(script, "grpo", "ocr")) == {"kl_form"}


@pytest.mark.parametrize("algo, steps, official_indices", [("dgpo", 10, 7), ("awm", 14, 12)])
def test_timestep_ranges_cover_the_official_step_indices(algo, steps, official_indices):
    """DGPO trunc_steps 6 trains indices 0..6 (7); AWM timestep_fraction 0.9 of 14 steps trains indices 0..11 (12).
    The scripts' --timestep-range keeps the indices whose sigma >= 1 - range on SD3.5's schedule (shift 3) as the
    official code samples it (diffusers' set_timesteps(N)), computed here from diffusers' scheduler itself."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    assert OFFICIAL[algo]["pickscore"]["sigma_schedule"][0] == "scheduler"
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    sigmas = sched.sigmas[:-1].numpy()
    value = OFFICIAL[algo]["pickscore"]["timestep_range"][0]
    assert int((sigmas >= 1 - value - 1e-6).sum()) == official_indices
