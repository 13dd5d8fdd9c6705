"""A fork server for the tests: `python tests/forkserver.py` imports torch, diffusers, transformers and the other
third-party packages the scripts use once, then forks a child per request that runs `python <script> <args>` as a
fresh interpreter would. Most of a tiny run's wall time is those imports (~7 of ~9 s on one AMD EPYC core), and the
suite starts a few hundred script runs.

What the child shares with a fresh `python <script>` started with the same environment (conftest.run_script uses a
server only for a request whose environment equals the one the server was started with): the environment (so every
variable a package reads at import, OMP_NUM_THREADS and ATEN_CPU_CAPABILITY included, was read from it), the working
folder, sys.argv and sys.path[0], its own session (a process group to kill), stdin /dev/null, stdout and stderr to the
files named, the import-time stderr of the packages (replayed first), and the interpreter's exit: SystemExit codes,
a traceback and 1 for an exception, atexit handlers, buffered output flushed. None of this project's modules is
imported here, so each child imports them afresh. The server holds no thread (checked before it says ready): a child
forked from a process with OpenMP threads could hang.

Ranks (conftest.run_script's stand-in for `torchrun --standalone --nproc-per-node N`): a request may carry "env",
variables the child sets before the script runs: the ones torchrun gives each rank (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT, ...), which torch reads when the process group starts, never at import.

Protocol, one JSON line each way on stdin/stdout: {"run": [script, *args], "cwd": ..., "out": path, "err": path,
"env": {...}} -> {"pid": N}; {"wait": N} -> {"status": waitpid status}; {"wait_any": 1} -> {"pid": N, "status": ...},
the next child to end. Anything else, or EOF, ends the server.
"""

import importlib
import json
import os
import sys
import tempfile

# what a script run imports from outside this project (the rest a child imports itself)
PRELOAD = (
    "numpy",
    "PIL.Image",
    "PIL.PngImagePlugin",
    "torch",
    "torch.nn.functional",
    "torch.distributed",
    "torch.utils.tensorboard",
    "safetensors.torch",
    "tyro",
    "tqdm",
    "peft",
    "transformers",
    "diffusers",
)
ATTRS = {  # diffusers and transformers import their classes lazily, on first attribute access
    "diffusers": (
        "StableDiffusion3Pipeline",
        "FluxPipeline",
        "FluxKontextPipeline",
        "AutoencoderKL",
        "SD3Transformer2DModel",
        "FluxTransformer2DModel",
        "FlowMatchEulerDiscreteScheduler",
    ),
    "transformers": (
        "CLIPTextModel",
        "CLIPTextModelWithProjection",
        "CLIPTokenizer",
        "T5EncoderModel",
        "PreTrainedTokenizerFast",
    ),
}


def quiet_transformers():
    """The pipeline classes import image processors that warn, through transformers' logger, that torchvision is
    missing. A script run never reaches that import by attribute as ATTRS does (or silences it itself:
    benchmark/testbeds/build_tiny_edit.py), so the preload keeps it out of what every child would replay."""
    try:
        import transformers
    except ImportError:
        return
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    for name in ATTRS["diffusers"]:
        try:
            getattr(importlib.import_module("diffusers"), name)
        except (ImportError, AttributeError):
            pass
    transformers.logging.set_verbosity(verbosity)


def preload() -> bytes:
    """Import PRELOAD and ATTRS with fd 2 sent to a file; returns what they wrote there."""
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(f.fileno(), 2)
        try:
            quiet_transformers()
            for name in PRELOAD:
                try:
                    module = importlib.import_module(name)
                except ImportError:
                    continue
                for attr in ATTRS.get(name, ()):
                    try:
                        getattr(module, attr)
                    except (ImportError, AttributeError):
                        pass
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return f.read()


def child(request: dict, import_stderr: bytes):
    """Become `python <script> <args>`; never returns (the interpreter exits as a script's would)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (null, out, err):
        os.close(fd)
    os.write(2, import_stderr)
    os.environ.update(request.get("env", {}))  # a rank's variables (RANK, MASTER_PORT, ...): read at run time only
    os.chdir(request["cwd"])
    script, *args = request["run"]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import runpy

    path = os.path.abspath(script)
    try:
        runpy.run_path(path, run_name="__main__")  # __file__ absolute, as the interpreter's
    except SystemExit:
        raise  # the interpreter exits with its code, as a script's would
    except BaseException as e:  # reported from the script's frames on, as the interpreter would
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:  # this file's and runpy's frames
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # the hook prints e.__traceback__
        if isinstance(e, KeyboardInterrupt):  # the interpreter ends by SIGINT then
            import signal

            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


def main():
    import_stderr = preload()
    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    sys.stdout.write(json.dumps({"ready": tasks == 1, "threads": tasks}) + "\n")
    sys.stdout.flush()
    if tasks != 1:
        return
    for line in sys.stdin:
        request = json.loads(line)
        if "run" in request:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sys.stdin = open(os.devnull)  # not the server's pipe
                child(request, import_stderr)
                return  # the script ended normally: fall off main, the interpreter exits 0
            answer = {"pid": pid}
        elif "wait" in request:
            answer = {"status": os.waitpid(request["wait"], 0)[1]}
        elif "wait_any" in request:  # the next of this server's children to end (a rank of several)
            pid, status = os.wait()
            answer = {"pid": pid, "status": status}
        else:
            return
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
