"""The five algorithm files share their boilerplate byte for byte (CleanRL's rule), so `diff` shows only the algorithm."""

import ast
import re
from pathlib import Path

import pytest

ALGOS = sorted((Path(__file__).resolve().parents[1] / "algos").glob("*.py"))


def shared_blocks(path: Path) -> list:
    """The text of every `# TRY NOT TO MODIFY:` block, up to the next banner or section comment."""
    lines = path.read_text().splitlines()
    blocks, current = [], None
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("# TRY NOT TO MODIFY"):
            current = [line]
            blocks.append(current)
        elif current is not None and (
            stripped.startswith("# ALGO LOGIC") or stripped.startswith("# ----") or line.startswith("def ")
        ):
            current = None
        elif current is not None:
            current.append(line)
    return ["\n".join(b).rstrip() for b in blocks]


def test_all_five_algorithms_exist():
    assert {p.stem for p in ALGOS} >= {"crd", "grpo", "nft", "awm", "dgpo"}


@pytest.mark.parametrize("path", ALGOS, ids=lambda p: p.stem)
def test_shared_blocks_identical_to_crd(path):
    reference = shared_blocks(ALGOS[[p.stem for p in ALGOS].index("crd")])
    ours = shared_blocks(path)
    assert [b.splitlines()[0] for b in ours] == [b.splitlines()[0] for b in reference]
    for a, b in zip(ours, reference):
        assert a == b, f"{path.name}: shared block '{a.splitlines()[0].strip()}' differs from crd.py"


@pytest.mark.parametrize("path", ALGOS, ids=lambda p: p.stem)
def test_every_flag_is_documented(path):
    """Each Args field is followed by a docstring (tyro turns it into the --help text)."""
    tree = ast.parse(path.read_text())
    (args,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args"]
    body = args.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            nxt = body[i + 1] if i + 1 < len(body) else None
            assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), f"{path.name}: {node.target.id}"
    assert re.search(r"arXiv \d{4}\.\d{5}", path.read_text().split('"""')[1]), "module docstring cites the arXiv id"
