import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import models  # noqa: F401  (registers the model families with common)

REPO = Path(__file__).resolve().parents[1]


def importable(*modules: str) -> bool:
    """Whether every module imports here (an optional extra installed): a test of an extra skips, saying what to install,
    on a machine with the README's install only."""
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError:
        return False
    return True


# The files that take longest on one core (`pytest --durations=0`, 2 AMD EPYC cores), first: pytest.ini hands out whole
# files to the two workers in collection order, and a long file handed out last leaves one core idle at the end
# (test_edit_learning.py: 17 min of a 49-min run). Longest first, the others fill in around them.
LONGEST_FIRST = (
    "test_edit_learning.py",
    "test_edit_learning_more.py",
    "test_fsdp.py",
    "test_algos.py",
    "test_reward_server.py",
    "test_qwenimage_edit.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: each file's order kept


# the ocr reward's extra (rewards/requirements-ocr.txt): not in the README's install, so its tests skip without it
needs_ocr = pytest.mark.skipif(
    not importable("rapidocr", "onnxruntime"), reason="the ocr reward needs pip install -r rewards/requirements-ocr.txt"
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a hub
if os.environ.get("PYTEST_XDIST_WORKER"):
    # the suite runs on both cores, one pytest-xdist worker each (pytest.ini): one thread per worker and per process it
    # starts, since OpenMP threads that wait for a descheduled sibling make every op several times slower
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def random_pipeline_dir(tmp_path_factory):
    """A small random-weight SD3 pipeline built from configs (shift 3 like SD3.5), saved and reloadable offline."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from benchmark.testbeds import build_tiny_shapes as recipe

    words = ["a", "red", "blue", "circle", "square", "and"]
    tok = recipe.build_tokenizer(words)
    pipe = StableDiffusion3Pipeline(
        transformer=recipe.build_transformer(seed=0, layers=2),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=recipe.build_vae(seed=1),
        text_encoder=recipe.build_text_encoder(tok, seed=2),
        tokenizer=tok,
        text_encoder_2=recipe.build_text_encoder(tok, seed=3),
        tokenizer_2=tok,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    path = tmp_path_factory.mktemp("pipe") / "random-sd3"
    pipe.save_pretrained(path)
    return str(path)


def tiny_flux_parts(words, guidance_embeds: bool, vae_size: int) -> dict:
    """A small random-weight FLUX.1 pipeline's components, built from configs (seed 0): CLIP and T5 on the tiny-shapes
    recipe's word tokenizer over `words` (it also stands in for T5's, which cannot be built offline), a transformer
    with or without a guidance embedding, a VAE of factor 4 (`vae_size` pixels) with FLUX.1's scale/shift factors, and
    FLUX.1's dynamically shifted scheduler. FLUX.1's and FLUX.1-Kontext's tiny builds (tests/tiny_families.py) share it."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from benchmark.testbeds import build_tiny_shapes as recipe

    tok = recipe.build_tokenizer(list(words))
    torch.manual_seed(0)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=recipe.MAX_TOKENS,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    t5 = T5EncoderModel(T5Config(vocab_size=len(tok), d_model=32, d_kv=8, num_heads=4, num_layers=1, d_ff=64))
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )
    vae = recipe.build_vae(0, sample_size=vae_size, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's factors
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    return dict(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=tok,
        text_encoder_2=t5,
        tokenizer_2=tok,
        transformer=transformer,
    )


@pytest.fixture(scope="session")
def flux_pipeline_dirs(tmp_path_factory):
    """Two small random-weight FLUX pipelines (`tiny_flux_parts`), saved and reloadable offline: "dev"
    (guidance-distilled, with a guidance embedding) and "schnell" (without)."""
    from diffusers import FluxPipeline

    dirs = {}
    for variant in ("dev", "schnell"):
        parts = tiny_flux_parts(["a", "red", "blue", "circle", "square", "and"], variant == "dev", 64)
        dirs[variant] = tmp_path_factory.mktemp("pipe") / f"random-flux-{variant}"
        FluxPipeline(**parts).save_pretrained(dirs[variant])
    return {k: str(v) for k, v in dirs.items()}


def ode_sample(pipe, prompts, noise, steps, guidance_scale):
    """Our ODE sampler with CFG against the empty negative prompt, as the pipelines' __call__ runs it."""
    import common

    enc = common.PromptEncoder(pipe)
    out = common.sample(
        pipe.transformer,
        pipe.scheduler,
        enc.cond(prompts),
        num_steps=steps,
        guidance_scale=guidance_scale,
        noise=noise,
    )
    return out, enc


# seconds after which a test's process is taken to hang and killed: a guard, never a speed requirement (the longest
# test takes ~35 s on 2 idle cores, several times that on a busy or slower machine: a 300 s limit failed there)
HANG_S = 1800


# The CPU kernels torch can be made to run (ATEN_CPU_CAPABILITY): "native" is its own pick for this CPU (AVX512 where
# the CPU has it), "avx2" and "default" (no vector extension) what it picks on others. Rounding can differ
# between them (another vector width sums in another order), so an equality meant to hold on every CPU is tested under
# each, on any one machine: a test takes the `kernel_env` fixture, parametrized with KERNELS (or a subset), and passes
# the environment it returns to the processes it starts. torch reads the variable once per process, so this pytest
# process itself keeps its kernels.
KERNELS = ("native", "avx2", "default")


def kernel_environ(kernel: str) -> dict:
    """os.environ for a process that runs torch's `kernel` kernels (see KERNELS) on OMP_NUM_THREADS threads, 1 unless
    set: what torchrun gives each rank. A process compared bit for bit with torchrun's ranks must run their thread
    count: MKL's float32 matmul rounds differently on 1 and 2 threads for some row counts (measured on AMD, the tiny
    transformer's timestep embedding: 5-7 and 9-11 rows differ, 1-4, 8 and 12 do not), and DPO's micro-batches have a
    row count of their own (2 x the pairs in a group). So every process started with this environment runs the same
    count, one process or a rank."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}, expected one of {KERNELS}")
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env if kernel == "native" else {**env, "ATEN_CPU_CAPABILITY": kernel}


@pytest.fixture(params=KERNELS)
def kernel_env(request) -> dict:
    """The environment of a subprocess that runs `request.param`'s kernels (see KERNELS)."""
    return kernel_environ(request.param)


def scalars(run_dir) -> dict:
    """{tag: [values]} of every scalar a run logged to TensorBoard (the run folder's events files)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class ForkServer:
    """A `tests/forkserver.py` process started with one environment: `python <script> <args>` runs as its forked
    child, without the ~7 s of importing torch, diffusers and transformers that a fresh interpreter spends (most of a
    tiny run). The child is a fresh interpreter in every way a script can see (forkserver.py's docstring)."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "forkserver.py")],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.ready = json.loads(self.proc.stdout.readline() or "{}").get("ready", False)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def run(self, argv, cwd, timeout):
        """(returncode, stdout, stderr, timed out) of `python *argv` run by a child, killed with its group after
        `timeout` seconds."""
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "out"), Path(tmp, "err")
            pid = self.ask({"run": argv, "cwd": str(cwd), "out": str(out), "err": str(err)})["pid"]
            self.proc.stdin.write(json.dumps({"wait": pid}) + "\n")
            self.proc.stdin.flush()
            timed_out = not select.select([self.proc.stdout], [], [], timeout)[0]
            if timed_out:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            status = json.loads(self.proc.stdout.readline())["status"]
            return os.waitstatus_to_exitcode(status), out.read_text(), err.read_text(), timed_out

    def run_ranks(self, argv, nproc: int, cwd, timeout):
        """`torchrun --standalone --nproc-per-node nproc python *argv` as this server's children: each rank gets the
        variables torchrun gives it (its agent's store aside: rank 0 hosts the rendezvous, as without an agent), and
        as torchrun does, the first rank to fail ends the others. (returncode: the first failure's or 0, the ranks'
        stdout and stderr in rank order, timed out)."""
        with socket.socket() as sock:  # a free port, as torchrun --standalone picks one
            sock.bind(("localhost", 0))
            port = sock.getsockname()[1]
        common = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)}
        common.update(LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default")
        common.update(ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
        common.update(TORCHELASTIC_RUN_ID="tests", TORCHELASTIC_USE_AGENT_STORE="False", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
        common.update(TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT")
        with tempfile.TemporaryDirectory() as tmp:
            files, pids = [], []
            for rank in range(nproc):
                out, err = Path(tmp, f"out{rank}"), Path(tmp, f"err{rank}")
                env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
                pids.append(self.ask({"run": argv, "cwd": str(cwd), "out": str(out), "err": str(err), "env": env})["pid"])
                files.append((out, err))
            deadline, returncode, timed_out, running = time.monotonic() + timeout, 0, False, set(pids)
            while running:
                self.proc.stdin.write(json.dumps({"wait_any": 1}) + "\n")
                self.proc.stdin.flush()
                if not select.select([self.proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
                    timed_out = True
                    for pid in running:  # a hang: every rank's group, as run_script kills torchrun's
                        kill_pid_group(pid)
                    select.select([self.proc.stdout], [], [])
                answer = json.loads(self.proc.stdout.readline())
                running.discard(answer["pid"])
                code = os.waitstatus_to_exitcode(answer["status"])
                if code and not returncode:
                    returncode = code
                    for pid in running:  # torchrun stops the other ranks when one fails
                        kill_pid_group(pid)
            outs = [(o.read_text(), e.read_text()) for o, e in files]
        return returncode, "".join(o for o, _ in outs), "".join(e for _, e in outs), timed_out


def kill_pid_group(pid: int):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_fork_servers: dict = {}  # env_key -> ForkServer, oldest first
_requests: dict = {}  # env_key -> script runs asked for under it
MAX_FORK_SERVERS = 4


def env_key(env) -> tuple:
    """An environment as a key, less PYTEST_CURRENT_TEST (pytest sets it to each test's name; no script reads it)."""
    return tuple(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))


def fork_server(argv, env, runs: int = 1) -> "ForkServer | None":
    """The fork server for a `python <argv>` run under `env` (None: this process's), or None where the run takes a
    fresh interpreter: not a script; CLEANFLOW_TEST_FORK=0 (every script run a fresh interpreter, for a doubt about
    the server: tests/test_forkserver.py compares its children with fresh interpreters); or the first run under this
    environment (a test's own variables make an environment used once; a server started with it would cost what it
    saves). A server is started with exactly the run's environment (a package reads some
    variables once, at import), from its second run on; the MAX_FORK_SERVERS most recent are kept."""
    if os.environ.get("CLEANFLOW_TEST_FORK") == "0" or not str(argv[0]).endswith(".py"):
        return None
    key = env_key(os.environ if env is None else env)
    _requests[key] = _requests.get(key, 0) + runs
    if key not in _fork_servers:
        if _requests[key] < 2:
            return None
        if len(_fork_servers) >= MAX_FORK_SERVERS:
            oldest = next(iter(_fork_servers))
            _fork_servers.pop(oldest).proc.stdin.close()  # EOF: that server ends
        _fork_servers[key] = ForkServer(dict(key))
    server = _fork_servers[key]
    return server if server.ready and server.proc.poll() is None else None


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]  # `python` + this + a script


def torchrun_ranks(argv) -> "int | None":
    """N for `TORCHRUN`-like argv (`-m torch.distributed.run --standalone --nproc-per-node N x.py ...`), else None."""
    head = [str(a) for a in argv[: len(TORCHRUN)]]
    if head[:4] == TORCHRUN[:4] and len(argv) > len(TORCHRUN) and str(argv[len(TORCHRUN)]).endswith(".py"):
        return int(head[4])
    return None


def run_script(
    argv, *, timeout: float = HANG_S, check: bool = True, cwd=REPO, env=None, python: bool = True, real_torchrun=False
):
    """Run a command (an argument list, no shell; `python` prefixes sys.executable) in its own process group; a
    script (`python x.py ...`) as a fork server's child where one serves its environment (`fork_server`), and
    `python *TORCHRUN x.py ...` as that many children with the variables torchrun gives its ranks
    (`ForkServer.run_ranks`: ~18 s of CPU a launch less, torchrun's and each rank's imports), unless `real_torchrun`
    (the tests that keep torchrun itself honest).

    On a timeout the whole group is killed (a script, torchrun and its ranks alike: no orphan keeps running) and the
    test fails saying so. With `check`, a non-zero exit fails the test with the command and the output's tail."""
    nproc = torchrun_ranks(argv) if python and not real_torchrun else None
    if nproc:  # torchrun's ranks as a fork server's children, with the thread count torchrun sets where none is
        env = {"OMP_NUM_THREADS": "1", **(os.environ if env is None else env)}
        server = fork_server(argv[len(TORCHRUN) :], env, runs=nproc)
    else:
        server = fork_server(argv, env) if python else None
    argv = [sys.executable, *map(str, argv)] if python else [str(a) for a in argv]
    if server is not None:
        if nproc:
            returncode, out, err, timed_out = server.run_ranks(argv[1 + len(TORCHRUN) :], nproc, cwd, timeout)
        else:
            returncode, out, err, timed_out = server.run(argv[1:], cwd, timeout)
        if timed_out:
            pytest.fail(
                f"timed out after {timeout:.0f} s, process group killed: {' '.join(argv)}\n{out[-1000:]}\n{err[-2000:]}"
            )
        proc = SimpleNamespace(returncode=returncode)
    else:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, err = proc.communicate()
            pytest.fail(
                f"timed out after {timeout:.0f} s, process group killed: {' '.join(argv)}\n{out[-1000:]}\n{err[-2000:]}"
            )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(argv)}\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_in_process(module, argv) -> int:
    """`python algos/<module>.py *argv` in this process, as its `__main__` runs it (`run.run_main` on tyro's Args),
    without the start-up of a new interpreter: the exit code (0 when main returns). The signal handlers a run
    installs are put back. For runs that end early (bad inputs): a run compared bit for bit with a script's must be
    a script itself, since pytest's process sets its own thread count."""
    import tyro

    from harness import run

    argv = [str(a) for a in argv]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        run.run_main(module.main, tyro.cli(module.Args, args=argv), argv=argv)
    except SystemExit as e:
        return e.code
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return 0


def start_script(argv, **kwargs) -> subprocess.Popen:
    """`run_script` without waiting (for tests that signal the process); stop it with `kill_group`."""
    return subprocess.Popen(
        [sys.executable, *map(str, argv)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def kill_group(proc: subprocess.Popen):
    """SIGKILL the process group of a `start_script`/`run_script` process (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
