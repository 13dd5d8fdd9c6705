"""Flow-GRPO, Liu et al. 2025, arXiv 2505.05470 -- docs/grpo.md

The ODE sampler becomes an SDE with the same marginals (Eq. 8), whose Euler-Maruyama step (Eq. 9, common.sde_step) is
a Gaussian policy with a per-step log-prob; each prompt's K images get group-relative advantages (Eq. 4,
group_advantages) and the policy maximises PPO's clipped surrogate on the per-step ratios minus beta x the KL to the
base (Eq. 5: ppo_loss + kl_beta x step_kl, the KL in closed form below Eq. 9). Equation numbers: arXiv v5.

python algos/grpo.py                                                   # tiny-shapes on CPU, a few minutes
torchrun --nproc-per-node 8 algos/grpo.py --model stabilityai/stable-diffusion-3.5-medium --reward pickscore  # see benchmark/
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

# --learning-rate's default, by what is trained: every weight (benchmark/results/convergence) or a LoRA
# (benchmark/results/shapes_clean/tuning.md)
LEARNING_RATES = {"full": 1e-4, "lora": 5e-4}


@dataclass
class GRPOArgs:
    """Flow-GRPO's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    adv_clip: float = 5.0
    """advantages are clipped to [-c, c]"""
    advantage_std: Literal["group", "global"] = "group"
    """std of the z-score: per group or global"""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """several rewards: z-score their sum, or each first"""
    sde_window: tuple[int, int] = (1, -1)
    """python slice of the step indices that may be stochastic"""
    num_sde_steps: int = 4
    """stochastic (and trained) steps per trajectory"""
    window_mode: Literal["subset", "contiguous"] = "subset"
    """SDE steps of the window: a random subset, or a random run (Flow-GRPO-Fast)"""
    zero_adv_filter: bool = False
    """drop zero-advantage samples from the loss mean"""
    log_prob_form: Literal["gaussian", "mse"] = "gaussian"
    """per-step log-prob: exact Gaussian, or "mse" -||x' - mu||^2"""
    shared_group_noise: bool = True
    """a group's K images share their initial noise"""
    num_inner_epochs: int = 1
    """passes over each rollout buffer"""
    clip_low: float = 1e-3
    """PPO clip below: ratio >= 1 - clip_low"""
    clip_high: float = 1e-3
    """PPO clip above: ratio <= 1 + clip_high"""
    leave_one_out: bool = False
    """RLOO baseline: the mean of the other K-1 rewards"""
    kl_beta: float = 0.0
    """KL weight to the base model"""
    kl_type: Literal["x", "v"] = "x"
    """"x": KL of the Gaussian steps; "v": ||v - v_ref||^2"""
    kl_form: Literal["exact", "official"] = "exact"
    """KL of the steps: exact, or flow_grpo's ("official", x |dt|)"""


@dataclass
class Args(flags.SharedArgs, GRPOArgs):
    # Flow-GRPO's flags come first in --help, then the flags every script shares; here, where this script's default
    # or help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    num_epochs: int = 40
    """epochs; one epoch = one rollout of M x K images + its updates"""
    dynamics: Literal["ODE", "Flow-SDE", "Dance-SDE", "CPS"] = "Flow-SDE"
    """rollout dynamics (GRPO needs an SDE)"""
    full_finetune: bool = False
    """train every transformer weight (fp32), no LoRA; off by default: GRPO then loses on tiny-shapes"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate; default 1e-4 (every weight) or 5e-4 (LoRA)"""
    grad_steps_per_epoch: int = 2
    """optimizer steps per inner epoch"""


# ALGO LOGIC: the group-relative advantage, the same function in every file that forms one (tests/test_skeleton.py)
# added to the std of the z-score, as flow_grpo does (flow_grpo/stat_tracking.py: np.std(...) + 1e-4): a group whose
# rewards differ only by float32 rounding (~1e-7) would otherwise be scaled up to advantages of +-1 (Flow-Factory's
# floor max(std, 1e-6) still lets a reward of scale 20 do that: its float32 spacing is 2e-6)
STD_EPS = 1e-4


def group_advantages(
    rewards: torch.Tensor, group_size: int, std: str = "group", leave_one_out: bool = False, clip: Optional[float] = None
) -> torch.Tensor:
    """Group-relative advantages for rewards laid out as contiguous groups of K ([B] with B = M K).

    A_i = (r_i - baseline_i) / scale. baseline: the group mean, or with `leave_one_out` the mean of the other K-1
    samples (RLOO). scale: the group's population std (`std="group"`), the std over all samples (`"global"`), each
    plus STD_EPS. A group whose rewards are all equal gets advantage 0 (never NaN), and a nearly
    flat one (differences at float rounding) gets advantages near 0, not +-1. Then optional clip to [-c, c].
    """
    r = rewards.double().view(-1, group_size)
    if leave_one_out:
        if group_size < 2:
            raise common.UserError("leave-one-out advantages need a group size >= 2")
        baseline = (r.sum(1, keepdim=True) - r) / (group_size - 1)
    else:
        baseline = r.mean(1, keepdim=True)
    centred = r - baseline
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
    leave_one_out: bool = False,
    clip: Optional[float] = None,
) -> torch.Tensor:
    """Several rewards -> one advantage per sample.

    "sum": advantages of the weighted sum of rewards (classic GRPO). "gdpo": each reward normalised within its
    groups first, then the weighted sum of those is normalised over the whole batch, so a reward with a large
    scale cannot drown the others.
    """
    if aggregation == "sum":
        total = sum(w * scores[k] for k, w in weights.items())
        return group_advantages(total, group_size, std, leave_one_out, clip)
    if aggregation == "gdpo":
        combined = sum(w * group_advantages(scores[k], group_size, "group", leave_one_out) for k, w in weights.items())
        combined = (combined - combined.mean()) / (combined.std(unbiased=False) + STD_EPS)  # as the group path
        return combined.clamp(-clip, clip) if clip is not None else combined
    raise common.UserError(f"unknown advantage aggregation {aggregation!r}; choose sum or gdpo")


# ALGO LOGIC: Flow-GRPO's math as small pure functions
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


def gaussian_kl(mean, mean_ref, std) -> torch.Tensor:
    """KL(N(mean, std^2) || N(mean_ref, std^2)) per element, averaged per sample (same std: only the means differ)."""
    return ((mean - mean_ref) ** 2 / (2 * std**2)).flatten(1).mean(1)


def step_kl(mean, mean_ref, std, dt: float, form: str = "exact", dynamics: str = "Flow-SDE") -> torch.Tensor:
    """The per-sample KL penalty of one stochastic step whose std is `std`. "exact": `gaussian_kl`. "official":
    flow_grpo's ||mu - mu_ref||^2 / (2 std_dev_t^2) (scripts/train_sd3.py), where std_dev_t is what its
    sde_step_with_logprob returns: for an SDE the diffusion coefficient sigma_t = std / sqrt(|dt|), so official =
    exact x |dt| (its beta 0.04, 0.01 is tuned on this; at the same beta the exact KL is 1/|dt| times stronger); for
    CPS the step's own std sigma_next sin(eta pi / 2), so official = exact (no |dt| there)."""
    kl = gaussian_kl(mean, mean_ref, std)
    return kl * abs(dt) if form == "official" and dynamics != "CPS" else kl


def zero_adv_weights(adv: torch.Tensor, grad_steps: int) -> torch.Tensor:
    """[total] weights that drop samples with advantage exactly 0 from the mean of their optimizer step (official
    flow_grpo filters them out of the batch): kept / (kept share of the step), 0 for a step with nothing kept."""
    kept = (adv != 0).float().view(grad_steps, -1)
    return (kept * kept.shape[1] / kept.sum(1, keepdim=True).clamp_min(1)).view(-1)


def sde_window_steps(window: list, count: int, mode: str, generator: torch.Generator) -> list:
    """The epoch's stochastic steps: `count` of `window`, a random subset ("subset"), or a run of consecutive steps
    with a uniformly random start ("contiguous", official Flow-GRPO-Fast's sde_window_size inside sde_window_range)."""
    if mode == "contiguous":
        start = int(torch.randint(len(window) - count + 1, (1,), generator=generator))
        return window[start : start + count]
    return sorted(window[i] for i in torch.randperm(len(window), generator=generator)[:count])


def main(args: Args):
    # TRY NOT TO MODIFY: the run folder (a resumed run's flags restored), the ranks, the seeds
    run_dir, ckpt, dist = shell.start(args, __file__)
    device = dist.device

    # ALGO LOGIC: flag checks that need no model, so a bad one fails before the model loads
    if args.dynamics == "ODE":
        raise common.UserError(
            "Flow-GRPO needs per-step log-probs: choose a stochastic --dynamics (Flow-SDE, Dance-SDE or CPS)"
        )
    window = list(range(args.num_steps))[slice(*args.sde_window)]
    if args.dynamics == "CPS":  # CPS has std = 0 at the last step (sigma_next = 0): it cannot be a Gaussian policy step
        window = [i for i in window if i < args.num_steps - 1]
    if not 1 <= args.num_sde_steps <= len(window):
        raise common.UserError(
            f"num_sde_steps ({args.num_sde_steps}) must be between 1 and the SDE window size ({len(window)}: steps {window})"
        )

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: the state a checkpoint must carry beyond weights and optimizer
    snapshots = {}  # GRPO keeps no snapshot: old log-probs come from the rollout itself
    if dist.is_main:
        print(
            f"trained SDE steps per trajectory={args.num_sde_steps} of the window {window}, "
            f"PPO inner epochs={args.num_inner_epochs}"
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
            # the same steps of the window on every rank (prompt_gen is shared), Flow-GRPO-Fast style
            sde_steps = sde_window_steps(window, args.num_sde_steps, args.window_mode, prompt_gen)
            init_keys = local_idx // args.group_size if args.shared_group_noise else local_idx
            noise = common.randn(
                (local_samples, *pipe.latent_shape), common.keyed_generators(args.seed, epoch, "init", indices=init_keys)
            )
            rollout = common.sample(
                transformer,
                pipe.scheduler,
                cond,
                num_steps=args.num_steps,
                noise=noise,
                guidance_scale=args.guidance_scale,
                dynamics=args.dynamics,
                eta=args.eta,
                sde_steps=sde_steps,
                generator=common.keyed_generators(args.seed, epoch, "rollout", indices=local_idx),
                keep_trajectory=True,
                latent_shape=pipe.latent_shape,
                use_autocast=args.mixed_precision,
                schedule=args.sigma_schedule,
                log_prob_form=args.log_prob_form,
                chunk=scorer.chunk,
                on_chunk=scorer,
            )
            sigmas = rollout.sigmas

        # ---- reward ----
        with timer("reward"):
            # each rank scores its own images (during sampling: --overlap-reward); advantages use the whole epoch's batch
            images, local_scores = scorer.result()
            scores = shell.gather_scores(local_scores, total, args.grad_steps_per_epoch)
            adv = aggregate_advantages(
                scores,
                rewards.weights,
                args.group_size,
                args.advantage_aggregation,
                args.advantage_std,
                leave_one_out=args.leave_one_out,
                clip=args.adv_clip,
            )
            weight = zero_adv_weights(adv, args.grad_steps_per_epoch)[local_idx].to(device) if args.zero_adv_filter else None
            adv = adv[local_idx].to(device)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            stats = {"policy_loss": [], "kl_ref": [], "grad_norm": [], "approx_kl": [], "clipfrac": [], "ratio_mean": []}
            per_step = micro_per_step * len(sde_steps)
            k = 0
            for inner in range(args.num_inner_epochs):
                for mb in range(num_micro):  # contiguous micro-batches (prompts arrive in random order), as on any rank count
                    sl = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                    mb_cond = cond[sl]
                    for i in sde_steps:
                        x, x_next = rollout.trajectory[sl, i], rollout.trajectory[sl, i + 1]
                        with common.autocast(device, args.mixed_precision):
                            v = common.velocity(transformer, x, sigmas[i], mb_cond, args.guidance_scale)
                        # old log-probs come from the rollout and are never recomputed: exactly PPO's ratio
                        # Eq. 9's Gaussian step: its log-prob at the rollout's x_next
                        _, log_prob, mean, std = common.sde_step(
                            x,
                            v,
                            sigmas[i],
                            sigmas[i + 1],
                            args.dynamics,
                            args.eta,
                            x_next=x_next,
                            sigma_cap=float(sigmas[1]),
                            log_prob_form=args.log_prob_form,
                        )
                        old_log_prob, mb_weight = rollout.log_probs[sl, i], None if weight is None else weight[sl]
                        policy_loss, ratio, approx_kl, clipfrac = ppo_loss(
                            log_prob, old_log_prob, adv[sl], args.clip_low, args.clip_high, mb_weight
                        )
                        kl = torch.zeros((), device=device)
                        if args.kl_beta > 0:
                            with (
                                torch.no_grad(),
                                models.reference_model(transformer),
                                common.autocast(device, args.mixed_precision),
                            ):
                                v_ref = common.velocity(transformer, x, sigmas[i], mb_cond, args.guidance_scale)
                            if args.kl_type == "x":
                                _, _, mean_ref, _ = common.sde_step(
                                    x,
                                    v_ref,
                                    sigmas[i],
                                    sigmas[i + 1],
                                    args.dynamics,
                                    args.eta,
                                    x_next=x_next,
                                    sigma_cap=float(sigmas[1]),
                                )
                                kl = step_kl(
                                    mean, mean_ref, std, float(sigmas[i] - sigmas[i + 1]), args.kl_form, args.dynamics
                                )
                            else:
                                kl = velocity_kl(v, v_ref)
                            kl = (kl if weight is None else weight[sl] * kl).mean()  # filtered samples leave the KL too
                        loss = policy_loss + args.kl_beta * kl  # Eq. 5, minimised
                        (loss / per_step).backward()
                        for name, value in (
                            ("policy_loss", policy_loss),
                            ("kl_ref", kl),
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
            diagnostics = {"ratio_mean": float(np.mean(stats.pop("ratio_mean"))), "sde_steps_mean": float(np.mean(sde_steps))}

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
