"""DiffusionOPD: on-policy distillation of RL teachers into one student (ali-vilab, arXiv 2605.15055) -- docs/opd.md

Train one teacher per task with any script here, then distil them all into one student on the student's own rollouts:
at every state the student visits, the student's Gaussian step is pulled onto the teacher's step from that same state
by their KL, which is closed-form (same std: a squared distance between the two means). The gradient is the analytic
one through the student's mean, not a policy gradient, and no reward model is needed to train (--reward only scores
the rollouts for the log and the held-out evaluation). Equations are not numbered here: only the abstract was
available; the loss follows the authors' code (scripts/train_sd3_opd.py).

python algos/opd.py                                                    # tiny-shapes on CPU: the two committed teachers
python algos/opd.py --teachers runs/<run A> runs/<run B> --teacher-prompts a.txt b.txt  # your own teachers
torchrun --nproc-per-node 8 algos/opd.py --model stabilityai/stable-diffusion-3.5-medium --teachers A B C  # benchmark/
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402  (also registers the model families with common)
from harness import flags, prompt_files, shell  # noqa: E402

# the tiny-shapes demo: two CRD teachers, one per prompt domain (colour attribution; every other kind of prompt), each
# trained on its own prompts (benchmark/convergence.py: opd_teacher_attr, opd_teacher_rest)
TEACHERS = tuple(str(common.REPO / "assets" / "opd" / "teachers" / d) for d in ("attr", "rest"))
TEACHER_PROMPTS = tuple(str(common.REPO / "assets" / "opd" / f"{d}_train.jsonl") for d in ("attr", "rest"))

# --learning-rate's default, by what is trained: every weight (the other scripts' tiny-model value) or a LoRA (the
# paper's SD3.5-M value)
LEARNING_RATES = {"full": 1e-4, "lora": 3e-4}


@dataclass
class OPDArgs:
    """DiffusionOPD's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    teachers: flags.RepoPaths = TEACHERS
    """the teachers: run folders of this project (their lora/ or transformer/ export) or diffusers pipeline folders"""
    teacher_prompts: flags.OptionalNames = None
    """each teacher's prompt file, in --teachers' order; default the demo's own, else --train-prompts for each"""
    teacher_guidance_scale: flags.OptionalFloat = None
    """CFG scale of the teachers' velocities; default guidance_scale"""
    timestep_fraction: float = 0.99
    """train the first int(N x fraction) steps of every rollout (the paper: 9 of 10)"""
    num_train_timesteps: flags.OptionalInt = None
    """steps trained per micro-batch, drawn stratified from those; default all of them"""


@dataclass
class Args(flags.SharedArgs, OPDArgs):
    # DiffusionOPD's flags come first in --help, then the flags every script shares; here, where this script's default
    # or help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate; default 1e-4 (every weight) or 3e-4 (LoRA)"""
    reward: str = "shapes_clean"
    """reward(s) that score the rollouts and the evaluation, for the log only: the loss uses none"""
    group_size: int = 8
    """K, rollouts per prompt (no groups are formed: K only sets the batch with M)"""


# ALGO LOGIC: DiffusionOPD's math as small pure functions
# Conventions: sigma = 1 is noise, x_t = (1 - sigma) x0 + sigma eps, v ~ eps - x0. One sampler step from sigma to
# sigma' < sigma is a Gaussian N(mean(x, v), std^2 I) (common.sde_step); std depends on sigma, sigma' and eta only, so the
# student's and the teacher's steps from the same x share it and differ only in their means.
def step_kl(mean_student, mean_teacher, std) -> torch.Tensor:
    """KL(N(mu_s, std^2 I) || N(mu_t, std^2 I)) per sample, mean over latent elements: (mu_s - mu_t)^2 / (2 std^2).

    Equal covariances make it symmetric (forward = reverse KL) and quadratic in the means. An ODE step (std 0, the
    paper's default: noise level 0) has no density; there, as in the authors' code, the numerator (mu_s - mu_t)^2 / 2,
    which for an Euler step is dt^2 ||v_s - v_t||^2 / 2: velocity matching weighted by the squared step."""
    sq = (mean_student - mean_teacher).pow(2).flatten(1).mean(1)
    std = torch.as_tensor(std, dtype=sq.dtype, device=sq.device).reshape(-1)
    return torch.where(std > 0, sq / (2 * std.clamp_min(1e-12) ** 2), sq / 2)


def teacher_of(indices, group_size: int, num_teachers: int) -> torch.Tensor:
    """The teacher of each sample (global index): its prompt's group g = i // K goes to teacher g mod n, so a batch
    alternates the teachers group by group (the paper's batch i uses teacher i mod n) on every rank count."""
    return torch.as_tensor(indices) // group_size % num_teachers


def draw_prompts(prompt_sets: list, num_prompts: int, group_size: int, generator: torch.Generator) -> list:
    """M groups of K: group g from teacher g mod n's prompts (common.group_prompts over each teacher's set in turn)."""
    n = len(prompt_sets)
    per_teacher = [
        common.group_prompts(prompts, len(range(t, num_prompts, n)), group_size, generator)
        for t, prompts in enumerate(prompt_sets)
    ]
    groups = [iter([p[j : j + group_size] for j in range(0, len(p), group_size)]) for p in per_teacher]
    return [prompt for g in range(num_prompts) for prompt in next(groups[g % n])]


def teacher_export(folder: str) -> tuple:
    """(kind, path) of a teacher folder: ("transformer", its full weights) or ("lora", its LoRA folder)."""
    path = Path(folder)
    for kind in ("transformer", "lora"):
        if path.name == kind and path.is_dir():
            return kind, path
        if (path / kind).is_dir():
            return kind, path / kind
    raise common.UserError(f"--teachers {folder}: no transformer/ or lora/ export in it (a run folder of this project)")


def load_teacher(args, export: tuple, device) -> torch.nn.Module:
    """A frozen teacher transformer as a user would load the export: --model's pipeline with the export's transformer
    weights in place, or its LoRA fused into the base weights."""
    from diffusers.utils import logging

    kind, path = export
    teacher = models.load_pipeline(
        args.model, device, models.DTYPES[args.base_dtype], args.resolution, height=args.height, width=args.width
    )
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.CRITICAL)  # a failed load is one line below, not diffusers' errors first
    try:
        if kind == "transformer":
            trained = type(teacher.transformer).from_pretrained(
                str(path),
                torch_dtype=models.DTYPES[args.base_dtype],
                use_safetensors=True,  # never a pickle
            )
            teacher.transformer.load_state_dict(trained.state_dict())
        else:
            teacher.pipe.load_lora_weights(str(path), use_safetensors=True)
            teacher.pipe.fuse_lora()
            teacher.pipe.unload_lora_weights()
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise common.UserError(f"--teachers {path.parent}: its {kind} export does not load into --model ({first})")
    finally:
        logging.set_verbosity(verbosity)
    return teacher.transformer.requires_grad_(False).eval()


def main(args: Args):
    # TRY NOT TO MODIFY: the run folder (a resumed run's flags restored), the ranks, the seeds
    run_dir, ckpt, dist = shell.start(args, __file__)
    device = dist.device

    # ALGO LOGIC: flag checks and the teachers' folders and prompt files, read before the model loads so a bad one fails first
    if not args.teachers:
        raise common.UserError("--teachers: name at least one teacher (a run folder of this project's scripts)")
    exports = [teacher_export(t) for t in args.teachers]
    if args.teacher_prompts is not None and len(args.teacher_prompts) != len(args.teachers):
        raise common.UserError(
            f"--teacher-prompts: {len(args.teacher_prompts)} files for {len(args.teachers)} teachers; give one per teacher"
        )
    if not 0 < args.timestep_fraction <= 1:
        raise common.UserError(f"--timestep-fraction {args.timestep_fraction}: must be in (0, 1]")
    eligible = int(args.num_steps * args.timestep_fraction)
    if eligible < 1:
        raise common.UserError(f"--timestep-fraction {args.timestep_fraction} trains no step of {args.num_steps}")
    num_train = eligible if args.num_train_timesteps is None else args.num_train_timesteps
    if not 1 <= num_train <= eligible:
        raise common.UserError(f"--num-train-timesteps {num_train}: must be in [1, {eligible}]")
    if args.teacher_prompts is None and tuple(args.teachers) == TEACHERS:
        args.teacher_prompts = TEACHER_PROMPTS  # written back: the run's record, and so a resume, name the files
    teacher_sets = [prompt_files.load_prompts(f) for f in args.teacher_prompts] if args.teacher_prompts else None

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: the frozen teachers, and which one teaches each of this rank's samples; no snapshot is kept
    teachers = [load_teacher(args, export, device) for export in exports]
    teacher_sets = teacher_sets or [train_prompts] * len(teachers)  # after --offload-text-encoders: encoded on the CPU
    routes = teacher_of(local_idx, args.group_size, len(teachers)).to(device)
    teacher_cfg = args.guidance_scale if args.teacher_guidance_scale is None else args.teacher_guidance_scale
    snapshots = {}
    sigmas = pipe.sigmas(args.num_steps, device, args.sigma_schedule)
    if dist.is_main:
        print(
            f"{len(teachers)} teacher(s) at CFG {teacher_cfg}; trained steps per micro-batch T={num_train} of the first "
            f"{eligible} of {args.num_steps}, {args.dynamics} rollouts"
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
            # the student's own rollouts (on-policy), every state kept: the teachers are asked from the states it visits
            prompts = draw_prompts(teacher_sets, args.num_prompts, args.group_size, prompt_gen)
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
                keep_trajectory=True,
                latent_shape=pipe.latent_shape,
                use_autocast=args.mixed_precision,
                schedule=args.sigma_schedule,
                chunk=scorer.chunk,
                on_chunk=scorer,
            )
            states = rollout.trajectory  # [B, N + 1, ...]: x_0 = noise, ..., x_N = the image's latents

        # ---- reward ----
        with timer("reward"):
            # for the log only: the loss needs no reward
            images, local_scores = scorer.result()
            scores = shell.gather_scores(local_scores, total, args.grad_steps_per_epoch)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            # pass 1 (no grad): each sample's teacher's step mean at the states the student visited
            batches = []
            for mb in range(num_micro):
                sl = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                t_gen = common.keyed_generator(args.seed, epoch, "timesteps", int(local_idx[sl.start]) // args.micro_batch)
                for j in common.stratified_indices(eligible, num_train, t_gen):
                    x, dyn = states[sl, j].to(device), args.dynamics if j < args.num_steps - 1 else "ODE"
                    step_args = (sigmas[j], sigmas[j + 1], dyn, args.eta)
                    mean_teacher = torch.empty_like(x)
                    with torch.no_grad(), common.autocast(device, args.mixed_precision):
                        for t, teacher in enumerate(teachers):
                            rows = (routes[sl] == t).nonzero().flatten()
                            if len(rows):
                                v_t = common.velocity(teacher, x[rows], sigmas[j], cond[sl][rows], teacher_cfg)
                                _, _, mean, _ = common.sde_step(x[rows], v_t.float(), *step_args, sigma_cap=float(sigmas[1]))
                                mean_teacher[rows] = mean
                    batches.append((sl, j, x, step_args, mean_teacher))

            # pass 2: the per-step KL of the student's step to its teacher's, grad_steps_per_epoch optimizer steps
            stats = {"policy_loss": [], "grad_norm": []}
            per_teacher = torch.zeros(len(teachers), 2, device=device)  # (KL sum, samples) of each teacher's samples
            per_step = micro_per_step * num_train
            k = 0
            for sl, j, x, step_args, mean_teacher in batches:
                with common.autocast(device, args.mixed_precision):
                    v = common.velocity(transformer, x, sigmas[j], cond[sl], args.guidance_scale)
                _, _, mean_student, std = common.sde_step(x, v.float(), *step_args, sigma_cap=float(sigmas[1]))
                kl = step_kl(mean_student, mean_teacher, std)
                loss = kl.mean()
                (loss / per_step).backward()
                stats["policy_loss"].append(loss.item())  # the mean step KL
                for t in range(len(teachers)):
                    mine = routes[sl] == t
                    per_teacher[t] += torch.stack([kl.detach()[mine].sum(), mine.sum().float()])
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
            # summed over ranks before dividing: a rank may hold none of a teacher's groups
            per_teacher = shell.all_reduce_mean(per_teacher)
            diagnostics = {f"kl_teacher{t}": (kl_sum / n.clamp_min(1)).item() for t, (kl_sum, n) in enumerate(per_teacher)}

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
