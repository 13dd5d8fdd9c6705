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
length, NaN, an error status, a redirect, over MAX_ANSWER bytes) stops it at once. The scripts score a whole epoch
before anything of it is applied, so the run stops at the last checkpoint, and `--resume` goes on with `--reward` given
again (a checkpoint never sets a server; a moved one serving the same rewards is accepted: run.restore_servers). The
URL is saved in args.json and every checkpoint, so it may not hold credentials (user:password@).

The server is not trusted: the client follows no redirect (the scores must come from the server the user named), gives
each request TIMEOUT seconds in all (a server sending a byte a second is no answer) and reads no answer over MAX_ANSWER
bytes. Nor are its clients: the server refuses a request over its MAX_REQUEST bytes unread and an image over MAX_PIXELS
undecoded, and answers every fault with one line (rewards/server.py).
"""

import base64
import http.client
import io
import json
import math
import os
import socket
import struct
import threading
import time
import urllib.parse
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch

from common import UserError, short

VERSION = 1
TIMEOUT = float(os.environ.get("CLEANFLOW_REWARD_TIMEOUT", 120))  # seconds per request: a GPU reward model on a batch
ATTEMPTS = 3  # a request that found no server or timed out is sent this many times in all
BACKOFF = 1.0  # seconds before the second attempt, doubled before each next one
RETRY_STATUS = (502, 503, 504)  # a proxy in front of a server that is (re)starting: worth another try
MAX_ANSWER = 64 << 20  # bytes: a batch's scores take a few bytes each, so more is no reward server's answer
MAX_PIXELS = 4096 * 4096  # per image: the server refuses a larger one (422) from its PNG header, undecoded
MAX_BATCH_PIXELS = 1 << 28  # per request (256 images of 1024 x 1024; 3 GiB as float32): tiny PNGs may decode to more


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


def png_size(raw: bytes) -> Tuple[int, int]:
    """A PNG's (width, height) from its header (the IHDR chunk first after the signature), before any pixel is decoded:
    PIL's own check (Image.MAX_IMAGE_PIXELS) allows 89 M pixels and warns on several lines of the log first."""
    if raw[:8] != b"\x89PNG\r\n\x1a\n" or raw[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return struct.unpack(">II", raw[16:24])


def decode_png_base64(images: Sequence[str]) -> torch.Tensor:
    """The inverse of `png_base64`: B base64 PNGs of one size -> [B, 3, H, W] float32 in [0, 1] (k / 255). Sizes over
    MAX_PIXELS an image or MAX_BATCH_PIXELS in all are a UserError before anything is decoded: a small PNG of one colour
    may say it holds gigabytes of pixels."""
    from PIL import Image

    raws = [base64.b64decode(s, validate=True) for s in images]
    sizes = [png_size(raw) for raw in raws]
    side = math.isqrt(MAX_PIXELS)
    for i, (width, height) in enumerate(sizes):
        if width * height > MAX_PIXELS:
            raise UserError(f"image {i} is {width}x{height} pixels, over the cap of {MAX_PIXELS} ({side}x{side})")
    if len(set(sizes)) > 1:
        raise ValueError(f"images of {len(set(sizes))} sizes")
    total = sum(width * height for width, height in sizes)
    if total > MAX_BATCH_PIXELS:
        raise UserError(
            f"{len(raws)} images of {sizes[0][0]}x{sizes[0][1]} are {total} pixels, over the cap of {MAX_BATCH_PIXELS} "
            "a request: score fewer images a call"
        )
    arrays = [np.asarray(Image.open(io.BytesIO(raw), formats=["PNG"]).convert("RGB")) for raw in raws]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


def _request(url: str, payload: Optional[dict], timeout: float, attempts: int = ATTEMPTS) -> dict:
    """GET (payload None) or POST a JSON payload; the decoded JSON object of a 2xx answer. Retries what a server that is
    down, restarting or slow gives (refused or reset connections, no whole answer within `timeout` seconds, 502-504)
    `attempts` times in all. Follows no redirect: the scores must come from the server the user named, not from a host
    that server points to."""
    shown = masked(url)
    data = None if payload is None else json.dumps(payload).encode()
    last = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(BACKOFF * 2 ** (attempt - 1))
        try:
            status, location, kind, body = _exchange(url, data, timeout)
        except TimeoutError:
            last = f"no answer within {timeout:g} s"
            continue
        except (http.client.HTTPException, OSError) as e:
            last = one_line(f"{type(e).__name__}: {e}")
            continue
        if status not in RETRY_STATUS:
            break
        last = f"HTTP {status}"
    else:
        raise UserError(
            f"reward server {shown}: {last} ({attempts} tries); is `python -m rewards.server` running there? "
            "(a stopped run continues with --resume)"
        )
    if 300 <= status < 400:
        to = f"to {short(masked(location))}" if location else "no Location"
        raise UserError(f"reward server {shown}: HTTP {status} redirect ({to}) not followed: give the server's own URL")
    if not 200 <= status < 300:
        raise UserError(f"reward server {shown}: HTTP {status}: {_detail(body)}")
    try:
        answer = json.loads(body)
    except RecursionError:
        raise UserError(f"reward server {shown}: the answer is JSON nested too deeply to read") from None
    except ValueError:  # not JSON, not text, or a number of more digits than Python reads (JSONDecodeError is one)
        raise UserError(
            f"reward server {shown}: the answer is not JSON ({kind or 'no content type'}): {_detail(body)}"
        ) from None
    if not isinstance(answer, dict):
        raise UserError(f"reward server {shown}: expected a JSON object, got {_detail(body)}")
    return answer


def _exchange(url: str, data: Optional[bytes], timeout: float) -> Tuple[int, str, str, bytes]:
    """One GET (data None) or POST -> (status, Location, Content-Type, body). http.client follows no redirect (urllib
    would, to whatever host the server names). The whole request (connecting, sending, the headers and the body) has
    `timeout` seconds, else TimeoutError; an answer over MAX_ANSWER bytes is a UserError."""
    parsed = urllib.parse.urlsplit(url)
    https = parsed.scheme == "https"
    connection = http.client.HTTPSConnection if https else http.client.HTTPConnection
    # the port is given apart: http.client would read the last part of a bare IPv6 address as one
    conn = connection(parsed.hostname, parsed.port or (443 if https else 80), timeout=timeout)
    target = urllib.parse.quote(parsed.path or "/", safe="/%") + (f"?{parsed.query}" if parsed.query else "")
    headers = {"Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    expired = threading.Event()
    sockets = []  # the connection's, kept: http.client lets go of it once the headers say the server will hang up

    def expire():
        # the socket's timeout bounds each read, not the request: a server sending a byte a second would hold the run
        # forever. Shutting the socket down at the deadline ends the read (or send) that waits on it. socket.socket's
        # own shutdown, so that a TLS socket's state is left to the thread that reads it.
        expired.set()
        for sock in sockets:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:  # closed already: the request ended meanwhile
                pass

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        sockets.append(conn.sock)
        if expired.is_set():  # the deadline passed while connecting, before there was a socket to shut
            raise TimeoutError
        conn.request("POST" if data is not None else "GET", target, body=data, headers=headers)
        response = conn.getresponse()
        if response.length is not None and response.length > MAX_ANSWER:  # its Content-Length says so: not read
            body = None
        else:
            body = response.read(MAX_ANSWER + 1)  # a byte more than the cap tells an answer that goes on
        if body is None or len(body) > MAX_ANSWER:
            raise UserError(
                f"reward server {masked(url)}: the answer is over {MAX_ANSWER >> 20} MiB (a batch's scores take a few "
                "bytes each): is this a reward server?"
            )
        if response.length:  # a read of a given size ends quietly where the server hung up: not the whole answer
            raise http.client.IncompleteRead(body, response.length)
    except (http.client.HTTPException, OSError):
        if expired.is_set():  # the shut socket's error, or a timeout of its own: no answer in time
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():  # a shut socket may read as the end of an answer without a Content-Length
        raise TimeoutError
    return response.status, response.getheader("Location", ""), response.getheader("Content-Type", ""), body


def one_line(text: str) -> str:
    """`text` on one line (each run of whitespace one space), cut to 300 characters."""
    text = " ".join(text.split())
    return text if len(text) <= 300 else f"{text[:300]}... ({len(text)} characters)"


def _detail(body: bytes) -> str:
    """An error answer's message: FastAPI's {"detail": ...} or the body's start, on one line. Never raises: it words
    another fault."""
    try:
        text = str(json.loads(body)["detail"])
    except Exception:  # not JSON, no detail, or one nested too deeply to print (RecursionError): the body as it came
        text = body.decode("utf-8", "replace")
    return one_line(text)


def _json_line(value) -> str:
    """A decoded answer as JSON on one line, for a message; never raises."""
    try:
        text = json.dumps(value)
    except (RecursionError, ValueError):  # nested too deeply (json.loads took it, at a shallower stack)
        text = f"a {type(value).__name__} nested too deeply to print"
    return one_line(text)


def _float(number) -> float:
    """A JSON number as a float; an integer beyond a float's range is inf (float() would raise)."""
    try:
        return float(number)
    except OverflowError:
        return math.inf if number > 0 else -math.inf


def remote(url: str, timeout: float = TIMEOUT) -> Callable:
    """A reward served at `url` (http://HOST:PORT/name, or http://HOST:PORT when the server serves one reward):
    fn(images [B, 3, H, W] float in [0, 1], prompts) -> float32 [B] on the images' device, like a local reward;
    `fn.reward_name` is the served reward's name (the name it is logged under). Asks the server now which rewards it
    serves, so a server that is down or a wrong name fails before the model loads."""
    parsed = urllib.parse.urlsplit(url)
    base, name = f"{parsed.scheme}://{parsed.netloc}", parsed.path.strip("/")
    info = _request(base + "/", None, timeout)
    served = info.get("rewards")
    # the names are checked before they are printed or joined: an answer is a server's, not necessarily a good one
    if (
        info.get("version") != VERSION
        or not isinstance(served, list)
        or not served
        or not all(isinstance(n, str) for n in served)
    ):
        raise UserError(
            f"reward server {masked(base)}: not a cleanflow reward server of version {VERSION}: {_json_line(info)}"
        )
    listed = one_line(", ".join(served))
    if not name:
        if len(served) != 1:
            raise UserError(f"reward server {masked(base)} serves {listed}; name one: {masked(base)}/{served[0]}")
        name = served[0]
    elif name not in served:
        raise UserError(f"reward server {masked(base)} does not serve {name!r}; it serves {listed}")
    endpoint = f"{base}/{name}"

    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
            got = f"{tuple(images.shape)} and {len(prompts)} prompts"
            raise ValueError(f"expected images [B, 3, H, W] float in [0, 1] and B prompts, got {got}")
        answer = _request(endpoint, {"prompts": list(prompts), "images": png_base64(images)}, timeout)
        scores = answer.get("scores")
        if not isinstance(scores, list) or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
            raise UserError(f"reward server {masked(endpoint)}: expected {{'scores': [numbers]}}, got {_json_line(answer)}")
        if len(scores) != len(prompts):
            raise UserError(f"reward server {masked(endpoint)}: {len(scores)} scores for {len(prompts)} images")
        # checked as float32, the scores' type: a number beyond its range (an integer of 400 digits too) is inf
        values = torch.tensor([_float(s) for s in scores], dtype=torch.float32)
        bad = int((~torch.isfinite(values)).sum())
        if bad:
            raise UserError(f"reward server {masked(endpoint)}: NaN or inf for {bad} of {len(scores)} images")
        return values.to(images.device)

    def check_prompts(prompts):
        """The served reward's own prompt check (ocr: a quoted text in each), run before the model loads."""
        _request(f"{endpoint}/check", {"prompts": list(prompts)}, timeout)

    fn.check_prompts = check_prompts
    fn.reward_name = name
    fn.thread_safe = True  # one HTTP request per call; the server serialises a reward that is not thread-safe itself
    return fn
