"""The README's results table, from the committed scores of the 960-image held-out protocol.

    python benchmark/results_table.py            # every row (benchmark/results/README.md, whose links it writes)
    python benchmark/results_table.py --summary  # one cell per algorithm and testbed, at its defaults (the README's)
    python benchmark/results_table.py --exports  # the exports it cites that are in the tree (benchmark/results/README.md)

One protocol for every row: each export (what a user loads: runs/<run>/transformer or lora) sampled in a fresh stock
pipeline, ODE 10 steps at CFG 1, on the 30 held-out prompts x 32 noises (960 images) of tiny-shapes and tiny-shapes-8,
or the 64 held-out words x 8 noises (512 images) of tiny-text, paired with the base on the same noises at CFG 1 and at
CFG 4.5 (`python benchmark/convergence.py final RUN ... --noises 32 --sets test`, which wrote the `final.jsonl` files
read here); tiny-edit's are the 28 held-out instructions x 8 noises, each with its source image, through the stock
FluxKontextPipeline, exact = the exact edit (`python benchmark/edit.py score RUN ...`). A gain is the mean over prompts
of the seeds' mean per-prompt gain, ± one standard error over prompts (it carries the base's own noise on these
images); bold when beyond two. Extra objects: per image, mean over seeds. Prints markdown; reads only the jsonl files
named in ROWS.
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark.convergence import mean_se, read_jsonl  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TESTBEDS = {"tiny-shapes": "30 x 32", "tiny-shapes-8": "30 x 32", "tiny-text (OCR)": "64 x 8", "tiny-edit": "28 x 8"}
# testbed, algorithm (a GRPO variant: "grpo (MixGRPO)", a switch of algos/grpo_variants.py), the results folder
# holding its final.jsonl (and the base scored on the same noises), the setting's name in it, the committed export of
# one of its seeds (None: not in the tree; each run's command remakes it)
ROWS = [
    ("tiny-shapes", "crd", "shapes_clean/rescore32", "crd", None),
    ("tiny-shapes", "dgpo", "shapes_clean/rescore32", "dgpo", None),
    ("tiny-shapes", "nft", "shapes_clean/rescore32", "nft", None),
    ("tiny-shapes", "dpo", "convergence/dpo_elbo", "dpo_full", None),
    # the established fixes together (issue dpo-learns): every pair sharing a group's noise, TR-DPO's reference renewal
    ("tiny-shapes", "dpo (all pairs, beta 500, reference every 2 steps)", "convergence/dpo_learns", "dpo_all_b500_ref2", None),
    ("tiny-shapes", "elbo_grpo", "convergence/dpo_elbo", "elbo_grpo_full_lr3e-5", None),
    ("tiny-shapes", "awm", "convergence/awm_kl", "awm_full_kl0.1_lr1e-4", None),  # KL 0.1, the default since leg 16
    ("tiny-shapes", "crd", "convergence/rescore32", "crd_full_lr1e-4", "convergence/leg2/crd_full_lr1e-4__s1"),
    ("tiny-shapes", "nft", "convergence/rescore32", "nft_full_lr1e-4", "convergence/leg2/nft_full_lr1e-4__s1"),
    ("tiny-shapes", "dgpo", "convergence/rescore32", "dgpo_full_lr1e-4", "convergence/leg2/dgpo_full_lr1e-4__s1"),
    ("tiny-shapes", "awm (KL 0.01)", "convergence/rescore32", "awm_full_lr1e-4", None),  # AWM's default KL until leg 16
    ("tiny-shapes", "grpo", "convergence/leg7", "grpo", "convergence/leg7/grpo__s1"),
    # issue few-step: a student of two CRD teachers (each on its own prompt domain), the 2-step DMD2 generator (its
    # seed 1 is where TDM-R1 starts) and TDM-R1 on it, against the base at 10 steps (benchmark/few_step_table.py)
    ("tiny-shapes", "opd (two teachers)", "convergence/few_step", "opd", None),
    ("tiny-shapes", "dmd2 (2 steps)", "convergence/few_step", "dmd2", "convergence/few_step/dmd2__s1"),
    ("tiny-shapes", "tdm_r1 (2 steps)", "convergence/few_step", "tdm_r1", None),
    ("tiny-shapes-8", "crd", "convergence/testbed8/seeds32", "crd_full_lr1e-4", None),
    ("tiny-shapes-8", "dgpo", "convergence/testbed8/seeds32_long", "dgpo_full_lr1e-4", None),
    (
        "tiny-shapes-8",
        "nft",
        "convergence/testbed8/seeds32_12800",
        "nft_full_lr1e-4",
        "convergence/testbed8/leg9b/nft_full_lr1e-4__s3",
    ),
    ("tiny-shapes-8", "awm", "convergence/testbed8/leg12", "awm_full_kl0.1_lr1e-4", None),  # the default KL 0.1
    # AWM's best setting there (leg 18)
    ("tiny-shapes-8", "awm (KL 0.03, EMA 0.99)", "convergence/testbed8/leg18", "awm_full_kl0.03_ema0.99_lr1e-4", None),
    ("tiny-shapes-8", "grpo", "convergence/testbed8/seeds32_grpo", "grpo", "convergence/testbed8/leg10/grpo__s1"),
    # the long run to the length GRPO's gradient noise scale predicts (testbed8/grpo_long/README.md)
    (
        "tiny-shapes-8",
        "grpo (8 SDE steps, lr 2e-5)",
        "convergence/testbed8/grpo_long",
        "grpo_long_sde8_lr2e-5",
        "convergence/testbed8/grpo_long/export",
    ),
    ("tiny-shapes-8", "elbo_grpo", "convergence/testbed8/leg13", "elbo_grpo_full_lr3e-5", None),
    ("tiny-shapes-8", "dpo", "convergence/testbed8/dpo_default", "dpo_full", None),
    ("tiny-shapes-8", "grpo (MixGRPO)", "convergence/testbed8/leg14", "grpo_mixgrpo", None),
    ("tiny-shapes-8", "grpo (TempFlow-GRPO)", "convergence/testbed8/leg14", "grpo_tempflow", None),
    ("tiny-shapes-8", "grpo (Flow-DPPO)", "convergence/testbed8/leg14", "grpo_flow_dppo", None),
    ("tiny-shapes-8", "grpo (Pref-GRPO)", "convergence/testbed8/leg14", "grpo_pref", None),
    ("tiny-text (OCR)", "crd", "convergence/ocr/leg6", "crd", "convergence/ocr/leg6/crd__s1"),
    ("tiny-text (OCR)", "nft", "convergence/ocr/leg6", "nft", None),
    ("tiny-text (OCR)", "dgpo", "convergence/ocr/leg6", "dgpo", None),
    ("tiny-text (OCR)", "awm", "convergence/ocr/awm_kl", "awm_kl0.1", None),
    ("tiny-text (OCR)", "grpo", "convergence/ocr/leg6", "grpo", "convergence/ocr/leg6/grpo__s1"),
    ("tiny-text (OCR)", "dpo", "convergence/ocr/dpo_elbo", "dpo_full", None),
    ("tiny-text (OCR)", "elbo_grpo", "convergence/ocr/dpo_elbo", "elbo_grpo_full_lr3e-5", None),
    ("tiny-text (OCR)", "grpo (MixGRPO)", "convergence/ocr/variants", "grpo_mixgrpo", None),
    ("tiny-text (OCR)", "grpo (TempFlow-GRPO)", "convergence/ocr/variants", "grpo_tempflow", None),
    ("tiny-text (OCR)", "grpo (Flow-DPPO)", "convergence/ocr/variants", "grpo_flow_dppo", None),
    ("tiny-text (OCR)", "grpo (Pref-GRPO)", "convergence/ocr/variants", "grpo_pref", None),
    # exact = the exact edit (benchmark/edit.py score: the stock FluxKontextPipeline, 28 held-out instructions x 8 noises)
    ("tiny-edit", "crd", "edit", "crd", None),
    ("tiny-edit", "nft", "edit", "nft", None),
    ("tiny-edit", "dgpo", "edit", "dgpo", None),
    ("tiny-edit", "awm (KL 0.01)", "edit", "awm", None),
    ("tiny-edit", "grpo", "edit", "grpo", None),
    ("tiny-edit", "dpo", "edit", "dpo_full", None),
    ("tiny-edit", "elbo_grpo (lr 1e-4)", "edit", "elbo_grpo_full", None),  # the default before leg 15
]
HEADER = [
    "| testbed | algorithm | images trained | seeds | held-out exact | vs base CFG 1 | vs base CFG 4.5 | extra objects/img |",
    "|---|---|---|---|---|---|---|---|",
]


def held_out(folder: str, name: str) -> list:
    """The rows of folder/name on the held-out prompts."""
    return [r for r in read_jsonl(RESULTS / folder / name) if r["set"] == "test"]


def gain(rows: list, tag: str) -> str:
    """The seeds' mean per-prompt exact gain over the base at `tag`, ± one SE over prompts; bold beyond two SE."""
    per_prompt = np.mean([r[f"exact_gain_{tag}_per_prompt"] for r in rows], axis=0)
    cell = mean_se(per_prompt)
    beyond = abs(per_prompt.mean()) > 2 * per_prompt.std(ddof=1) / np.sqrt(len(per_prompt))  # unrounded, as mean_se's
    return f"**{cell}**" if beyond else cell


def extra(rows: list) -> str:
    return f"{np.mean([r['extra'] for r in rows]):.2f}" if all("extra" in r for r in rows) else "-"


def table() -> list:
    out, based = list(HEADER), set()
    for testbed, algo, folder, setting, export in ROWS:
        if testbed not in based:  # the base on the same noises, once per testbed
            based.add(testbed)
            for cfg in (1.0, 4.5):
                (b,) = [r for r in held_out(folder, "base.jsonl") if r["guidance_scale"] == cfg]
                label = f"base, CFG {cfg:g} ({TESTBEDS[testbed]})"
                out.append(f"| {testbed} | {label} | 0 | - | {b['exact']:.3f} | | | {extra([b])} |")
        rows = [r for r in held_out(folder, "final.jsonl") if r["setting"] == setting]
        if not rows:
            raise SystemExit(f"results_table.py: no held-out row of {setting} in {folder}/final.jsonl")
        images = "/".join(sorted({f"{r['images']:,}" for r in rows}))
        exact = np.mean([r["exact"] for r in rows])
        name, _, variant = algo.partition(" ")
        # the table lives in benchmark/results/README.md
        link = f"[{name}](../../docs/{name}.md)" + (f" {variant}" if variant else "")
        out.append(
            f"| {testbed} | {link} | {images} | {len(rows)} | {exact:.3f} | {gain(rows, 'cfg1')} | "
            f"{gain(rows, 'cfg4.5')} | {extra(rows)} |"
        )
    return out


ALGOS = ["crd", "nft", "dgpo", "awm", "elbo_grpo", "grpo", "dpo", "opd", "dmd2", "tdm_r1"]


def summary() -> list:
    """One cell per algorithm and testbed: the first row of ROWS at the file's defaults (a plain algorithm name; else
    its first labelled row, the label in the cell), as held-out exact, its gain over the CFG-1 base ± one SE (bold
    beyond two), images trained and seeds."""
    testbeds = list(TESTBEDS)
    out = ["| algorithm | " + " | ".join(testbeds) + " |", "|---" * (len(testbeds) + 1) + "|"]
    bases = {}
    for testbed in testbeds:
        folder = next(f for t, _, f, _, _ in ROWS if t == testbed)
        bases[testbed] = {r["guidance_scale"]: r["exact"] for r in held_out(folder, "base.jsonl")}
    for cfg in (1.0, 4.5):
        out.append(f"| base, CFG {cfg:g} | " + " | ".join(f"{bases[t][cfg]:.3f}" for t in testbeds) + " |")
    for algo in ALGOS:
        cells = []
        for testbed in testbeds:
            mine = [r for r in ROWS if r[0] == testbed and r[1].split(" ")[0] == algo]
            plain = [r for r in mine if r[1] == algo]
            if not (plain or mine):
                cells.append("-")
                continue
            _, label, folder, setting, _ = (plain or mine)[0]
            rows = [r for r in held_out(folder, "final.jsonl") if r["setting"] == setting]
            images = "/".join(sorted({f"{r['images']:,}" for r in rows}))
            note = label.partition(" ")[2].strip("()")
            exact = np.mean([r["exact"] for r in rows])
            cells.append(
                f"{exact:.3f} ({gain(rows, 'cfg1')}; {images} img, {len(rows)} seed{'s' * (len(rows) > 1)}"
                + (f"; {note}" if note else "")
                + ")"
            )
        out.append(f"| [{algo}](docs/{algo}.md) | " + " | ".join(cells) + " |")
    return out


def exports() -> list:
    """The committed export of each row that has one (links relative to benchmark/results/, where this table lives)."""
    out = ["| testbed | algorithm | images trained | seed | folder |", "|---|---|---|---|---|"]
    for testbed, algo, folder, setting, export in ROWS:
        if export:
            seed = json.loads((RESULTS / export / "args.json").read_text())["seed"]
            (row,) = [r for r in held_out(folder, "final.jsonl") if r["setting"] == setting and r["seed"] == seed]
            out.append(f"| {testbed} | {algo} | {row['images']:,} | {seed} | [{export}]({export}) |")
    return out


if __name__ == "__main__":
    if sys.argv[1:] in (["--help"], ["-h"]):
        print(__doc__)
    elif sys.argv[1:] not in ([], ["--exports"], ["--summary"]):
        print(f"results_table.py: unknown arguments {' '.join(sys.argv[1:])}; --help says what it prints", file=sys.stderr)
        sys.exit(2)
    else:
        print("\n".join({"--exports": exports, "--summary": summary}.get("".join(sys.argv[1:]), table)()))
