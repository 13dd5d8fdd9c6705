"""Config parity: every benchmark/sd35_<algo>.sh, for every TASK, sets the official config's values, or names the
difference with the value it sets and its reason in a "# DIFF[task] --flag VALUE: reason" line of its header.

The tables hold the official values in cleanflow's flag units, each with the file and line of the official repository
it comes from (commits: flow_grpo ac4c86e = the fetched snapshot, 54809b5 / 74db691 = the stored index copies of the
newer Fast code, which hold `pickscore_sd3_fast` without a line-numbered snapshot; DiffusionNFT 24af555; AWM be51372;
DGPO 01ceb4b; Flow-Factory a0b2bc5 for CRD, whose authors restated the paper's Table 3 there). An entry shared by two
tasks cites the PickScore config where the two configs set the same value. Every flag a script passes is either in
its table or in RUN_FLAGS, and a mutation test changes each table field once and expects the check to fail."""

import dataclasses
import functools
import re
from pathlib import Path

import pytest
from test_benchmark_scripts import REPO, parse_script

import common

FG = "yifan123/flow_grpo@ac4c86e "
FAST = "yifan123/flow_grpo@54809b5 config/grpo.py::pickscore_sd3_fast "
NFT = "NVlabs/DiffusionNFT@24af555 "
AWM = "scxue/advantage_weighted_matching@be51372 advantage_weighted_matching/config/dgx_awm.py "
AWM_CODE = "scxue/advantage_weighted_matching@be51372 advantage_weighted_matching/"
DGPO = "Luo-Yihong/DGPO@01ceb4b "
FF = "X-GenGroup/Flow-Factory@a0b2bc5 examples/crd/lora/sd3_5/default.yaml "
FF_CODE = "X-GenGroup/Flow-Factory@a0b2bc5 src/flow_factory/"
# the official codes keep the frozen transformer as loaded (fp32) and autocast in fp16 (flow_grpo, DiffusionNFT, AWM) or
# bf16 (DGPO); cleanflow's --mixed-precision is bf16 autocast, so an official fp16 has no value in its units
FP16 = "fp16 autocast"
DGPO_SCHEDULE = (
    DGPO + "scripts/train_sd3_dgpo.py:557-559 (DPM-Solver, flow_shift 3: its sigmas = the shifted linspace within 4e-4)"
)
AWM_PIPE = AWM_CODE + "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py:243-247 (sigmas None)"
# flags that set up the run rather than the method; every other flag a script passes must be in its table
RUN_FLAGS = {
    "model": "SD3.5-Medium, asserted by tests/test_benchmark_scripts.py",
    "reward": "the TASK itself, asserted by tests/test_benchmark_scripts.py",
    "train_prompts": "the DATA folder",
    "test_prompts": "the DATA folder",
    "num_epochs": "run length: the official runs are stopped by hand",
    "eval_every": "evaluation cadence (the official eval_freq is in epochs of another size)",
    "save_every": "checkpoint cadence",
}

GRPO = {
    "num_steps": (10, FG + "config/grpo.py:36"),
    "sigma_schedule": ("scheduler", FG + "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py:121-127 (sigmas None)"),
    "eval_num_steps": (40, FG + "config/grpo.py:37"),
    "guidance_scale": (4.5, FG + "config/grpo.py:38"),
    "eval_guidance_scale": (4.5, FG + "scripts/train_sd3.py:254 (eval uses sample.guidance_scale)"),
    "eval_ema_decay": (0.9, FG + "scripts/train_sd3.py:445 (decay 0.9, update_step_interval 8)"),
    "eval_ema_interval": (8, FG + "scripts/train_sd3.py:445 (update_step_interval 8)"),
    "eval_ema_repeats": (2, FG + "scripts/train_sd3.py:955 (ema.step per micro-batch: 2 per step on the configs' 32 GPUs)"),
    "resolution": (512, FG + "config/grpo.py:40"),
    "micro_batch": (9, FG + "config/grpo.py:41"),
    "group_size": (24, FG + "config/grpo.py:42"),
    "num_prompts": (48, FG + "config/grpo.py:43"),
    "grad_steps_per_epoch": (2, FG + "config/grpo.py:48"),
    "dynamics": ("Flow-SDE", FG + "flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:47"),
    "kl_form": ("official", FG + "scripts/train_sd3.py:895"),
    "zero_adv_filter": (True, FG + "scripts/train_sd3.py:797-817"),
    "advantage_std": ("global", FG + "config/grpo.py:54"),
    "adv_clip": (5.0, FG + "config/base.py:84"),
    "learning_rate": (3e-4, FG + "config/base.py:63"),
    "weight_decay": (1e-4, FG + "config/base.py:69"),
    "max_grad_norm": (1.0, FG + "config/base.py:76"),
    "num_inner_epochs": (1, FG + "config/base.py:79"),
    "lora_rank": (32, FG + "scripts/train_sd3.py:430"),
    "lora_alpha": (64.0, FG + "scripts/train_sd3.py:431"),
    "base_dtype": ("float32", FG + "scripts/train_sd3.py:415 (the transformer stays as loaded)"),
    "mixed_precision": (FP16, FG + "config/base.py:21"),
}
NFT_BASE = {
    "num_steps": (10, NFT + "config/nft.py:20"),
    "sigma_schedule": ("scheduler", NFT + "flow_grpo/diffusers_patch/pipeline_with_logprob.py:179-183 (sigmas=None)"),
    "eval_num_steps": (40, NFT + "config/nft.py:21"),
    "resolution": (512, NFT + "config/nft.py:23"),
    "kl_beta": (1e-4, NFT + "config/nft.py:24"),
    "micro_batch": (9, NFT + "config/nft.py:26 (bsz 9 passes the search at :31-47)"),
    "group_size": (24, NFT + "config/nft.py:28"),
    "num_prompts": (48, NFT + "config/nft.py:29"),
    "guidance_scale": (1.0, NFT + "config/nft.py:64"),
    "eval_guidance_scale": (1.0, NFT + "config/nft.py:64 (eval passes sample.guidance_scale, train_nft_sd3.py:274)"),
    "dynamics": ("dpm2", NFT + "config/nft.py:65-66 (deterministic, solver dpm2)"),
    "eval_ema_decay": (0.9, NFT + "scripts/train_nft_sd3.py:567 (update_step_interval 1)"),
    "eval_ema_interval": (1, NFT + "scripts/train_nft_sd3.py:567"),
    "eval_ema_repeats": (1, NFT + "scripts/train_nft_sd3.py:1024-1029 (once per gradient step)"),
    "learning_rate": (3e-4, NFT + "config/base.py:66"),
    "weight_decay": (1e-4, NFT + "config/base.py:72"),
    "max_grad_norm": (1.0, NFT + "config/base.py:79"),
    "timestep_range": (0.99, NFT + "config/base.py:87"),
    "num_train_timesteps": (9, NFT + "config/base.py:87 (int(10 x 0.99))"),
    "timesteps_per_image": (True, NFT + "scripts/train_nft_sd3.py:810-816 (a timestep permutation per image)"),
    "lora_rank": (32, NFT + "scripts/train_nft_sd3.py:431"),
    "lora_alpha": (64.0, NFT + "scripts/train_nft_sd3.py:431"),
    "base_dtype": ("float32", NFT + "scripts/train_nft_sd3.py:417 (the transformer stays as loaded)"),
    "mixed_precision": (FP16, NFT + "config/base.py:23"),
}
AWM_BASE = {
    "num_steps": (14, AWM + ":315"),
    "sigma_schedule": ("scheduler", AWM_PIPE),
    "eval_num_steps": (40, AWM + ":316"),
    "guidance_scale": (1.0, AWM + ":317"),
    "eval_guidance_scale": (1.0, AWM + ":317 (eval uses sample.guidance_scale)"),
    "resolution": (512, AWM + ":321"),
    "group_size": (24, AWM + ":323"),
    "grad_steps_per_epoch": (1, AWM + ":330 (gradient_accumulation_steps = the whole epoch)"),
    "num_train_timesteps": (6, AWM + ":334"),
    "timestep_range": (0.65, AWM + ":338 (the first 90% of the 14 indices = sigma >= 0.357 on its schedule)"),
    "learning_rate": (3e-4, AWM + ":340"),
    "weighting": ("ghuber", AWM + ":341"),
    "ghuber_power": (0.25, AWM + ":342"),
    "ema_decay_max": (0.3, AWM + ":344"),
    "ema_decay_ramp": (0.001, AWM_CODE + "scripts/train_sd3_awm.py:1413 (min(0.3, 0.001 x step))"),
    "ema_kl_beta": (1.0, AWM + ":345"),
    "dynamics": ("SA-Solver", AWM + ":349 (use_sa_solver)"),
    "advantage_std": ("global", AWM + ":350"),
    "adv_clip": (5.0, AWM_CODE + "config/base_awm.py:91"),
    "advantage_max": (1.0, AWM + ":336"),
    "clip_low": (1.0, AWM + ":365"),
    "clip_high": (1.0, AWM + ":365"),
    "eval_ema_decay": (0.99, AWM + ":370"),
    "eval_ema_interval": (1, AWM + ":371"),
    "eval_ema_repeats": (1, AWM_CODE + "scripts/train_sd3_awm.py:1392 (once per inner epoch = optimizer step)"),
    "weight_decay": (1e-4, AWM_CODE + "config/base_awm.py:76"),
    "max_grad_norm": (1.0, AWM_CODE + "config/base_awm.py:83"),
    "lora_rank": (32, AWM_CODE + "scripts/train_sd3_awm.py:633"),
    "lora_alpha": (64.0, AWM_CODE + "scripts/train_sd3_awm.py:634"),
    "base_dtype": ("float32", AWM_CODE + "scripts/train_sd3_awm.py:607 (the cast to the inference dtype is commented out)"),
    "mixed_precision": (FP16, AWM_CODE + "config/base_awm.py:23"),
}
DGPO_BASE = {
    "num_train_timesteps": (4, DGPO + "config/dgpo.py:28"),
    "timestep_range": (0.35, DGPO + "config/dgpo.py:29 (trunc_steps 6: indices 0..6, sigma >= 0.667)"),
    "off_policy_after": (200, DGPO + "config/dgpo.py:31"),
    "clip_dsm": (True, DGPO + "config/dgpo.py:39"),
    "dynamics": ("DPM-Solver", DGPO + "config/dgpo.py:24 (use_dpm)"),
    "sigma_schedule": ("pipeline", DGPO_SCHEDULE),
    "num_steps": (10, DGPO + "config/dgpo.py:147"),
    "guidance_scale": (4.5, DGPO + "config/dgpo.py:149"),
    "eval_guidance_scale": (4.5, DGPO + "scripts/train_sd3_dgpo.py:427"),
    "eval_solver": (
        "dpm",
        DGPO + "scripts/train_sd3_dgpo.py:420 (eval through the pipeline, whose scheduler is the DPM-Solver)",
    ),
    "resolution": (512, DGPO + "config/dgpo.py:151"),
    "grad_steps_per_epoch": (1, DGPO + "config/dgpo.py:159"),
    "advantage_std": ("global", DGPO + "config/dgpo.py:166"),
    "eval_ema_decay": (0.9, DGPO + "scripts/train_sd3_dgpo.py:627 (update_step_interval 8)"),
    "eval_ema_interval": (8, DGPO + "scripts/train_sd3_dgpo.py:627"),
    "ema_ref_decay_max": (0.3, DGPO + "scripts/train_sd3_dgpo.py:629"),
    "ema_ref_decay_ramp": (1e-3, DGPO + "scripts/train_sd3_dgpo.py:1176 (min(0.3, 0.001 x step))"),
    "kl_cfg": (1.0, DGPO + "config/base.py:29"),
    "learning_rate": (3e-4, DGPO + "config/base.py:68"),
    "weight_decay": (1e-4, DGPO + "config/base.py:74"),
    "max_grad_norm": (1.0, DGPO + "config/base.py:81"),
    "adv_clip": (5.0, DGPO + "config/base.py:89"),
    "lora_rank": (64, DGPO + "scripts/train_sd3_dgpo.py:612"),
    "lora_alpha": (128.0, DGPO + "scripts/train_sd3_dgpo.py:613"),
    "base_dtype": ("float32", DGPO + "scripts/train_sd3_dgpo.py:597 (the transformer stays as loaded)"),
    "mixed_precision": (True, DGPO + "config/base.py:21 (bf16)"),
}
CRD = {
    "crd_beta": (1.0, FF + ":47"),
    "loss_type": ("mse", FF + ":48"),
    "use_old_for_loss": (True, FF + ":49"),
    "adaptive_weighting": (True, FF + ":50"),
    "weight_temp": (-1.0, FF + ":51"),
    "centering": ("batch", FF + ":81 (centred over each per-device batch of 8)"),
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
    "kl_adaptive": ("advantage", FF_CODE + "trainers/crd.py:815-820 (the [0, 1]-mapped advantage scales the KL)"),
    "kl_floor": (1e-4, FF_CODE + "trainers/crd.py:818"),
    "adv_clip": (5.0, FF + ":73"),
    "resolution": (512, FF + ":76"),
    "num_steps": (10, FF + ":77"),
    "sigma_schedule": ("pipeline", FF_CODE + "scheduler/flow_match_euler_discrete.py:57"),
    "guidance_scale": (1.0, FF + ":78"),
    "micro_batch": (8, FF + ":81"),
    "group_size": (24, FF + ":82"),
    "advantage_std": ("global", FF + ":83"),
    "num_prompts": (48, FF + ":84"),
    "grad_steps_per_epoch": (2, FF + ":85"),
    "learning_rate": (3e-4, FF + ":89"),
    "weight_decay": (1e-4, FF + ":90"),
    "max_grad_norm": (1.0, FF + ":93"),
    "dynamics": ("ODE", FF + ":103"),
    "eval_guidance_scale": (1.0, FF + ":109"),
    "eval_num_steps": (40, FF + ":110"),
    "eval_ema_decay": (0.0, FF + "(no EMA in the eval settings :105-112)"),
    "lora_rank": (32, FF + ":23"),
    "lora_alpha": (64.0, FF + ":24"),
    "base_dtype": ("bfloat16", FF_CODE + "models/abc.py:825-850 (frozen weights cast to the bf16 inference dtype)"),
    "mixed_precision": (True, FF + ":8 (bf16)"),
}

# {script: {task: {Args field: (official value in cleanflow's units, where it comes from)}}}
DPO_CODE = FG + "scripts/train_sd3_dpo.py:"
DPO_CFG = FG + "config/dpo.py:"
# flow_grpo's DPO (config/dpo.py `pickscore_sd3`); it has no OCR config, so TASK=ocr keeps these values
DPO = {
    "num_steps": (40, DPO_CFG + "74"),
    "sigma_schedule": ("scheduler", FG + "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py:121-127 (sigmas None)"),
    "eval_num_steps": (40, DPO_CFG + "75"),
    "guidance_scale": (4.5, DPO_CFG + "76"),
    "eval_guidance_scale": (4.5, DPO_CODE + "229 (eval passes sample.guidance_scale)"),
    "resolution": (512, DPO_CFG + "78"),
    "group_size": (24, DPO_CFG + "80"),
    "micro_batch": (24, DPO_CFG + "88 (train.batch_size = sample.train_batch_size: one group)"),
    "num_prompts": (1, DPO_CFG + "79-81 (24 images of one prompt per process) + scripts/single_node/dpo.sh (1 process)"),
    "grad_steps_per_epoch": (1, DPO_CFG + "50 + " + DPO_CODE + "332 (one step per batch's 39 timesteps)"),
    "num_train_timesteps": (39, DPO_CODE + "320 + " + DPO_CFG + "91 (int(40 x 0.99))"),
    "timestep_sampling": ("logit-normal", DPO_CODE + "890-896 (compute_density_for_timestep_sampling)"),
    "logit_mean": (0.0, DPO_CODE + "893"),
    "logit_std": (1.0, DPO_CODE + "894"),
    "dpo_beta": (50.0, DPO_CFG + "92 (beta 100) + " + DPO_CODE + "936 (-0.5 * beta inside the sigmoid)"),
    "pairs_per_group": ("best-worst", FG + "flow_grpo/stat_tracking.py:38-52 (argmax vs argmin)"),
    "rollout_policy": ("base", DPO_CODE + "618 (the ref adapter samples) + " + DPO_CFG + "86 (never refreshed)"),
    "dynamics": ("Flow-SDE", FG + "flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:47"),
    "eta": (0.7, FG + "config/base.py:54 (sample.noise_level)"),
    "eval_ema_decay": (0.9, DPO_CODE + "422"),
    "eval_ema_interval": (8, DPO_CODE + "422 (update_step_interval 8)"),
    "eval_ema_repeats": (1, DPO_CODE + "973-974 (ema.step once per optimizer step)"),
    "learning_rate": (3e-4, FG + "config/base.py:63"),
    "weight_decay": (1e-4, FG + "config/base.py:69"),
    "max_grad_norm": (1.0, FG + "config/base.py:76"),
    "lora_rank": (32, DPO_CODE + "400"),
    "lora_alpha": (64.0, DPO_CODE + "401"),
    "base_dtype": ("float32", DPO_CODE + "385 (the transformer stays as loaded)"),
    "mixed_precision": (FP16, FG + "config/base.py:21"),
}


# ELBO-GRPO: the official code of "Rethinking the Design Space of RL for Diffusion Models" (line numbers not stored)
RDS = "jaemoo-choi/rethinking-diffusion-rl@c257000 "
RDS_SD3 = RDS + "config/sd3.py::_sd3_ode_base_config "
ELBO_GRPO = {
    "num_steps": (10, RDS_SD3 + "sample.num_steps"),
    "sigma_schedule": (
        "scheduler",
        RDS + "src/diffusers_patch/pipeline_with_logprob_sd3.py (retrieve_timesteps, sigmas=None)",
    ),
    "eval_num_steps": (40, RDS_SD3 + "sample.eval_num_steps"),
    "guidance_scale": (1.0, RDS + "scripts/sd3/*.sh GUIDANCE_SCALE=1.0, TRAIN_GUIDANCE_SCALE=1.0"),
    "eval_guidance_scale": (1.0, RDS + "src/utils/sd3.py::eval_fn (sample.guidance_scale)"),
    "dynamics": ("dpm2", RDS_SD3 + "sample.deterministic True, sample.solver dpm2"),
    "resolution": (512, RDS_SD3 + "resolution"),
    "micro_batch": (9, RDS_SD3 + "bsz 9 on 8 GPUs (train.batch_size = sample.train_batch_size)"),
    "group_size": (24, RDS_SD3 + "num_image_per_prompt"),
    "num_prompts": (48, RDS_SD3 + "num_groups"),
    "grad_steps_per_epoch": (1, RDS + "scripts/sd3/*.sh GRADIENT_STEP_PER_EPOCH=1"),
    "num_train_timesteps": (9, RDS + "config/base.py timestep_fraction 0.99 -> src/train.py int(10 x 0.99)"),
    "timestep_range": (0.99, RDS + "src/train.py (every sampler timestep is eligible)"),
    "elbo_weighting": ("adaptive", RDS + "scripts/sd3/*.sh ELBO=adaptive -> src/utils/__init__.py::compute_elbo"),
    "shared_group_noise": (False, RDS + "src/utils/base.py::compute_loss (noise = randn_like(x0) per image)"),
    "advantage_std": ("global", RDS + "config/base.py sample.global_std True"),
    "adv_clip": (5.0, RDS + "src/utils/base.py::compute_policy_loss grpo (clamp -5, 5)"),
    "clip_low": (1e-3, RDS + "src/utils/base.py::compute_policy_loss grpo"),
    "clip_high": (1e-3, RDS + "src/utils/base.py::compute_policy_loss grpo"),
    "kl_beta": (1e-4, RDS + "scripts/sd3/*.sh BETA=0.0001, KL_METHOD=girsanov (||v - v_ref||^2)"),
    "learning_rate": (3e-4, RDS + "scripts/sd3/*.sh LEARNING_RATE=3e-4"),
    "weight_decay": (1e-4, RDS + "config/base.py train.adam_weight_decay"),
    "max_grad_norm": (5.0, RDS + "scripts/sd3/*.sh MAX_GRAD_NORM=5.0"),
    "eval_ema_decay": (0.9, RDS + "src/train.py EMAModuleWrapper(decay=0.9, update_step_interval=1)"),
    "eval_ema_interval": (1, RDS + "src/train.py EMAModuleWrapper(update_step_interval=1)"),
    "eval_ema_repeats": (1, RDS + "src/train.py (ema.step once per gradient step)"),
    "lora_rank": (32, RDS + "src/utils/sd3.py::get_lora_config"),
    "lora_alpha": (64.0, RDS + "src/utils/sd3.py::get_lora_config"),
    "base_dtype": ("float32", RDS + "src/utils/sd3.py::get_pretrained_model (the transformer stays as loaded)"),
    "mixed_precision": (False, RDS + "config/base.py mixed_precision 'no'"),
}
# Flow-DPPO: the authors' SD3.5 recipe in Tencent-Hunyuan/UniRL (FlowDPPO/README.md); no OCR config, so TASK=ocr keeps
# these values. Its script runs algos/grpo_variants.py (the method is its --kl-mask)
UNIRL = "Tencent-Hunyuan/UniRL@1a7b501 "
DPPO_CFG = UNIRL + "examples/diffusion/sd3_flowdppo.yaml:"
FLOW_DPPO = {
    "num_steps": (10, DPPO_CFG + "137"),
    "sigma_schedule": ("pipeline", UNIRL + "unirl/sde/runtime.py:98-99 (linspace(1, 0, N + 1) shifted by 3)"),
    "guidance_scale": (1.0, DPPO_CFG + "138"),
    "resolution": (512, DPPO_CFG + "139-140"),
    "dynamics": ("Flow-SDE", DPPO_CFG + "47 (FlowSDEStrategy)"),
    "eta": (0.7, DPPO_CFG + "141"),
    "group_size": (16, DPPO_CFG + "142"),
    "shared_group_noise": (False, DPPO_CFG + "144 (init_same_noise false)"),
    "num_prompts": (48, DPPO_CFG + "20 (prompts_per_rollout)"),
    "sde_window": ((0, 5), DPPO_CFG + "151 (timestep_fraction [0.0, 0.5] of 10 steps)"),
    "num_sde_steps": (3, DPPO_CFG + "152"),
    "window_mode": ("subset", UNIRL + "unirl/utils/scheduler_utils.py:118-124 (a random choice of the pool)"),
    "micro_batch": (8, DPPO_CFG + "121"),
    "grad_steps_per_epoch": (2, DPPO_CFG + "123 (num_updates_per_batch: mini-batches per rollout)"),
    "num_inner_epochs": (1, DPPO_CFG + "123 (one pass of the 2 mini-batches)"),
    "max_grad_norm": (1.0, DPPO_CFG + "122"),
    "learning_rate": (3e-4, DPPO_CFG + "64"),
    "weight_decay": (0.0, DPPO_CFG + "68"),
    "lora_rank": (32, DPPO_CFG + "76"),
    "lora_alpha": (64.0, DPPO_CFG + "77"),
    "advantage_std": ("global", DPPO_CFG + "27 (adv_use_global_std: the group mean, one batch-wide std)"),
    "adv_clip": (None, UNIRL + "unirl/types/rollout_resp.py:220-300 (compute_advantages: None = no clip)"),
    "kl_mask": (1e-5, DPPO_CFG + "116 (kl_mask_threshold, on the per-element mean KL)"),
    "kl_beta": (0.0, UNIRL + "unirl/algorithms/flowdppo.py:319 (the loss is the masked surrogate alone)"),
    "base_dtype": ("bfloat16", DPPO_CFG + "34 (model_precision bf16)"),
    "mixed_precision": (True, DPPO_CFG + "35 (autocast_precision bf16)"),
}
# MixGRPO: its authors' SD3.5 recipe in UniRL (the paper trains FLUX.1-dev only); no OCR config either
MIX_CFG = UNIRL + "examples/diffusion/sd3_mixgrpo.yaml:"
MIXGRPO = {
    "num_steps": (10, MIX_CFG + "127"),
    "sigma_schedule": ("pipeline", UNIRL + "unirl/sde/runtime.py:98-99 (linspace(1, 0, N + 1) shifted by 3)"),
    "guidance_scale": (1.0, MIX_CFG + "128"),
    "resolution": (512, MIX_CFG + "129-130"),
    "dynamics": ("Flow-SDE", MIX_CFG + "37 (FlowSDEStrategy)"),
    "eta": (0.7, MIX_CFG + "131"),
    "group_size": (16, MIX_CFG + "132"),
    "shared_group_noise": (True, MIX_CFG + "134 (init_same_noise true)"),
    "num_prompts": (48, MIX_CFG + "15 (prompts_per_rollout)"),
    "sde_window": ((0, 10), MIX_CFG + "143 + 149 (every step of the 10, the window starting at step 0)"),
    "window_mode": ("sliding", MIX_CFG + "142-146 (WindowScheduler, strategy progressive)"),
    "num_sde_steps": (4, MIX_CFG + "147 (window_size)"),
    "window_shift": ((25, 3), MIX_CFG + "148-151 (iters_per_window 25; stride = window 4 - overlap 1; roll_back)"),
    "micro_batch": (8, MIX_CFG + "111"),
    "grad_steps_per_epoch": (2, MIX_CFG + "113 (num_updates_per_batch: mini-batches per rollout)"),
    "num_inner_epochs": (1, MIX_CFG + "113 (one pass of the 2 mini-batches)"),
    "max_grad_norm": (1.0, MIX_CFG + "112"),
    "learning_rate": (3e-4, MIX_CFG + "54"),
    "weight_decay": (1e-4, MIX_CFG + "58"),
    "lora_rank": (32, MIX_CFG + "66"),
    "lora_alpha": (64.0, MIX_CFG + "67"),
    "clip_low": (1e-4, MIX_CFG + "101 (clip_range)"),
    "clip_high": (1e-4, MIX_CFG + "101 (clip_range)"),
    "advantage_std": ("global", MIX_CFG + "16 (adv_use_global_std)"),
    "adv_clip": (None, UNIRL + "unirl/types/rollout_resp.py:220-300 (compute_advantages: None = no clip)"),
    "kl_beta": (0.0, UNIRL + "unirl/algorithms/flowgrpo.py:174-180 (the loss is the clipped surrogate alone)"),
    "base_dtype": ("bfloat16", MIX_CFG + "24 (model_precision bf16)"),
    "mixed_precision": (True, MIX_CFG + "25 (autocast_precision bf16)"),
}
# a paper script named after a method that one of the algos/ scripts runs with a flag
SCRIPT_ALGO = {"flow_dppo": "grpo_variants", "mixgrpo": "grpo_variants"}
OFFICIAL = {
    "grpo": {
        "pickscore": {
            **GRPO,
            "num_steps": (10, FAST + "sample.num_steps"),
            "eval_num_steps": (40, FAST + "sample.eval_num_steps"),
            "guidance_scale": (4.5, FAST + "sample.guidance_scale"),
            "resolution": (512, FAST + "resolution"),
            "num_prompts": (48, FAST + "num_batches_per_epoch = 48 / (gpus x 9 / 24)"),
            "group_size": (24, FAST + "sample.num_image_per_prompt"),
            "micro_batch": (9, FAST + "train.batch_size = mini_num_image_per_prompt"),
            "grad_steps_per_epoch": (2, FAST + "gradient_accumulation_steps = num_batches_per_epoch // 2"),
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
            "advantage_std": ("global", FAST + "sample.global_std"),
            "shared_group_noise": (
                True,
                "yifan123/flow_grpo@74db691 Fast pipeline: latents.repeat(mini_num_image_per_prompt)",
            ),
        },
        "ocr": {
            **GRPO,
            "num_sde_steps": (9, FG + "config/grpo.py:50 (timestep_fraction 0.99: int(10 x 0.99) trained steps)"),
            "sde_window": ((0, 9), FG + "scripts/train_sd3.py (trains steps 0 .. num_train_timesteps - 1)"),
            "window_mode": ("contiguous", FG + "scripts/train_sd3.py:863 (the whole window is trained: either mode)"),
            "kl_beta": (0.04, FG + "config/grpo.py:52"),
            "eta": (0.7, FG + "config/base.py:54"),
            "clip_low": (1e-4, FG + "config/base.py:86"),
            "clip_high": (1e-4, FG + "config/base.py:86"),
            "shared_group_noise": (False, "yifan123/flow_grpo@31c71b9 config/grpo.py::general_ocr_sd3 same_latent = False"),
        },
    },
    "nft": {
        "pickscore": {
            **NFT_BASE,
            "grad_steps_per_epoch": (1, NFT + "config/nft.py:104"),
            "nft_beta": (1.0, NFT + "config/nft.py:61"),
            "old_decay_flat_steps": (0, NFT + "config/nft.py:60 decay_type 1 -> scripts/train_nft_sd3.py:175"),
            "old_decay_ramp": (0.001, NFT + "scripts/train_nft_sd3.py:176"),
            "old_decay_max": (0.5, NFT + "scripts/train_nft_sd3.py:177"),
        },
        "ocr": {
            **NFT_BASE,
            "grad_steps_per_epoch": (2, NFT + "config/nft.py:75"),
            "nft_beta": (0.1, NFT + "config/nft.py:77"),
            "old_decay_flat_steps": (75, NFT + "config/nft.py:78 decay_type 2 -> scripts/train_nft_sd3.py:179"),
            "old_decay_ramp": (0.0075, NFT + "scripts/train_nft_sd3.py:180"),
            "old_decay_max": (0.999, NFT + "scripts/train_nft_sd3.py:181"),
        },
    },
    "awm": {
        "pickscore": {
            **AWM_BASE,
            "num_prompts": (24, AWM + ":320-324 (8 GPUs x 6 x 12 batches / 24 images)"),
            "micro_batch": (2, AWM + ":329 (train.batch_size: one timestep draw per 2 images)"),
            "kl_beta": (1e-4, AWM + ":333"),
            "skip_pure_noise": (False, AWM + ":367 (time_type discrete)"),
        },
        "ocr": {
            **AWM_BASE,
            "num_steps": (14, AWM + ":176"),
            "eval_num_steps": (40, AWM + ":177"),
            "guidance_scale": (1.0, AWM + ":178"),
            "num_prompts": (72, AWM + ":181-185 (8 GPUs x 6 x 36 batches / 24 images)"),
            "micro_batch": (3, AWM + ":190 (train.batch_size)"),
            "eta": (0.4, AWM + ":187 (SA-Solver noise)"),
            "kl_beta": (3e-3, AWM + ":194"),
            "timestep_range": (0.65, AWM + ":199"),
            "skip_pure_noise": (True, AWM + ":228 (time_type discrete_wo_init)"),
            "eval_ema_decay": (0.99, AWM + ":231"),
        },
    },
    "elbo_grpo": {"pickscore": ELBO_GRPO, "ocr": ELBO_GRPO},
    "dgpo": {
        "pickscore": {
            **DGPO_BASE,
            "clip_range": (5e-2, DGPO + "config/dgpo.py:33"),
            "eval_num_steps": (14, DGPO + "config/dgpo.py:148"),
            "group_size": (24, DGPO + "config/dgpo.py:153"),
            "num_prompts": (8, DGPO + "config/dgpo.py:154"),
            "micro_batch": (12, DGPO + "config/dgpo.py:152 (train.batch_size = sample.train_batch_size)"),
            "kl_beta": (1e-3, DGPO + "config/dgpo.py:163"),
            "dpo_beta": (10.0, DGPO + "config/dgpo.py:164"),
            "eval_ema_repeats": (4, DGPO + "scripts/train_sd3_dgpo.py:1215 (per micro-batch) + config/dgpo.py:152-159 (4)"),
        },
        "ocr": {
            **DGPO_BASE,
            "dpo_beta": (100.0, DGPO + "config/dgpo.py:32 (not overridden for OCR)"),
            "eval_num_steps": (14, DGPO + "config/dgpo.py:104"),
            "guidance_scale": (4.5, DGPO + "config/dgpo.py:105"),
            "clip_range": (1e-2, DGPO + "config/dgpo.py:107"),
            "micro_batch": (16, DGPO + "config/dgpo.py:109 (train.batch_size = sample.train_batch_size)"),
            "group_size": (16, DGPO + "config/dgpo.py:110"),
            "num_prompts": (8, DGPO + "config/dgpo.py:111"),
            "kl_beta": (0.02, DGPO + "config/dgpo.py:115"),
            "advantage_std": ("global", DGPO + "config/dgpo.py:124"),
            "eval_ema_repeats": (2, DGPO + "scripts/train_sd3_dgpo.py:1215 + config/dgpo.py:108-119 (8 x 16 / (4 x 16))"),
        },
    },
    "crd": {task: dict(CRD) for task in ("pickscore", "ocr")},
    "dpo": {task: dict(DPO) for task in ("pickscore", "ocr")},
    "flow_dppo": {task: dict(FLOW_DPPO) for task in ("pickscore", "ocr")},
    "mixgrpo": {task: dict(MIXGRPO) for task in ("pickscore", "ocr")},
}


DIFF = re.compile(r"^# DIFF(?:\[(\w+)\])? --([\w-]+) (\S+): (.+)$")


def listed_differences(script: Path, task: str) -> dict:
    """{Args field: (value it allows, reason)} of the header's "# DIFF --flag VALUE: reason" (every task) and
    "# DIFF[task] ..." lines."""
    out = {}
    for line in script.read_text().splitlines():
        m = DIFF.match(line)
        if m and m.group(1) in (None, task):
            out[m.group(2).replace("-", "_")] = (parse_value(m.group(3)), m.group(4))
        elif not m and line.startswith("# DIFF"):
            raise AssertionError(f"{script.name}: malformed DIFF line (want '# DIFF[task] --flag VALUE: reason'): {line}")
    return out


def parse_value(token: str):
    for kind in (int, float):
        try:
            return kind(token)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(token, token)


def same(ours, official) -> bool:
    if isinstance(official, bool) or isinstance(ours, bool):
        return ours is official
    if isinstance(official, (int, float)) and isinstance(ours, (int, float)):
        return abs(ours - official) <= 1e-12 * max(1.0, abs(official))
    if isinstance(official, tuple):
        return tuple(ours) == official
    return ours == official


@functools.lru_cache(maxsize=None)
def parsed(script: Path, task: str):
    """(algorithm, parsed Args, flags the script passes) of a paper script for a TASK."""
    _, name, args, flags = parse_script(script, task, with_flags=True)
    fields = (f[2:].replace("-", "_") for f in flags if f.startswith("--"))
    return name, args, tuple(f[3:] if f.startswith("no_") and not hasattr(args, f) else f for f in fields)


def problems(algo: str, task: str, args, diffs: dict, flags=()) -> dict:
    """{field: what is wrong}: a field off the official value without a DIFF line, a DIFF whose value is not the
    script's, a DIFF that names the official value or a field outside the table, a flag in neither table."""
    out = {}
    table = OFFICIAL[algo][task]
    for field, (official, where) in table.items():
        ours = getattr(args, field, "<no such flag>")
        if field in diffs:
            allowed = diffs[field][0]
            if not same(ours, allowed):
                out[field] = f"DIFF allows {allowed!r}, the script sets {ours!r} (official {official!r}, {where})"
            elif same(allowed, official):
                out[field] = f"DIFF names the official value {official!r}: drop the line"
        elif not same(ours, official):
            out[field] = f"{ours!r} but official {official!r} ({where}), and no DIFF line"
    for field in diffs:
        if field not in table:
            out[field] = "DIFF names a field that is not in the official table"
    for field in flags:
        if field not in table and field not in RUN_FLAGS and field != "nproc_per_node":
            out[field] = "the script passes it, but it is neither in the official table nor in RUN_FLAGS"
    return out


def script_problems(script: Path, algo: str, task: str) -> dict:
    name, args, flags = parsed(script, task)
    assert name == SCRIPT_ALGO.get(algo, algo)
    return problems(algo, task, args, listed_differences(script, task), flags)


@pytest.mark.parametrize("task", ["pickscore", "ocr"])
@pytest.mark.parametrize("algo", sorted(OFFICIAL))
def test_script_sets_the_official_config_or_says_why_not(algo, task):
    found = script_problems(REPO / "benchmark" / f"sd35_{algo}.sh", algo, task)
    assert not found, f"sd35_{algo}.sh TASK={task}: {found}"


def flipped(value):
    """A different value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 0.5
    if isinstance(value, tuple):
        return tuple(v + 1 for v in value)
    return f"{value}-changed"


@pytest.mark.parametrize("task", ["pickscore", "ocr"])
@pytest.mark.parametrize("algo", sorted(OFFICIAL))
def test_every_field_flipped_once_is_caught(algo, task):
    """Mutation test: each field of the table, changed in the parsed script (DIFF'd ones away from the value their
    DIFF line allows), must be reported, whatever DIFF lines the header has."""
    script = REPO / "benchmark" / f"sd35_{algo}.sh"
    _, args, flags = parsed(script, task)
    diffs = listed_differences(script, task)
    assert not problems(algo, task, args, diffs, flags)
    missed = []
    for field in OFFICIAL[algo][task]:
        mutant = dataclasses.replace(args, **{field: flipped(getattr(args, field))})
        if field not in problems(algo, task, mutant, diffs, flags):
            missed.append(field)
    assert not missed, f"changing these fields went unnoticed: {missed}"


def test_a_silent_difference_is_caught_in_the_script_text(tmp_path):
    """End to end on a script copy: the exact KL form without a DIFF line, and a DIFF line whose value is no longer the
    script's, are both flagged; an unknown flag is flagged too."""
    text = (REPO / "benchmark" / "sd35_grpo.sh").read_text()
    script = tmp_path / "sd35_grpo.sh"
    script.write_text(text.replace("--kl-form official", "--kl-form exact"))
    assert set(script_problems(script, "grpo", "ocr")) == {"kl_form"}
    script = tmp_path / "a" / "sd35_grpo.sh"
    script.parent.mkdir()
    script.write_text(text.replace("--group-size 24 --micro-batch 8", "--group-size 24 --micro-batch 4"))
    assert set(script_problems(script, "grpo", "pickscore")) == {"micro_batch"}
    script = tmp_path / "b" / "sd35_grpo.sh"
    script.parent.mkdir()
    script.write_text(text.replace("--kl-form official", "--kl-form official --leave-one-out"))
    assert set(script_problems(script, "grpo", "pickscore")) == {"leave_one_out"}


@pytest.mark.parametrize("algo, steps, official_indices", [("dgpo", 10, 7), ("awm", 14, 12)])
def test_timestep_ranges_cover_the_official_step_indices(algo, steps, official_indices):
    """DGPO trunc_steps 6 trains indices 0..6 (7); AWM timestep_fraction 0.9 of 14 steps trains indices 0..11 (12).
    The scripts' --timestep-range keeps the indices whose sigma >= 1 - range on SD3.5's schedule (shift 3) as the
    official code samples it (AWM: diffusers' set_timesteps(14); DGPO: its DPM-Solver's flow sigmas, the shifted
    linspace to within 5e-4, checked below against diffusers' DPMSolverMultistepScheduler itself)."""
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

    schedule = OFFICIAL[algo]["pickscore"]["sigma_schedule"][0]
    sigmas = common.sigma_schedule(FlowMatchEulerDiscreteScheduler(shift=3.0), steps, schedule=schedule)
    value = OFFICIAL[algo]["pickscore"]["timestep_range"][0]
    assert int((sigmas[:-1] >= 1 - value - 1e-6).sum()) == official_indices
    if algo == "dgpo":
        dpm = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
        dpm.set_timesteps(steps)
        assert (dpm.sigmas.float() - sigmas).abs().max() < 5e-4
