"""A refactor must not change a number: two-epoch tiny runs of every script (and each Flow-GRPO variant), the sha256 of
every exported file's tensors, written as JSON. Run it at two commits on one machine and compare the files:

    python benchmark/same_exports.py --out /tmp/before.json          # at the commit before the change
    python benchmark/same_exports.py --out /tmp/after.json --compare /tmp/before.json

Bitwise equality holds for one machine and thread count (float kernels differ between CPU families), which is why the
comparison is between two runs here rather than against hashes in the repository. One thread: OMP_NUM_THREADS=1."""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = "--num-epochs 2 --num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --eval-every 1 --save-every 1"
# every script at its default algorithm, LoRA and every weight, and each Flow-GRPO variant's switch
RUNS = {
    "awm": "awm.py --grad-steps-per-epoch 2 --micro-batch 2 --no-full-finetune",
    "awm_full": "awm.py --grad-steps-per-epoch 1",
    "crd": "crd.py --grad-steps-per-epoch 1 --no-full-finetune",
    "crd_full": "crd.py --grad-steps-per-epoch 1",
    "dgpo": "dgpo.py --grad-steps-per-epoch 1 --off-policy-after 1 --no-full-finetune",
    "dpo": "dpo.py --grad-steps-per-epoch 1 --pairs-per-group all --no-full-finetune",
    "elbo_grpo": "elbo_grpo.py --no-full-finetune",
    "nft": "nft.py --no-full-finetune",
    "nft_full": "nft.py",
    "grpo": "grpo.py --grad-steps-per-epoch 1 --num-sde-steps 2",
    "grpo_mix": "grpo_variants.py --grad-steps-per-epoch 1 --num-sde-steps 2 --window-mode sliding --window-shift 1 1",
    "grpo_tempflow": "grpo_variants.py --grad-steps-per-epoch 1 --num-sde-steps 2 --noise-weight 2.25",
    "grpo_dppo": "grpo_variants.py --grad-steps-per-epoch 1 --num-sde-steps 2 --kl-mask 0.01",
    "grpo_pref": "grpo_variants.py --grad-steps-per-epoch 1 --num-sde-steps 2 --win-rate-reward",
    "grpo_guard": "grpo_variants.py --grad-steps-per-epoch 1 --num-sde-steps 2 --grpo-guard",
    "grpo_kl": "grpo.py --grad-steps-per-epoch 1 --num-sde-steps 2 --kl-beta 0.01 --leave-one-out --num-inner-epochs 2",
    # the distillation files: two teachers, a fake score, and RL on the committed 2-step model
    "opd": "opd.py --grad-steps-per-epoch 1 --num-train-timesteps 2 --no-full-finetune",
    "dmd2": "dmd2.py --grad-steps-per-epoch 1 --fake-updates 2",
    "tdm_r1": "tdm_r1.py --grad-steps-per-epoch 1 --num-steps 2",
}


def tensor_hashes(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.rglob("*.safetensors")):
        tensors = load_file(f)
        h = hashlib.sha256()
        for name in sorted(tensors):
            h.update(name.encode())
            h.update(tensors[name].contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
        out[str(f.relative_to(folder))] = h.hexdigest()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", default=None, help="a file of an earlier run: exit 1 where a hash differs")
    parser.add_argument("--only", nargs="*", default=None)
    opts = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, command in RUNS.items():
            if opts.only and name not in opts.only:
                continue
            script, *flags = command.split()
            out = Path(tmp) / name
            argv = [sys.executable, f"algos/{script}", *TINY.split(), *flags, "--output-dir", str(out), "--seed", "3"]
            proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
            (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
            exports = [p for p in run_dir.iterdir() if p.name in ("lora", "transformer")]
            results[name] = {str(e.name): tensor_hashes(e) for e in exports}
            print(name, json.dumps(results[name])[:120], flush=True)
    Path(opts.out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if opts.compare:
        before = json.loads(Path(opts.compare).read_text())
        differ = [n for n in results if n in before and results[n] != before[n]]
        missing = [n for n in results if n not in before]
        print(f"same: {len(results) - len(differ) - len(missing)}, differ: {differ}, not in {opts.compare}: {missing}")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
