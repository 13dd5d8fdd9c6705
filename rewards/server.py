"""Serve rewards of the registry over HTTP: `python -m rewards.server --reward ocr --port 8000` (from the repository root).

A training run scores through it with `--reward http://HOST:8000` (or `http://HOST:8000/ocr`, weights as for local
rewards: `--reward http://a:8000/ocr:1.0,http://b:8001/pickscore:0.5`). The wire format is in rewards/remote.py.
Optional dependencies (FastAPI + uvicorn): `pip install -r rewards/requirements-server.txt`.
"""

import logging
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import UserError  # noqa: E402
from harness.distributed import check_device  # noqa: E402
from rewards import REWARDS  # noqa: E402
from rewards.remote import VERSION, decode_png_base64, one_line  # noqa: E402

MAX_REQUEST = 256 << 20  # bytes: a longer request is refused (413) from its Content-Length, before it is read


@dataclass
class Args:
    reward: str = "ocr"
    """reward name(s) of the registry to serve, comma-separated (each at POST /<name>)"""
    host: str = "127.0.0.1"
    """address to listen on (0.0.0.0: every interface; the server has no authentication, so only on a trusted network)"""
    port: int = 8000
    """port to listen on"""
    device: Optional[str] = None
    """torch device of the reward models (cpu, cuda, cuda:1; default: cuda when available)"""


def build_app(fns: dict, device: torch.device):
    """The FastAPI app serving `fns` ({name: reward fn}). A reward not marked `thread_safe` is called once at a time
    (FastAPI runs each request in a worker thread).

    The clients are not trusted either: a fault is an answer of one line (a client's error, or a reward's ValueError,
    4xx; a reward's crash, 500) and the same line in the server's log, without a traceback and without the request's
    content (FastAPI's own answer to a bad request repeats it: 300 MB, or a NaN prompt it cannot encode). A request is
    at most MAX_REQUEST bytes, refused from its Content-Length before it is read; an image at most MAX_PIXELS, refused
    from its PNG header before it is decoded (rewards/remote.py)."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel
    from starlette.exceptions import HTTPException as StarletteHTTPException

    class ScoreRequest(BaseModel):
        prompts: List[str]
        images: List[str]

    class CheckRequest(BaseModel):
        prompts: List[str]

    app = FastAPI(title="cleanflow reward server")
    locks = {name: threading.Lock() for name in fns}
    log = logging.getLogger("uvicorn.error")  # uvicorn's own log, as it prints it

    def fault(status: int, message: str) -> JSONResponse:
        """The answer to a request that failed, and its line in the log."""
        message = one_line(message)
        log.log(logging.ERROR if status >= 500 else logging.WARNING, message)
        return JSONResponse({"detail": message}, status_code=status)

    @app.exception_handler(StarletteHTTPException)  # ours below, and the router's (404, 405)
    async def http_fault(request: Request, e: StarletteHTTPException):
        return fault(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid"}
        if first.get("type") == "json_invalid":
            what = f"the body is not JSON ({first.get('ctx', {}).get('error', 'invalid')})"
        else:  # where, not what: the input is the client's (and may be big)
            where = ".".join(str(part) for part in first["loc"][1:]) or str(first["loc"][0])
            what = f"{where}: {first['msg']}"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return fault(422, f"bad request: {what}{more}")

    @app.middleware("http")
    async def cap_request(request: Request, call_next):
        # from the headers, before the body is read: a 300 MB request is refused without reading it
        if request.method == "POST":
            length = request.headers.get("content-length")
            if length is None:  # chunked: its size is known only once read
                return fault(411, "a request needs a Content-Length")
            if not length.isdigit():
                return fault(400, "a Content-Length that is not a number")
            if int(length) > MAX_REQUEST:
                cap = f"{MAX_REQUEST} ({MAX_REQUEST >> 20} MiB)"
                return fault(413, f"the request is {length} bytes, over the cap of {cap}: score fewer images a call")
        return await call_next(request)

    def reward(name: str):
        if name not in fns:
            raise HTTPException(404, f"no reward {name!r} here; this server serves {', '.join(fns)}")
        return fns[name]

    def run(name: str, call: Callable):
        """`call()`, the reward's work: its ValueError (UserError included) is the client's error, as a prompt the
        reward cannot score (422); any other exception its own crash (500). Both one line, no traceback."""
        try:
            return call()
        except ValueError as e:
            raise HTTPException(422, str(e))
        except Exception as e:
            raise HTTPException(500, f"reward {name} failed: {type(e).__name__}: {e}")

    @app.get("/")
    def info():
        return {"version": VERSION, "rewards": list(fns)}

    @app.post("/{name}")
    def score(name: str, request: ScoreRequest):
        fn = reward(name)
        if len(request.images) != len(request.prompts):
            raise HTTPException(422, f"{len(request.images)} images for {len(request.prompts)} prompts")
        try:
            images = decode_png_base64(request.images).to(device)
        except UserError as e:  # over a cap: its own message
            raise HTTPException(422, str(e))
        except Exception as e:  # any undecodable image is the client's error, reported in one line
            raise HTTPException(422, f"the images are not base64 PNGs of one size ({type(e).__name__}: {e})")

        def call():
            if getattr(fn, "thread_safe", False):
                return fn(images, request.prompts)
            with locks[name]:
                return fn(images, request.prompts)

        value = run(name, call)
        if not isinstance(value, torch.Tensor) or value.shape != (len(request.prompts),):
            raise HTTPException(500, f"reward {name!r} returned {getattr(value, 'shape', type(value).__name__)}")
        if not torch.isfinite(value).all():  # JSON has no NaN: say so instead of failing to encode
            raise HTTPException(500, f"reward {name!r} returned NaN or inf for {int((~torch.isfinite(value)).sum())} images")
        return {"scores": value.float().cpu().tolist()}

    @app.post("/{name}/check")
    def check(name: str, request: CheckRequest):
        fn = reward(name)
        if hasattr(fn, "check_prompts"):
            run(name, lambda: fn.check_prompts(request.prompts))
        return {}

    return app


def serve(app, sock: socket.socket):
    """Serves `app` on the bound socket `sock` until the process ends; the log shows warnings and errors only."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


def main(args: Args):
    try:
        import uvicorn  # noqa: F401  (serve's; checked here, before the models load)
    except ImportError as e:
        raise UserError(f"the reward server needs FastAPI and uvicorn ({e}): pip install -r rewards/requirements-server.txt")
    names = [n.strip() for n in args.reward.split(",")]
    unknown = [n for n in names if n not in REWARDS]
    if unknown or len(set(names)) != len(names):
        what = f"unknown reward {unknown[0]!r}" if unknown else f"a reward named twice in {args.reward!r}"
        raise UserError(f"{what}; available: {', '.join(REWARDS)}")
    device = check_device(args.device)
    # the port is taken before the reward models load, so that one in use fails at once, in one line
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server takes its port back at once
    try:
        sock.bind((args.host, args.port))
    except (OSError, OverflowError) as e:
        raise UserError(f"cannot listen on {args.host}:{args.port} ({getattr(e, 'strerror', None) or e})")
    fns = {name: REWARDS[name](device) for name in names}
    print(f"serving {', '.join(names)} on http://{args.host}:{args.port}", flush=True)
    serve(build_app(fns, device), sock)


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
