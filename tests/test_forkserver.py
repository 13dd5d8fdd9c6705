"""The tests' fork server (tests/forkserver.py) runs a script as a fresh interpreter would: the same exit code, stdout
and stderr for a script that ends, exits 2 with one line, raises, is interrupted, or hangs past its timeout."""

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ForkServer, kill_group

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
