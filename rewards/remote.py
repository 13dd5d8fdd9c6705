"""A reward scored by a reward server (`python -m rewards.server`, rewards/server.py): `--reward http://HOST:PORT[/name]`.

Large reward models run on their own GPUs and rewards with conflicting dependencies in their own environment, as
Flow-Factory's and flow_grpo's reward servers do. The client speaks plain HTTP with the standard library, so a training
environment needs nothing beyond requirements.txt; only the server needs rewards/requirements-server.txt.

Wire format (version 1): GET / -> {"version": 1, "rewards": [names]}; POST /<name> with {"prompts": [B strings],
"images": [B base64 PNGs]} -> {"scores": [B numbers]}; POST /<name>/check with {"prompts": [...]} -> {} or 422 with
the reward's one-line message. Images travel as 8-bit RGB PNG (lossless): the server's reward sees the image rounded to
8 bits, `round(255 x)`, which is what the rewards that quantise first (ocr, jpeg_*) see locally too, so through the
server they give the local numbers bit for bit; a reward that reads float pixels (shapes, the CLIP family) scores the
8-bit image, as it would a saved PNG. Scores come back as JSON numbers: a float32 survives float64 text exactly.

Faults are one line (`UserError`): a server that is down or does not answer within TIMEOUT seconds is tried ATTEMPTS
times (BACKOFF seconds apart, doubling), then the run stops; an answer that is not the scores asked for (HTML, wrong
length, NaN, an error status) stops it at once. The scripts score a whole epoch before anything of it is applied, so
the run stops at the last checkpoint, and `--resume` goes on with `--reward` given again (a checkpoint never sets a
server; a moved one serving the same rewards is accepted: run.restore_servers). The URL is saved
in args.json and every checkpoint, so it may not hold credentials (user:password@).
"""

import base64
import http.client
import io
import json
import math
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch

from common import UserError, short

VERSION = 1
TIMEOUT = float(os.environ.get("CLEANFLOW_REWARD_TIMEOUT", 120))  # seconds per request: a GPU reward model on a batch
ATTEMPTS = 3  # a request that found no server or timed out is sent this many times in all
BACKOFF = 1.0  # seconds before the second attempt, doubled before each next one
RETRY_STATUS = (502, 503, 504)  # a proxy in front of a server that is (re)starting: worth another try


def is_url(part: str) -> bool:
    return part.startswith(("http://", "https://"))


def masked(part: str) -> str:
    """`part` as it may be printed: credentials masked (`user:***@`, `***@` for a bare token) and a query or fragment
    (`?***`, `#***`), which can hold a token too. Everything before the last `@` counts as credentials: a password may
    hold a `/`."""
    head, sep, rest = part.partition("://")
    if not sep:
        head, rest = "", part
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        rest = (f"{user}:***@" if colon and "/" not in user else "***@") + rest
    for mark in "?#":
        if mark in rest:
            rest = rest[: rest.index(mark)] + f"{mark}***"
    return head + sep + rest


def split_weight(part: str) -> Tuple[str, str]:
    """ "http://host:8000/ocr:0.5" -> ("http://host:8000/ocr", "0.5"); "http://host:8000" -> (its URL, "").

    A weight follows the path (`/name:w`) or, without a path, the port (`host:port:w`): the URL's own colons are the
    scheme's and the port's. The URL is checked here, before anything loads: it is saved in args.json and every
    checkpoint, so it may hold no credentials nor a query (a token), and no message prints them (`masked`)."""
    expected = "expected http://HOST:PORT[/name][:weight]"
    if "@" in part:
        raise UserError(
            f"reward server URL {short(masked(part))} holds credentials: the URL is saved in args.json and every "
            "checkpoint; put the server on a network you trust (or behind an SSH tunnel) instead"
        )
    if "?" in part or "#" in part:
        raise UserError(
            f"bad reward server URL {short(masked(part))}: a query or fragment (a token?) would be saved in args.json "
            f"and every checkpoint; {expected}"
        )
    scheme, _, rest = part.partition("://")
    netloc, slash, path = rest.partition("/")
    weight = ""
    if slash:
        path, _, weight = path.partition(":")
    elif netloc.rsplit("]", 1)[-1].count(":") == 2:  # host:port:weight ([IPv6]:port:weight alike)
        netloc, _, weight = netloc.rpartition(":")
    url = f"{scheme}://{netloc}" + (f"/{path}" if path else "")
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018  (raises ValueError on a port that is not a number in 0-65535)
    except ValueError as e:
        raise UserError(f"bad reward server URL {short(part)} ({e}); {expected}")
    if not parsed.hostname or "/" in path:
        raise UserError(f"bad reward server URL {short(part)}; {expected}")
    return url, weight


def png_base64(images: torch.Tensor) -> list:
    """images [B, 3, H, W] float in [0, 1] -> B base64 strings of 8-bit RGB PNGs of round(255 x)."""
    from PIL import Image

    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    out = []
    for image in pixels:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG", compress_level=1)  # lossless at any level; 1 is the fastest
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def decode_png_base64(images: Sequence[str]) -> torch.Tensor:
    """The inverse of `png_base64`: B base64 PNGs of one size -> [B, 3, H, W] float32 in [0, 1] (k / 255)."""
    from PIL import Image

    arrays = [np.asarray(Image.open(io.BytesIO(base64.b64decode(s, validate=True))).convert("RGB")) for s in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


def _request(url: str, payload: Optional[dict], timeout: float, attempts: int = ATTEMPTS) -> dict:
    """GET (payload None) or POST a JSON payload; the decoded JSON object of a 200 answer. Retries what a server that is
    down, restarting or slow gives (refused or reset connections, timeouts, 502-504) `attempts` times in all."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    last = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(BACKOFF * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout) as r:
                body, kind = r.read(), r.headers.get("Content-Type", "")
            break
        except urllib.error.HTTPError as e:
            if e.code in RETRY_STATUS:
                last = f"HTTP {e.code}"
                continue
            raise UserError(f"reward server {url}: HTTP {e.code}: {_detail(e.read())}") from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            timed_out = isinstance(reason, (socket.timeout, TimeoutError))
            last = f"no answer within {timeout:g} s" if timed_out else f"{type(reason).__name__}: {reason}"
    else:
        raise UserError(
            f"reward server {url}: {last} ({attempts} tries); is `python -m rewards.server` running there? "
            "(a stopped run continues with --resume)"
        )
    try:
        answer = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(
            f"reward server {url}: the answer is not JSON ({kind or 'no content type'}): {_detail(body)}"
        ) from None
    if not isinstance(answer, dict):
        raise UserError(f"reward server {url}: expected a JSON object, got {_detail(body)}")
    return answer


def _detail(body: bytes) -> str:
    """An error answer's message: FastAPI's {"detail": ...} or the body's start, on one line."""
    try:
        text = str(json.loads(body)["detail"])
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace")
    text = " ".join(text.split())
    return text if len(text) <= 300 else f"{text[:300]}... ({len(text)} characters)"


def remote(url: str, timeout: float = TIMEOUT) -> Callable:
    """A reward served at `url` (http://HOST:PORT/name, or http://HOST:PORT when the server serves one reward):
    fn(images [B, 3, H, W] float in [0, 1], prompts) -> float32 [B] on the images' device, like a local reward;
    `fn.reward_name` is the served reward's name (the name it is logged under). Asks the server now which rewards it
    serves, so a server that is down or a wrong name fails before the model loads."""
    parsed = urllib.parse.urlsplit(url)
    base, name = f"{parsed.scheme}://{parsed.netloc}", parsed.path.strip("/")
    info = _request(base + "/", None, timeout)
    served = info.get("rewards")
    if info.get("version") != VERSION or not isinstance(served, list):
        raise UserError(
            f"reward server {base}: not a cleanflow reward server of version {VERSION}: {_detail(json.dumps(info).encode())}"
        )
    if not name:
        if len(served) != 1:
            raise UserError(f"reward server {base} serves {', '.join(served)}; name one: {base}/{served[0]}")
        name = served[0]
    elif name not in served:
        raise UserError(f"reward server {base} does not serve {name!r}; it serves {', '.join(served)}")
    endpoint = f"{base}/{name}"

    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
            got = f"{tuple(images.shape)} and {len(prompts)} prompts"
            raise ValueError(f"expected images [B, 3, H, W] float in [0, 1] and B prompts, got {got}")
        answer = _request(endpoint, {"prompts": list(prompts), "images": png_base64(images)}, timeout)
        scores = answer.get("scores")
        if not isinstance(scores, list) or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
            raise UserError(
                f"reward server {endpoint}: expected {{'scores': [numbers]}}, got {_detail(json.dumps(answer).encode())}"
            )
        if len(scores) != len(prompts):
            raise UserError(f"reward server {endpoint}: {len(scores)} scores for {len(prompts)} images")
        bad = sum(not math.isfinite(s) for s in scores)
        if bad:
            raise UserError(f"reward server {endpoint}: NaN or inf for {bad} of {len(scores)} images")
        return torch.tensor(scores, dtype=torch.float32, device=images.device)

    def check_prompts(prompts):
        """The served reward's own prompt check (ocr: a quoted text in each), run before the model loads."""
        _request(f"{endpoint}/check", {"prompts": list(prompts)}, timeout)

    fn.check_prompts = check_prompts
    fn.reward_name = name
    fn.thread_safe = True  # one HTTP request per call; the server serialises a reward that is not thread-safe itself
    return fn
