"""How much does the reward differ inside one of GRPO's groups, and which sampling step's noise moves it?

    python benchmark/studies/group_spread.py --model assets/tiny-shapes-8                     # shapes_clean, training prompts
    python benchmark/studies/group_spread.py --model assets/tiny-text --reward ocr --prompts assets/text_train.jsonl

A diagnostic for the convergence protocol (benchmark/results/convergence/README.md, leg 10), not an algorithm: why
GRPO gains on tiny-text OCR and not on tiny-shapes. The base model draws `--groups` groups of 8 images of training
prompts with GRPO's rollout (`algos/grpo.py` defaults: 10 steps, Flow-SDE, eta 0.7, CFG 1, 4 SDE steps drawn from
steps 1-8) and prints, with the group's initial noise shared (GRPO's default) and not shared (Flow-GRPO's
`same_latent = False`): the mean reward, its standard deviation over all images and within a group (the contrast
group-relative advantages are made of), the share of groups whose images all score the same (advantage 0), and the
distinct reward values per group. Then the same groups with SDE noise at one step only (every other step an ODE
step, initial noise shared): which step's noise changes the reward. Prints markdown; writes nothing.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import common  # noqa: E402
import models  # noqa: E402,F401  (registers the model families with common)
from algos.grpo import sde_window_steps  # noqa: E402
from harness import prompt_files  # noqa: E402
from rewards import load_rewards  # noqa: E402

GROUP_SIZE, NUM_STEPS, ETA, SDE_STEPS = 8, 10, 0.7, 4  # algos/grpo.py's defaults


def rewards_of(pipe, encoder, reward, prompts, noise, sde_steps_of, seed):
    """Rewards [groups, 8] of one GRPO-style rollout per image, 64 images at a time (each chunk its own SDE steps)."""
    out = []
    for c in range(0, len(prompts), 64):
        sl = slice(c, c + 64)
        indices = range(c, min(c + 64, len(prompts)))
        with torch.no_grad():
            rollout = common.sample(
                pipe.transformer,
                pipe.scheduler,
                encoder.cond(prompts[sl]),
                num_steps=NUM_STEPS,
                noise=noise[sl],
                dynamics="Flow-SDE",
                eta=ETA,
                sde_steps=sde_steps_of(c),
                generator=common.keyed_generators(seed, "rollout", indices=indices),
                latent_shape=pipe.latent_shape,
            )
            out.append(reward.total(reward(common.decode(pipe, rollout.latents), prompts[sl])))
    return torch.cat(out).reshape(-1, GROUP_SIZE)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=common.TINY_MODEL)
    ap.add_argument("--reward", default="shapes_clean")
    ap.add_argument("--prompts", default=common.TRAIN_PROMPTS, help="prompt file the groups are drawn from")
    ap.add_argument("--groups", type=int, default=16, help="groups of 8 images (a multiple of 8: whole 64-image chunks)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.groups < 8 or args.groups % 8:
        raise common.UserError(f"--groups must be a positive multiple of 8 (got {args.groups})")
    torch.set_num_threads(1)
    device = torch.device("cpu")
    prompt_list = prompt_files.load_prompts(args.prompts)
    reward = load_rewards(args.reward, device, prompt_list)
    pipe = models.load_pipeline(args.model, device)
    encoder = common.PromptEncoder(pipe, None, "")
    prompts = common.group_prompts(prompt_list, args.groups, GROUP_SIZE, torch.Generator().manual_seed(args.seed))
    index = np.arange(len(prompts))
    window = list(range(NUM_STEPS))[1:-1]

    def window_subset(c):  # GRPO's own draw (--window-mode subset): SDE_STEPS of the window, one draw per chunk
        return sde_window_steps(window, SDE_STEPS, "subset", torch.Generator().manual_seed(args.seed * 1000 + c))

    print(f"\n{args.model}, reward {args.reward}, {args.groups} groups of {GROUP_SIZE} training prompts\n")
    print(
        "| initial noise | mean reward | std, all images | std within a group | groups all equal | distinct values per group |"
    )
    print("|---|---|---|---|---|---|")
    for shared in (True, False):
        keys = index // GROUP_SIZE if shared else index
        noise = common.randn((len(prompts), *pipe.latent_shape), common.keyed_generators(args.seed, "init", indices=keys))
        r = rewards_of(pipe, encoder, reward, prompts, noise, window_subset, args.seed)
        within = r.std(1)
        distinct = np.mean([len(set(np.round(g.numpy(), 4))) for g in r])
        print(
            f"| {'shared in a group' if shared else 'one per image'} | {r.mean():.3f} | {r.std():.3f} | {within.mean():.3f} "
            f"| {(within < 1e-6).float().mean():.0%} | {distinct:.1f} |"
        )
    noise = common.randn((len(prompts), *pipe.latent_shape), common.keyed_generators(args.seed, "init", indices=index // 8))
    print("\n| SDE noise at step only | mean reward | std within a group |\n|---|---|---|")
    for step in range(NUM_STEPS - 1):
        r = rewards_of(pipe, encoder, reward, prompts, noise, lambda c, s=step: [s], args.seed + 1 + step)
        print(f"| {step} | {r.mean():.3f} | {r.std(1).mean():.3f} |", flush=True)


if __name__ == "__main__":
    try:
        main()
    except common.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
