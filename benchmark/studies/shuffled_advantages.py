"""A control run for GRPO (issue learning-shown): `algos/grpo.py` unchanged, except that each batch's advantages are
shuffled across its samples before the loss, so every update has GRPO's size and noise but carries no reward signal.

GRPO with every weight trained loses reward and held-out exact on tiny-shapes while its per-step ratios stay inside
PPO's clip. If a run with shuffled advantages falls as fast, the real run's updates are mostly noise at this batch
size: AdamW scales noise and signal to the same step size, and the steps add up to a random walk away from the base.

    python benchmark/studies/shuffled_advantages.py --full-finetune --learning-rate 1e-4 --exp-name grpo_shuffled ...

takes every flag of algos/grpo.py (`benchmark/convergence.py train grpo_full_shuffled_lr1e-4` runs it).
"""

import importlib.util
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("grpo_shuffled", REPO / "algos" / "grpo.py")  # not the real `grpo`
grpo = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = grpo  # tyro reads Args' field docstrings from the module's source (--help, a flag's error)
spec.loader.exec_module(grpo)  # puts the repo on sys.path, as running the script does
from harness import run  # noqa: E402

real_advantages = grpo.aggregate_advantages


def shuffled_advantages(scores: dict, *a, **kw) -> torch.Tensor:
    adv = real_advantages(scores, *a, **kw)
    # a permutation keyed by the rewards themselves: the same batch gets the same shuffle on an exact --resume
    key = int(sum(float(v.double().sum()) for v in scores.values()) * 1e6) % (2**62)
    return adv[torch.randperm(adv.numel(), generator=torch.Generator().manual_seed(key))]


grpo.aggregate_advantages = shuffled_advantages

if __name__ == "__main__":
    run.run_main(grpo.main, run.cli(grpo.Args))
