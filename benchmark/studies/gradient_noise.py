"""How much of one optimizer step of each algorithm is signal? The gradient noise scale at the base model.

    python benchmark/studies/gradient_noise.py grpo --full-finetune --model assets/tiny-shapes-8 --num-epochs 40
    python benchmark/studies/gradient_noise.py crd --full-finetune --model assets/tiny-shapes-8 --num-epochs 40 --out crd.json

A diagnostic for the convergence protocol (benchmark/results/convergence/README.md, leg 11), not an algorithm. It runs
`algos/<algo>.py` unchanged with every flag given after the algorithm's name, except that each optimizer step's
gradient is recorded and then zeroed before AdamW sees it (and the weight decay is 0): the weights never leave the
base, so every epoch is a fresh on-policy batch drawn from the same model, and the recorded gradients are independent
draws of the algorithm's step direction there. From them, with g one step's gradient over B images (B = prompts x
group size / optimizer steps per epoch, the algorithm's own batch):

    |G|^2        = mean of g_i . g_j over steps i, j of different epochs     (unbiased: E[g_i . g_j] = G . G)
    tr(Sigma_B)  = mean of |g_i|^2 - |G|^2                                    (the step's noise)
    B_noise      = B tr(Sigma_B) / |G|^2                                       (images)

B_noise is McCandlish et al. 2018's simple noise scale B_simple (arXiv 1812.06162, Sec. 2.2): the batch in images at
which a step is half signal, half noise; a step of B images points along the true gradient with cosine
sqrt(B / (B + B_noise)).
It is also reported with every coordinate divided by its root mean square over the steps (the scaling AdamW applies),
which is what AdamW's steps see. Standard errors: jackknife over epochs. Prints one line and writes `--out` (json).
`--shuffled-advantages`: each batch's advantages permuted across its images first (as
benchmark/studies/shuffled_advantages.py; DPO, which has none: the rewards its pairs are chosen by), a control that keeps
the loss's form and scale and removes the reward: what signal remains does not come from the reward.

    python benchmark/studies/gradient_noise.py table benchmark/results/convergence/testbed8/leg11/gradient_noise

prints the markdown table of every json in a folder (and with --plot draws it).
"""

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import tyro

REPO = Path(__file__).resolve().parents[2]
ALGOS = ("grpo", "grpo_variants", "dgpo", "nft", "awm", "crd", "dpo", "elbo_grpo")


class Recorder:
    """Stands in for shell.clip_grad_norm (harness/distributed.py): keeps each step's gradient (summed per epoch, in
    float64, plus each epoch's per-coordinate sum of squares and each step's squared norm), then zeroes it so AdamW
    moves nothing."""

    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch
        self.epoch_sums, self.epoch_coord_sq, self.sq_norms = [], [], []

    def __call__(self, params, max_norm=None, *a, **kw):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten() for p in params])
        g = g.to(torch.float64).cpu()
        if len(self.sq_norms) % self.steps_per_epoch == 0:
            self.epoch_sums.append(torch.zeros_like(g))
            self.epoch_coord_sq.append(torch.zeros_like(g, dtype=torch.float32))
        self.epoch_sums[-1] += g
        self.epoch_coord_sq[-1] += (g * g).float()
        self.sq_norms.append(float(g @ g))
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        return torch.tensor(float(g @ g) ** 0.5)


def noise_scale(gram: np.ndarray, sq_norm_sum: float, steps: np.ndarray, batch: float) -> dict:
    """|G|^2, tr(Sigma_B) and B_noise from the Gram matrix of the per-epoch gradient sums (cross-epoch pairs only)."""
    n = steps.sum()
    pairs = n * n - (steps**2).sum()
    signal = (gram.sum() - np.trace(gram)) / pairs
    noise = sq_norm_sum / n - signal
    return {"signal": signal, "noise": noise, "b_noise": batch * noise / signal if signal > 0 else float("inf")}


def jackknife(gram: np.ndarray, sq_by_epoch: np.ndarray, steps: np.ndarray, batch: float) -> dict:
    full = noise_scale(gram, sq_by_epoch.sum(), steps, batch)
    n = len(steps)
    keep = [np.arange(n) != e for e in range(n)]
    loo = [noise_scale(gram[np.ix_(k, k)], sq_by_epoch[k].sum(), steps[k], batch) for k in keep]
    out = {}
    for key, value in full.items():
        vals = np.array([r[key] for r in loo])
        finite = np.isfinite(vals).all() and np.isfinite(value)
        out[key] = float(value)
        out[f"{key}_se"] = float(np.sqrt((n - 1) / n * ((vals - vals.mean()) ** 2).sum())) if finite else float("nan")
    return out


def adam_scaled(sums: torch.Tensor, coord_sq: torch.Tensor, steps: int) -> tuple:
    """AdamW's view of the steps: each coordinate divided by its root mean square over all `steps` (the second moment
    AdamW divides by; a coordinate that never had a gradient is left out). From the per-epoch gradient sums and
    per-epoch per-coordinate sums of squares [epochs, d]: the scaled sums' Gram matrix and each epoch's summed scaled
    squared norms, jackknife's inputs."""
    total_sq = coord_sq.sum(0)
    w = torch.where(total_sq > 0, steps / total_sq.clamp_min(1e-300), torch.zeros_like(total_sq))
    scaled = sums * w.sqrt()
    return (scaled @ scaled.T).numpy(), (coord_sq @ w).numpy()


def shuffle_rewards(module, algo: str, seed: int = 0):
    """The --shuffled-advantages control, patched into the loaded algorithm `module`: each batch's advantages are
    permuted across its images (DPO, which has none: the rewards its pairs are chosen by), so the loss keeps its form
    and scale and the reward no longer says which image is better."""
    gen = torch.Generator().manual_seed(seed)
    if algo == "dpo":
        real_pairs = module.select_pairs

        def shuffled_pairs(rewards, *a, **kw):
            return real_pairs(rewards[torch.randperm(rewards.numel(), generator=gen)], *a, **kw)

        module.select_pairs = shuffled_pairs
        return
    real = module.aggregate_advantages

    def shuffled_advantages(*a, **kw):
        adv = real(*a, **kw)
        return adv[torch.randperm(adv.numel(), generator=gen)]

    module.aggregate_advantages = shuffled_advantages


class OneLineParser(argparse.ArgumentParser):
    """Its own flags' errors in one line, exit 2 (the algorithm's flags are checked by the algorithm's own parser)."""

    def error(self, message):
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


def b_noise_range(r: dict, batch: float) -> tuple:
    """B_noise from the signal +- 2 SE: (low, high); high is inf when the signal is not 2 SE above 0."""
    lo, hi = r["signal"] - 2 * r["signal_se"], r["signal"] + 2 * r["signal_se"]
    return batch * r["noise"] / hi if hi > 0 else float("inf"), batch * r["noise"] / lo if lo > 0 else float("inf")


def fmt(x: float) -> str:
    return "inf" if not np.isfinite(x) else f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def plot(points: list, path: Path):
    """B_noise of each result on a log axis: the point, and the 2 SE range as a bar (an arrow where it is open above)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.35 * len(points) + 1.4))
    top = max(hi if np.isfinite(hi) else lo for _, lo, _, hi, _ in points) * 3
    for y, (name, lo, mid, hi, colour) in enumerate(points):
        right = hi if np.isfinite(hi) else top
        ax.plot([lo, right], [y, y], color=colour, lw=3, alpha=0.5)
        if np.isfinite(mid) and mid > 0:
            ax.plot(mid, y, "o", color=colour)
        if not np.isfinite(hi):
            ax.annotate("", (top * 1.4, y), (right, y), arrowprops=dict(arrowstyle="->", color=colour))
    ax.set_xscale("log")
    ax.set_yticks(range(len(points)), [p[0] for p in points], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("B_noise, images: the batch at which a step is half signal")
    ax.set_title("gradient noise scale at the base model (bar: 2 SE range; arrow: open above)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(folder: Path, png: Path = None):
    """The markdown table of every result in `folder`, sorted by the plain noise scale's lower end; `png`: its plot."""
    files = sorted(folder.glob("*.json"))
    if not files:
        print(f"gradient_noise.py: table: no .json results in {folder}", file=sys.stderr)
        sys.exit(2)
    rows = []
    for f in files:
        r = json.loads(f.read_text())
        b = r["images_per_step"]
        skip = {"--out", "--num-epochs", "--model", "--seed", "--reward", "--train-prompts", "--test-prompts"}
        flags = [a for i, a in enumerate(r["flags"]) if a not in skip and r["flags"][i - 1] not in skip]
        lo, hi = b_noise_range(r["plain"], b)
        alo, ahi = b_noise_range(r["adam"], b)
        p = r["plain"]
        cos = (b / (b + p["b_noise"])) ** 0.5 if p["signal"] > 0 else 0.0
        colour = "tab:red" if r["algo"] == "grpo" else "tab:grey" if r.get("shuffled_advantages") else "tab:blue"
        label = f"{' '.join([r['algo'], *flags])} ({Path(r['model']).name}, {r['reward']}, {r['steps']} steps)"
        rows.append(
            (
                lo,
                (label, lo, p["b_noise"] if p["signal"] > 0 else float("inf"), hi, colour),
                f"| {f.stem} | {' '.join([r['algo'], *flags])} | {Path(r['model']).name} | {r['reward']} | {b:g} x "
                f"{r['steps']} | {p['signal']:.3g} ± {p['signal_se']:.2g} | {p['noise']:.3g} | {fmt(p['b_noise'])} "
                f"({fmt(lo)}-{fmt(hi)}) | {fmt(r['adam']['b_noise'])} ({fmt(alo)}-{fmt(ahi)}) | {cos:.2f} |",
            )
        )
    print(
        "| result | algorithm and flags | model | reward | images per step x steps | signal \\|G\\|^2 ± SE | "
        "noise tr(Sigma_B) | B_noise, images (2 SE range) | Adam-scaled B_noise (2 SE range) | cos(step, G) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows.sort(key=lambda t: t[0])
    for *_, row in rows:
        print(row)
    if png:
        plot([point for _, point, _ in rows], png)


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "table":
        ap = OneLineParser(prog="gradient_noise.py table", allow_abbrev=False)
        ap.add_argument("folder", type=Path, help="a folder of gradient_noise.py's json results")
        ap.add_argument("--plot", type=Path, help="also draw the noise scales into this .png")
        opts = ap.parse_args(sys.argv[2:])
        if not opts.folder.is_dir():
            ap.error(f"{opts.folder}: not a folder")
        if opts.plot and not opts.plot.parent.is_dir():
            ap.error(f"--plot {opts.plot}: the folder {opts.plot.parent} does not exist")
        if opts.plot and importlib.util.find_spec("matplotlib") is None:
            ap.error("--plot needs matplotlib: pip install -r benchmark/requirements.txt")
        return table(opts.folder, opts.plot)
    usage = f"usage: gradient_noise.py {{{','.join(ALGOS)}}} [--out FILE] [--shuffled-advantages] [flags] | table FOLDER"
    if sys.argv[1:] in (["--help"], ["-h"]):  # the usage and this file's docstring; `ALGO --help` lists the file's flags
        print(f"{usage}\n\n{__doc__}")
        return
    if len(sys.argv) < 2 or sys.argv[1] not in ALGOS:
        print(usage, file=sys.stderr)
        sys.exit(2)
    algo = sys.argv[1]
    ap = OneLineParser(prog="gradient_noise.py", add_help=False, allow_abbrev=False)
    ap.add_argument("--out", type=Path, help="the json result")
    ap.add_argument("--shuffled-advantages", action="store_true", help="the control: advantages permuted per batch")
    opts, argv = ap.parse_known_args(sys.argv[2:])  # the rest are the algorithm's own flags
    out, shuffled = opts.out, opts.shuffled_advantages
    if out is not None and not out.parent.is_dir():
        ap.error(f"--out {out}: the folder {out.parent} does not exist")
    flags = argv + ["--shuffled-advantages"] * shuffled  # what the result records (no --out: no machine's folder)
    spec = importlib.util.spec_from_file_location(algo, REPO / "algos" / f"{algo}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[algo] = module  # tyro reads Args' field docstrings through the module, so it must be findable
    spec.loader.exec_module(module)  # puts the repo on sys.path, as running the script does
    if shuffled:
        shuffle_rewards(module, algo)
    from harness import run

    tmp = tempfile.TemporaryDirectory(prefix="gradient_noise_")
    # no evaluation or checkpoint in between (the weights never move), the run folder thrown away, AdamW's decay off
    argv = [*argv, "--weight-decay", "0", "--eval-every", "1000000", "--save-every", "1000000", "--output-dir", tmp.name]
    args = tyro.cli(module.Args, args=argv)
    if args.num_epochs < 3:
        print("gradient_noise.py: needs --num-epochs >= 3 (pairs of steps from different epochs)", file=sys.stderr)
        sys.exit(2)
    steps_per_epoch = args.grad_steps_per_epoch * getattr(args, "num_inner_epochs", 1)
    batch = args.num_prompts * args.group_size / args.grad_steps_per_epoch
    recorder = Recorder(steps_per_epoch)
    from harness import distributed, shell

    distributed.clip_grad_norm = shell.clip_grad_norm = recorder  # the loop calls it as shell.clip_grad_norm
    try:
        run.run_main(module.main, args, argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    steps = len(recorder.sq_norms)
    if steps != args.num_epochs * steps_per_epoch:
        raise SystemExit(f"gradient_noise.py: expected {args.num_epochs * steps_per_epoch} optimizer steps, saw {steps}")
    sums = torch.stack(recorder.epoch_sums)
    sq = np.array(recorder.sq_norms).reshape(-1, steps_per_epoch).sum(1)
    per_epoch = np.full(len(sums), steps_per_epoch, dtype=np.float64)
    plain = jackknife((sums @ sums.T).numpy(), sq, per_epoch, batch)
    adam = jackknife(*adam_scaled(sums, torch.stack(recorder.epoch_coord_sq).double(), steps), per_epoch, batch)
    result = {
        "algo": algo,
        "flags": flags,
        "shuffled_advantages": shuffled,
        "model": args.model,
        "reward": args.reward,
        "params": int(sums.shape[1]),
        "epochs": args.num_epochs,
        "steps": steps,
        "images_per_step": batch,
        "plain": plain,
        "adam": adam,
    }
    cos = (batch / (batch + plain["b_noise"])) ** 0.5 if np.isfinite(plain["b_noise"]) else 0.0
    print(
        f"{algo}: {steps} steps of {batch:g} images; |G|^2 {plain['signal']:.3g} +- {plain['signal_se']:.2g}, "
        f"tr(Sigma_B) {plain['noise']:.3g}; B_noise {plain['b_noise']:.4g} images (Adam-scaled {adam['b_noise']:.4g}); "
        f"cos(step, G) {cos:.3f}"
    )
    if out:
        out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
