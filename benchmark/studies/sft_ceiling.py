"""Can the tiny model learn "exact" at all? Fine-tune its LoRA on its own exact samples and measure.

    python benchmark/studies/sft_ceiling.py                          # CFG 4.5 samples, 16 per training prompt, 1000 steps
    python benchmark/studies/sft_ceiling.py --guidance-scale 1 --samples-per-prompt 32

A diagnostic for the convergence protocol (benchmark/results/convergence/README.md), not an algorithm of the project:
rejection-sampling fine-tuning (RAFT, arXiv 2304.06767, one round). The base model samples every training prompt
`--samples-per-prompt` times; the samples that are exact (the asked objects and nothing else) are kept; a LoRA of the
scripts' default shape (or every weight, `--full-finetune`) is trained on them with the plain flow-matching loss
||v(x_sigma) - (eps - x0)||^2 (sigma uniform over the 10-step schedule); then held-out and training prompts are
scored like `convergence.py base`, ODE 10 steps at CFG 1. If this cannot raise exact, the RL algorithms' plateau is
the model's or the LoRA's limit; if it can, the room is reachable and the algorithms' signal is what is missing.
`--ground-truth` trains on freshly rendered scenes of the training prompts instead (what pretraining saw, exact by
construction): the same budget spent on perfect data, a reference for what the model can still learn.
Appends one row to benchmark/results/convergence/sft_ceiling.jsonl.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import models  # noqa: E402,F401  (registers the model families with common)
from benchmark.convergence import RESULTS, append, prompt_sets, score, summary  # noqa: E402
from harness import prompt_files  # noqa: E402
from rewards import shapes  # noqa: E402
from rewards.worlds import shapes as world  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--guidance-scale", type=float, default=4.5, help="CFG of the base's samples (not of the eval)")
    ap.add_argument("--samples-per-prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--feed-forward", action="store_true", help="LoRA on the feed-forward layers too (more capacity)")
    ap.add_argument("--full-finetune", action="store_true", help="train every transformer weight instead of a LoRA")
    ap.add_argument(
        "--ground-truth",
        action="store_true",
        help="train on rendered scenes of the training prompts (the pretraining data) instead of the base's exact samples",
    )
    ap.add_argument("--cache", default=None, help="a file to keep the kept samples in and reuse (e.g. runs/sft.pt)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t0 = time.time()
    pipe = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"))
    encoder = common.PromptEncoder(pipe)
    train = prompt_files.load_prompts(common.TRAIN_PROMPTS)

    # 1. the base's samples of every training prompt; keep the exact ones (or reuse the kept ones from --cache)
    key = {"guidance_scale": args.guidance_scale, "samples_per_prompt": args.samples_per_prompt, "seed": args.seed}
    cached = torch.load(args.cache, weights_only=True) if args.cache and Path(args.cache).is_file() else None
    if args.ground_truth:  # what pretraining saw: every scene is exact by construction (and stays exact through the VAE)
        rng = random.Random(args.seed)
        rows = [spec for spec in world.splits()[0] for _ in range(args.samples_per_prompt)]
        images = torch.from_numpy(np.stack([world.render(world.sample_scene(rng, *spec)) for spec in rows]))
        vae = pipe.pipe.vae
        with torch.no_grad():
            z = vae.encode(images.permute(0, 3, 1, 2).float() / 127.5 - 1).latent_dist.mode()
        kept_latents = [(z - (getattr(vae.config, "shift_factor", None) or 0.0)) * vae.config.scaling_factor]
        kept_prompts, total = [spec[1] for spec in rows], len(rows)
    elif cached is not None and cached["key"] == key:
        kept_latents, kept_prompts, total = [cached["latents"]], cached["prompts"], cached["total"]
    else:
        kept_latents, kept_prompts = [], []
        prompts = [p for p in train for _ in range(args.samples_per_prompt)]
        for k in range(0, len(prompts), 64):
            chunk = prompts[k : k + 64]
            out = common.sample(
                pipe.transformer,
                pipe.scheduler,
                encoder.cond(chunk, negative=args.guidance_scale > 1),
                num_steps=10,
                guidance_scale=args.guidance_scale,
                generator=torch.Generator().manual_seed(10_000 * args.seed + k),
            )
            exact = shapes.evaluate(common.decode(pipe, out.latents), chunk, chunk)["exact"].bool()
            kept_latents.append(out.latents[exact])
            kept_prompts += [p for p, e in zip(chunk, exact.tolist()) if e]
        total = len(prompts)
        if args.cache:
            Path(args.cache).parent.mkdir(parents=True, exist_ok=True)
            torch.save({"key": key, "latents": torch.cat(kept_latents), "prompts": kept_prompts, "total": total}, args.cache)
    x0_all = torch.cat(kept_latents)
    covered = len(set(kept_prompts))
    print(f"kept {len(kept_prompts)} exact samples of {total} ({covered} of {len(train)} prompts)", flush=True)

    # 2. flow matching on the kept samples, LoRA as the scripts attach it
    pipe.transformer.requires_grad_(False)
    targets = None  # the family's attention projections, as the scripts
    if args.feed_forward:
        targets = (*pipe.family.lora_targets, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
    if args.full_finetune:  # the capacity question without the LoRA's rank limit
        pipe.transformer.requires_grad_(True)
        params = list(pipe.transformer.parameters())
    else:
        params = models.add_lora(pipe.transformer, args.lora_rank, 2.0 * args.lora_rank, targets)
    opt = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=1e-4)
    sigmas = common.sigma_schedule(pipe.scheduler, 10)[:-1]
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        idx = torch.randint(len(kept_prompts), (args.batch,), generator=gen)
        x0 = x0_all[idx]
        eps = torch.randn(x0.shape, generator=gen)
        sigma = sigmas[torch.randint(len(sigmas), (args.batch,), generator=gen)]
        s = sigma.view(-1, *[1] * (x0.dim() - 1))
        v = common.velocity(pipe.transformer, (1 - s) * x0 + s * eps, sigma, encoder.cond([kept_prompts[i] for i in idx]))
        loss = ((v - (eps - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 200 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    # 3. the same scoring as `convergence.py base` (CFG 1), paired with the base at CFG 1 on the same noises
    pipe.transformer.eval()
    method = "sft_on_rendered_scenes" if args.ground_truth else "sft_on_exact_samples"
    row = {"method": method, **vars(args), "kept": len(kept_prompts), "prompts_covered": covered}
    base_pipe = models.load_pipeline(common.TINY_MODEL, torch.device("cpu"))
    base_encoder = common.PromptEncoder(base_pipe)
    for name, prompts in prompt_sets().items():
        m = score(pipe, encoder, prompts, 1.0)
        b = score(base_pipe, base_encoder, prompts, 1.0)
        row[name] = summary(m, {"cfg1": b})
        print(name, json.dumps({k: round(v, 3) for k, v in row[name].items()}), flush=True)
    row["seconds"] = round(time.time() - t0)
    append(RESULTS / "sft_ceiling.jsonl", row)


if __name__ == "__main__":
    main()
