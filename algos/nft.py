"""DiffusionNFT, Zheng et al. 2025, arXiv 2509.16117 -- docs/nft.md

python algos/nft.py                                                    # tiny-shapes on CPU, a few minutes
torchrun --nproc-per-node 8 algos/nft.py --model stabilityai/stable-diffusion-3.5-medium --reward pickscore  # docs/nft.md
"""

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402  (also registers the model families with common)
from harness import flags, shell  # noqa: E402

# --learning-rate's default, by what is trained: every weight (benchmark/results/convergence) or a LoRA
# (benchmark/results/shapes_clean/tuning.md)
LEARNING_RATES = {"full": 1e-4, "lora": 3e-3}


@dataclass
class NFTArgs:
    """DiffusionNFT's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    num_train_timesteps: int = 4
    """T, trained timesteps per micro-batch"""
    timestep_range: float = 0.99
    """train where sigma >= 1 - range"""
    timesteps_per_image: bool = False
    """draw T distinct indices per image, not per micro-batch"""
    adv_clip: float = 5.0
    """advantages are clipped to [-c, c], then mapped to [0, 1]"""
    advantage_std: Literal["group", "global"] = "global"
    """std of the z-score: per group or global"""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """several rewards: z-score their sum, or each first"""
    nft_beta: float = 1.0
    """beta, guidance strength of the implicit policies v+ and v-"""
    adaptive_weighting: bool = True
    """divide each x0 error by its detached mean |error| (sec. 3.3)"""
    off_policy: bool = True
    """roll out with the "old" policy, not the current weights"""
    old_decay_start: float = 0.0
    """decay d of the old policy at first"""
    old_decay_flat_steps: int = 0
    """steps before d starts to ramp"""
    old_decay_ramp: float = 0.02
    """increase of d per optimizer step"""
    old_decay_max: float = 0.5
    """the largest decay d of the old policy"""
    kl_beta: float = 0.0
    """KL weight to the base model"""


@dataclass
class Args(flags.SharedArgs, NFTArgs):
    # DiffusionNFT's flags come first in --help, then the flags every script shares; here, where this script's default
    # or help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate; default 1e-4 (every weight) or 3e-3 (LoRA)"""
    grad_steps_per_epoch: int = 1
    """optimizer steps per epoch"""


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


# ALGO LOGIC: DiffusionNFT's math as small pure functions.
# Conventions: sigma = 1 is noise, x_t = (1 - sigma) x0 + sigma eps, the velocity target is u = eps - x0 and the
# x0 prediction of a velocity v is x0_hat = x_t - sigma v (so x0_hat - x0 = sigma (u - v)).
def optimality_probability(adv: torch.Tensor, clip: float) -> torch.Tensor:
    """r = 0.5 + 0.5 clip(A / c, -1, 1) in [0, 1], the probability that a sample is "positive" (DiffusionNFT
    Algorithm 1, line 5)."""
    return (adv.clamp(-clip, clip) / clip / 2 + 0.5).clamp(0, 1)


def x0_regression(x0_hat, x0, adaptive: bool) -> torch.Tensor:
    """Per-sample mean of (x0_hat - x0)^2; with `adaptive`, divided by sg(mean |x0_hat - x0|) (sec. 3.3).

    The self-normalised form replaces a hand-tuned w(t): as x0_hat - x0 = sigma (u - v), it equals
    sigma ||u - v||^2 / mean|u - v|, a velocity loss whose weight grows with the noise level (the paper finds that
    weighting noisy timesteps more is stabler, sec. 4.4).
    The normaliser is computed in float64 and clamped at 1e-5, as in the official code."""
    err = x0_hat - x0
    loss = err**2
    if adaptive:
        dims = tuple(range(1, err.dim()))
        loss = loss / err.detach().double().abs().mean(dims, keepdim=True).clamp_min(1e-5).to(err.dtype)
    return loss.flatten(1).mean(1)


def nft_loss(v, v_old, x0, xt, sigma, r, beta: float, adaptive: bool):
    """Eq. (5): r ||v+ - u||^2 + (1 - r) ||v- - u||^2, in x0 space, divided by beta (official code); per sample.

    v+ = (1 - beta) v_old + beta v and v- = (1 + beta) v_old - beta v are the implicit positive and negative policies;
    v_old is a constant (no gradient). At v = v_old both branches have the same error, so the gradient is (2r - 1)
    times the plain flow-matching gradient: r > 0.5 pulls v towards the sample, r < 0.5 pushes it away, and the
    optimum is v_old + (2 / beta) Delta, the old policy moved along the reinforcement guidance Delta (Eq. 6).
    Returns (loss [B], positive term [B], negative term [B])."""
    v_old = v_old.detach()
    v_pos = (1 - beta) * v_old + beta * v
    v_neg = (1 + beta) * v_old - beta * v
    pos = x0_regression(xt - sigma * v_pos, x0, adaptive)
    neg = x0_regression(xt - sigma * v_neg, x0, adaptive)
    return (r * pos + (1 - r) * neg) / beta, pos.detach(), neg.detach()


def timestep_indices(
    num_indices: int, count: int, sample_idx, seed: int, epoch: int, micro_batch: int, per_image: bool
) -> torch.Tensor:
    """[B, T] schedule indices for the samples `sample_idx` of one micro-batch: `per_image`, T distinct
    indices per image from its own keyed stream (the official per-image permutation); otherwise the micro-batch's T
    stratified indices, shared by its samples (keyed by the micro-batch, so the same on any rank count)."""
    if per_image:
        gens = common.keyed_generators(seed, epoch, "image-timesteps", indices=sample_idx)
        return torch.stack([torch.randperm(num_indices, generator=g)[:count] for g in gens])
    t_gen = common.keyed_generator(seed, epoch, "timesteps", int(sample_idx[0]) // micro_batch)
    return torch.tensor(common.stratified_indices(num_indices, count, t_gen)).expand(len(sample_idx), count)


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
    if args.nft_beta <= 0:
        raise common.UserError(f"nft_beta ({args.nft_beta}) must be > 0: the loss is divided by it")
    if args.timesteps_per_image and args.num_train_timesteps > args.num_steps:  # the window is checked once sigmas exist
        raise common.UserError(
            f"--num-train-timesteps {args.num_train_timesteps}: --timesteps-per-image draws distinct indices, and only "
            f"{args.num_steps} schedule indices exist"
        )

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: the "old" policy, an EMA of the trained weights: the reference of v+/v-, and the rollout policy if off_policy
    old_snapshot = [p.detach().clone() for p in params]
    snapshots = {"old": old_snapshot}  # saved with every checkpoint
    sigmas = pipe.sigmas(args.num_steps, device, args.sigma_schedule)
    eligible = int((sigmas[:-1] >= 1 - args.timestep_range - 1e-6).sum())
    if args.timesteps_per_image and args.num_train_timesteps > eligible:
        raise common.UserError(
            f"--num-train-timesteps {args.num_train_timesteps}: --timesteps-per-image draws distinct indices, and only "
            f"{eligible} schedule indices are in the window"
        )
    if dist.is_main:
        print(
            f"training timesteps per {'image' if args.timesteps_per_image else 'micro-batch'} T={args.num_train_timesteps}, "
            f"drawn from the {eligible} noisiest of {args.num_steps} steps"
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
            with models.swapped_weights(params, old_snapshot) if args.off_policy else contextlib.nullcontext():
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
            )[local_idx]
            r_opt = optimality_probability(adv, args.adv_clip).to(device)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            stats = {
                name: [] for name in ("policy_loss", "kl_ref", "grad_norm", "positive_loss", "negative_loss", "old_deviate")
            }
            per_step = micro_per_step * args.num_train_timesteps
            k = 0
            train_gens = common.keyed_generators(args.seed, epoch, "train", indices=local_idx)  # one noise stream per sample
            for mb in range(num_micro):
                sl = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                mb_cond = cond[sl]
                idx = timestep_indices(
                    eligible,
                    args.num_train_timesteps,
                    local_idx[sl],
                    args.seed,
                    epoch,
                    args.micro_batch,
                    args.timesteps_per_image,
                )  # [mb, T]
                for j in range(args.num_train_timesteps):
                    eps = common.randn(x0[sl].shape, train_gens[sl]).to(device)
                    s = sigmas[idx[:, j].to(sigmas.device)].view(-1, *([1] * (x0.dim() - 1)))
                    xt = (1 - s) * x0[sl] + s * eps
                    with torch.no_grad(), common.autocast(device, args.mixed_precision):
                        with models.swapped_weights(params, old_snapshot):
                            v_old = common.velocity(transformer, xt, s.flatten(), mb_cond, args.guidance_scale)
                        v_ref = None
                        if args.kl_beta > 0:
                            with models.reference_model(transformer):
                                v_ref = common.velocity(transformer, xt, s.flatten(), mb_cond, args.guidance_scale)
                    with common.autocast(device, args.mixed_precision):
                        v = common.velocity(transformer, xt, s.flatten(), mb_cond, args.guidance_scale)
                    loss_i, pos, negl = nft_loss(v, v_old, x0[sl], xt, s, r_opt[sl], args.nft_beta, args.adaptive_weighting)
                    policy_loss = loss_i.mean() * args.adv_clip  # x c, the official code's (and Flow-Factory's) scale
                    kl = velocity_kl(v, v_ref).mean() if v_ref is not None else torch.zeros((), device=device)
                    loss = policy_loss + args.kl_beta * kl
                    (loss / per_step).backward()
                    old_deviate = (v.detach() - v_old).pow(2).mean()
                    for name, value in (
                        ("policy_loss", policy_loss),
                        ("kl_ref", kl),
                        ("positive_loss", pos.mean()),
                        ("negative_loss", negl.mean()),
                        ("old_deviate", old_deviate),
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

            # ALGO LOGIC: soft update of the old policy once per epoch (Algorithm 1, line 14), its decay indexed by the
            # optimizer step: d = 0 is fully on-policy (fast, unstable), d -> 1 nearly offline (stable, slow); the paper
            # ramps from the first to the second (sec. 3.3, Fig. 8; official code `return_decay`)
            flat_groups = rewards.total(scores).view(-1, args.group_size).std(1) < 1e-8  # r = 0.5 for the whole group
            diagnostics = {
                "old_decay": get_decay(
                    step, args.old_decay_start, args.old_decay_flat_steps, args.old_decay_ramp, args.old_decay_max
                ),
                "zero_std_ratio": flat_groups.float().mean().item(),
                "old_distance": sum((p.detach() - e).pow(2).sum() for p, e in zip(params, old_snapshot)).sqrt().item(),
            }
            update_ema(old_snapshot, params, diagnostics["old_decay"])

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
