"""Diffusion-DPO (Wallace et al. 2023, arXiv 2311.12908) for flow-matching models, online or offline -- docs/dpo.md

python algos/dpo.py                                                    # tiny-shapes on CPU, a few minutes
python algos/dpo.py --pairs pairs.jsonl                                # offline: {"prompt", "chosen", "rejected"} images
python algos/dpo.py --model <FLUX.1-Kontext> --pairs edits.jsonl       # offline edits: lines with "image", the one to edit
torchrun --nproc-per-node 8 algos/dpo.py --model stabilityai/stable-diffusion-3.5-medium --reward pickscore  # see benchmark/
"""

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402  (also registers the model families with common)
from harness import flags, pair_files, shell  # noqa: E402

# --learning-rate's default, by what is trained: every weight (benchmark/results/convergence) or a LoRA
# (benchmark/results/shapes_clean/tuning.md)
LEARNING_RATES = {"full": 1e-4, "lora": 1e-3}


@dataclass
class DPOArgs:
    """Diffusion-DPO's own flags, first in --help (the flags every script shares: flags.SharedArgs)"""

    num_train_timesteps: int = 4
    """T, noised copies (sigma, eps) of every pair trained per epoch"""
    dpo_beta: float = 50.0
    """beta of Eq. (14), T omega(lambda_t) folded in; flow_grpo's SD3.5 value is 100 x its 0.5 = 50 (docs/dpo.md)"""
    pairs: flags.OptionalStr = None
    """offline: a .jsonl of {"prompt", "chosen", "rejected"} image paths; without "rejected": SFT; with "image": edits"""
    pairs_per_group: Literal["best-worst", "all"] = "best-worst"
    """online pairs: each group's best vs worst rollout, or every ordered pair of unequal rewards"""
    rollout_policy: Literal["current", "base"] = "current"
    """online rollouts from the current weights, or from the frozen base (flow_grpo's DPO)"""
    timestep_sampling: Literal["logit-normal", "uniform"] = "logit-normal"
    """u of sigma = shifted(1 - u), per pair: sigmoid(N(mean, std)) (SD3's training) or U(0, 1)"""
    logit_mean: float = 0.0
    """mean of the logit-normal u"""
    logit_std: float = 1.0
    """std of the logit-normal u"""
    ref_update_every: int = 0
    """the reference takes the current weights every N optimizer steps (flow_grpo's online DPO); 0: the frozen base"""
    sft_weight: float = 0.0
    """lambda of the chosen images' flow-matching loss added to DPO's (RPO, arXiv 2404.19733)"""
    kl_beta: float = 0.0
    """weight of ||v - v_base||^2, the velocity KL to the frozen base"""
    kl_cfg: float = 1.0
    """CFG scale of the base velocity the KL anchors to"""


@dataclass
class Args(flags.SharedArgs, DPOArgs):
    # Diffusion-DPO's flags come first in --help, then the flags every script shares; here, where this script's default
    # or help differs from theirs
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    guidance_scale: float = 1.0
    """CFG scale of the rollout (training forwards use none)"""
    learning_rate: flags.OptionalFloat = None
    """AdamW learning rate; default 1e-4 (every weight) or 1e-3 (LoRA)"""
    num_prompts: int = 8
    """M, prompts per epoch (global); offline: M K / 2 pairs (M K chosen images for SFT) per epoch"""
    micro_batch: int = 16
    """per-rank micro-batch (whole groups online, whole pairs offline)"""


# ALGO LOGIC: Diffusion-DPO's math as small pure functions
# Conventions: sigma = 1 is noise, x_t = (1 - sigma) x0 + sigma eps, velocity target u = eps - x0. The paper writes the
# denoising error on eps (Eq. 14); in velocity form ||v - u||^2 = ||eps_hat - eps||^2 / (1 - sigma)^2, a per-timestep
# factor of the kind its omega(lambda_t) holds. Like flow_grpo's and Flow-Factory's DPO we take the plain velocity
# error, mean over latent elements, and fold T omega(lambda_t) and the element count into one beta.
def fm_error(v, v_target) -> torch.Tensor:
    """||v - u||^2 per sample, mean over latent elements: the flow-matching loss, and -log p up to scale (Eq. 14)."""
    return (v - v_target).pow(2).flatten(1).mean(1)


def dpo_loss(err_w, err_l, err_ref_w, err_ref_l, beta: float):
    """Eq. (14) per pair: -log sigmoid(-beta ((err_w - err_ref_w) - (err_l - err_ref_l))).

    err_* are the policy's and the frozen base's errors on the chosen (w) and rejected (l) image, noised with the same
    sigma and eps. The logit z = -beta (...) is the implicit reward margin r(w) - r(l), r(x) = -beta (err - err_ref):
    z > 0 when the policy lowered its error on w, relative to the base, more than on l. Returns (loss [P], z [P])."""
    z = -beta * ((err_w - err_ref_w) - (err_l - err_ref_l))
    return -F.logsigmoid(z), z.detach()


def regularizer(err_w, v, v_base, sft_weight: float, kl_beta: float) -> torch.Tensor:
    """What the follow-ups add to Eq. (14): sft_weight x the chosen images' flow-matching loss (RPO, Pang et al. 2024,
    arXiv 2404.19733: DPO + the chosen answer's NLL) + kl_beta x mean ||v - v_base||^2, the velocity form of the KL to
    the base (Flow-GRPO's Eq. 5 and CRD's anchor; v_base at --kl-cfg), each mean over the micro-batch."""
    out = sft_weight * err_w.mean()
    if v_base is not None:
        out = out + kl_beta * (v.float() - v_base.float()).pow(2).mean()
    return out


def select_pairs(rewards: torch.Tensor, group_size: int, mode: str) -> torch.Tensor:
    """(chosen, rejected) sample indices [P, 2] within each group of K contiguous samples, in group order.

    "best-worst": the group's highest and lowest reward (the first of equals), flow_grpo's DPO pairs; "all": every
    ordered pair (i, j) with r_i > r_j, i.e. each unordered pair of unequal rewards once, best first. Ties are skipped:
    a group whose rewards are all equal gives no pair (flow_grpo then pairs samples 0 and 1 anyway)."""
    pairs = []
    for g, row in enumerate(rewards.view(-1, group_size).tolist()):
        base = g * group_size
        if mode == "best-worst":
            hi = max(range(group_size), key=lambda i: row[i])
            lo = min(range(group_size), key=lambda i: row[i])
            candidates = [(hi, lo)]
        elif mode == "all":
            candidates = [(i, j) for i in range(group_size) for j in range(group_size)]
        else:
            raise common.UserError(f"unknown pairs mode {mode!r}; choose best-worst or all")
        pairs += [(base + i, base + j) for i, j in candidates if row[i] > row[j]]
    return torch.tensor(pairs, dtype=torch.long).view(-1, 2)


def train_sigma(generator: torch.Generator, grid: torch.Tensor, sampling: str, mean: float, std: float) -> float:
    """One training sigma: u in (0, 1) (logit-normal or uniform), then grid[floor(u len(grid))], the model's shifted
    1000-step schedule, as flow_grpo indexes its scheduler's timesteps (train_sd3_dpo.py)."""
    if sampling == "logit-normal":
        u = torch.sigmoid(mean + std * torch.randn(1, generator=generator))
    else:
        u = torch.rand(1, generator=generator)
    return float(grid[min(int(u * len(grid)), len(grid) - 1)])


def group_noise(samples, unit: int, shape, key: tuple, grid, sampling: str, mean: float, std: float):
    """(sigma [n], eps [n, *shape]) for the global sample indices `samples`: one draw per group (sample s is in group
    s // unit), sigma (train_sigma) then eps from common.keyed_generator(*key, group), shared by the group's images,
    so any subset of a group (a rank's, a micro-batch's) gets the same draw."""
    draws = {}
    for g in sorted({s // unit for s in samples}):
        gen = common.keyed_generator(*key, g)
        draws[g] = (train_sigma(gen, grid, sampling, mean, std), torch.randn(tuple(shape), generator=gen))
    sigma = torch.tensor([draws[s // unit][0] for s in samples])
    return sigma, torch.stack([draws[s // unit][1] for s in samples])


def draw_lines(num_lines: int, count: int, generator: torch.Generator) -> list:
    """`count` line indices of the pairs file, without replacement, cycling when the file is shorter (group_prompts)."""
    idx = []
    while len(idx) < count:
        idx += torch.randperm(num_lines, generator=generator).tolist()
    return idx[:count]


def main(args: Args):
    # TRY NOT TO MODIFY: the run folder (a resumed run's flags restored), the ranks, the seeds
    run_dir, ckpt, dist = shell.start(args, __file__)
    device = dist.device

    # ALGO LOGIC: flag checks and the offline pairs file, read before the model loads so a bad one fails first
    if args.ref_update_every < 0:
        raise common.UserError(f"--ref-update-every {args.ref_update_every}: must be >= 0 (0: the frozen base)")
    if args.dpo_beta <= 0 or args.logit_std <= 0:
        name, value = ("dpo-beta", args.dpo_beta) if args.dpo_beta <= 0 else ("logit-std", args.logit_std)
        raise common.UserError(f"--{name} {value}: must be > 0")
    offline = None
    if args.pairs is None:
        if args.micro_batch % args.group_size:
            raise common.UserError(
                f"micro_batch ({args.micro_batch}) must hold whole groups (a multiple of group_size {args.group_size}): "
                "the pairs are drawn within a group"
            )
    else:
        online_flags = sorted(shell.given_flags(args) & {"pairs_per_group", "rollout_policy"})
        if online_flags:
            raise common.UserError(f"--{online_flags[0].replace('_', '-')}: an online setting, but --pairs trains offline")
        offline = pair_files.load_pairs(args.pairs, args.height or args.resolution, args.width or args.resolution)
        pair_files.check_pair_images(args.model, offline[0], offline[1].shape[2:0:-1], f"--pairs {args.pairs}")
        if offline[2] is not None and args.micro_batch % 2:
            raise common.UserError(
                f"micro_batch ({args.micro_batch}) must be even with --pairs: a pair's two images train together"
            )

    # TRY NOT TO MODIFY: the batch over ranks and micro-batches; prompts, rewards, model (a bad file fails before it loads)
    total, local_idx, local_samples, num_micro, micro_per_step = shell.batch_layout(args, dist)
    train_prompts, test_prompts, rewards = shell.load_data(args, device)
    pipe, params, named, optimizer, encoder = shell.load_model(args, dist, LEARNING_RATES, train_prompts + test_prompts)
    transformer = pipe.transformer

    # ALGO LOGIC: the reference is the frozen base (models.reference_model), so no snapshot is kept; the offline images
    # are encoded once and scored once (their reward is what charts/reward_* shows offline), then their pixels dropped
    # (--ref-update-every: the reference is a snapshot of the weights instead, renewed every N steps, saved with them)
    snapshots = {"reference": [p.detach().clone() for p in params]} if args.ref_update_every else {}
    ref_step = -1  # the step the reference last took the weights at (none yet in this process: a resume takes them again)
    train_grid = pipe.sigmas(1000, device)[:-1].cpu()  # the shifted 1000-step schedule the training sigmas come from
    sft = offline is not None and offline[2] is None
    if offline is not None:
        data_prompts, sides = offline[0], [p for p in offline[1:] if p is not None]
        data_latents = [pair_files.encode_images(pipe, p, args.micro_batch) for p in sides]
        data_scores = []  # per side: {reward name: [N]}
        for p in sides:
            parts = [
                rewards(
                    torch.from_numpy(p[k : k + args.micro_batch]).permute(0, 3, 1, 2).float() / 255,
                    data_prompts[k : k + args.micro_batch],
                )
                for k in range(0, len(p), args.micro_batch)
            ]
            data_scores.append({name: torch.cat([s[name] for s in parts]).float().cpu() for name in parts[0]})
        offline = None  # the pixels
    if dist.is_main:
        mode = "online" if args.pairs is None else f"offline {'SFT' if sft else 'DPO'} ({len(data_prompts)} lines)"
        print(f"{mode}; T={args.num_train_timesteps} noised copies of every pair per epoch, beta={args.dpo_beta}")

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
            if args.pairs is None:  # online: K rollouts of each of M prompts, with the current weights or the base's
                prompts = common.group_prompts(train_prompts, args.num_prompts, args.group_size, prompt_gen)
                prompts = [prompts[j] for j in local_idx]
                cond = encoder.cond(prompts)
                scorer = common.Scorer(pipe, rewards, prompts, args.micro_batch, overlap=args.overlap_reward, epoch=epoch)
                with models.reference_model(transformer) if args.rollout_policy == "base" else contextlib.nullcontext():
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
            else:  # offline: sample s is line lines[s // 2]'s chosen (s even) or rejected image; SFT: line lines[s]
                lines = draw_lines(len(data_prompts), total if sft else total // 2, prompt_gen)
                line_of = [lines[s] for s in range(total)] if sft else [lines[s // 2] for s in range(total)]
                side_of = [0] * total if sft else [s % 2 for s in range(total)]
                prompts = [data_prompts[line_of[j]] for j in local_idx]
                cond = encoder.cond(prompts)
                x0 = torch.stack([data_latents[side_of[j]][line_of[j]] for j in local_idx]).to(device)
                images = common.decode(pipe, x0[:16]) if epoch % args.eval_every == 0 else None  # for the logged grid

        # ---- reward ----
        with timer("reward"):
            if args.pairs is None:
                # each rank scores its own images (during sampling: --overlap-reward); the pairs use the whole epoch's batch
                images, local_scores = scorer.result()
                scores = shell.gather_scores(local_scores, total, args.grad_steps_per_epoch)
                pairs = select_pairs(rewards.total(scores), args.group_size, args.pairs_per_group)
            else:
                scores = {
                    k: torch.stack([data_scores[side_of[s]][k][line_of[s]] for s in range(total)]) for k in rewards.weights
                }
                pairs = None if sft else torch.arange(total).view(-1, 2)  # (chosen, rejected) = (2i, 2i + 1)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            stats = (
                {"policy_loss": [], "grad_norm": []}
                if sft
                else {
                    "policy_loss": [],
                    "grad_norm": [],
                    "implicit_acc": [],
                    "margin": [],
                    "chosen_error": [],
                    "rejected_error": [],
                }
            )
            per_step = micro_per_step * args.num_train_timesteps
            position = {int(j): i for i, j in enumerate(local_idx)}  # global sample index -> row of this rank's x0
            k = 0
            for mb in range(num_micro):
                sl = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                mine = set(local_idx[sl].tolist())
                # the micro-batch's pairs (whole groups or pairs, so none straddles two); SFT: each sample alone
                rows = [(s,) for s in sorted(mine)] if pairs is None else [tuple(p) for p in pairs.tolist() if p[0] in mine]
                for i in range(args.num_train_timesteps):
                    if snapshots and step % args.ref_update_every == 0 and step != ref_step:
                        with torch.no_grad():  # the reference takes the weights every N steps (TR-DPO's hard update)
                            for r, p in zip(snapshots["reference"], params):
                                r.copy_(p)
                        ref_step = step
                    if not rows:  # only ties here: a zero gradient keeps every rank's optimizer step in lockstep
                        loss = sum(p.sum() for p in params) * 0.0
                        (loss / per_step).backward()
                    else:
                        # one (sigma, eps) per group (online: a prompt's K rollouts; offline: a pair; SFT: an image),
                        # shared by every image in it: a pair's two images get the same noise (the paper's x_t^w and
                        # x_t^l), and each image's errors are computed once however many pairs it is in (K forwards
                        # for --pairs-per-group all's K(K-1)/2 pairs). Keyed by the group's global index: any rank
                        # count and a resume draw the same ones
                        unit = 1 if pairs is None else (2 if args.pairs else args.group_size)
                        used = sorted({s for row in rows for s in row})  # the global samples these pairs hold
                        sigma, noise = group_noise(
                            used,
                            unit,
                            x0.shape[1:],
                            (args.seed, epoch, "train", i),
                            train_grid,
                            args.timestep_sampling,
                            args.logit_mean,
                            args.logit_std,
                        )
                        sigma, noise = sigma.to(device), noise.to(device)
                        idx = [position[s] for s in used]
                        x, mb_cond = x0[idx], cond[idx]
                        sb = sigma.view(-1, *[1] * (x.dim() - 1))  # broadcast over the latent dims
                        xt = (1 - sb) * x + sb * noise
                        if pairs is not None:
                            with (
                                torch.no_grad(),
                                common.autocast(device, args.mixed_precision),
                                models.swapped_weights(params, snapshots["reference"])
                                if snapshots
                                else models.reference_model(transformer),
                            ):
                                err_ref = fm_error(common.velocity(transformer, xt, sigma, mb_cond), noise - x)
                        if args.kl_beta > 0:
                            with (
                                torch.no_grad(),
                                common.autocast(device, args.mixed_precision),
                                models.reference_model(transformer),
                            ):
                                v_base = common.velocity(transformer, xt, sigma, mb_cond, args.kl_cfg)
                        with common.autocast(device, args.mixed_precision):
                            v = common.velocity(transformer, xt, sigma, mb_cond)  # training forwards: no CFG
                        err = fm_error(v, noise - x)
                        if pairs is None:  # SFT: the plain flow-matching loss on the chosen images
                            policy_loss = err.mean()
                        else:
                            row = {s: r for r, s in enumerate(used)}
                            win = torch.tensor([row[a] for a, _ in rows])
                            lose = torch.tensor([row[b] for _, b in rows])
                            pair_loss, z = dpo_loss(err[win], err[lose], err_ref[win], err_ref[lose], args.dpo_beta)
                            policy_loss = pair_loss.mean()
                            if args.sft_weight > 0 or args.kl_beta > 0:
                                reg = regularizer(
                                    err[win], v, v_base if args.kl_beta > 0 else None, args.sft_weight, args.kl_beta
                                )
                                policy_loss = policy_loss + reg
                            stats["implicit_acc"].append((z > 0).float().mean().item())
                            stats["margin"].append(z.mean().item())
                            # each side's error against the base's: the chosen one falling and the rejected one rising
                            # is the method working; both moving together is the model drifting on its own samples
                            stats["chosen_error"].append((err[win] - err_ref[win]).mean().item())
                            stats["rejected_error"].append((err[lose] - err_ref[lose]).mean().item())
                        (policy_loss / per_step).backward()
                        stats["policy_loss"].append(policy_loss.item())
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
            reward_all = rewards.total(scores)
            diagnostics = {"pairs": 0.0 if pairs is None else float(len(pairs))}
            if pairs is not None and len(pairs):
                diagnostics["pair_reward_gap"] = (reward_all[pairs[:, 0]] - reward_all[pairs[:, 1]]).mean().item()

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
