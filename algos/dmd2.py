"""DMD2: improved Distribution Matching Distillation into a few-step generator (Yin et al. 2024, arXiv 2405.14867) --
docs/dmd2.md

The generator (initialised from the base) samples in --num-steps Euler steps. Its clean predictions are pulled along
the difference of two scores at re-noised copies: the frozen base ("real" score, CFG real_guidance_scale) and a "fake"
score fitted online to the generator's own samples, so that the generator's distribution moves onto the teacher's
(the gradient of their KL, DMD Eq. 7). DMD2 drops DMD's regression loss, updates the fake score several times per
generator step (two time-scales) and trains every step of the few-step sampler on the states that sampler reaches
(backward simulation); its GAN term is left out (as Flow-Factory's flow-matching port does: docs/dmd2.md).

python algos/dmd2.py                                                   # tiny-shapes on CPU: a 2-step generator
torchrun --nproc-per-node 8 algos/dmd2.py --model stabilityai/stable-diffusion-3.5-medium  # see benchmark/
"""

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402  (also registers the model families with common)
from harness import flags, shell  # noqa: E402

# --learning-rate's default, by what is trained: every weight (the other scripts' tiny-model value) or a LoRA
LEARNING_RATES = {"full": 1e-4, "lora": 1e-3}


@dataclass
class DMD2Args:
    """DMD2's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    real_guidance_scale: float = 4.5
    """CFG scale of the real score (the teacher the generator matches)"""
    fake_updates: int = 5
    """fake-score optimizer steps per generator step (DMD2's two time-scale ratio)"""
    fake_learning_rate: flags.OptionalFloat = None
    """AdamW learning rate of the fake score; default learning_rate"""
    min_sigma: float = 0.02
    """re-noising sigma of both scores ~ U(min_sigma, max_sigma)"""
    max_sigma: float = 0.98
    """see min_sigma"""
    backward_simulation: bool = True
    """train each generator step at the state its own sampler reaches; else only its first step (pure noise)"""


@dataclass
class Args(flags.SharedArgs, DMD2Args):
    # DMD2's flags come first in --help, then the flags every script shares; here, where this script's default or
    # help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    num_steps: int = 2
    """N, the generator's sampling steps (its export is sampled at N; the paper: 4 for SDXL, 1 for SD1.5)"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate of the generator; default 1e-4 (every weight) or 1e-3 (LoRA)"""
    reward: str = "shapes_clean"
    """reward(s) that score the samples and the evaluation, for the log only: the loss uses none"""
    group_size: int = 8
    """K, samples per prompt (no groups are formed: K only sets the batch with M)"""


# ALGO LOGIC: DMD2's math as small pure functions
# Conventions: sigma = 1 is noise, x_t = (1 - sigma) x0 + sigma eps, v ~ eps - x0, so a velocity v at x_t predicts the
# clean sample x0_hat = x_t - sigma v.
def predicted_x0(x, sigma, v) -> torch.Tensor:
    return x - sigma * v


def dmd_gradient(x0, x0_real, x0_fake) -> torch.Tensor:
    """DMD's gradient of KL(p_fake || p_real) with respect to the generator's sample, in x0 space (DMD Eq. 7):
    s_fake - s_real is proportional to x0_fake - x0_real at the same noised point. Normalised per sample by the mean
    |x0 - x0_real| (DMD Eq. 8), so its scale does not depend on the noise level."""
    dims = tuple(range(1, x0.dim()))
    weight = (x0 - x0_real).abs().mean(dims, keepdim=True).clamp_min(1e-5)
    return (x0_fake - x0_real) / weight


def dmd_loss(x0, grad) -> torch.Tensor:
    """0.5 mean (x0 - sg(x0 - grad))^2: a loss whose gradient with respect to x0 is grad / (elements), the
    distribution-matching gradient handed to autograd (DMD2's implementation trick)."""
    return 0.5 * (x0 - (x0 - grad).detach()).pow(2).mean()


def fake_score_loss(v_fake, x0, eps) -> torch.Tensor:
    """The fake score's flow-matching loss on the generator's (detached) samples: mean ||v_fake - (eps - x0)||^2."""
    return (v_fake - (eps - x0)).pow(2).mean()


def renoise(x0, eps, sigma) -> torch.Tensor:
    """x_sigma = (1 - sigma) x0 + sigma eps, per-sample sigma [B]."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0 + s * eps


def main(args: Args):
    # TRY NOT TO MODIFY: the run folder (a resumed run's flags restored), the ranks, the seeds
    run_dir, ckpt, dist = shell.start(args, __file__)
    device = dist.device

    # ALGO LOGIC: flag checks that need no model, so a bad one fails before the model loads
    if not 0 < args.min_sigma <= args.max_sigma < 1:
        raise common.UserError(f"--min-sigma {args.min_sigma} / --max-sigma {args.max_sigma}: need 0 < min <= max < 1")
    if args.fake_updates < 1:
        raise common.UserError(f"--fake-updates {args.fake_updates}: must be >= 1")
    if args.fsdp:
        raise common.UserError("--fsdp: dmd2.py keeps a second trained network (the fake score) that is not sharded yet")

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: the fake score, a copy of the base being trained (its own LoRA, or every weight), in the optimizer as a
    # second group so a checkpoint holds its moments; saved as a snapshot. The real score is the frozen base itself.
    fake = copy.deepcopy(transformer)
    fake_params = [p for p in fake.parameters() if p.requires_grad]
    fake_lr = args.learning_rate if args.fake_learning_rate is None else args.fake_learning_rate
    optimizer.add_param_group({"params": fake_params, "lr": fake_lr})
    snapshots = {"fake": fake_params}
    sigmas = pipe.sigmas(args.num_steps, device, args.sigma_schedule)
    if dist.is_main:
        print(
            f"{args.num_steps}-step generator; real score at CFG {args.real_guidance_scale}; "
            f"{args.fake_updates} fake-score steps per generator step"
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
            # backward simulation: each sample's step k ~ U{0..N-1}, its state x_k reached by the generator's own
            # N-step sampler (no grad); the full samples are scored for the log
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
            k_gen = common.keyed_generator(args.seed, epoch, "steps")
            steps = torch.randint(args.num_steps if args.backward_simulation else 1, (total,), generator=k_gen)[local_idx]
            states = rollout.trajectory[torch.arange(len(local_idx)), steps].to(device)  # x_k of each sample
            step_sigmas = sigmas[steps.to(device)]

        # ---- reward ----
        with timer("reward"):
            # for the log only: the loss needs no reward
            images, local_scores = scorer.result()
            scores = shell.gather_scores(local_scores, total, args.grad_steps_per_epoch)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            stats = {"fake_loss": [], "policy_loss": [], "grad_norm": [], "fake_grad_norm": [], "dmd_grad": []}
            noise_gens = common.keyed_generators(args.seed, epoch, "renoise", indices=local_idx)
            micro = [slice(m * args.micro_batch, (m + 1) * args.micro_batch) for m in range(num_micro)]
            per_step = micro_per_step

            def renoised(sl, x0):  # a fresh (sigma, eps) per sample from its own stream: the same on any rank count
                u = torch.stack([torch.rand((), generator=g) for g in noise_gens[sl]])
                sigma = (args.min_sigma + (args.max_sigma - args.min_sigma) * u).to(device)
                eps = common.randn(x0.shape, noise_gens[sl]).to(device)
                return renoise(x0, eps, sigma), sigma, eps

            def generated(sl):  # the generator's clean prediction from each sample's state x_k (with grad if enabled)
                with common.autocast(device, args.mixed_precision):
                    v = common.velocity(transformer, states[sl], step_sigmas[sl], cond[sl], args.guidance_scale)
                return predicted_x0(states[sl], step_sigmas[sl].view(-1, *[1] * (v.dim() - 1)), v.float())

            # the fake score: fake_updates optimizer steps per generator step, on the generator's samples of this epoch
            with torch.no_grad():
                x0_gen = torch.cat([generated(sl) for sl in micro])
            for i in range(args.fake_updates * args.grad_steps_per_epoch):
                for sl in micro[(i % args.grad_steps_per_epoch) * per_step :][:per_step]:
                    xt, sigma, eps = renoised(sl, x0_gen[sl])
                    with common.autocast(device, args.mixed_precision):
                        v_fake = common.velocity(fake, xt, sigma, cond[sl], 1.0)
                    loss = fake_score_loss(v_fake.float(), x0_gen[sl], eps)
                    (loss / per_step).backward()
                    stats["fake_loss"].append(loss.item())
                shell.all_reduce_grads(fake_params)
                stats["fake_grad_norm"].append(shell.clip_grad_norm(fake_params, args.max_grad_norm).item())
                optimizer.step()  # the generator's weights have no gradient here: AdamW leaves them as they are
                optimizer.zero_grad(set_to_none=True)

            # the generator: the distribution-matching gradient at a re-noised copy of its prediction, through x0
            k = 0
            for sl in micro:
                x0 = generated(sl)
                xt, sigma, _ = renoised(sl, x0.detach())
                s = sigma.view(-1, *[1] * (x0.dim() - 1))
                with torch.no_grad(), common.autocast(device, args.mixed_precision):
                    with models.reference_model(transformer):
                        v_real = common.velocity(transformer, xt, sigma, cond[sl], args.real_guidance_scale)
                    v_fake = common.velocity(fake, xt, sigma, cond[sl], 1.0)
                grad = dmd_gradient(x0.detach(), predicted_x0(xt, s, v_real.float()), predicted_x0(xt, s, v_fake.float()))
                loss = dmd_loss(x0, grad)
                (loss / per_step).backward()
                stats["policy_loss"].append(loss.item())  # the generator's dmd_loss
                stats["dmd_grad"].append(grad.pow(2).mean().item())
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
            diagnostics = {"fake_learning_rate": optimizer.param_groups[1]["lr"]}

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
