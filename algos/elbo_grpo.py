"""ELBO-GRPO: GRPO on the flow-matching ELBO of the final sample, ODE rollouts. "Rethinking the Design Space of RL for
Diffusion Models" (Choi et al., ICML 2026, arXiv 2602.04663) and V-GRPO (Tang et al., arXiv 2604.23380) -- docs/elbo_grpo.md

python algos/elbo_grpo.py                                              # tiny-shapes on CPU, a few minutes
torchrun --nproc-per-node 8 algos/elbo_grpo.py --model stabilityai/stable-diffusion-3.5-medium --reward pickscore  # benchmark/
"""

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

# --learning-rate's default, by what is trained. Every weight: 3e-5, not AWM's 1e-4: at 1e-4 one step moves the ELBO
# log-ratio ~30x the papers' clip and tiny-shapes-8 comes apart; 3e-5 learns it and is level or better on tiny-shapes
# and OCR (convergence README, legs 13 and 15). LoRA: AWM's, not re-measured
LEARNING_RATES = {"full": 3e-5, "lora": 1e-3}


@dataclass
class ELBOGRPOArgs:
    """ELBO-GRPO's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    num_train_timesteps: int = 4
    """T, (t, eps) draws of the ELBO per image"""
    timestep_range: float = 0.99
    """draw t where sigma >= 1 - range"""
    adv_clip: float = 5.0
    """advantages are clipped to [-c, c]"""
    advantage_std: Literal["group", "global"] = "group"
    """std of the z-score: per group or global"""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """several rewards: z-score their sum, or each first"""
    elbo_weighting: Literal["adaptive", "uniform", "t", "exact"] = "adaptive"
    """w(t) of the ELBO estimate (Eq. 3)"""
    shared_group_noise: bool = True
    """the K images of a prompt share their (t, eps) draws (V-GRPO)"""
    clip_low: float = 1e-3
    """PPO clip below: ratio >= 1 - clip_low (Eq. 5)"""
    clip_high: float = 1e-3
    """PPO clip above: ratio <= 1 + clip_high (Eq. 5)"""
    kl_beta: float = 0.0
    """beta, KL weight to the base model (Eq. 6)"""


@dataclass
class Args(flags.SharedArgs, ELBOGRPOArgs):
    # ELBO-GRPO's flags come first in --help, then the flags every script shares; here, where this script's default
    # or help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    dynamics: Literal["ODE", "Flow-SDE", "Dance-SDE", "CPS"] = "ODE"
    """rollout dynamics (the papers: ODE; the ELBO needs only x0)"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate; default 3e-5 (every weight) or 1e-3 (LoRA)"""
    grad_steps_per_epoch: int = 1
    """optimizer steps per epoch (1: ratio 1, as the papers' configs)"""


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


# ALGO LOGIC: the ELBO surrogate and its clipped ratio as small pure functions (equations numbered in docs/elbo_grpo.md)
def elbo(v, v_target, sigma, weighting: str) -> torch.Tensor:
    """One-draw estimate of the flow-matching ELBO of the clean sample x0, per sample, in float64 (Eq. 2):
    -w(t) mean over latent elements of (v(x_t, t) - u)^2, with x_t = (1 - t) x0 + t eps and u = eps - x0, up to a
    constant that does not depend on the weights (Eq. 1). `sigma` is t, a float or a [B] tensor.

    w(t) (Eq. 3, the Rethinking code's `compute_elbo`): "uniform" 1 (the plain flow-matching loss); "t" t^2 (the error of
    x0_hat = x_t - t v, since x0_hat - x0 = t (u - v)); "exact" (1 - t) / (t + 1e-3); "adaptive" (their default) the
    x0_hat error divided by its own mean absolute value, held constant (no gradient), floored at 1e-5: every sample and
    t then contributes on the same scale. Higher = x0 is more likely under v. Mean over elements, not a sum, so log-ratios
    are per element and the clip range is ~1e-3 (as Flow-Factory's per-step log-probs)."""
    err = v.double() - v_target.double()
    t = torch.as_tensor(sigma, dtype=torch.float64, device=err.device).reshape(-1, *([1] * (err.dim() - 1)))
    if weighting == "uniform":
        return -err.pow(2).flatten(1).mean(1)
    if weighting == "t":
        return -(t * err).pow(2).flatten(1).mean(1)
    if weighting == "exact":
        return -((1 - t) / (t + 1e-3) * err.pow(2)).flatten(1).mean(1)
    if weighting == "adaptive":
        x0_err = (t * err).flatten(1)
        scale = x0_err.detach().abs().mean(1).clamp_min(1e-5)
        return -x0_err.pow(2).mean(1) / scale
    raise common.UserError(f"unknown ELBO weighting {weighting!r}; choose adaptive, uniform, t or exact")


def timestep_indices(num_indices: int, count: int, keys, seed: int, epoch: int) -> torch.Tensor:
    """[B, T] schedule indices in [0, num_indices): T stratified indices per key (V-GRPO's stratified timestep
    sampling), each key's own stream keyed by (seed, epoch, key), so the draw does not depend on the rank count, the
    micro-batch or a resume. Keys are group indices (the K images of a prompt share their timesteps) or sample indices."""
    gens = common.keyed_generators(seed, epoch, "timesteps", indices=keys)
    return torch.tensor([common.stratified_indices(num_indices, count, g) for g in gens])


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


def main(args: Args):
    # TRY NOT TO MODIFY: the run folder (a resumed run's flags restored), the ranks, the seeds
    run_dir, ckpt, dist = shell.start(args, __file__)
    device = dist.device

    # ALGO LOGIC: flag checks that need no model, so a bad one fails before the model loads
    if not 0 < args.timestep_range <= 1:
        raise common.UserError(
            f"--timestep-range {args.timestep_range}: must be in (0, 1] (t is drawn where sigma >= 1 - range)"
        )

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: the state a checkpoint must carry beyond weights and optimizer, and the window of training timesteps
    snapshots = {}  # no snapshot: the old ELBOs come from the rollout's own weights, computed before the epoch's updates
    sigmas = pipe.sigmas(args.num_steps, device, args.sigma_schedule)
    eligible = int((sigmas[:-1] >= 1 - args.timestep_range - 1e-6).sum())
    if eligible < 1:
        raise common.UserError(f"--timestep-range {args.timestep_range}: leaves no schedule index to train on")
    if dist.is_main:
        print(
            f"ELBO draws per image T={args.num_train_timesteps} ({args.elbo_weighting} weighting), t from steps "
            f"0..{eligible - 1} of {args.num_steps} (sigma {sigmas[eligible - 1]:.3f}..{sigmas[0]:.3f}), "
            f"{'shared by each group' if args.shared_group_noise else 'per image'}"
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
            x0 = rollout.latents  # the ELBO needs only the clean samples: no trajectory, no per-step log-probs

        # ---- reward ----
        with timer("reward"):
            # each rank scores its own images (during sampling: --overlap-reward); advantages use the whole epoch's batch
            images, local_scores = scorer.result()
            scores = shell.gather_scores(local_scores, total, args.grad_steps_per_epoch)
            adv = aggregate_advantages(  # Eq. 7: GRPO's group-relative advantage (grpo.py's, without RLOO)
                scores, rewards.weights, args.group_size, args.advantage_aggregation, args.advantage_std, clip=args.adv_clip
            )[local_idx].to(device)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            # pass 1 (no grad): T draws (t, eps) per image and the old ELBOs under the rollout's weights (Eq. 2), plus the
            # base velocities of the KL, for every micro-batch before any update: the ratio compares the moved policy
            # with the one that sampled x0, at the very same (t, eps) (Eq. 4). Draws are keyed by the global group (or
            # sample) index and micro-batches are contiguous, so any rank count computes the same thing.
            keys = local_idx // args.group_size if args.shared_group_noise else local_idx
            idx = timestep_indices(eligible, args.num_train_timesteps, keys, args.seed, epoch)  # [B, T]
            train_gens = common.keyed_generators(args.seed, epoch, "train", indices=keys)  # one noise stream per image
            batches = []
            for mb in range(num_micro):
                sl = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                mb_cond = cond[sl]
                for j in range(args.num_train_timesteps):
                    eps = common.randn(x0[sl].shape, train_gens[sl]).to(device)  # a group's streams draw alike
                    s = sigmas[idx[sl, j].to(sigmas.device)]  # [mb]
                    st = s.view(-1, *([1] * (x0.dim() - 1)))
                    xt = (1 - st) * x0[sl] + st * eps
                    v_target = eps - x0[sl]
                    v_ref = None
                    with torch.no_grad(), common.autocast(device, args.mixed_precision):
                        if args.kl_beta > 0:
                            with models.reference_model(transformer):
                                v_ref = common.velocity(transformer, xt, s, mb_cond, args.guidance_scale)
                        v_old = common.velocity(transformer, xt, s, mb_cond, args.guidance_scale)
                    old_elbo = elbo(v_old, v_target, s, args.elbo_weighting)  # old = the rollout's weights, never updated
                    batches.append((mb_cond, sl, s, xt, v_target, old_elbo, v_ref))

            # pass 2: the clipped ELBO-ratio surrogate plus the KL to the base, grad_steps_per_epoch optimizer steps
            stats = {
                name: [] for name in ("policy_loss", "kl_ref", "grad_norm", "approx_kl", "clipfrac", "ratio_mean", "elbo")
            }
            per_step = micro_per_step * args.num_train_timesteps
            k = 0
            for mb_cond, sl, s, xt, v_target, old_elbo, v_ref in batches:
                with common.autocast(device, args.mixed_precision):
                    v = common.velocity(transformer, xt, s, mb_cond, args.guidance_scale)
                new_elbo = elbo(v, v_target, s, args.elbo_weighting)
                # Eq. 4-5: r = exp(ELBO_theta - ELBO_old), PPO-clipped; at r = 1 the gradient is -A grad ELBO
                policy_loss, ratio, approx_kl, clipfrac = ppo_loss(new_elbo, old_elbo, adv[sl], args.clip_low, args.clip_high)
                kl = velocity_kl(v, v_ref).mean() if v_ref is not None else torch.zeros((), device=device)  # Eq. 6
                loss = policy_loss + args.kl_beta * kl
                (loss / per_step).backward()
                for name, value in (
                    ("policy_loss", policy_loss),
                    ("kl_ref", kl),
                    ("approx_kl", approx_kl),
                    ("clipfrac", clipfrac),
                    ("ratio_mean", ratio.mean()),
                    ("elbo", new_elbo.detach().mean()),
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
            diagnostics = {"ratio_mean": float(np.mean(stats.pop("ratio_mean"))), "elbo": float(np.mean(stats.pop("elbo")))}

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
