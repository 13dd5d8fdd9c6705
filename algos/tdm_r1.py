"""TDM-R1: RL on a few-step generator with a non-differentiable reward (Luo et al., arXiv 2603.07700) -- docs/tdm_r1.md

A few-step generator (dmd2.py's export) cannot be trained by a policy gradient of its deterministic few-step sampler,
and the reward has no gradient. TDM-R1 turns the reward into a score: a surrogate diffusion model (initialised from the
base) learns, with DGPO's group preference loss on the generator's own samples and their group-relative advantages,
to prefer the better images of each group; the difference between its prediction and the base's at a re-noised
generator sample is then a direction of higher reward, and the generator is pulled along it. Distribution matching
(DMD2's real score minus a fake score fitted online) keeps it on the teacher's distribution meanwhile. Three networks
train together: the generator, the fake score, the surrogate reward model. Equations are not numbered here: only the
abstract was available; the losses follow the authors' code (scripts/train_tdmr1_pub.py).

python algos/tdm_r1.py                                                 # tiny-shapes on CPU: RL on the committed 2-step model
python algos/tdm_r1.py --generator runs/<dmd2 run>                    # on your own few-step model
"""

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402  (also registers the model families with common)
from harness import flags, shell  # noqa: E402

# --learning-rate's default (the generator's): every weight; the fake score and the surrogate learn 4x faster, the
# authors' ratio (3e-4 against 7.5e-5). 1e-4 for all three pulled extra objects in within 1,280 images (docs/tdm_r1.md)
LEARNING_RATES = {"full": 3e-5, "lora": 2.5e-4}
AUX_LR_RATIO = 4.0


@dataclass
class TDMR1Args:
    """TDM-R1's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    generator: flags.RepoPath = str(common.REPO / "benchmark" / "results" / "convergence" / "few_step" / "dmd2__s1")
    """the few-step model RL starts from: a run folder of dmd2.py (its transformer/ or lora/ export)"""
    adv_clip: float = 5.0
    """advantages are clipped to [-c, c]"""
    advantage_std: Literal["group", "global"] = "global"
    """std of the z-score: per group or global (the authors' global)"""
    rl_weight: float = 0.7
    """weight of the reward pull, x0 + (x0_reward - x0_base), in the generator's loss"""
    kl_weight: float = 1.0
    """weight of the distribution-matching pull, x0 + (x0_real - x0_fake)"""
    real_guidance_scale: float = 4.5
    """CFG scale of the real score (the base) in the distribution-matching pull"""
    reward_guidance_scale: float = 4.5
    """CFG scale of the surrogate reward model and of the base in the reward pull"""
    reward_beta: float = 10.0
    """beta of the surrogate's DGPO group preference"""
    reward_kl: float = 0.1
    """weight of ||v_reward - v_base||^2 in the surrogate's loss (the authors' 0.001 let it drift: docs/tdm_r1.md)"""
    aux_learning_rate: flags.OptionalFloat = None
    """AdamW learning rate of the fake score and the surrogate; default 4 x learning_rate"""
    min_sigma: float = 0.02
    """re-noising sigma ~ U(min_sigma, max_sigma) for every network"""
    max_sigma: float = 0.98
    """see min_sigma"""


@dataclass
class Args(flags.SharedArgs, TDMR1Args):
    # TDM-R1's flags come first in --help, then the flags every script shares; here, where this script's default or
    # help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    num_steps: int = 2
    """N, the generator's sampling steps (its dmd2.py run's)"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate of the generator; default 3e-5 (every weight)"""
    num_epochs: int = 40
    """epochs; one epoch = M x K few-step samples + one update of each network per optimizer step"""
    micro_batch: int = 16
    """per-rank micro-batch (whole groups, for the surrogate's group preference)"""


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


def velocity_kl(v, v_ref) -> torch.Tensor:
    """||v - v_ref||^2 per sample (mean over latent elements), the velocity-space KL surrogate: two Gaussian steps of
    the same std whose means come from v and v_ref differ in mean by a multiple of v - v_ref, so their KL is a multiple
    of this."""
    return (v - v_ref).pow(2).flatten(1).mean(1)


# ALGO LOGIC: TDM-R1's math as small pure functions. Conventions: sigma = 1 is noise, x_t = (1 - sigma) x0 + sigma eps,
# v ~ eps - x0, so a velocity v at x_t predicts x0_hat = x_t - sigma v.
def predicted_x0(x, sigma, v) -> torch.Tensor:
    return x - sigma * v


def renoise(x0, eps, sigma) -> torch.Tensor:
    """x_sigma = (1 - sigma) x0 + sigma eps, per-sample sigma [B]."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0 + s * eps


def fm_error(v, x0, eps) -> torch.Tensor:
    """||v - (eps - x0)||^2 per sample, mean over latent elements: the flow-matching (denoising) error."""
    return (v - (eps - x0)).pow(2).flatten(1).mean(1)


def surrogate_loss(err, err_ref, adv, group_size: int, beta: float) -> tuple:
    """DGPO's group preference in its gradient-equivalent form (dgpo.py's dgpo_loss): mean_i sigmoid(z_g) A_i err_i,
    z_g = beta / K sum_{i in g} A_i (err_i - err_ref_i) detached. The surrogate lowers its denoising error on a group's
    better samples and raises it on the worse, so that its score leans towards the reward; z_g < 0 once it prefers a
    group's better samples more than the base does. Returns (loss, z [groups])."""
    z = (adv * beta * (err.detach() - err_ref) / group_size).view(-1, group_size).sum(1).detach()
    return (torch.sigmoid(z).repeat_interleave(group_size) * adv * err).mean(), z


def pull(x0, delta, weight) -> torch.Tensor:
    """0.5 mean (x0 - sg(x0 + delta))^2 / weight: a loss whose gradient moves x0 along delta (per sample divided by its
    `weight`, DMD's normaliser mean |x0 - x0_real|), the form TDM-R1 gives each of its targets."""
    w = weight.view(-1, *([1] * (x0.dim() - 1)))
    return 0.5 * ((x0 - (x0 + delta).detach()).pow(2) / w).mean()


def normaliser(x0, x0_real) -> torch.Tensor:
    return (x0 - x0_real).abs().flatten(1).mean(1).clamp_min(1e-5).detach()


def load_generator(run: str, named: dict, args):
    """The few-step model's weights (a dmd2.py run's export) into the trained parameters: its transformer/ into every
    weight (--full-finetune), or its lora/ into a LoRA of the same rank, alpha and targets; its run's step count must be
    this run's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path, kind = Path(run), "transformer" if args.full_finetune else "lora"
    if not (path / kind).is_dir():
        other = "--no-full-finetune" if kind == "transformer" else "--full-finetune"
        raise common.UserError(f"--generator {run}: no {kind}/ export in it (its run trained {other[2:]}: pass {other})")
    try:
        saved = json.loads((path / "args.json").read_text()) if (path / "args.json").is_file() else {}
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise common.UserError(f"--generator {run}: its args.json cannot be read ({type(e).__name__})")
    if not isinstance(saved, dict):
        raise common.UserError(f"--generator {run}: its args.json is not a JSON object")
    if saved.get("num_steps", args.num_steps) != args.num_steps:
        raise common.UserError(
            f"--generator {run} samples at {saved['num_steps']} steps; pass --num-steps {saved['num_steps']}"
        )
    for flag in ("lora_rank", "lora_alpha", "lora_targets") if kind == "lora" else ():
        if flag in saved and saved[flag] != getattr(args, flag):
            raise common.UserError(f"--generator {run} has --{flag.replace('_', '-')} {saved[flag]}: pass the same")
    try:
        state = {k: v for f in sorted((path / kind).glob("*.safetensors")) for k, v in load_file(f).items()}
    except (OSError, SafetensorError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise common.UserError(f"--generator {run}: its {kind} weights cannot be read ({first})")
    if (
        kind == "lora"
    ):  # diffusers' file names transformer.<module>.lora_A.weight; peft's parameter <module>.lora_A.default.weight
        state = {k.removeprefix("transformer.").replace(".weight", ".default.weight"): v for k, v in state.items()}
    if not set(named) <= set(state) or any(state[n].shape != p.shape for n, p in named.items()):
        raise common.UserError(f"--generator {run}: its {kind} weights do not fit --model's transformer")
    with torch.no_grad():  # a full export also holds the buffers (SD3's positional embedding): the parameters only
        for name, p in named.items():
            p.copy_(state[name])


def main(args: Args):
    # TRY NOT TO MODIFY: the run folder (a resumed run's flags restored), the ranks, the seeds
    run_dir, ckpt, dist = shell.start(args, __file__)
    device = dist.device

    # ALGO LOGIC: flag checks that need no model, so a bad one fails before the model loads
    if not args.generator:
        raise common.UserError("--generator: name the few-step model to start from (a run folder of dmd2.py)")
    if not any((Path(args.generator) / kind).is_dir() for kind in ("transformer", "lora")):
        raise common.UserError(f"--generator {args.generator}: no transformer/ or lora/ export in it (a dmd2.py run)")
    if not 0 < args.min_sigma <= args.max_sigma < 1:
        raise common.UserError(f"--min-sigma {args.min_sigma} / --max-sigma {args.max_sigma}: need 0 < min <= max < 1")
    if args.micro_batch % args.group_size:
        raise common.UserError(
            f"micro_batch ({args.micro_batch}) must hold whole groups (a multiple of group_size {args.group_size}) "
            "for the surrogate's group preference"
        )
    if args.fsdp:
        raise common.UserError("--fsdp: tdm_r1.py keeps two more trained networks that are not sharded yet")
    if (
        args.full_finetune is not None
        and not (Path(args.generator) / ("transformer" if args.full_finetune else "lora")).is_dir()
    ):
        given = "--full-finetune" if args.full_finetune else "--no-full-finetune"
        raise common.UserError(f"{given}: --generator {args.generator} holds no such export; drop {given}")

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: the fake score and the surrogate reward model, copies of the base, trained in the one optimizer (groups
    # 2 and 3, so a checkpoint holds their moments) and saved as snapshots; then the generator's few-step weights
    fake, surrogate = copy.deepcopy(transformer), copy.deepcopy(transformer)
    fake_params = [p for p in fake.parameters() if p.requires_grad]
    surrogate_params = [p for p in surrogate.parameters() if p.requires_grad]
    aux_lr = AUX_LR_RATIO * args.learning_rate if args.aux_learning_rate is None else args.aux_learning_rate
    optimizer.add_param_group({"params": fake_params, "lr": aux_lr})
    optimizer.add_param_group({"params": surrogate_params, "lr": aux_lr})
    snapshots = {"fake": fake_params, "surrogate": surrogate_params}
    load_generator(args.generator, named, args)
    sigmas = pipe.sigmas(args.num_steps, device, args.sigma_schedule)

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
            # K few-step samples per prompt, every state kept: each sample's step k ~ U{0..N-1} is where the generator
            # is trained (DMD2's backward simulation), its final image is what the reward scores
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
                generator=common.keyed_generators(args.seed, epoch, "rollout", indices=local_idx),
                keep_trajectory=True,
                latent_shape=pipe.latent_shape,
                use_autocast=args.mixed_precision,
                schedule=args.sigma_schedule,
                chunk=scorer.chunk,
                on_chunk=scorer,
            )
            steps = torch.randint(args.num_steps, (total,), generator=common.keyed_generator(args.seed, epoch, "steps"))
            steps = steps[local_idx]
            states = rollout.trajectory[torch.arange(len(local_idx)), steps].to(device)
            step_sigmas = sigmas[steps.to(device)]
            x0_final = rollout.latents

        # ---- reward ----
        with timer("reward"):
            images, local_scores = scorer.result()
            scores = shell.gather_scores(local_scores, total, args.grad_steps_per_epoch)
            adv = group_advantages(rewards.total(scores), args.group_size, args.advantage_std, clip=args.adv_clip)
            adv = adv[local_idx].to(device)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            stats = {
                "policy_loss": [],
                "fake_loss": [],
                "surrogate_loss": [],
                "surrogate_z": [],
                "grad_norm": [],
                "rl_pull": [],
                "kl_pull": [],
            }
            noise_gens = common.keyed_generators(args.seed, epoch, "renoise", indices=local_idx)
            group_gens = common.keyed_generators(
                args.seed, epoch, "group", indices=sorted({int(i) // args.group_size for i in local_idx})
            )
            micro = [slice(m * args.micro_batch, (m + 1) * args.micro_batch) for m in range(num_micro)]
            per_step = micro_per_step

            def renoised(sl, x0):  # a fresh (sigma, eps) per sample from its own stream: the same on any rank count
                u = torch.stack([torch.rand((), generator=g) for g in noise_gens[sl]])
                sigma = (args.min_sigma + (args.max_sigma - args.min_sigma) * u).to(device)
                eps = common.randn(x0.shape, noise_gens[sl]).to(device)
                return renoise(x0, eps, sigma), sigma, eps

            def generated(sl):  # the generator's clean prediction from each sample's state x_k
                with common.autocast(device, args.mixed_precision):
                    v = common.velocity(transformer, states[sl], step_sigmas[sl], cond[sl], args.guidance_scale)
                return predicted_x0(states[sl], step_sigmas[sl].view(-1, *[1] * (v.dim() - 1)), v.float())

            def velocity(model, xt, sigma, sl, cfg):  # no grad
                with torch.no_grad(), common.autocast(device, args.mixed_precision):
                    return common.velocity(model, xt, sigma, cond[sl], cfg).float()

            with torch.no_grad():
                x0_gen = torch.cat([generated(sl) for sl in micro])
            for i in range(args.grad_steps_per_epoch):
                # the fake score (flow matching on the generator's samples) and the surrogate reward model (DGPO on the
                # final samples, one (sigma, eps) per group), one optimizer step each, before the generator's step
                for sl in micro[i * per_step : (i + 1) * per_step]:
                    xt, sigma, eps = renoised(sl, x0_gen[sl])
                    with common.autocast(device, args.mixed_precision):
                        err_fake = fm_error(common.velocity(fake, xt, sigma, cond[sl], 1.0).float(), x0_gen[sl], eps)
                    (err_fake.mean() / per_step).backward()
                    stats["fake_loss"].append(err_fake.mean().item())
                    gens = group_gens[sl.start // args.group_size : sl.stop // args.group_size]
                    u = torch.stack([torch.rand((), generator=g) for g in gens]).repeat_interleave(args.group_size)
                    sigma = (args.min_sigma + (args.max_sigma - args.min_sigma) * u).to(device)
                    eps = common.randn((len(gens), *x0_final.shape[1:]), gens).repeat_interleave(args.group_size, 0).to(device)
                    x0 = x0_final[sl].to(device)
                    xt = renoise(x0, eps, sigma)
                    with models.reference_model(transformer):
                        v_base = velocity(transformer, xt, sigma, sl, 1.0)
                    with common.autocast(device, args.mixed_precision):
                        v_rew = common.velocity(surrogate, xt, sigma, cond[sl], 1.0).float()
                    err, err_ref = fm_error(v_rew, x0, eps), fm_error(v_base, x0, eps)
                    loss, z = surrogate_loss(err, err_ref, adv[sl], args.group_size, args.reward_beta)
                    loss = loss + args.reward_kl * velocity_kl(v_rew, v_base).mean()
                    (loss / per_step).backward()
                    stats["surrogate_loss"].append(loss.item())
                    stats["surrogate_z"].append(z.mean().item())
                shell.all_reduce_grads(fake_params + surrogate_params)
                shell.clip_grad_norm(fake_params, args.max_grad_norm)
                shell.clip_grad_norm(surrogate_params, args.max_grad_norm)
                optimizer.step()  # the generator's weights have no gradient here: AdamW leaves them as they are
                optimizer.zero_grad(set_to_none=True)

            # the generator: pulled along the distribution-matching direction and the surrogate's reward direction
            k = 0
            for sl in micro:
                x0 = generated(sl)
                xt, sigma, _ = renoised(sl, x0.detach())
                s = sigma.view(-1, *[1] * (x0.dim() - 1))
                with models.reference_model(transformer):
                    x0_real = predicted_x0(xt, s, velocity(transformer, xt, sigma, sl, args.real_guidance_scale))
                    x0_base = predicted_x0(xt, s, velocity(transformer, xt, sigma, sl, args.reward_guidance_scale))
                x0_fake = predicted_x0(xt, s, velocity(fake, xt, sigma, sl, 1.0))
                x0_rew = predicted_x0(xt, s, velocity(surrogate, xt, sigma, sl, args.reward_guidance_scale))
                weight = normaliser(x0.detach(), x0_real)
                kl_pull = pull(x0, x0_real - x0_fake, weight)
                rl_pull = pull(x0, x0_rew - x0_base, weight)
                loss = args.kl_weight * kl_pull + args.rl_weight * rl_pull
                (loss / per_step).backward()
                stats["policy_loss"].append(loss.item())
                stats["kl_pull"].append(kl_pull.item())
                stats["rl_pull"].append(rl_pull.item())
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
            diagnostics = {"adv_abs": adv.abs().mean().item()}

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
