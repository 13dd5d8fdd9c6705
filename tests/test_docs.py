"""The README and docs/ name only flags and files that exist: a renamed flag or a moved file fails here, not for a
reader. Flags: every `--flag` in the text must be a field of some algorithm's Args, a flag of a benchmark, asset or
reward-server script, or one of the few other tools' flags the text quotes (pip, torchrun, pytest). Files: every
backticked or linked repository path must exist."""

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "benchmark" / "results" / "convergence" / "README.md",
]
ALGOS = ("grpo", "nft", "awm", "crd", "dgpo")
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
        *REPO.glob("assets/*.py"),
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
                next((REPO / top).rglob(ref), None) for top in ("algos", "assets", "benchmark", "models", "rewards", "tests")
            ):
                if not (REPO / ref).exists():
                    missing.append(ref)
            continue
        here = (doc.parent / ref).resolve() if ref.startswith("../") else REPO / ref
        if not here.exists():
            missing.append(ref)
    assert not missing, f"{doc.name} names files that do not exist: {missing}"
