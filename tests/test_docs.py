"""The README and docs/ name only flags and files that exist: a renamed flag or a moved file fails here, not for a
reader. Flags: every `--flag` in the text must be a field of some algorithm's Args, a flag of a benchmark, asset or
reward-server script, or one of the few other tools' flags the text quotes (pip, torchrun, pytest). Files: every
backticked or linked repository path must exist."""

import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_script

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "benchmark" / "README.md",
    REPO / "benchmark" / "studies" / "README.md",
    REPO / "benchmark" / "results" / "README.md",
    REPO / "benchmark" / "results" / "convergence" / "README.md",
]
ALGOS = ("grpo", "grpo_variants", "nft", "awm", "crd", "dgpo", "dmd2", "dpo", "elbo_grpo", "opd", "tdm_r1")
# other tools' flags the docs quote in their commands
EXTERNAL = {
    "--help",
    "--index-url",
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--logdir",
    "--depth",  # git clone
    "--exports",  # benchmark/results_table.py's flags, read from sys.argv
    "--summary",
}


def known_flags() -> set:
    flags = set(EXTERNAL)
    for algo in ALGOS:
        args = importlib.import_module(f"algos.{algo}").Args
        for f in dataclasses.fields(args):
            flags |= {"--" + f.name.replace("_", "-"), "--no-" + f.name.replace("_", "-")}
    for script in [
        *REPO.glob("benchmark/*.py"),
        *REPO.glob("benchmark/studies/*.py"),
        *REPO.glob("benchmark/testbeds/*.py"),
        REPO / "rewards" / "server.py",
    ]:
        text = script.read_text()
        for flag, rest in re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"([^)]*)", text):
            flags |= {flag, "--no-" + flag[2:]} if "BooleanOptionalAction" in rest else {flag}
        flags |= {"--" + name.replace("_", "-") for name in re.findall(r"^    ([a-z_]+): [A-Za-z\[]", text, re.M)}
    return flags


def test_every_flag_the_docs_name_exists():
    flags = known_flags()
    missing = {}
    for doc in DOCS:
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", doc.read_text()):
            if flag not in flags:
                missing.setdefault(flag, doc.relative_to(REPO).as_posix())
    assert not missing, f"flags named in the docs that no script has: {missing}"


PATH = re.compile(r"(?:`|\]\()((?:\.\./)*(?:algos|benchmark|rewards|models|assets|tests|docs)/[\w./-]+|[\w-]+\.py)(?:`|\)|#)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_file_the_docs_name_exists(doc):
    missing = []
    for ref in PATH.findall(doc.read_text()):
        if "<" in ref or "*" in ref:  # a pattern (algos/<algo>.py), not a file
            continue
        if "/" not in ref:  # a bare file name: somewhere in the repository's own folders
            if not any(
                next((REPO / top).rglob(ref), None)
                for top in ("algos", "assets", "benchmark", "harness", "models", "rewards", "tests")
            ):
                if not (REPO / ref).exists():
                    missing.append(ref)
            continue
        here = (doc.parent / ref).resolve() if ref.startswith("../") else REPO / ref
        if not here.exists():
            missing.append(ref)
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def results_table(*flags) -> str:
    out = subprocess.run([sys.executable, "benchmark/results_table.py", *flags], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow
def test_readme_results_table_is_the_scripts_output():
    """The README's results table is `python benchmark/results_table.py --summary`, and benchmark/results/README.md's
    full table `python benchmark/results_table.py`, as printed (so their numbers are the committed scores'); the results
    README lists the exports the table cites."""
    results = (REPO / "benchmark" / "results" / "README.md").read_text()
    for text, flags, header in (
        ((REPO / "README.md").read_text(), ["--summary"], "| algorithm | tiny-shapes |"),
        (results, [], "| testbed | algorithm | images trained |"),
    ):
        start = text.index(header)
        assert text[start:].split("\n\n", 1)[0].strip() == results_table(*flags), f"table {flags} differs: run it"
    assert results_table("--exports") in results


@pytest.mark.slow
def test_readme_python_blocks_run_on_the_quick_start_output(tmp_path, monkeypatch):
    """Every ```python block of the README, run as written on what the quick start writes (`python algos/crd.py`,
    its defaults, two epochs instead of 60): `runs/<run_name>` is that run's folder, the tiny model its path here."""
    run_script(["algos/crd.py", "--num-epochs", "2", "--output-dir", tmp_path / "runs"], timeout=900)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert blocks and any("runs/<run_name>/transformer" in b for b in blocks)
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        before = set(tmp_path.iterdir())
        exec(block.replace("runs/<run_name>", str(run_dir)).replace('"assets/', f'"{REPO}/assets/'), {})
        assert set(tmp_path.iterdir()) - before, "a README block ran and wrote nothing"


CODE_PATH = re.compile(r"(?<![\w./-])((?:algos|benchmark|rewards|models|assets|tests|docs|harness)/[\w.-]+(?:/[\w.-]+)*)")
# named in comments on purpose, though not files: a mistyped path the model loader's message is about
NOT_FILES = {"assets/tiny-shape"}


def test_every_repository_path_a_comment_names_exists():
    """Every path into the repository named in a comment or a docstring of its Python files exists (a pattern such as
    `benchmark/sd35_<algo>.sh`, a prefix ending in `_` and a runs/ folder a command writes are not files)."""
    import io
    import tokenize

    missing = {}
    for path in sorted(REPO.rglob("*.py")):
        if {".venv", ".ci-venv", "results"} & set(path.relative_to(REPO).parts):
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type != tokenize.COMMENT and not (
                tok.type == tokenize.STRING and tok.string.lstrip("rbuf").startswith('"""')
            ):
                continue
            for ref in CODE_PATH.findall(tok.string):
                ref = ref.rstrip(".,")
                if any(c in ref for c in "<*{") or ref.endswith("_") or "/runs" in ref or ref in NOT_FILES:
                    continue
                if not (REPO / ref).exists():
                    missing.setdefault(path.relative_to(REPO).as_posix(), []).append(ref)
    assert not missing, f"paths named in comments that do not exist: {missing}"
