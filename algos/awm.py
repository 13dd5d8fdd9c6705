"""Advantage Weighted Matching (AWM), Xue et al. 2025, arXiv 2509.25050 -- docs/awm.md

DDPO's policy gradient is flow matching with noisy targets; AWM keeps pretraining's flow-matching loss on each clean
rollout sample as a pseudo log-likelihood and weights it by the sample's advantage (in a PPO-style ratio, optionally),
plus a KL to the base. Equations are not numbered here: the paper's text was not available, only its abstract and the
official code (scxue/advantage_weighted_matching), which the math follows.

python algos/awm.py                                                    # tiny-shapes on CPU, a few minutes
torchrun --nproc-per-node 8 algos/awm.py --model stabilityai/stable-diffusion-3.5-medium --reward pickscore  # benchmark/
"""

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402  (also registers the model families with common)
from harness import flags, shell  # noqa: E402

# --learning-rate's default, by what is trained: every weight (benchmark/results/convergence) or a LoRA
# (benchmark/results/shapes_clean/tuning.md)
LEARNING_RATES = {"full": 1e-4, "lora": 1e-3}


@dataclass
class AWMArgs:
    """AWM's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    num_train_timesteps: int = 4
    """T, trained timesteps per micro-batch"""
    timestep_range: float = 0.9
    """train where sigma >= 1 - range"""
    adv_clip: float = 5.0
    """advantages are clipped to [-c, c], then scaled by advantage_max / c"""
    advantage_std: Literal["group", "global"] = "global"
    """std of the z-score: per group or global"""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """several rewards: z-score their sum, or each first"""
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"
    """pseudo log-likelihood from the FM error l (sigma-weighted forms)"""
    ghuber_power: float = 0.25
    """p of the generalised-Huber weighting"""
    advantage_max: float = 1.0
    """the clipped advantage is scaled by advantage_max / adv_clip"""
    skip_pure_noise: bool = False
    """never train at sigma = 1"""
    clip_low: float = 1.0
    """PPO clip below: ratio >= 1 - clip_low"""
    clip_high: float = 1.0
    """PPO clip above: ratio <= 1 + clip_high"""
    kl_beta: float = 0.1
    """KL weight to the base model (docs/awm.md: why 0.1 on the tiny models; the papers' 1e-4 to 3e-3 in sd35_awm.sh)"""
    ema_kl_beta: float = 0.0
    """KL weight to the EMA of the policy, ||v - v_ema||^2"""
    ema_decay_start: float = 0.0
    """decay d of the EMA at first"""
    ema_decay_flat_steps: int = 0
    """steps before d starts to ramp"""
    ema_decay_ramp: float = 0.001
    """increase of d per optimizer step"""
    ema_decay_max: float = 0.3
    """the largest decay d of the EMA"""
    off_policy: bool = False
    """roll out (and take old log-likelihoods) with the EMA, not the current weights"""


@dataclass
class Args(flags.SharedArgs, AWMArgs):
    # AWM's flags come first in --help, then the flags every script shares; here, where this script's default
    # or help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate; default 1e-4 (every weight) or 1e-3 (LoRA)"""


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


# ALGO LOGIC: AWM's math as small pure functions
def fm_error(v, v_target) -> torch.Tensor:
    """l = mean over latent elements of (v - u)^2, u = eps - x0 the flow-matching target; per sample, in float64
    (the official code computes the pseudo log-likelihood in float64: ratios of exp(-l) need the precision)."""
    return (v.double() - v_target.double()).pow(2).flatten(1).mean(1)


def pseudo_log_prob(v, v_target, sigma, weighting: str, power: float = 0.25) -> torch.Tensor:
    """AWM's pseudo log-likelihood log p_theta(x0 | c) ~ -w(l, sigma): the flow-matching error of the clean sample x0,
    noised with fresh eps to x_t = (1 - sigma) x0 + sigma eps (sigma = 1 is noise), against the target u = eps - x0,
    with one of the paper's weightings (official `compute_log_prob_awm`; Flow-Factory `compute_weighted_log_prob`).
    Higher = x0 is more likely under v_theta.

    huber and ghuber grow sub-linearly in l, so samples the model already fits badly do not dominate the gradient;
    the 1e-10 keeps their gradient finite at l = 0 and the offsets make w(0) = 0. `sigma` is a float or a [B] tensor."""
    lp = -fm_error(v, v_target)
    sigma = torch.as_tensor(sigma, dtype=torch.float64, device=lp.device)
    if weighting == "uniform":
        return lp
    if weighting == "t":
        return lp * sigma
    if weighting == "t2":
        return lp * sigma**2
    if weighting == "huber":
        return -(torch.sqrt(-lp + 1e-10) - 1e-5) * sigma
    if weighting == "ghuber":
        return -((-lp + 1e-10) ** power - 1e-10**power) * sigma / power
    raise common.UserError(f"unknown weighting {weighting!r}; choose uniform, t, t2, huber or ghuber")


def scale_advantages(adv: torch.Tensor, clip: float, advantage_max: float) -> torch.Tensor:
    """Clip to [-c, c], then rescale to [-advantage_max, advantage_max] (official code: A / adv_clip_max * advantage_max)."""
    return adv.clamp(-clip, clip) / clip * advantage_max


def ppo_loss(log_prob, old_log_prob, adv, clip_low: float, clip_high: float, weight=None):
    """PPO's clipped surrogate on the likelihood ratio r = exp(log p - log p_old):
    mean_i max(-A_i r_i, -A_i clip(r_i, 1 - eps_low, 1 + eps_high)).

    `weight` [B] multiplies each sample's term inside the mean. Returns (loss, ratio, approx_kl, clipfrac);
    approx_kl = E[(log r)^2] / 2, clipfrac = share of clipped ratios."""
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    terms = torch.maximum(unclipped, clipped)
    loss = (terms if weight is None else weight * terms).mean()
    approx_kl = 0.5 * (log_ratio.detach() ** 2).mean()
    clipfrac = ((ratio.detach() < 1 - clip_low) | (ratio.detach() > 1 + clip_high)).float().mean()
    return loss, ratio.detach(), approx_kl, clipfrac


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

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: the EMA (KL trust region, optional off-policy sampler) and the trainable timestep indices
    ema = [p.detach().clone() for p in params]
    snapshots = {"ema": ema}  # saved with every checkpoint
    sigmas = pipe.sigmas(args.num_steps, device, args.sigma_schedule)
    eligible = int((sigmas[:-1] >= 1 - args.timestep_range - 1e-6).sum())
    min_index = 1 if args.skip_pure_noise else 0
    if eligible - min_index < 1:
        raise common.UserError(f"timestep_range ({args.timestep_range}) leaves no schedule index to train on")
    if dist.is_main:
        print(
            f"training timesteps per micro-batch T={args.num_train_timesteps}, drawn from steps {min_index}..{eligible - 1} "
            f"of {args.num_steps} (sigma {sigmas[eligible - 1]:.3f}..{sigmas[min_index]:.3f})"
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
            with models.swapped_weights(params, ema) if args.off_policy else contextlib.nullcontext():
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
            x0 = rollout.latents  # only the clean samples are kept: training re-noises them

        # ---- reward ----
        with timer("reward"):
            # each rank scores its own images (during sampling: --overlap-reward); advantages use the whole epoch's batch
            images, local_scores = scorer.result()
            scores = shell.gather_scores(local_scores, total, args.grad_steps_per_epoch)
            adv = aggregate_advantages(
                scores, rewards.weights, args.group_size, args.advantage_aggregation, args.advantage_std, clip=args.adv_clip
            )[local_idx]
            adv = scale_advantages(adv, args.adv_clip, args.advantage_max).to(device)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            # pass 1 (no grad): timesteps, fresh noise, and the old pseudo log-likelihoods under the sampling policy
            # (plus the base / EMA velocities of the KL terms), for every micro-batch before any update: from the second
            # optimizer step of the epoch on, the ratio compares the moved policy with the sampler. Micro-batches are
            # contiguous (the prompts already arrive in random order), so any rank count computes the same thing.
            train_gens = common.keyed_generators(args.seed, epoch, "train", indices=local_idx)  # one noise stream per sample
            batches = []
            for mb in range(num_micro):
                sl = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                mb_cond = cond[sl]
                t_gen = common.keyed_generator(args.seed, epoch, "timesteps", int(local_idx[sl.start]) // args.micro_batch)
                for i in common.stratified_indices(eligible - min_index, args.num_train_timesteps, t_gen):
                    s = sigmas[min_index + i]
                    eps = common.randn(x0[sl].shape, train_gens[sl]).to(device)
                    xt = (1 - s) * x0[sl] + s * eps
                    v_target = eps - x0[sl]
                    v_ref = v_ema = None
                    with torch.no_grad(), common.autocast(device, args.mixed_precision):
                        if args.kl_beta > 0:
                            with models.reference_model(transformer):
                                v_ref = common.velocity(transformer, xt, s, mb_cond, args.guidance_scale)
                        if args.ema_kl_beta > 0 or args.off_policy:
                            with models.swapped_weights(params, ema):
                                v_ema = common.velocity(transformer, xt, s, mb_cond, args.guidance_scale)
                        v_sampler = (
                            v_ema if args.off_policy else common.velocity(transformer, xt, s, mb_cond, args.guidance_scale)
                        )
                    old_lp = pseudo_log_prob(v_sampler, v_target, s, args.weighting, args.ghuber_power)
                    batches.append((mb_cond, sl, s, xt, v_target, old_lp, v_ref, v_ema if args.ema_kl_beta > 0 else None))

            # pass 2: the clipped advantage-weighted matching loss, grad_steps_per_epoch optimizer steps
            stats = {
                name: []
                for name in ("policy_loss", "kl_ref", "kl_ema", "fm_loss", "grad_norm", "approx_kl", "clipfrac", "ratio_mean")
            }
            per_step = micro_per_step * args.num_train_timesteps
            k = 0
            for mb_cond, sl, s, xt, v_target, old_lp, v_ref, v_ema in batches:
                with common.autocast(device, args.mixed_precision):
                    v = common.velocity(transformer, xt, s, mb_cond, args.guidance_scale)
                log_prob = pseudo_log_prob(v, v_target, s, args.weighting, args.ghuber_power)
                # at r = 1 the gradient is -A grad log p: an advantage-weighted flow-matching loss (A > 0 lowers the error)
                policy_loss, ratio, approx_kl, clipfrac = ppo_loss(log_prob, old_lp, adv[sl], args.clip_low, args.clip_high)
                kl = velocity_kl(v, v_ref).mean() if v_ref is not None else torch.zeros((), device=device)
                kl_ema = velocity_kl(v, v_ema).mean() if v_ema is not None else torch.zeros((), device=device)
                loss = policy_loss + args.kl_beta * kl + args.ema_kl_beta * kl_ema
                (loss / per_step).backward()
                fm_loss = fm_error(v.detach(), v_target).mean()  # unweighted, a drift diagnostic
                for name, value in (
                    ("policy_loss", policy_loss),
                    ("kl_ref", kl),
                    ("kl_ema", kl_ema),
                    ("fm_loss", fm_loss),
                    ("approx_kl", approx_kl),
                    ("clipfrac", clipfrac),
                    ("ratio_mean", ratio.mean()),
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

            # ALGO LOGIC: the EMA update, once per epoch, its decay indexed by the optimizer step (official "linear"
            # kl_ema_decay_type): the EMA starts as a copy of the latest weights and slowly gains memory
            diagnostics = {
                "ratio_mean": float(np.mean(stats.pop("ratio_mean"))),
                "ema_decay": get_decay(
                    step, args.ema_decay_start, args.ema_decay_flat_steps, args.ema_decay_ramp, args.ema_decay_max
                ),
            }
            update_ema(ema, params, diagnostics["ema_decay"])

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
