"""The held-out evaluation: the test prompts sampled with fixed noises (the same at every evaluation, on any rank count
and after a resume), scored by the run's rewards and the side metrics of --eval-rewards, logged as eval/<reward> with a
captioned grid and printed as one line (`evaluate_and_log`); `evaluate` is the sampler and scorer the benchmark
scripts call alone."""

from typing import TYPE_CHECKING, Sequence

import torch

from common import Cond, UserError, autocast, decode, randn, sample, velocity
from models import EvalEMA, is_fsdp

if TYPE_CHECKING:
    from harness import logs


def evaluate_and_log(
    args, pipe, encoder, prompts, rewards, eval_ema: EvalEMA, logger: "logs.Logger", images_seen: int, label: str = "eval"
):
    """Rank 0 (the logger's rank): `evaluate` the held-out `prompts` with the eval sampler (--eval-num-steps,
    --eval-guidance-scale; the eval EMA's weights when --eval-ema-decay > 0), log eval/<reward> and a captioned grid
    at x = images seen, with the side metrics of --eval-rewards (the logger's) beside the training rewards, and print the
    means as a line that stays above the progress bar. Returns {reward: mean} (None on the other ranks). Under --fsdp
    every rank samples with rank 0, since each forward gathers the weights from all of them."""
    if not logger.enabled and not is_fsdp(pipe.transformer):
        return None

    def score(images, prompts):  # the training rewards' eval metrics, then the side metrics (--eval-rewards)
        out = rewards.evaluate(images, prompts)
        side = logger.eval_rewards(images, prompts) if logger.eval_rewards is not None else {}
        return {**out, **{k: v for k, v in side.items() if k not in out}}

    with eval_ema.swapped():
        imgs, scores = evaluate(
            pipe,
            pipe.transformer,
            encoder,
            prompts,
            score,
            num_steps=args.eval_num_steps or args.num_steps,
            guidance_scale=args.guidance_scale if args.eval_guidance_scale is None else args.eval_guidance_scale,
            seed=0,
            use_autocast=args.mixed_precision,
            repeats=getattr(args, "eval_noises", 2),
            schedule=getattr(args, "sigma_schedule", "pipeline"),
            solver=getattr(args, "eval_solver", "euler"),
            progress=False,  # the run's one progress bar is the epochs'
        )
    if not logger.enabled:
        return None
    logger.scalars({f"eval/{k}": v.mean() for k, v in scores.items()}, images_seen)
    logger.images("eval/images", imgs[:16], captions(prompts[:16], scores), images_seen)
    means = {k: v.mean().item() for k, v in scores.items()}
    from tqdm import tqdm

    tqdm.write(f"{label} after {images_seen:,} images: {scores_line(means)}")
    return means


def evaluate(
    pipe,
    transformer,
    encoder,
    prompts,
    reward_fn,
    *,
    num_steps,
    guidance_scale,
    seed,
    batch=32,
    use_autocast=False,
    repeats: int = 2,
    progress: bool = True,
    schedule: str = "pipeline",
    solver: str = "euler",
):
    """ODE samples of a fixed prompt list (each `repeats` times) with fixed noise (seed + chunk index), scored by
    `reward_fn`: the same noise in every run and algorithm, so eval curves compare. `solver` "dpm" uses
    `dpm_solver_sample` (its own flow sigmas, `schedule` ignored). Returns (images, {reward: [B]}), prompts * repeats."""
    from tqdm import tqdm

    prompts = list(prompts) * repeats
    images, scores = [], {}
    # a context manager, so that the bar is cleared before an error (e.g. a reward returning NaN) is reported
    with tqdm(total=len(prompts), desc="eval", unit="img", leave=False, disable=not progress) as bar:
        for k in range(0, len(prompts), batch):
            chunk = prompts[k : k + batch]
            gen = torch.Generator().manual_seed(seed + k)
            cond = encoder.cond(chunk, negative=guidance_scale > 1)
            if solver == "dpm":  # the same initial noise as the Euler sampler draws from `gen`
                shape = (
                    getattr(pipe, "latent_shape", None)
                    or (transformer.config.in_channels,) + (transformer.config.sample_size,) * 2
                )
                noise = randn((len(chunk), *shape), gen).to(cond.embeds.device)
                kwargs = dict(num_steps=num_steps, guidance_scale=guidance_scale, use_autocast=use_autocast)
                latents = dpm_solver_sample(transformer, pipe.scheduler, cond, noise, **kwargs)
            else:
                latents = sample(
                    transformer,
                    pipe.scheduler,
                    cond,
                    num_steps=num_steps,
                    guidance_scale=guidance_scale,
                    generator=gen,
                    latent_shape=getattr(pipe, "latent_shape", None),
                    use_autocast=use_autocast,
                    schedule=schedule,
                ).latents
            imgs = decode(pipe, latents)
            for name, value in reward_fn(imgs, chunk).items():
                scores.setdefault(name, []).append(value.float().cpu())
            images.append(imgs.cpu())
            bar.update(len(chunk))
    return torch.cat(images), {k: torch.cat(v) for k, v in scores.items()}


@torch.no_grad()
def dpm_solver_sample(
    transformer, scheduler, cond: Cond, noise: torch.Tensor, *, num_steps: int, guidance_scale: float = 1.0, use_autocast=False
) -> torch.Tensor:
    """ODE sampling with diffusers' DPMSolverMultistepScheduler (2nd-order DPM-Solver++ on flow sigmas, the Sana
    scheduler config that DGPO evaluates with, scripts/train_sd3_dgpo.py:557-559) at the pipeline scheduler's static
    shift; the model sees the scheduler's timestep t as sigma = t / 1000, as a stock pipeline passes it. Returns the
    final latents. Deterministic: no noise is drawn after `noise`."""
    from diffusers import DPMSolverMultistepScheduler

    if scheduler.config.get("use_dynamic_shifting", False):
        raise UserError("the DPM-Solver evaluation needs a scheduler with a static shift (SD3)")
    dpm = DPMSolverMultistepScheduler(
        num_train_timesteps=scheduler.config.get("num_train_timesteps", 1000),
        flow_shift=scheduler.config.get("shift", 1.0),
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        algorithm_type="dpmsolver++",
        solver_order=2,
        final_sigmas_type="zero",
        lower_order_final=True,
    )
    dpm.set_timesteps(num_steps, device=noise.device)
    x = noise.float()
    for t in dpm.timesteps:
        with autocast(noise.device, use_autocast):
            v = velocity(transformer, x, t.float() / dpm.config.num_train_timesteps, cond, guidance_scale)
        x = dpm.step(v.float(), t, x).prev_sample
    return x


def captions(prompts: Sequence[str], scores: dict) -> list:
    """One caption per image: the prompt, then its eval scores (shortened names), e.g. "a red circle" /
    "shapes .50 strict 0 exact 0 objects 3"."""
    short = {"shapes_strict": "strict", "shapes_exact": "exact", "shapes_clean": "clean", "ocr_strict": "strict"}
    skip = {"objects_extra", "prompt_specific_gap"}
    out = []
    for i, prompt in enumerate(prompts):
        values = " ".join(
            f"{short.get(k, k)} {float(v[i]):.2f}".replace(".00", "").replace(" 0.", " .")
            for k, v in scores.items()
            if k not in skip
        )
        out.append(f"{prompt} | {values}")
    return out


def scores_line(means: dict) -> str:
    """{reward: mean} as "shapes_clean 0.578  shapes_exact 0.45": 3 significant digits, already finer than the
    standard error of a held-out mean (about 0.06 for a 0/1 score over the default 60 images)."""
    return "  ".join(f"{name} {value:.3g}" for name, value in means.items())
