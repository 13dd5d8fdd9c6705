"""Direct Group Preference Optimization (DGPO), Luo, Hu & Tang 2025, arXiv 2510.08425 -- docs/dgpo.md

python algos/dgpo.py                                                   # tiny-shapes on CPU, a few minutes
torchrun --nproc-per-node 8 algos/dgpo.py --model stabilityai/stable-diffusion-3.5-medium --reward pickscore  # see benchmark/
"""

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402  (also registers the model families with common)
from harness import flags, shell  # noqa: E402

# --learning-rate's default, by what is trained: every weight (benchmark/results/convergence) or a LoRA
# (benchmark/results/shapes_clean/tuning.md)
LEARNING_RATES = {"full": 1e-4, "lora": 1e-3}


@dataclass
class DGPOArgs:
    """DGPO's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    num_train_timesteps: int = 4
    """T, trained timesteps per inner epoch, shared by all micro-batches"""
    timestep_range: float = 0.6
    """train where sigma >= 1 - range"""
    adv_clip: float = 5.0
    """advantages are clipped to [-c, c]"""
    advantage_std: Literal["group", "global"] = "group"
    """std of the z-score: per group or global"""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """several rewards: z-score their sum, or each first"""
    num_inner_epochs: int = 1
    """passes over each rollout buffer, with fresh timesteps and noise"""
    dpo_beta: float = 100.0
    """beta of the group preference sigmoid"""
    clip_dsm: bool = True
    """PPO-style clip of the DSM ratio against ema_ref"""
    clip_range: float = 1e-2
    """eps of the DSM ratio clip"""
    use_ema_ref: bool = False
    """implicit reward relative to ema_ref instead of the base model"""
    ema_ref_decay_start: float = 0.0
    """decay d of ema_ref at first"""
    ema_ref_decay_flat_steps: int = 0
    """steps before d starts to ramp"""
    ema_ref_decay_ramp: float = 1e-3
    """increase of d per optimizer step"""
    ema_ref_decay_max: float = 0.3
    """the largest decay d of ema_ref"""
    off_policy_after: int = 200
    """roll out with ema_ref after this many optimizer steps"""
    kl_beta: float = 0.5
    """KL weight to the base model"""
    kl_cfg: float = 4.5
    """CFG scale of the base model in the KL and the reference DSM"""
    eval_solver: Literal["euler", "dpm"] = "euler"
    """evaluation sampler: "euler" (the rollout's) or "dpm" (DPM-Solver++)"""


@dataclass
class Args(flags.SharedArgs, DGPOArgs):
    # DGPO's flags come first in --help, then the flags every script shares; here, where this script's default
    # or help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    guidance_scale: float = 1.0
    """CFG scale of the rollout (training forwards use none)"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate; default 1e-4 (every weight) or 1e-3 (LoRA)"""
    micro_batch: int = 16
    """per-rank micro-batch (whole groups)"""
    grad_steps_per_epoch: int = 2
    """optimizer steps per inner epoch"""


# ALGO LOGIC: the group-relative advantage, the same function in every file that forms one (tests/test_skeleton.py)
# added to the std of the z-score, as flow_grpo does (flow_grpo/stat_tracking.py: np.std(...) + 1e-4): a group whose
# rewards differ only by float32 rounding (~1e-7) would otherwise be scaled up to advantages of +-1 (Flow-Factory's
# floor max(std, 1e-6) still lets a reward of scale 20 do that: its float32 spacing is 2e-6)
STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, std: str = "group", clip: Optional[float] = None) -> torch.Tensor:
    """Group-relative advantages for rewards laid out as contiguous groups of K ([B] with B = M K).

    A_i = (r_i - mean of its group) / scale. scale: the group's population std (`std="group"`), the std over all samples
    (`"global"`), each plus STD_EPS. A group whose rewards are all equal gets advantage 0 (never NaN), and a nearly
    flat one (differences at float rounding) gets advantages near 0, not +-1. Then optional clip to [-c, c].
    """
    r = rewards.double().view(-1, group_size)
    centred = r - r.mean(1, keepdim=True)
    if std == "group":
        scale = r.std(1, unbiased=False, keepdim=True) + STD_EPS
    elif std == "global":
        scale = rewards.double().std(unbiased=False).expand_as(r[:, :1]) + STD_EPS
    else:
        raise common.UserError(f"unknown advantage std mode {std!r}; choose group or global")
    flat = r.std(1, unbiased=False, keepdim=True) < 1e-8  # zero-variance group: no signal
    adv = torch.where(flat, torch.zeros_like(centred), centred / scale)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.view(-1).float()


def aggregate_advantages(
    scores: dict,
    weights: dict,
    group_size: int,
    aggregation: str = "sum",
    std: str = "group",
    clip: Optional[float] = None,
) -> torch.Tensor:
    """Several rewards -> one advantage per sample.

    "sum": advantages of the weighted sum of rewards (classic GRPO). "gdpo": each reward normalised within its
    groups first, then the weighted sum of those is normalised over the whole batch, so a reward with a large
    scale cannot drown the others.
    """
    if aggregation == "sum":
        total = sum(w * scores[k] for k, w in weights.items())
        return group_advantages(total, group_size, std, clip=clip)
    if aggregation == "gdpo":
        combined = sum(w * group_advantages(scores[k], group_size, "group") for k, w in weights.items())
        combined = (combined - combined.mean()) / (combined.std(unbiased=False) + STD_EPS)  # as the group path
        return combined.clamp(-clip, clip) if clip is not None else combined
    raise common.UserError(f"unknown advantage aggregation {aggregation!r}; choose sum or gdpo")


# ALGO LOGIC: DGPO's math as small pure functions
# Conventions: sigma = 1 is noise, x_t = (1 - sigma) x0 + sigma eps, velocity target u = eps - x0. The paper writes the
# denoising error on x0; in velocity form ||v - u||^2 = ||x0_hat - x0||^2 / sigma^2, a per-timestep factor that the
# paper's lambda_t absorbs (Eq. 17); like the official code we use the plain velocity error, lambda_t = 1.
def dsm_error(v, v_target) -> torch.Tensor:
    """L_dsm per sample: mean over latent elements of (v - u)^2; -L_dsm plays log p in the implicit reward."""
    return (v - v_target).pow(2).flatten(1).mean(1)


def clip_dsm_ratio(dsm, dsm_old, adv, clip_range: float):
    """PPO-style trust region on the denoising "likelihood" (official code; not in the paper's equations).

    With log p := -L_dsm, ratio = p_theta / p_old = exp(dsm_old - dsm). A sample whose ratio has already moved past
    1 + eps in the direction its advantage pushes (A > 0 lowers dsm, raising the ratio; A <= 0 the reverse) keeps its
    value but loses its gradient. Returns (dsm with clipped entries detached, ratio, clipped mask)."""
    ratio = torch.exp(dsm_old - dsm.detach())
    clipped = torch.where(adv > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)
    return torch.where(clipped, dsm.detach(), dsm), ratio, clipped


def group_logits(dsm, dsm_ref, adv, group_size: int, beta: float) -> torch.Tensor:
    """z_g = beta / K sum_{i in g} A_i (dsm_i - dsm_ref_i), one per group of K contiguous samples (detached).

    Eq. (17) with the weights w = |A| of Eq. (14): the positive group (A > 0) enters with +|A|, the negative group with
    -|A|, so the sum over both is sum_i A_i (...). Since sum_i A_i = 0 within a group, log Z(c) cancels. z < 0 once the
    model already prefers the group's good images over its bad ones more than the reference does."""
    return (adv * beta * (dsm.detach() - dsm_ref) / group_size).view(-1, group_size).sum(1).detach()


def dgpo_loss(dsm, dsm_ref, adv, group_size: int, beta: float):
    """The gradient-equivalent form of L = -log sigmoid(-z_g) (Eq. 17), as in the official code and Flow-Factory.

    dL/d dsm_i = sigmoid(z_g) beta / K A_i, so mean_i sigmoid(z_g) A_i dsm_i (weight detached) has the gradient of
    mean_g L_g / beta: lower the error of good images and raise that of bad ones, each group weighted by how far it is
    from already satisfying its preference. Returns (loss, z [groups])."""
    z = group_logits(dsm, dsm_ref, adv, group_size, beta)
    weight = torch.sigmoid(z).repeat_interleave(group_size)
    return (weight * adv * dsm).mean(), z


def group_noise(generators: list, group_size: int, shape) -> torch.Tensor:
    """One eps per group (one generator each), repeated for its K contiguous samples: the K images of a prompt are
    noised identically, so their denoising errors differ only through x0 (variance reduction, paper §3.1 after Eq. 16)."""
    return common.randn((len(generators), *shape), generators).repeat_interleave(group_size, 0)


def draw_timesteps(num_indices: int, count: int, generator: torch.Generator) -> list:
    """`count` distinct schedule indices in [0, num_indices), a uniformly random subset, as the official
    `random.sample(train_timesteps, M)` (DGPO scripts/train_sd3_dgpo.py:52-67): a stratified draw can repeat an index
    when the strata do not fall on whole indices (4 of 7 in the SD3.5 config)."""
    if count > num_indices:
        raise common.UserError(f"--num-train-timesteps {count}: only {num_indices} schedule indices are in the window")
    return torch.randperm(num_indices, generator=generator)[:count].tolist()


def velocity_kl(v, v_ref) -> torch.Tensor:
    """||v - v_ref||^2 per sample (mean over latent elements), the velocity-space KL surrogate: two Gaussian steps of
    the same std whose means come from v and v_ref differ in mean by a multiple of v - v_ref, so their KL is a multiple
    of this."""
    return (v - v_ref).pow(2).flatten(1).mean(1)


def get_decay(step: int, start: float, flat_steps: int, ramp: float, max_decay: float) -> float:
    """Decay d of a snapshot's soft update after `step` optimizer steps (nanoGPT's `get_lr(it)` pattern): `start` for
    the first `flat_steps` steps, then a linear ramp from `start` by `ramp` per step, capped at `max_decay`."""
    if step < flat_steps:
        return start
    return min(start + ramp * (step - flat_steps), max_decay)


def update_ema(ema, params, decay: float):
    """ema <- d ema + (1 - d) theta, d clamped to [0, 1]: d = 0 is a hard copy of theta, d = 1 leaves the EMA frozen."""
    with torch.no_grad():
        for e, p in zip(ema, params):
            e.lerp_(p.detach(), 1 - min(max(decay, 0.0), 1.0))


def main(args: Args):
    # TRY NOT TO MODIFY: the run folder (a resumed run's flags restored), the ranks, the seeds
    run_dir, ckpt, dist = shell.start(args, __file__)
    device = dist.device

    # ALGO LOGIC: flag checks that need no model, so a bad one fails before the model loads
    if args.micro_batch % args.group_size:
        raise common.UserError(
            f"micro_batch ({args.micro_batch}) must hold whole groups (a multiple of group_size {args.group_size}): "
            "the preference weight sums over a whole group"
        )
    if args.num_train_timesteps > args.num_steps:  # the exact window (--timestep-range) is checked once sigmas exist
        draw_timesteps(args.num_steps, args.num_train_timesteps, torch.Generator())

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: ema_ref, the fast EMA: anchor of the DSM clip, and the rollout policy after off_policy_after steps
    ema_ref = [p.detach().clone() for p in params]
    snapshots = {"ema_ref": ema_ref}  # saved with every checkpoint
    sigmas = pipe.sigmas(args.num_steps, device, args.sigma_schedule)
    eligible = int((sigmas[:-1] >= 1 - args.timestep_range - 1e-6).sum())
    draw_timesteps(eligible, args.num_train_timesteps, torch.Generator())  # refuses T > window before any output
    if dist.is_main:
        print(
            f"training timesteps per epoch T={args.num_train_timesteps} (shared by all groups), "
            f"from the {eligible} noisiest of {args.num_steps} steps"
        )

    # TRY NOT TO MODIFY: the prompt stream, the eval EMA, the logger, a resumed run's state; save, progress bar
    prompt_gen, eval_ema, logger, start_epoch, step, images_seen = shell.resume(
        args, run_dir, ckpt, dist, params, named, optimizer, snapshots
    )

    def save(epoch):  # the checkpoint of an exact --resume, then the exported model that users load (rank 0 writes)
        shell.save(
            run_dir, args, pipe, named, optimizer, snapshots, eval_ema, prompt_gen, logger, epoch, step, images_seen, __doc__
        )

    timer, stop, finite_grads = shell.Timer(), shell.GracefulStop(), shell.FiniteGradients()
    stopped_at = None
    pbar = shell.progress(args, dist, start_epoch)
    for epoch in pbar:
        if stop.requested:
            save(epoch)
            stopped_at = epoch
            break
        if epoch % args.eval_every == 0:
            shell.evaluate_and_log(args, pipe, encoder, test_prompts, rewards, eval_ema, logger, images_seen)
        if epoch % args.save_every == 0 and epoch > start_epoch:
            save(epoch)

        # ---- sampling ----
        with timer("sampling"):
            prompts = common.group_prompts(train_prompts, args.num_prompts, args.group_size, prompt_gen)
            prompts = [prompts[j] for j in local_idx]
            cond = encoder.cond(prompts)
            scorer = common.Scorer(pipe, rewards, prompts, args.micro_batch, overlap=args.overlap_reward, epoch=epoch)
            # the rollout policy theta^-: the current weights, then ema_ref after off_policy_after steps (paper App. E)
            with models.swapped_weights(params, ema_ref) if step > args.off_policy_after else contextlib.nullcontext():
                rollout = common.sample(
                    transformer,
                    pipe.scheduler,
                    cond,
                    num_steps=args.num_steps,
                    guidance_scale=args.guidance_scale,
                    dynamics=args.dynamics,
                    eta=args.eta,
                    generator=common.keyed_generators(args.seed, epoch, "rollout", indices=local_idx),
                    latent_shape=pipe.latent_shape,
                    use_autocast=args.mixed_precision,
                    schedule=args.sigma_schedule,
                    chunk=scorer.chunk,
                    on_chunk=scorer,
                )
            x0 = rollout.latents

        # ---- reward ----
        with timer("reward"):
            # each rank scores its own images (during sampling: --overlap-reward); advantages use the whole epoch's batch
            images, local_scores = scorer.result()
            scores = shell.gather_scores(local_scores, total, args.grad_steps_per_epoch)
            adv = aggregate_advantages(
                scores, rewards.weights, args.group_size, args.advantage_aggregation, args.advantage_std, clip=args.adv_clip
            )[local_idx].to(device)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            stats = {
                "policy_loss": [],
                "kl_ref": [],
                "grad_norm": [],
                "approx_kl": [],
                "clipfrac": [],
                "ratio_mean": [],
                "group_weight": [],
                "group_nll": [],
                "dsm": [],
            }
            per_step = micro_per_step * args.num_train_timesteps
            k = 0
            for inner in range(args.num_inner_epochs):
                # one set of T timesteps for every micro-batch (and rank: prompt_gen is shared), and one noise per group
                # (keyed by the global group index) reused at every timestep
                timesteps = draw_timesteps(eligible, args.num_train_timesteps, prompt_gen)
                groups = local_idx[:: args.group_size] // args.group_size
                eps = group_noise(
                    common.keyed_generators(args.seed, epoch, "train", inner, indices=groups), args.group_size, x0.shape[1:]
                ).to(device)
                for mb in range(num_micro):
                    sl = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                    mb_cond = cond[sl]
                    v_target = eps[sl] - x0[sl]
                    for i in timesteps:
                        s = sigmas[i]
                        xt = (1 - s) * x0[sl] + s * eps[sl]
                        v_ref = v_ema_ref = None
                        with torch.no_grad(), common.autocast(device, args.mixed_precision):
                            if args.kl_beta > 0 or not args.use_ema_ref:
                                with models.reference_model(transformer):
                                    v_ref = common.velocity(transformer, xt, s, mb_cond, args.kl_cfg)
                            if args.clip_dsm or args.use_ema_ref:  # the fast EMA, as of the last optimizer step
                                with models.swapped_weights(params, ema_ref):
                                    v_ema_ref = common.velocity(transformer, xt, s, mb_cond)
                        with common.autocast(device, args.mixed_precision):
                            v = common.velocity(transformer, xt, s, mb_cond)  # training forwards: no CFG
                        dsm = dsm_error(v, v_target)
                        if v_ema_ref is not None:
                            clipped_dsm, ratio, clipped = clip_dsm_ratio(
                                dsm, dsm_error(v_ema_ref, v_target), adv[sl], args.clip_range
                            )
                            dsm = clipped_dsm if args.clip_dsm else dsm
                            stats["clipfrac"].append(clipped.float().mean().item() if args.clip_dsm else 0.0)
                            stats["ratio_mean"].append(ratio.mean().item())
                            stats["approx_kl"].append(0.5 * ratio.log().pow(2).mean().item())
                        dsm_ref = dsm_error(v_ema_ref if args.use_ema_ref else v_ref, v_target)
                        policy_loss, z = dgpo_loss(dsm, dsm_ref, adv[sl], args.group_size, args.dpo_beta)
                        kl = velocity_kl(v, v_ref).mean() if args.kl_beta > 0 else torch.zeros((), device=device)
                        loss = policy_loss + args.kl_beta * kl
                        (loss / per_step).backward()
                        for name, value in (
                            ("policy_loss", policy_loss),
                            ("kl_ref", kl),
                            ("group_weight", torch.sigmoid(z).mean()),
                            ("group_nll", -F.logsigmoid(-z).mean()),
                            ("dsm", dsm.mean()),
                        ):
                            stats[name].append(value.item())
                        # TRY NOT TO MODIFY: an optimizer step every per_step backward passes; a non-finite gradient skips it
                        k += 1
                        if k % per_step == 0:
                            shell.all_reduce_grads(params)
                            grad_norm = shell.clip_grad_norm(params, args.max_grad_norm)
                            if finite_grads(grad_norm, lambda: save(epoch)):
                                optimizer.step()
                                step += 1
                                eval_ema.update(step)
                                stats["grad_norm"].append(grad_norm.item())
                            optimizer.zero_grad(set_to_none=True)
                        # ALGO LOGIC: ema_ref follows theta after each optimizer step, d from the steps before this one
                        if k % per_step == 0 and torch.isfinite(grad_norm):
                            update_ema(
                                ema_ref,
                                params,
                                get_decay(
                                    step - 1,
                                    args.ema_ref_decay_start,
                                    args.ema_ref_decay_flat_steps,
                                    args.ema_ref_decay_ramp,
                                    args.ema_ref_decay_max,
                                ),
                            )
            ratios = stats.pop("ratio_mean")
            diagnostics = {
                "ratio_mean": float(np.mean(ratios)) if ratios else 1.0,
                "ema_ref_decay": get_decay(
                    step,
                    args.ema_ref_decay_start,
                    args.ema_ref_decay_flat_steps,
                    args.ema_ref_decay_ramp,
                    args.ema_ref_decay_max,
                ),
                "reward_std_group": rewards.total(scores).view(-1, args.group_size).std(1, unbiased=False).mean().item(),
            }

        # ---- logging ----
        # TRY NOT TO MODIFY: global means of every metric, at x = images seen; rank 0 writes
        times = timer.pop()
        reward_total = rewards.total(scores)
        metrics = {
            "charts/reward_mean": reward_total.mean(),
            "charts/reward_std": reward_total.std(),
            **{f"charts/{k}": v.mean() for k, v in scores.items()},
            "charts/images_per_sec": args.num_prompts * args.group_size / sum(times.values()),
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            **{f"charts/{k}": v for k, v in diagnostics.items()},
            **{f"losses/{k}": shell.nanmean(v) for k, v in stats.items()},
            **{f"time/{k}": v for k, v in times.items()},
        }
        metrics = {k: shell.all_reduce_mean(torch.tensor(float(v), device=device)).item() for k, v in metrics.items()}
        logger.scalars(metrics, images_seen)
        if dist.is_main and epoch % args.eval_every == 0:
            logger.images(
                "train/images",
                images[:16],
                [f"{p} | {r:.2f}" for p, r in zip(prompts[:16], reward_total[local_idx][:16])],
                images_seen,
            )
        pbar.set_postfix(reward=f"{metrics['charts/reward_mean']:.3g}", loss=f"{metrics['losses/policy_loss']:.3g}")

    # TRY NOT TO MODIFY: final eval, checkpoint, close
    if stopped_at is None:
        shell.evaluate_and_log(args, pipe, encoder, test_prompts, rewards, eval_ema, logger, images_seen, "final eval")
        save(args.num_epochs)
    shell.close(args, dist, run_dir, stopped_at, logger, stop)  # exit 143 after a SIGTERM, for a scheduler


if __name__ == "__main__":
    shell.run_main(main, shell.cli(Args))
