"""Centered Reward Distillation (CRD), Zhu et al. 2026, arXiv 2603.14128 -- docs/crd.md

KL-regularised reward maximisation makes log(p / p_ref) = r / beta - log Z(c): CRD regresses an implicit reward (the
velocity-error gap to an "old" snapshot) onto the advantage, both centred within a prompt's group, where log Z(c)
cancels, plus a KL to the CFG-guided base. Equations are not numbered here: only the paper's abstract was available;
the math follows the first author's implementation (Flow-Factory PR #121).

python algos/crd.py                                                    # tiny-shapes on CPU, a few minutes
torchrun --nproc-per-node 8 algos/crd.py --model stabilityai/stable-diffusion-3.5-medium --reward ocr  # see benchmark/
"""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

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
class CRDArgs:
    """CRD's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    num_train_timesteps: int = 4
    """T, trained timesteps per micro-batch"""
    timestep_range: float = 0.99
    """train where sigma >= 1 - range"""
    adv_clip: float = 5.0
    """advantages are clipped to [-c, c], then mapped to [0, 1]"""
    advantage_std: Literal["group", "global"] = "global"
    """std of the z-score: per group or global"""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """several rewards: z-score their sum, or each first"""
    crd_beta: float = 1.0
    """beta, scale of the implicit reward matched to the advantage"""
    loss_type: Literal["mse", "bce"] = "mse"
    """matching loss between centred implicit reward and advantage"""
    weight_temp: float = -1.0
    """tau of the centring weights: <0 mean, >0 softmax, 0 hard pools"""
    centering: Literal["group", "batch"] = "group"
    """centre within each prompt's group or over the micro-batch"""
    adaptive_weighting: bool = True
    """divide each velocity error by its detached mean |error|"""
    use_old_for_loss: bool = True
    """implicit reward relative to the "old" snapshot, else the base"""
    old_decay_start: float = 0.25
    """decay d of the old snapshot at first"""
    old_decay_flat_steps: int = 0
    """steps before d starts to ramp"""
    old_decay_ramp: float = 0.005
    """increase of d per optimizer step"""
    old_decay_max: float = 0.999
    """the largest decay d of the old snapshot"""
    sampling_decay_start: float = 0.0
    """decay d of the sampling snapshot at first"""
    sampling_decay_flat_steps: int = 75
    """steps before d starts to ramp"""
    sampling_decay_ramp: float = 0.0075
    """increase of d per optimizer step"""
    sampling_decay_max: float = 0.999
    """the largest decay d of the sampling snapshot"""
    kl_beta: float = 1.0
    """KL weight to the CFG-guided base model at reward 1"""
    kl_cfg: float = 4.5
    """CFG scale of the base model inside the KL term"""
    kl_adaptive: Literal["batch", "sample", "advantage", "none"] = "batch"
    """KL strength from kl_floor to kl_beta, following the reward"""
    kl_floor: float = 1e-4
    """KL weight at reward 0"""


@dataclass
class Args(flags.SharedArgs, CRDArgs):
    # CRD's flags come first in --help, then the flags every script shares; here, where this script's default
    # or help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate; default 1e-4 (every weight) or 1e-3 (LoRA)"""
    micro_batch: int = 16
    """per-rank micro-batch (whole groups, for within-prompt centring)"""


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


# ALGO LOGIC: CRD's math as small pure functions
def optimality_probability(adv: torch.Tensor, clip: float) -> torch.Tensor:
    """r = 0.5 + 0.5 clip(A / c, -1, 1) in [0, 1], the probability that a sample is "positive" (DiffusionNFT
    Algorithm 1, line 5)."""
    return (adv.clamp(-clip, clip) / clip / 2 + 0.5).clamp(0, 1)


def implicit_reward(v, v_anchor, v_target, adaptive: bool) -> torch.Tensor:
    """r_theta = -(||v - u||^2 - ||v_anchor - u||^2), per sample: the implicit log-ratio p_theta / p_anchor in velocity
    space, the anchor being the old snapshot (the paper) or the frozen base model (--no-use-old-for-loss).

    With `adaptive`, each squared error is divided by its own detached mean absolute error, so samples and timesteps
    with large errors do not dominate (DiffusionNFT's adaptive weighting)."""
    err, err_old = (v - v_target) ** 2, (v_anchor - v_target) ** 2
    if adaptive:
        dims = tuple(range(1, v.dim()))
        err = err / (v - v_target).abs().mean(dims, keepdim=True).clamp_min(1e-5).detach()
        err_old = err_old / (v_anchor - v_target).abs().mean(dims, keepdim=True).clamp_min(1e-5)
    return -(err - err_old).flatten(1).mean(1)


def centring_weights(a: torch.Tensor, weight_temp: float):
    """Weights (positive side, negative side) over one centring set of [0, 1] advantages a.

    tau < 0: one uniform mean. tau > 0: softmax(a / tau) and softmax(-a / tau), i.e. centres pulled towards the best
    and the worst samples. tau == 0: uniform over the samples above / below the set's mean advantage (Flow-Factory
    tested a > 0 after mapping a to [0, 1], which selects everything; we pool on the centred advantage)."""
    n = a.shape[0]
    uniform = torch.full_like(a, 1.0 / n)
    if weight_temp < 0:
        return uniform, None
    if weight_temp > 0:
        return torch.softmax(a / weight_temp, 0), torch.softmax(-a / weight_temp, 0)
    ac = a - a.mean()
    pools = []
    for mask in (ac > 1e-8, ac < -1e-8):
        pools.append(mask.float() / mask.sum() if mask.any() else uniform)
    return pools[0], pools[1]


def matching_loss(r_c, a_c, loss_type: str) -> torch.Tensor:
    if loss_type == "mse":
        return (r_c - a_c) ** 2
    return F.binary_cross_entropy_with_logits(r_c, torch.sigmoid(a_c), reduction="none")


def crd_loss(r_theta, a, set_size: int, beta: float, loss_type: str, weight_temp: float) -> torch.Tensor:
    """Centred reward matching: within each centring set S, match beta (r_i - c_S(r)) to a_i - c_S(a).

    The centre c_S(r) is detached: centring cancels the prompt-dependent log Z(c) of the optimal policy without
    letting the set's mean implicit reward drift. `set_size` = K for within-prompt centring, B for batch centring."""
    losses = []
    for r_s, a_s in zip(r_theta.split(set_size), a.split(set_size)):
        for w in centring_weights(a_s, weight_temp):
            if w is None:
                continue
            r_c = beta * (r_s - (w * r_s).sum().detach())
            a_c = a_s - (w * a_s).sum()
            losses.append(matching_loss(r_c, a_c, loss_type).mean() * (1.0 if weight_temp < 0 else 0.5))
    return torch.stack(losses).sum() / (r_theta.shape[0] / set_size)


def kl_weight(reward, a, kl_beta: float, floor: float, mode: str) -> torch.Tensor:
    """Per-sample KL weight [B]: floor + level (kl_beta - floor), level in [0, 1] (CRD's reward-adaptive KL strength).

    The paper motivates it as weak KL while rewards are low (fast early learning) and strong once they are high
    (less late exploitation of reward-model loopholes), so the level is the reward: the epoch's mean reward ("batch")
    or each sample's ("sample"). Flow-Factory feeds the [0, 1]-mapped group advantage `a` instead ("advantage"), whose
    mean is 0.5 at every stage of training, so its strength never adapts; kept for parity with that code."""
    if mode == "none":
        return torch.full_like(a, kl_beta)
    level = {"batch": reward.mean().expand_as(a), "sample": reward, "advantage": a}[mode].clamp(0, 1)
    floor = min(floor, kl_beta)
    return floor + level * (kl_beta - floor)


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation; NaN when either side is constant (e.g. a batch of zero-variance groups)."""
    x, y = x - x.mean(), y - y.mean()
    denom = (x.norm() * y.norm()).item()
    return (x * y).sum().item() / denom if denom > 1e-12 else float("nan")


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
    if args.centering == "group" and args.micro_batch % args.group_size:
        raise common.UserError(
            f"micro_batch ({args.micro_batch}) must hold whole groups "
            f"(a multiple of group_size {args.group_size}) for within-prompt centring"
        )

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: the "old" snapshot (implicit-reward reference) and the "sampling" snapshot (rollout policy)
    old_snapshot = [p.detach().clone() for p in params]
    sampling_snapshot = [p.detach().clone() for p in params]
    snapshots = {"old": old_snapshot, "sampling": sampling_snapshot}  # saved with every checkpoint
    sigmas = pipe.sigmas(args.num_steps, device, args.sigma_schedule)
    eligible = int((sigmas[:-1] >= 1 - args.timestep_range - 1e-6).sum())
    if dist.is_main:
        print(
            f"training timesteps per micro-batch T={args.num_train_timesteps}, "
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
            with models.swapped_weights(params, sampling_snapshot):
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
            )
            a_all = optimality_probability(adv, args.adv_clip)
            kl_w = kl_weight(rewards.total(scores), a_all, args.kl_beta, args.kl_floor, args.kl_adaptive)[local_idx].to(device)
            a = a_all[local_idx].to(device)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            # pass 1 (no grad): timesteps, noise, and the velocities of the old snapshot and the CFG-guided base,
            # all computed before any update so every micro-batch of the epoch sees the same old model
            batches = []
            train_gens = common.keyed_generators(args.seed, epoch, "train", indices=local_idx)  # one noise stream per sample
            for mb in range(num_micro):
                sl = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                t_gen = common.keyed_generator(args.seed, epoch, "timesteps", int(local_idx[sl.start]) // args.micro_batch)
                for i in common.stratified_indices(eligible, args.num_train_timesteps, t_gen):
                    eps = common.randn(x0[sl].shape, train_gens[sl]).to(device)
                    s = sigmas[i]
                    xt = (1 - s) * x0[sl] + s * eps
                    mb_cond = cond[sl]
                    with torch.no_grad(), common.autocast(device, args.mixed_precision):
                        with models.reference_model(transformer):
                            v_ref = common.velocity(transformer, xt, s, mb_cond, args.kl_cfg) if args.kl_beta > 0 else None
                            if not args.use_old_for_loss:
                                v_anchor = common.velocity(transformer, xt, s, mb_cond, args.guidance_scale)
                        if args.use_old_for_loss:
                            with models.swapped_weights(params, old_snapshot):
                                v_anchor = common.velocity(transformer, xt, s, mb_cond, args.guidance_scale)
                    batches.append((sl, s, xt, eps - x0[sl], v_anchor, v_ref))

            # pass 2: the centred reward-matching loss, grad_steps_per_epoch optimizer steps
            stats = {"policy_loss": [], "kl_ref": [], "grad_norm": [], "implicit_reward_corr": []}
            per_step = micro_per_step * args.num_train_timesteps
            set_size = args.group_size if args.centering == "group" else args.micro_batch
            k = 0
            for sl, s, xt, v_target, v_anchor, v_ref in batches:
                with common.autocast(device, args.mixed_precision):
                    v = common.velocity(transformer, xt, s, cond[sl], args.guidance_scale)
                r_theta = implicit_reward(v, v_anchor, v_target, args.adaptive_weighting)
                policy_loss = crd_loss(r_theta, a[sl], set_size, args.crd_beta, args.loss_type, args.weight_temp)
                policy_loss = policy_loss * args.adv_clip / max(args.crd_beta, 1e-8)  # Flow-Factory's scale: x c / beta
                kl = (kl_w[sl] * velocity_kl(v, v_ref)).mean() if v_ref is not None else torch.zeros((), device=device)
                loss = policy_loss + kl
                (loss / per_step).backward()
                stats["policy_loss"].append(policy_loss.item())
                stats["kl_ref"].append(kl.item())
                stats["implicit_reward_corr"].append(correlation(r_theta.detach(), a[sl]))
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

            # ALGO LOGIC: snapshot updates, indexed by the optimizer step (as in the authors' Flow-Factory code)
            diagnostics = {
                "old_decay": get_decay(
                    step, args.old_decay_start, args.old_decay_flat_steps, args.old_decay_ramp, args.old_decay_max
                ),
                "sampling_decay": get_decay(
                    step,
                    args.sampling_decay_start,
                    args.sampling_decay_flat_steps,
                    args.sampling_decay_ramp,
                    args.sampling_decay_max,
                ),
                "kl_weight": kl_w.mean().item(),
            }
            update_ema(old_snapshot, params, diagnostics["old_decay"])
            update_ema(sampling_snapshot, params, diagnostics["sampling_decay"])

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
