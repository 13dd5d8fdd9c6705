"""Flow-GRPO's variants, each a paper's change to algos/grpo.py (Flow-GRPO, arXiv 2505.05470) -- docs/grpo.md

MixGRPO (arXiv 2507.21802): --window-mode sliding --window-shift TAU S, the SDE steps a window that slides over time.
TempFlow-GRPO (arXiv 2508.04324): --noise-weight C, each step's policy term weighted by C x the step's std.
Flow-DPPO (arXiv 2606.11025): --kl-mask TAU, a per-step KL trust-region mask in place of PPO's ratio clip (Eq. 14, 18).
Pref-GRPO (arXiv 2508.20751): --win-rate-reward, an image's reward is its win rate inside its group.
GRPO-Guard (arXiv 2510.22319): --grpo-guard, RatioNorm of the log-ratio (and --guard-reweight, 1 / |dt| per step).
Flow-GRPO's flags and math are grpo.py's, imported from it (`grpo.GRPOArgs`, `grpo.ppo_loss`, ...), so this file holds
only what the five papers change; with none of these switches the run is grpo.py's, number for number (tested).

python algos/grpo_variants.py --window-mode sliding --window-shift 25 1          # MixGRPO on tiny-shapes, CPU
torchrun --nproc-per-node 8 algos/grpo_variants.py --model stabilityai/stable-diffusion-3.5-medium --kl-mask 1e-5  # Flow-DPPO
"""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402  (also registers the model families with common)
from algos import grpo  # noqa: E402  (Flow-GRPO: its flags, advantages, PPO loss and KL)
from harness import flags, shell  # noqa: E402

LEARNING_RATES = grpo.LEARNING_RATES  # --learning-rate's default: grpo.py's


@dataclass
class VariantArgs:
    """The five papers' switches, first in --help; then Flow-GRPO's flags (grpo.GRPOArgs) and the shared ones"""

    window_shift: tuple[int, int] = (25, 1)
    """MixGRPO, with --window-mode sliding: tau s, move the run s steps later every tau epochs (MixGRPO: 25 1)"""
    noise_weight: float = 0.0
    """TempFlow-GRPO: a step's policy loss x c x its std (0 = off; official 2.25)"""
    kl_mask: float = 0.0
    """Flow-DPPO: KL threshold of the mask that replaces the clip (0 = PPO clip)"""
    win_rate_reward: bool = False
    """Pref-GRPO: an image's reward is its win rate against the rest of its group"""
    grpo_guard: bool = False
    """GRPO-Guard RatioNorm of the log-ratio (arXiv 2510.22319)"""
    guard_reweight: bool = True
    """with grpo_guard: weight each step's loss by 1 / |dt|"""


@dataclass
class Args(flags.SharedArgs, grpo.GRPOArgs, VariantArgs):
    # the variants' flags come first in --help, then Flow-GRPO's, then the flags every script shares; here, where this
    # script's default or help differs from theirs (a dataclass keeps a field where its first declaration put it)
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    window_mode: Literal["subset", "contiguous", "sliding"] = "subset"
    """SDE steps of the window: random subset, random run, sliding run (MixGRPO)"""
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


# ALGO LOGIC: the five papers' changes to Flow-GRPO as small pure functions
def group_win_rates(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pref-GRPO's reward (arXiv 2508.20751): each image's win rate inside its group of K, [B] for rewards in contiguous
    groups. Every pair of the group is compared once, a win counting 1 and a tie 1/2 to each (as the official
    _pairwise_win_rate), over the K - 1 comparisons of an image. The paper asks a pairwise preference model which image
    of a pair is better; here the reward's scores are compared. Only the order inside the group is kept: how far apart
    the scores are, an outlier or the reward's scale no longer set the advantages (but two near-equal scores are still
    ordered: the pairwise model, not the win rate, is what lets the paper call them a tie)."""
    r = rewards.double().view(-1, group_size)
    diff = r[:, :, None] - r[:, None, :]  # [G, K, K]: image i against image j of its group
    wins = (diff > 0).double().sum(2) + 0.5 * (diff == 0).double().sum(2) - 0.5  # minus the self-comparison's tie
    return (wins / (group_size - 1)).view(-1).float()


def kl_mask_loss(log_prob, old_log_prob, mean, old_mean, std, adv, threshold: float, weight=None):
    """Flow-DPPO's surrogate (arXiv 2606.11025): PPO's ratio without the clip, each term dropped when its step left the
    trust region in the direction it is pushed. Returns (loss, ratio, approx_kl, maskfrac), maskfrac = share dropped.

    The rollout's step and the current one are Gaussians of the same std s, so their KL is exact (Eq. 14), here the
    per-element mean D = mean (mu - mu_old)^2 / (2 s^2) as in the official code (its threshold 1e-5 is on this scale).
    A term is dropped when D >= threshold and it moves further away: r > 1 with A > 0, or r < 1 with A < 0 (Eq. 18);
    a step back towards the rollout policy, or any step inside the region, keeps its gradient."""
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    kl = grpo.gaussian_kl(mean.detach(), old_mean, std)  # Eq. 14, per sample
    away = ((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0))
    drop = ((kl >= threshold) & away).detach()  # Eq. 18
    terms = torch.where(drop, torch.zeros_like(ratio), -adv * ratio)
    loss = (terms if weight is None else weight * terms).mean()
    approx_kl = 0.5 * (log_ratio.detach() ** 2).mean()
    return loss, ratio.detach(), approx_kl, drop.float().mean()


def guard_log_ratio(log_prob, old_log_prob, mean, old_mean, std) -> torch.Tensor:
    """GRPO-Guard's RatioNorm (arXiv 2510.22319): (log p - log p_old + ||mu - mu_old||^2 / (2 std^2)) std, per sample.

    For a Gaussian step x' = mu_old + std z the plain log-ratio is (z.(mu - mu_old) / std - ||mu - mu_old||^2 / (2 std^2))
    per element: its mean is negative (ratios sit below 1, so clip_high rarely binds on positive samples) and its spread
    1/std differs by step. Removing the bias and multiplying by std leaves z.(mu - mu_old), centred at 0 with the
    same scale at every step."""
    bias = ((mean - old_mean) ** 2).flatten(1).mean(1) / (2 * std.reshape(-1) ** 2)
    return (log_prob - old_log_prob + bias) * std.reshape(-1)


def noise_weights(std: torch.Tensor, batch: int, scale: float) -> torch.Tensor:
    """TempFlow-GRPO's noise-aware weighting (arXiv 2508.04324): [batch] weights c s of one step's policy term, where s is
    the step's std (Flow-SDE: s = sigma_t sqrt(|dt|)), so the high-noise early steps, where a perturbation changes the
    image most, get the larger steps. The official code multiplies the PPO terms, not the KL, by 2.25 s in its
    trajectory-branching script (scripts/train_sd3_pr.py; the s its sde_step_with_logprob returns is std_dev_t
    sqrt(-dt), the step's std; its train_sd3.py keeps Flow-GRPO's loss). 2.25 is 1 / the mean of s over the 9 steps
    that script trains (SD3.5, 10 steps of the scheduler's schedule, eta 0.7; the last step is not trained): the weights
    average 1 over the trained steps, the normalisation the paper's weighting is described with.
    Another schedule, eta or window needs its own c for mean 1."""
    std = std.reshape(-1).float()
    return scale * (std.expand(batch) if std.numel() == 1 else std)


def sde_window_steps(
    window: list, count: int, mode: str, generator: torch.Generator, epoch: int = 0, shift: tuple = (25, 1)
) -> list:
    """The epoch's stochastic steps: `count` of `window`, a random subset ("subset"), a run of consecutive steps with
    a uniformly random start ("contiguous", official Flow-GRPO-Fast's sde_window_size inside sde_window_range), or
    MixGRPO's sliding window ("sliding", arXiv 2507.21802; official fastvideo/utils/grpo_states.py, strategy
    "progressive" with --roll_back, as UniRL's WindowScheduler): the run starts at the window's first step and moves
    `stride` steps later every `interval` epochs, back to the start once it would leave the window. Sliding draws
    nothing from `generator`: the run depends on the epoch alone, so a resume continues it."""
    if mode == "sliding":
        interval, stride = shift
        starts = (len(window) - count) // stride + 1  # l = 0, s, 2s, ... while the run of `count` fits
        start = (epoch // interval) % starts * stride
        return window[start : start + count]
    return grpo.sde_window_steps(window, count, mode, generator)


def main(args: Args):
    # TRY NOT TO MODIFY: the run folder (a resumed run's flags restored), the ranks, the seeds
    run_dir, ckpt, dist = shell.start(args, __file__)
    device = dist.device

    # ALGO LOGIC: flag checks that need no model, so a bad one fails before the model loads
    if args.dynamics == "ODE":
        raise common.UserError(
            "Flow-GRPO needs per-step log-probs: choose a stochastic --dynamics (Flow-SDE, Dance-SDE or CPS)"
        )
    if args.grpo_guard and args.log_prob_form != "gaussian":
        raise common.UserError("--grpo-guard normalises Gaussian log-ratios: it needs --log-prob-form gaussian")
    window = list(range(args.num_steps))[slice(*args.sde_window)]
    if args.dynamics == "CPS":  # CPS has std = 0 at the last step (sigma_next = 0): it cannot be a Gaussian policy step
        window = [i for i in window if i < args.num_steps - 1]
    if not 1 <= args.num_sde_steps <= len(window):
        raise common.UserError(
            f"num_sde_steps ({args.num_sde_steps}) must be between 1 and the SDE window size ({len(window)}: steps {window})"
        )
    if args.win_rate_reward and args.advantage_aggregation == "gdpo":
        raise common.UserError(
            "--win-rate-reward ranks the weighted sum of the rewards, --advantage-aggregation gdpo normalises each reward"
            " first: pick one"
        )
    if args.kl_mask < 0:
        raise common.UserError(f"--kl-mask {args.kl_mask}: must be >= 0 (0 = PPO's ratio clip)")
    if args.kl_mask > 0 and args.grpo_guard:
        raise common.UserError("--kl-mask replaces the ratio clip that --grpo-guard normalises: pick one")
    if args.kl_mask > 0 and shell.given_flags(args) & {"clip_low", "clip_high"}:
        raise common.UserError("--clip-low/--clip-high: --kl-mask replaces PPO's clip, so they would be unused; drop them")
    if args.noise_weight < 0:
        raise common.UserError(f"--noise-weight {args.noise_weight}: must be >= 0 (0 = off)")
    if args.noise_weight > 0 and args.grpo_guard and args.guard_reweight:
        raise common.UserError("--noise-weight and --grpo-guard's --guard-reweight both weight the steps: pick one")
    if "window_shift" in shell.given_flags(args) and args.window_mode != "sliding":
        raise common.UserError("--window-shift moves the sliding window: pass --window-mode sliding too, or drop it")
    if min(args.window_shift) < 1:
        raise common.UserError(f"--window-shift {' '.join(map(str, args.window_shift))}: tau and s must be >= 1")

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
            sde_steps = sde_window_steps(window, args.num_sde_steps, args.window_mode, prompt_gen, epoch, args.window_shift)
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
                keep_means=args.grpo_guard or args.kl_mask > 0,
                chunk=scorer.chunk,
                on_chunk=scorer,
            )
            sigmas = rollout.sigmas

        # ---- reward ----
        with timer("reward"):
            # each rank scores its own images (during sampling: --overlap-reward); advantages use the whole epoch's batch
            images, local_scores = scorer.result()
            scores = shell.gather_scores(local_scores, total, args.grad_steps_per_epoch)
            adv_scores, adv_weights = scores, rewards.weights
            if args.win_rate_reward:  # Pref-GRPO: the group win rate of the weighted reward is the reward
                adv_scores, adv_weights = (
                    {"win_rate": group_win_rates(rewards.total(scores), args.group_size)},
                    {"win_rate": 1},
                )
            adv = grpo.aggregate_advantages(
                adv_scores,
                adv_weights,
                args.group_size,
                args.advantage_aggregation,
                args.advantage_std,
                leave_one_out=args.leave_one_out,
                clip=args.adv_clip,
            )
            weight = (
                grpo.zero_adv_weights(adv, args.grad_steps_per_epoch)[local_idx].to(device) if args.zero_adv_filter else None
            )
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
                        old_log_prob = rollout.log_probs[sl, i]
                        if args.grpo_guard:  # RatioNorm: the ratio is exp(guard_log_ratio), PPO-clipped as usual
                            log_prob = guard_log_ratio(log_prob, old_log_prob, mean, rollout.means[sl, i], std)
                            old_log_prob = torch.zeros_like(log_prob)
                        step_weight = None if weight is None else weight[sl]
                        if args.noise_weight > 0:  # TempFlow-GRPO: the policy term scaled by c x the step's std
                            nw = noise_weights(std, x.shape[0], args.noise_weight)
                            step_weight = nw if step_weight is None else step_weight * nw
                        if args.kl_mask > 0:  # Flow-DPPO: the KL trust-region mask instead of the clip
                            policy_loss, ratio, approx_kl, clipfrac = kl_mask_loss(
                                log_prob, old_log_prob, mean, rollout.means[sl, i], std, adv[sl], args.kl_mask, step_weight
                            )
                        else:
                            policy_loss, ratio, approx_kl, clipfrac = grpo.ppo_loss(
                                log_prob, old_log_prob, adv[sl], args.clip_low, args.clip_high, step_weight
                            )
                        if args.grpo_guard and args.guard_reweight:  # equal gradient scale across noise levels
                            policy_loss = policy_loss / float(sigmas[i] - sigmas[i + 1])
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
                                kl = grpo.step_kl(
                                    mean, mean_ref, std, float(sigmas[i] - sigmas[i + 1]), args.kl_form, args.dynamics
                                )
                            else:
                                kl = grpo.velocity_kl(v, v_ref)
                            kl = (kl if weight is None else weight[sl] * kl).mean()  # filtered samples leave the KL too
                        loss = policy_loss + args.kl_beta * kl  # Flow-GRPO's Eq. 5, minimised
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
