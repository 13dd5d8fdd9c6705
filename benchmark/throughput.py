"""Our sampler vs the diffusers pipeline's own `__call__`, same model, same noise, same schedule.

    python benchmark/throughput.py                       # tiny-shapes, 16 images x 10 steps, CFG 1 and 4.5
    python benchmark/throughput.py --model <folder or hub id> --device cuda --height 512

Both paths encode the prompts, run the transformer N times (x2 with CFG), and decode with the VAE, so the ratio
pipeline_time / our_time measures plumbing overhead (>= 1 means ours is no slower). Median of --repeats runs after
one warm-up each; the two are interleaved so that machine load hits both alike. It also checks that the images match.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import models  # noqa: E402,F401  (registers the model families with common)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=common.TINY_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-images", type=int, default=16)
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--height", type=int, default=None, help="default: the model's native size")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    pipe = models.load_pipeline(args.model, device)
    prompts = [f"a red circle and a blue square {i % 4}" for i in range(args.num_images)]
    t = pipe.transformer.config
    height = args.height or t.sample_size * pipe.vae_scale_factor
    latent = height // pipe.vae_scale_factor
    noise = torch.randn(args.num_images, t.in_channels, latent, latent, generator=torch.Generator().manual_seed(0))
    sigmas = np.linspace(1.0, 1.0 / args.num_steps, args.num_steps).tolist()

    def ours(g):
        enc = common.PromptEncoder(pipe)  # fresh: no cached embeddings, like the pipeline call
        out = common.sample(
            pipe.transformer,
            pipe.scheduler,
            enc.cond(prompts),
            num_steps=args.num_steps,
            guidance_scale=g,
            noise=noise,
        )
        return common.decode(pipe, out.latents)

    def theirs(g):
        msl = 1 if pipe.text_encoder_3 is None else 128
        return pipe(
            prompt=prompts,
            latents=noise.clone().to(device),
            num_inference_steps=args.num_steps,
            guidance_scale=g,
            height=height,
            width=height,
            sigmas=sigmas,
            max_sequence_length=msl,
            output_type="pt",
        ).images

    def timed(fn, g):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = fn(g)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    print(
        f"model {args.model}, {args.num_images} images x {args.num_steps} steps at {height}px, device {device}, "
        f"{args.threads} threads, median of {args.repeats}\n"
    )
    print(
        "| CFG | diffusers pipeline (s) | cleanflow sampler (s) | ratio pipeline/ours | max abs image diff |\n"
        "|---|---|---|---|---|"
    )
    for g in (1.0, 4.5):
        timed(ours, g), timed(theirs, g)  # warm-up
        t_ours, t_theirs = [], []
        for _ in range(args.repeats):
            dt, img_ours = timed(ours, g)
            t_ours.append(dt)
            dt, img_theirs = timed(theirs, g)
            t_theirs.append(dt)
        diff = (img_ours.cpu() - img_theirs.cpu()).abs().max().item()
        a, b = statistics.median(t_theirs), statistics.median(t_ours)
        print(f"| {g} | {a:.3f} | {b:.3f} | {a / b:.3f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
