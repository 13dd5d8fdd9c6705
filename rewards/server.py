"""Serve rewards of the registry over HTTP: `python -m rewards.server --reward ocr --port 8000` (from the repository root).

A training run scores through it with `--reward http://HOST:8000` (or `http://HOST:8000/ocr`, weights as for local
rewards: `--reward http://a:8000/ocr:1.0,http://b:8001/pickscore:0.5`). The wire format is in rewards/remote.py.
Optional dependencies (FastAPI + uvicorn): `pip install -r rewards/requirements-server.txt`.
"""

import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import UserError  # noqa: E402
from distributed import check_device  # noqa: E402
from rewards import REWARDS  # noqa: E402
from rewards.remote import VERSION, decode_png_base64  # noqa: E402


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
    (FastAPI runs each request in a worker thread)."""
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel

    class ScoreRequest(BaseModel):
        prompts: List[str]
        images: List[str]

    class CheckRequest(BaseModel):
        prompts: List[str]

    app = FastAPI(title="cleanflow reward server")
    locks = {name: threading.Lock() for name in fns}

    def reward(name: str):
        if name not in fns:
            raise HTTPException(404, f"no reward {name!r} here; this server serves {', '.join(fns)}")
        return fns[name]

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
        except Exception as e:  # any undecodable image is the client's error, reported in one line
            raise HTTPException(422, f"the images are not base64 PNGs of one size ({type(e).__name__}: {e})")
        try:
            if getattr(fn, "thread_safe", False):
                value = fn(images, request.prompts)
            else:
                with locks[name]:
                    value = fn(images, request.prompts)
        except UserError as e:
            raise HTTPException(422, str(e))
        if not isinstance(value, torch.Tensor) or value.shape != (len(request.prompts),):
            raise HTTPException(500, f"reward {name!r} returned {getattr(value, 'shape', type(value).__name__)}")
        if not torch.isfinite(value).all():  # JSON has no NaN: say so instead of failing to encode
            raise HTTPException(500, f"reward {name!r} returned NaN or inf for {int((~torch.isfinite(value)).sum())} images")
        return {"scores": value.float().cpu().tolist()}

    @app.post("/{name}/check")
    def check(name: str, request: CheckRequest):
        fn = reward(name)
        try:
            if hasattr(fn, "check_prompts"):
                fn.check_prompts(request.prompts)
        except UserError as e:
            raise HTTPException(422, str(e))
        return {}

    return app


def main(args: Args):
    try:
        import uvicorn
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
    uvicorn.Server(uvicorn.Config(build_app(fns, device), log_level="warning", access_log=False)).run(sockets=[sock])


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
