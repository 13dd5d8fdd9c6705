"""The algorithm files share their boilerplate byte for byte (CleanRL's rule), so `diff` shows only the algorithm."""

import ast
import re
import textwrap
from pathlib import Path

import pytest

ALGOS = sorted((Path(__file__).resolve().parents[1] / "algos").glob("*.py"))


def shared_blocks(path: Path) -> list:
    """The text of every `# TRY NOT TO MODIFY:` block, up to the next banner or section comment or the end of the banner's
    indentation level, dedented: the optimizer-step block sits one loop deeper in the files with inner epochs."""
    lines = path.read_text().splitlines()
    blocks, current, indent = [], None, 0
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("# TRY NOT TO MODIFY"):
            current, indent = [line], len(line) - len(line.lstrip())
            blocks.append(current)
        elif current is not None and (
            stripped.startswith("# ALGO LOGIC")
            or stripped.startswith("# ----")
            or line.startswith("def ")
            or (stripped and len(line) - len(line.lstrip()) < indent)
        ):
            current = None
        elif current is not None:
            current.append(line)
    return [textwrap.dedent("\n".join(b)).rstrip() for b in blocks]


def test_the_shared_plumbing_is_under_banners():
    """The loop's shared pieces -- resume, save and close (harness/shell.py), the optimizer step with its non-finite-gradient
    guard, the logging block -- are inside `# TRY NOT TO MODIFY:` blocks, so the identity test below covers them."""
    text = "\n".join(shared_blocks(ALGOS[0]))
    for piece in (
        "shell.resume(",
        "shell.save(",
        "shell.close(",
        "shell.clip_grad_norm(params, args.max_grad_norm)",
        "finite_grads(grad_norm, lambda: save(epoch))",
        "optimizer.step()",
        "logger.scalars(metrics",
    ):
        assert piece in text, piece


def test_every_algorithm_exists():
    assert {p.stem for p in ALGOS} >= {"crd", "grpo", "nft", "awm", "dgpo", "dpo", "elbo_grpo"}


@pytest.mark.parametrize("path", ALGOS, ids=lambda p: p.stem)
def test_shared_blocks_identical_to_crd(path):
    reference = shared_blocks(ALGOS[[p.stem for p in ALGOS].index("crd")])
    ours = shared_blocks(path)
    assert [b.splitlines()[0] for b in ours] == [b.splitlines()[0] for b in reference]
    for a, b in zip(ours, reference):
        assert a == b, f"{path.name}: shared block '{a.splitlines()[0].strip()}' differs from crd.py"


def dataclass_fields(path: Path) -> dict:
    """{class name: [field names]} of every top-level class of `path` that declares fields, each field checked to be
    followed by its docstring (tyro turns it into the --help text)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names = []
            for i, item in enumerate(node.body):
                if isinstance(item, ast.AnnAssign):
                    nxt = node.body[i + 1] if i + 1 < len(node.body) else None
                    assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), f"{path.name}: {item.target.id}"
                    names.append(item.target.id)
            if names:
                out[node.name] = names
    return out


@pytest.mark.parametrize("path", ALGOS, ids=lambda p: p.stem)
def test_every_flag_is_documented(path):
    """Each flag is followed by a docstring, the script's own and the shared ones (flags.SharedArgs); the module
    docstring cites the paper."""
    dataclass_fields(path)
    dataclass_fields(path.parents[1] / "harness" / "flags.py")
    assert re.search(r"arXiv \d{4}\.\d{5}", path.read_text().split('"""')[1]), "module docstring cites the arXiv id"


@pytest.mark.parametrize("path", ALGOS, ids=lambda p: p.stem)
def test_args_opens_with_the_algorithm_and_declares_the_shared_flags_once(path):
    """`Args` = the algorithm's own dataclass, then flags.SharedArgs: the algorithm's flags open --help, at most 30 are
    declared in the file, and a shared flag is declared again only where this script's default or help differs. A
    variants file (grpo_variants.py) may take its base algorithm's flags from the base's file (`grpo.GRPOArgs`), between
    the two, and redeclare one of them too."""
    shared = dataclass_fields(path.parents[1] / "harness" / "flags.py")["SharedArgs"]
    classes = dataclass_fields(path)
    (own,) = [names for name, names in classes.items() if name != "Args"]
    own_class = next(n for n in classes if n != "Args")
    tree = ast.parse(path.read_text())
    (args,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args"]
    bases = [ast.unparse(b) for b in args.bases]
    assert bases[0] == "flags.SharedArgs" and bases[-1] == own_class, bases
    inherited = set()
    for base in bases[1:-1]:  # a base algorithm's flags: `<file>.<Class>` of a sibling algorithm file
        module, cls = base.split(".")
        inherited |= set(dataclass_fields(path.parent / f"{module}.py")[cls])
    assert not set(own) & (set(shared) | inherited), f"{path.name} declares shared flags as its own"
    assert set(classes.get("Args", ())) <= set(shared) | inherited, "Args declares a flag that is neither own nor shared"
    assert len(own) + len(classes.get("Args", ())) <= 30


def top_level_sources(path: Path) -> dict:
    """{name: source} of the module's top-level functions and assignments."""
    text = path.read_text()
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = ast.get_source_segment(text, node)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = ast.get_source_segment(text, node)
    return out


# the math the algorithms share: the group-relative advantage and the velocity KL (all five), the snapshot/EMA decay
# schedule and update (the four with a snapshot), PPO's clipped surrogate (grpo, awm), DiffusionNFT's optimality
# probability (nft, crd); each file holds its own copy, so a reader sees it, and the copies must not drift
SHARED_MATH = {
    "STD_EPS": {"awm", "crd", "dgpo", "elbo_grpo", "grpo", "nft", "tdm_r1"},
    # grpo.py's copy adds RLOO's leave-one-out baseline (--leave-one-out), which only Flow-GRPO offers
    "group_advantages": {"awm", "crd", "dgpo", "elbo_grpo", "nft", "tdm_r1"},
    "aggregate_advantages": {"awm", "crd", "dgpo", "elbo_grpo", "nft"},
    "get_decay": {"awm", "crd", "dgpo", "nft"},
    "update_ema": {"awm", "crd", "dgpo", "nft"},
    "velocity_kl": {"awm", "crd", "dgpo", "elbo_grpo", "grpo", "nft", "tdm_r1"},
    "ppo_loss": {"awm", "elbo_grpo", "grpo"},
    "optimality_probability": {"crd", "nft"},
}
# copies that differ on purpose: Flow-GRPO's advantages also offer the leave-one-out baseline
OWN_COPIES = {"group_advantages": {"grpo"}, "aggregate_advantages": {"grpo"}}


@pytest.mark.parametrize("name", sorted(SHARED_MATH))
def test_shared_math_is_identical_where_the_algorithms_agree(name):
    sources = {p.stem: top_level_sources(p).get(name) for p in ALGOS}
    have = {stem for stem, src in sources.items() if src is not None}
    assert have >= SHARED_MATH[name], f"{name} missing from {sorted(SHARED_MATH[name] - have)}"
    assert have - SHARED_MATH[name] <= OWN_COPIES.get(name, set()), f"{name}: an unlisted copy"
    reference = sources[min(SHARED_MATH[name])]
    for stem in sorted(SHARED_MATH[name]):
        assert sources[stem] == reference, f"algos/{stem}.py: {name} differs from algos/{min(SHARED_MATH[name])}.py"


def test_common_holds_no_advantage_math():
    """The house style (CleanRL's): the advantage is the algorithm, so it lives in the algorithm files, not in the plumbing."""
    names = top_level_sources(Path(__file__).resolve().parents[1] / "common.py")
    assert not {"STD_EPS", "group_advantages", "aggregate_advantages"} & set(names)


REPO = Path(__file__).resolve().parents[1]
SHARED = sorted([*REPO.glob("*.py"), *(p for d in ("harness", "models", "rewards") for p in (REPO / d).glob("*.py"))])


def import_graph() -> dict:
    """{module: the repo's modules it imports} over the shared modules (top-level files, models/, rewards/), every import
    counted, also those inside functions: a cycle through a function-level import is still a cycle to a reader."""
    names = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in SHARED}
    graph = {}
    for path in SHARED:
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x / from .x import y, relative to this module's package
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                targets |= {base} | {f"{base}.{a.name}" for a in node.names}
        # a submodule's import of its own package (`from models import X` in models/wan.py) is how packages work
        graph[name] = {t for t in targets if t in names and t != name and not name.startswith(t + ".")}
    return graph


def test_the_shared_modules_have_no_import_cycle_and_stay_under_800_lines():
    """The shared code a reader opens is split by concept (run, checkpoints, shards, export, logs, common, ...): each
    under 800 lines, and a module never imports one that imports it back."""
    for path in SHARED:
        assert len(path.read_text().splitlines()) < 800, f"{path.relative_to(REPO)} is 800 lines or more: split it"
    graph, state = import_graph(), {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != "open", f"import cycle: {' -> '.join([*stack, nxt])}"
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    run, below = graph["harness.run"], graph["harness.checkpoints"] | graph["harness.export"] | graph["harness.shards"]
    assert run >= {"harness.checkpoints"} and "harness.run" not in below


@pytest.mark.slow
@pytest.mark.parametrize("path", ALGOS, ids=lambda p: p.stem)
def test_help_fits_on_110_lines_at_120_columns(path):
    """`--help` is read, not searched: at most 110 lines in a 120-column terminal. tyro puts a flag whose invocation is
    wider than its column on a line of its own, which is why the optional flags carry short type labels (harness/flags.py)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "120"}
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--num-epochs" in out.stdout and len(out.stdout.splitlines()) <= 110, len(out.stdout.splitlines())
    first_own = next(names for name, names in dataclass_fields(path).items() if name != "Args")[0]
    flags = re.findall(r"^│ (--[a-z0-9-]+)", out.stdout, re.M)
    assert flags[0] == "--" + first_own.replace("_", "-"), f"--help opens with {flags[0]}, not the algorithm's flags"


PROJECT = {"common", "models", "rewards", "harness", "benchmark", "algos"}


@pytest.mark.parametrize("path", ALGOS, ids=lambda p: p.stem)
def test_an_algorithm_imports_at_most_five_of_the_projects_modules(path):
    """The file is the algorithm: what it takes from the project is the sampler (common), the model helpers (models),
    its flags and shell (harness.flags, harness.shell), and at most one input module of its own (DPO's pair_files)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            used |= {a.name for a in node.names if a.name.split(".")[0] in PROJECT}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PROJECT:
            package = REPO / node.module.replace(".", "/")
            used |= {f"{node.module}.{a.name}" if package.is_dir() else node.module for a in node.names}
    assert len(used) <= 5, f"{path.name} imports {sorted(used)}"


def test_the_top_level_holds_at_most_two_python_files():
    """The layout shows the layers: algos/, common.py, models/, rewards/, harness/ (the run's management), assets/
    (data only: the worlds are rewards/worlds/, the builders benchmark/testbeds/), benchmark/, docs/, tests/."""
    assert len(list(REPO.glob("*.py"))) <= 2, sorted(p.name for p in REPO.glob("*.py"))
    assert not list(REPO.glob("assets/**/*.py")), "assets/ holds data only"
