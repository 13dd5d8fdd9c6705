"""The tests' fork server (tests/forkserver.py) runs a script as a fresh interpreter would: the same exit code, stdout
and stderr for a script that ends, exits 2 with one line, raises, is interrupted, or hangs past its timeout."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, TORCHRUN, ForkServer, kill_group, run_script

SCRIPTS = {
    "ends": "import sys\nprint('out', sys.argv[1:], __file__.endswith('s.py'), __name__)\n",
    "exit2": "import sys\nprint('error: --x 1: must be >= 2', file=sys.stderr)\nsys.exit(2)\n",
    "raises": "def f():\n    raise ValueError('boom')\nf()\n",
    "interrupt": "raise KeyboardInterrupt\n",
    "atexit": "import atexit\natexit.register(lambda: print('atexit ran'))\nprint('body', end='')\n",
    "imports_path": "import sys, os\nprint(sys.path[0] == os.path.dirname(os.path.abspath(__file__)), os.getcwd())\n",
    "stdin": "import sys\nprint(repr(sys.stdin.read()))\n",
    "threads": "import torch, sys\nprint(torch.get_num_threads(), torch.ones(3).sum().item())\n",
}


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    s = ForkServer(env)
    assert s.ready, "the server holds a thread after its imports: it refuses to fork"
    yield s, env
    s.proc.stdin.close()
    s.proc.wait(timeout=30)


def fresh(argv, cwd, env, timeout):
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err, False
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return proc.returncode, out, err, True


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_child_is_a_fresh_interpreter(server, tmp_path, name):
    s, env = server
    script = tmp_path / f"{name}s.py"
    script.write_text(SCRIPTS[name])
    argv = [script.name, "a", "--b"]
    assert s.run(argv, tmp_path, 60) == fresh(argv, tmp_path, env, 60)


@pytest.mark.slow
def test_a_hung_child_is_killed_with_its_group(server, tmp_path):
    s, env = server
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            """
            import subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print(child.pid, flush=True)
            time.sleep(600)
            """
        )
    )
    code, out, err, timed_out = s.run([str(script)], tmp_path, 3)
    assert timed_out and code == -9
    grandchild = int(out.split()[0])
    for _ in range(50):  # the killed group's grandchild is reaped by init shortly after
        if not os.path.exists(f"/proc/{grandchild}") or " Z " in open(f"/proc/{grandchild}/stat").read():
            break
        __import__("time").sleep(0.1)
    else:
        pytest.fail("the script's own child outlived the kill")


# what a rank sees of its launch: torchrun's variables (the port and the run's id aside), its thread count, and a gloo
# process group that works; rank 1 prints second
RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
x = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(x)
skip = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}
torchrun = [k for k in os.environ if k.startswith(("TORCHELASTIC", "ROLE", "GROUP", "LOCAL_", "MASTER"))] + ["RANK"]
seen = {k: os.environ[k] for k in sorted(torchrun) if k not in skip}
dist.barrier()
if dist.get_rank() == 1:
    __import__("time").sleep(0.5)
print(json.dumps([seen, os.environ["WORLD_SIZE"], torch.get_num_threads(), x.item(), sys.argv[1:]]), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ranks_as_children_see_what_torchrun_gives_its_ranks(tmp_path):
    """conftest.run_script runs `python -m torch.distributed.run --standalone --nproc-per-node 2 x.py` as two fork-server
    children (ForkServer.run_ranks): each sees torchrun's variables, thread count and a working process group, as
    under torchrun itself; a rank that fails ends the launch with its code, the other rank stopped, as torchrun does."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    argv = [*TORCHRUN, script, "a"]
    real = run_script(argv, real_torchrun=True, env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    server = ForkServer({**os.environ, "OMP_NUM_THREADS": "1"})
    code, out, err, timed_out = server.run_ranks([str(script), "a"], 2, REPO, 60)
    assert (code, timed_out) == (0, False), err
    assert out.splitlines() == real.stdout.splitlines() and len(out.splitlines()) == 2
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(600)\n")
    start = time.monotonic()
    code, out, err, timed_out = server.run_ranks([str(script)], 2, REPO, 60)
    assert (code, timed_out) == (3, False) and time.monotonic() - start < 30
    server.proc.stdin.close()
