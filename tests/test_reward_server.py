"""The reward server (rewards/server.py) and its client (rewards/remote.py) against real server processes on 127.0.0.1:
served scores equal the local reward's, a training run through a server equals the local run bit for bit in every
script, several servers combine by weighted sum and GDPO, faults (down, slow, HTML, wrong length, NaN) stop with one
line, and a server killed mid-run stops the run cleanly, which then resumes exactly once the server is back (at the
URL given again: a checkpoint never sets one). Neither side trusts the other: a redirect, an answer that drips, one
too big or malformed JSON is one line on the client; a bad request, or a reward that raises, is a 4xx or 500 of one
line, and one line in the server's log."""

import base64
import http.client
import json
import math
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import REPO, kill_group, run_script, start_script
from test_algos import FLAGS, _wait_for_checkpoint, assert_same_state, script_argv, trained, write_prompts
from test_ocr import render as render_word

from common import UserError
from harness import checkpoints
from rewards import REWARDS, load_rewards, parse_reward_spec, remote

SERVED = "jpeg_compressibility,shapes_clean,ocr"
TEXT_TRAIN = ['a sign that says "YK"', 'the word "ZPW"', 'a label with the text "AV"']  # tiny-text's own prompts
TEXT_TEST = ['a sign that says "PBJ"', 'the word "RNKR"']


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(rewards: str, port: int):
    """`python -m rewards.server` serving `rewards` on 127.0.0.1:port, once it answers (at most 120 s of start-up)."""
    for package in ("fastapi", "uvicorn"):  # the server's optional extra; the client needs nothing beyond the stdlib
        pytest.importorskip(package, reason="the reward server needs pip install -r rewards/requirements-server.txt")
    proc = start_script(["-m", "rewards.server", "--reward", rewards, "--port", port, "--device", "cpu"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            kill_group(proc)
            pytest.fail(f"the reward server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                if json.loads(r.read())["rewards"] == rewards.split(","):
                    return proc
        except OSError:
            time.sleep(0.2)
    kill_group(proc)
    pytest.fail("the reward server did not answer within 120 s")


@pytest.fixture(scope="module")
def servers():
    """A factory of reward servers on free ports (rewards -> base URL), each started once; all stopped at the end."""
    for package in ("fastapi", "uvicorn"):  # the server's optional extra; the client needs nothing beyond the stdlib
        pytest.importorskip(package, reason="the reward server needs pip install -r rewards/requirements-server.txt")
    procs, urls = [], {}

    def get(rewards: str = SERVED) -> str:
        if rewards not in urls:
            port = free_port()
            procs.append(start_server(rewards, port))
            urls[rewards] = f"http://127.0.0.1:{port}"
        return urls[rewards]

    yield get
    for proc in procs:
        kill_group(proc)
        proc.communicate()


class Misbehaving(BaseHTTPRequestHandler):
    """A real HTTP server that says it serves the rewards below, passes their prompt checks, and then answers their
    scoring with what their name says; a GET of anything but / is a web page (a URL pointing at some other web
    server)."""

    served = ["html", "short", "nan", "strings", "error", "slow", "drip", "drip_headers", "huge", "huge_stream"]

    def do_GET(self):
        if self.path == "/":
            self.reply(200, "application/json", json.dumps({"version": 1, "rewards": self.served}))
        else:
            self.reply(200, "text/html", "<!DOCTYPE html>\n<html><body><h1>Welcome to nginx!</h1></body></html>")

    def do_POST(self):
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
        name = self.path.strip("/")
        if name.endswith("/check"):  # the prompt check before the model loads passes
            self.reply(200, "application/json", "{}")
        elif name == "html":
            self.reply(200, "text/html", "<html><body>502 Bad Gateway</body></html>")
        elif name == "short":
            self.reply(200, "application/json", json.dumps({"scores": [0.5] * (n - 1)}))
        elif name == "nan":
            self.reply(200, "application/json", json.dumps({"scores": [0.5] * (n - 1) + [math.nan]}))
        elif name == "strings":
            self.reply(200, "application/json", json.dumps({"scores": ["0.5"] * n}))
        elif name == "error":
            self.reply(500, "application/json", json.dumps({"detail": "CUDA out of memory"}))
        elif name == "slow":
            time.sleep(3)
            self.reply(200, "application/json", json.dumps({"scores": [0.5] * n}))
        elif name in ("drip", "drip_headers"):  # a byte every 0.1 s (in the body or the headers) for 1.5 s
            self.send_response(200)
            if name == "drip":
                self.send_header("Content-Length", "100")
                self.end_headers()
            else:
                self.flush_headers()  # the status line, then a header line that never ends
            self.write([b" "] * 15, pause=0.1)
        elif name in ("huge", "huge_stream"):  # 65 MiB, announced by a Content-Length or read until the connection ends
            self.send_response(200)
            if name == "huge":
                self.send_header("Content-Length", str(65 << 20))
            self.end_headers()
            self.write([b" " * (1 << 20)] * 65)

    def write(self, pieces: list, pause: float = 0.0):
        try:
            for piece in pieces:
                time.sleep(pause)
                self.wfile.write(piece)
        except OSError:  # the client hung up, as it should
            pass

    def reply(self, status: int, kind: str, body: str):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def misbehaving():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# ----------------------------------------------------------------------------------------------------------------
# the client against the server, in this process
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_served_scores_equal_local(servers):
    """Through the server: OCR and JPEG (which quantise to 8 bits themselves) give the local scores bit for bit on
    float images; `shapes_clean` (float pixels) gives the local scores of the images rounded to 8 bits."""
    from test_rewards import blur, render

    base = servers()
    gen = torch.Generator().manual_seed(0)
    words = ["cat", "OCR", "hello", "flow"]
    images = torch.stack([render_word(w, 64) for w in words])
    images = (images + 0.01 * torch.randn(images.shape, generator=gen)).clamp(0, 1)  # off the 8-bit grid
    prompts = [f'a sign that says "{w}"' for w in words]
    ocr = remote.remote(f"{base}/ocr")(images, prompts)
    assert torch.equal(ocr, REWARDS["ocr"]("cpu")(images, prompts)) and ocr.sum() > 0
    jpeg = remote.remote(f"{base}/jpeg_compressibility")(images, prompts)
    assert torch.equal(jpeg, REWARDS["jpeg_compressibility"]("cpu")(images, prompts))

    scenes = torch.cat([render(("red", "circle", 20, 30, 12)), render(("blue", "square", 40, 30, 10))] * 2)
    scenes = blur(scenes, 0.7)  # float pixels between the 8-bit levels
    captions = ["a red circle", "a blue square", "a blue square", "a red circle"]
    served = remote.remote(f"{base}/shapes_clean")(scenes, captions)
    local = REWARDS["shapes_clean"]("cpu")((scenes * 255).round() / 255, captions)
    assert torch.equal(served, local) and served.tolist()[:2] == [1.0, 1.0] and served.tolist()[2:] == [0.0, 0.0]


def test_load_rewards_names_a_served_reward_by_its_name(servers):
    """A URL reward is logged under the served name (so a run reports what the local run reports, eval metrics
    included); a URL without a name takes the server's only reward; a reward given twice is refused."""
    base = servers()
    multi = load_rewards(f"{base}/shapes_clean:1.0,{base}/jpeg_compressibility:0.1", "cpu", ["a red circle"])
    assert multi.weights == {"shapes_clean": 1.0, "jpeg_compressibility": 0.1}
    from test_rewards import render

    images = torch.cat([render(("red", "circle", 20, 30, 12))] * 2)
    scores = multi.evaluate(images, ["a red circle"] * 2)
    assert {"shapes_clean", "jpeg_compressibility", "shapes_exact", "objects_extra"} <= set(scores)
    assert torch.equal(multi.total(scores), scores["shapes_clean"] + 0.1 * scores["jpeg_compressibility"])
    with pytest.raises(UserError, match=r"serves jpeg_compressibility, shapes_clean, ocr; name one: .*/jpeg"):
        load_rewards(base, "cpu")
    with pytest.raises(UserError, match="reward 'shapes_clean' is given twice"):
        load_rewards(f"shapes_clean,{base}/shapes_clean", "cpu")
    with pytest.raises(UserError, match="does not serve 'pickscore'; it serves jpeg_compressibility, shapes_clean, ocr"):
        load_rewards(f"{base}/pickscore", "cpu")
    with pytest.raises(UserError, match=r"/ocr/check: HTTP 422: the ocr reward needs the text to write in double quotes"):
        load_rewards(f"{base}/ocr", "cpu", ["a red circle"])


def test_reward_spec_with_urls():
    assert parse_reward_spec("http://h:8000/ocr:0.5,shapes") == {"http://h:8000/ocr": 0.5, "shapes": 1.0}
    assert parse_reward_spec("http://h:8000") == {"http://h:8000": 1.0}  # the port is not a weight
    assert parse_reward_spec("http://h:8000:2,https://[::1]:9/x:3") == {"http://h:8000": 2.0, "https://[::1]:9/x": 3.0}
    for spec, message in [
        ("http://user:secret@h:8000/ocr", "holds credentials"),
        ("http://h:0.5", "bad reward server URL"),
        ("http://:8000/ocr", "bad reward server URL"),
        ("http://h:8000/a/b", "bad reward server URL"),
        ("http://h:8000/ocr?key=1", "bad reward server URL"),
        ("http://h:8000/ocr:heavy", "bad weight 'heavy'"),
    ]:
        with pytest.raises(UserError, match=message):
            parse_reward_spec(spec)


@pytest.mark.parametrize(
    "name, message",
    [
        ("html", r"/html: the answer is not JSON \(text/html\): <html><body>502 Bad Gateway"),
        ("short", r"/short: 3 scores for 4 images"),
        ("nan", r"/nan: NaN or inf for 1 of 4 images"),
        ("strings", r"/strings: expected \{'scores': \[numbers\]\}"),
        ("error", r"/error: HTTP 500: CUDA out of memory"),
        ("slow", r"/slow: no answer within 0.5 s \(3 tries\)"),
        # each read comes in time, the answer never does: the timeout is for the whole request
        ("drip", r"/drip: no answer within 0.5 s \(3 tries\)"),
        ("drip_headers", r"/drip_headers: no answer within 0.5 s \(3 tries\)"),
    ],
)
def test_garbage_answers_are_one_line(misbehaving, name, message, monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF", 0.0)
    fn = remote.remote(f"{misbehaving}/{name}", timeout=0.5)
    with pytest.raises(UserError, match=message):
        fn(torch.rand(4, 3, 8, 8), ["a red circle"] * 4)


@pytest.mark.slow
def test_down_or_foreign_server_is_one_line(misbehaving):
    url = f"http://127.0.0.1:{free_port()}/ocr"
    with pytest.raises(UserError, match=r"ConnectionRefusedError.*\(3 tries\); is `python -m rewards.server` running"):
        remote.remote(url)
    with pytest.raises(UserError, match=r"the answer is not JSON \(text/html\): <!DOCTYPE html> <html>"):
        remote._request(f"{misbehaving}/some/page", None, 1.0)


def test_a_url_is_never_printed_with_its_credentials_or_query():
    for part, shown in [
        ("http://user:secret@h:8000/ocr", "http://user:***@h:8000/ocr"),
        ("http://secret@h:8000", "http://***@h:8000"),  # a token as the user name
        ("http://user:se/cr@et@h:8000", "http://user:***@h:8000"),  # a password holding '/' and '@'
        ("http://h:8000/ocr?token=secret:0.5", "http://h:8000/ocr?***"),
        ("http://h:8000/ocr#secret", "http://h:8000/ocr#***"),
        ("http://h:8000/ocr:0.5", "http://h:8000/ocr:0.5"),
    ]:
        assert remote.masked(part) == shown
    for spec in ["http://user:secret@h:8000/ocr", "shapes,,http://user:secret@h:8000", "http://h:99999/x?k=secret"]:
        with pytest.raises(UserError) as e:
            parse_reward_spec(spec)
        assert "secret" not in str(e.value) and "***" in str(e.value), str(e.value)


class Recording(BaseHTTPRequestHandler):
    """A reward server's GET / that notes each request in `events`, as the test's model load does."""

    events: list = []

    def do_GET(self):
        self.events.append(f"GET {self.path}")
        body = json.dumps({"version": 1, "rewards": ["jpeg_compressibility", "shapes"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "name, message",
    [
        ("jpeg_compressibility", "the model loads"),  # valid: the server was asked first
        ("nosuch", "does not serve 'nosuch'; it serves jpeg_compressibility, shapes"),
        ("shapes", "logs eval/shapes, which the training reward's eval (shapes_clean) logs already"),
        # the same served reward under two URLs (127.0.0.1 and localhost): one side metric twice
        ("jpeg_compressibility localhost", "serves 'jpeg_compressibility', named already"),
    ],
)
def test_an_eval_reward_server_is_asked_before_the_model_loads(name, message, tmp_path, capsys, monkeypatch):
    """Rank 0 asks an --eval-rewards server what it serves in the flag checks: a name it does not serve, or a served
    reward that the training reward's eval logs already (compared by its served name, not its URL), is one line
    before the model loads."""
    from test_bad_inputs import TINY, call

    import models

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    events = Recording.events = []

    def load(*a, **k):
        events.append("load")
        raise UserError("the model loads")

    monkeypatch.setattr(models, "load_pipeline", load)
    name, *again = name.split()
    urls = [f"http://{host}:{server.server_address[1]}/{name}" for host in ["127.0.0.1", *again]]
    try:
        argv = [*TINY, "--output-dir", str(tmp_path / "runs"), "--eval-rewards", *urls]
        rc, err = call("nft", argv, capsys)
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 2 and err.count("\n") == 1 and message in err, err
    assert events == (["GET /", "load"] if message == "the model loads" else ["GET /"] * len(urls))
    assert not (tmp_path / "runs").exists()


def test_server_refuses_bad_requests(servers):
    """The server's own checks: images that are not PNGs, or not as many as the prompts, are a 422 with a reason."""
    base = servers()
    for payload, message in [
        ({"prompts": ["a"], "images": ["not base64 png"]}, "the images are not base64 PNGs"),
        ({"prompts": ["a", "b"], "images": remote.png_base64(torch.rand(1, 3, 8, 8))}, "1 images for 2 prompts"),
    ]:
        with pytest.raises(UserError, match=f"HTTP 422: {message}"):
            remote._request(f"{base}/jpeg_compressibility", payload, 10.0)


class Scripted(BaseHTTPRequestHandler):
    """A reward server serving `r` whose answers a test scripts: `answers` maps a request ("GET /", "POST /r/check",
    "POST /r") to (status, headers, body); the others get a good server's answer (for 4 images). Each request is noted
    in `seen`."""

    answers: dict = {}
    seen: list = []

    def do_GET(self):
        self.answer()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer()

    def answer(self):
        request = f"{self.command} {self.path}"
        self.seen.append(request)
        good = {"GET /": {"version": 1, "rewards": ["r"]}, "POST /r/check": {}, "POST /r": {"scores": [0.5] * 4}}
        status, headers, body = self.answers.get(request, (200, {}, json.dumps(good.get(request))))
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    """A factory of `Scripted` servers: answers -> (base URL, the requests it saw); all stopped at the end."""
    servers = []

    def start(answers: dict):
        handler = type("Script", (Scripted,), {"answers": answers, "seen": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", handler.seen

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def load_check_score(url: str):
    """What a run asks a reward server, in order: GET / (remote), POST /r/check (the prompt check), POST /r (scores)."""
    fn = remote.remote(url, timeout=2.0)
    fn.check_prompts(["a red circle"] * 4)
    return fn(torch.rand(4, 3, 8, 8), ["a red circle"] * 4)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("request_", ["GET /", "POST /r/check", "POST /r"])
def test_a_redirect_is_not_followed(scripted, request_, status):
    """A server that redirects the start-up GET /, the prompt check or the scoring to another host: one line naming the
    status and where it points (masked), and the other host is never asked (the run would train on its scores)."""
    elsewhere, seen = scripted({})
    location = elsewhere.replace("://", "://user:secret@") + "/r?key=secret"
    base, _ = scripted({request_: (status, {"Location": location}, "")})
    shown = elsewhere.replace("://", "://user:***@") + "/r?***"
    with pytest.raises(UserError) as e:
        load_check_score(f"{base}/r")
    url = base + request_.split()[1]
    assert (
        str(e.value) == f"reward server {url}: HTTP {status} redirect (to '{shown}') not followed: give the server's own URL"
    )
    assert seen == []


DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it


@pytest.mark.parametrize(
    "request_, status, body, message",
    [
        ("GET /", 200, '{"version": 1, "rewards": [1, 2]}', ': not a cleanflow reward server of version 1: {"version": 1'),
        ("GET /", 200, '{"version": 1, "rewards": [{"a": 1}]}', ": not a cleanflow reward server of version 1: {"),
        ("GET /", 200, '{"version": 1, "rewards": []}', ': not a cleanflow reward server of version 1: {"version": 1'),
        ("GET /", 200, DEEP, "/: the answer is JSON nested too deeply to read"),
        ("GET /", 200, '{"version": 1, "rewards": ' + DEEP + "}", "/: the answer is JSON nested too deeply to read"),
        ("GET /", 500, '{"detail": ' + DEEP + "}", '/: HTTP 500: {"detail": [[[[[[[['),
        ("POST /r/check", 200, DEEP, "/r/check: the answer is JSON nested too deeply to read"),
        ("POST /r/check", 422, '{"detail": ' + DEEP + "}", '/r/check: HTTP 422: {"detail": [[[[[[[['),
        ("POST /r", 200, '{"scores": ' + DEEP + "}", "/r: the answer is JSON nested too deeply to read"),
        ("POST /r", 200, '{"scores": [' + "9" * 400 + ", 0, 0, 0]}", "/r: NaN or inf for 1 of 4 images"),  # > float max
        ("POST /r", 200, '{"scores": [' + "9" * 5000 + ", 0, 0, 0]}", "/r: the answer is not JSON"),  # > int digits
    ],
)
def test_malformed_answers_are_one_line(scripted, request_, status, body, message):
    """Whatever the start-up GET /, the prompt check or the scoring answers, the run stops with one short line."""
    base, _ = scripted({request_: (status, {}, body)})
    with pytest.raises(UserError) as e:
        load_check_score(f"{base}/r")
    assert str(e.value).startswith(f"reward server {base}{message}"), str(e.value)[:1000]
    assert "\n" not in str(e.value) and len(str(e.value)) < 500


@pytest.mark.parametrize("name", ["huge", "huge_stream"])
def test_an_answer_over_the_cap_is_one_line(misbehaving, name):
    """65 MiB of answer, announced by its Content-Length (refused before reading it) or streamed until the server hangs
    up (refused once 64 MiB are read): one line, however much a server would send."""
    fn = remote.remote(f"{misbehaving}/{name}", timeout=10.0)
    with pytest.raises(UserError, match=rf"^reward server {misbehaving}/{name}: the answer is over 64 MiB"):
        fn(torch.rand(4, 3, 8, 8), ["a red circle"] * 4)


# the server's side: `build_app` and `serve`, as `main` runs them, serving toy rewards that fail in every way
TOY_SERVER = """
import socket, sys
import torch
from common import UserError
from rewards import server

def ok(images, prompts):
    return torch.full((len(prompts),), 0.5)

def value_error(images, prompts):
    raise ValueError("no shape named in 'a dog'")

def user_error(images, prompts):
    raise UserError("the ocr reward needs the text to write in double quotes")

def runtime_error(images, prompts):
    raise RuntimeError("CUDA error: an illegal memory access\\nCompile with TORCH_USE_CUDA_DSA")

def check_refuses(prompts):
    raise ValueError("prompt 0 names no shape")

def check_crashes(prompts):
    raise KeyError("vocabulary")

value_error.check_prompts, runtime_error.check_prompts = check_refuses, check_crashes
sock = socket.socket()
sock.bind(("127.0.0.1", int(sys.argv[1])))
fns = {"ok": ok, "value_error": value_error, "user_error": user_error, "runtime_error": runtime_error}
server.serve(server.build_app(fns, torch.device("cpu")), sock)
"""


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory):
    """The toy reward server on a free port, its log (stdout and stderr) in a file: (base URL, log path)."""
    for package in ("fastapi", "uvicorn"):
        pytest.importorskip(package, reason="the reward server needs pip install -r rewards/requirements-server.txt")
    log, port = tmp_path_factory.mktemp("toy") / "server.log", free_port()
    with open(log, "wb") as out:
        argv = [sys.executable, "-c", TOY_SERVER, str(port)]
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                break
            except OSError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", log
    finally:
        kill_group(proc)
        proc.wait()


def png_claiming(width: int, height: int) -> str:
    """A base64 PNG whose header says width x height pixels (its data is an 8x8 image's): decoding it would allocate
    what the header says."""
    raw = bytearray(base64.b64decode(remote.png_base64(torch.zeros(1, 3, 8, 8))[0]))
    raw[16:24] = struct.pack(">II", width, height)  # IHDR's data follows the signature, its length and its type
    raw[29:33] = struct.pack(">I", zlib.crc32(raw[12:29]))  # the chunk's CRC covers its type and data
    return base64.b64encode(raw).decode()


ECHO = "ECHO" * 1000  # input that neither the answer nor the log may repeat
SCORE = json.dumps({"prompts": ["a dog"], "images": remote.png_base64(torch.zeros(1, 3, 8, 8))})


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, body, headers, status, message",
    [
        ("/value_error", SCORE, {}, 422, "no shape named in 'a dog'"),
        ("/user_error", SCORE, {}, 422, "the ocr reward needs the text to write in double quotes"),
        (
            "/runtime_error",
            SCORE,
            {},
            500,
            "reward runtime_error failed: RuntimeError: CUDA error: an illegal memory access Compile with TORCH_USE_CUDA_DSA",
        ),
        ("/value_error/check", '{"prompts": ["a dog"]}', {}, 422, "prompt 0 names no shape"),
        ("/runtime_error/check", '{"prompts": ["a dog"]}', {}, 500, "reward runtime_error failed: KeyError: 'vocabulary'"),
        (
            "/ok",
            json.dumps({"prompts": [1], "images": [ECHO]}),
            {},
            422,
            "bad request: prompts.0: Input should be a valid string",
        ),
        (
            "/ok",
            '{"prompts": [NaN], "images": ["' + ECHO + '"]}',
            {},
            422,
            "bad request: prompts.0: Input should be a valid string",
        ),
        (
            "/ok",
            json.dumps({"prompts": ["a"], "images": [{ECHO: ECHO}]}),
            {},
            422,
            "bad request: images.0: Input should be a valid string",
        ),
        ("/ok", '{"prompts": ["' + ECHO, {}, 422, "bad request: the body is not JSON (Unterminated string starting at)"),
        (
            "/ok",
            json.dumps({"prompts": ["a"], "images": [png_claiming(12000, 12000)]}),
            {},
            422,
            "image 0 is 12000x12000 pixels, over the cap of 16777216 (4096x4096)",
        ),
        (
            "/ok",
            json.dumps({"prompts": ["a"] * 17, "images": [png_claiming(4096, 4096)] * 17}),
            {},
            422,
            "17 images of 4096x4096 are 285212672 pixels, over the cap of 268435456 a request: score fewer images a call",
        ),
        (
            "/ok",
            "",
            {"Content-Length": str(300 << 20)},
            413,
            "the request is 314572800 bytes, over the cap of 268435456 (256 MiB): score fewer images a call",
        ),
        ("/ok", "0\r\n\r\n", {"Transfer-Encoding": "chunked"}, 411, "a request needs a Content-Length"),
    ],
)
def test_server_answers_a_bad_request_with_one_line(toy_server, path, body, headers, status, message):
    """A client's error (or a reward's ValueError) is a 4xx, a reward's crash a 500: each with a one-line reason, and one
    line in the server's log, which repeats no input (a request of 300 MB is refused from its Content-Length, unread)."""
    base, log = toy_server
    body = body.encode()
    conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=5)
    try:
        conn.putrequest("POST", path)
        for key, value in {"Content-Type": "application/json", **(headers or {"Content-Length": str(len(body))})}.items():
            conn.putheader(key, value)
        before = log.stat().st_size
        conn.endheaders(body)
        answer = conn.getresponse()
        got = (answer.status, answer.read().decode())
    finally:
        conn.close()
    assert got[0] == status and json.loads(got[1]) == {"detail": message}, got[1][:2000]
    with open(log, "rb") as f:
        f.seek(before)
        lines = f.read().decode().splitlines()
    assert len(lines) == 1 and lines[0].endswith(message) and ECHO not in lines[0], lines


# ----------------------------------------------------------------------------------------------------------------
# training runs through servers
# ----------------------------------------------------------------------------------------------------------------
def scalars(run_dir: Path) -> dict:
    """Every logged scalar but the timings: {tag: [values as float.hex, so that NaN equals NaN]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith(("charts/", "losses/", "eval/")) and "per_sec" not in t]
    return {t: [float(e.value).hex() for e in acc.Scalars(t)] for t in tags if not t.startswith("charts/seconds")}


def run_pair(algo, prompts, tmp_path, local_reward, served_reward, *flags):
    """The same tiny run with a local and a served reward -> the two run folders."""
    dirs = []
    for label, reward in (("local", local_reward), ("served", served_reward)):
        run_script(script_argv(algo, prompts, tmp_path / label, "--reward", reward, *flags))
        (run_dir,) = (tmp_path / label).iterdir()
        dirs.append(run_dir)
    return dirs


# crd in the fast tests, every algorithm in the slow ones (the same code path, another loss)
@pytest.mark.parametrize("algo", [a if a == "crd" else pytest.param(a, marks=pytest.mark.slow) for a in sorted(FLAGS)])
def test_run_through_server_equals_local(algo, servers, tmp_path):
    """Two epochs of every script scored through the server end bit-identical to the local run: weights, optimizer,
    every logged reward, loss and eval metric."""
    prompts = write_prompts(tmp_path)
    local, served = run_pair(
        algo, prompts, tmp_path, "jpeg_compressibility", f"{servers()}/jpeg_compressibility", "--num-epochs", 2
    )
    a, b = checkpoints.load_checkpoint(local), checkpoints.load_checkpoint(served)
    assert trained(algo, a)
    assert_same_state(a, b, algo)
    logged = scalars(local)
    assert logged["charts/jpeg_compressibility"] and logged["eval/jpeg_compressibility"]
    assert scalars(served) == logged
    assert b["args"]["reward"] == f"{servers()}/jpeg_compressibility"  # what a resume must be given again


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["sum", "gdpo"])
def test_two_servers_combine_like_local_rewards(aggregation, servers, tmp_path):
    """OCR and JPEG, each on its own server, weighted and aggregated (sum or GDPO) as the same local rewards are, on
    tiny-text: the same epoch bit for bit."""
    (tmp_path / "train.txt").write_text("\n".join(TEXT_TRAIN) + "\n")
    (tmp_path / "test.txt").write_text("\n".join(TEXT_TEST) + "\n")
    ocr, jpeg = servers("ocr"), servers("jpeg_compressibility")
    flags = ["--model", "assets/tiny-text", "--num-epochs", 1, "--advantage-aggregation", aggregation]
    local, served = run_pair("nft", tmp_path, tmp_path, "ocr:1.0,jpeg_compressibility:0.5", f"{ocr}:1.0,{jpeg}:0.5", *flags)
    assert_same_state(checkpoints.load_checkpoint(local), checkpoints.load_checkpoint(served), "nft")
    logged = scalars(local)
    assert {"charts/ocr", "charts/jpeg_compressibility", "eval/ocr", "eval/ocr_strict"} <= set(logged)
    assert scalars(served) == logged


@pytest.mark.slow
def test_server_down_stops_the_run_with_one_line(misbehaving, tmp_path):
    """A server that is not there: one line before the model loads, nothing written. A server that answers HTML once
    the run trains: one line, and no checkpoint of the half-scored epoch."""
    prompts = write_prompts(tmp_path)
    url = f"http://127.0.0.1:{free_port()}/jpeg_compressibility"
    out = run_script(script_argv("grpo", prompts, tmp_path / "down", "--reward", url), check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: reward server {url[: url.rfind('/')]}/: Connection")
    assert not (tmp_path / "down").exists()

    out = run_script(script_argv("grpo", prompts, tmp_path / "html", "--reward", f"{misbehaving}/html"), check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    html = "<html><body>502 Bad Gateway</body></html>"
    assert (
        out.stderr.strip().splitlines()[-1]
        == f"error: reward server {misbehaving}/html: the answer is not JSON (text/html): {html}"
    )
    assert not list((tmp_path / "html").glob("*/checkpoints/*"))


@pytest.mark.slow
def test_server_killed_mid_run_then_resume_is_exact(servers, tmp_path):
    """The server is killed once the run has saved epoch 1: the run stops with one line at its next reward call (after
    its bounded retries) and keeps its last checkpoint; the server restarted on another port, `--resume` with
    `--reward <its new URL>` (a checkpoint never sets a server) ends bit-identical to an uninterrupted local run."""
    prompts = write_prompts(tmp_path)
    epochs = 4
    run_script(script_argv("grpo", prompts, tmp_path / "local", "--reward", "jpeg_compressibility", "--num-epochs", epochs))
    (local,) = (tmp_path / "local").iterdir()

    port = free_port()
    url = f"http://127.0.0.1:{port}/jpeg_compressibility"
    server = start_server("jpeg_compressibility", port)
    try:
        proc = start_script(script_argv("grpo", prompts, tmp_path / "served", "--reward", url, "--num-epochs", epochs))
        try:
            run_dir = _wait_for_checkpoint(proc, tmp_path / "served", 1)
            kill_group(server)
            server.communicate()
            _, err = proc.communicate(timeout=240)
        finally:
            kill_group(proc)
        assert proc.returncode == 2 and "Traceback" not in err, err[-2000:]
        assert err.strip().splitlines()[-1].startswith(f"error: reward server {url}: ")
        assert "(3 tries)" in err.strip().splitlines()[-1]
        stopped_at = checkpoints.load_checkpoint(run_dir)["epoch"]
        assert 1 <= stopped_at < epochs

        port = free_port()
        server = start_server("jpeg_compressibility", port)
        run_script(["algos/grpo.py", "--resume", run_dir, "--reward", f"http://127.0.0.1:{port}/jpeg_compressibility"])
    finally:
        kill_group(server)
        server.communicate()
    assert_same_state(checkpoints.load_checkpoint(local), checkpoints.load_checkpoint(run_dir), "grpo")


@pytest.mark.slow
def test_server_bad_inputs_are_one_line(servers):
    """An unknown reward, a reward named twice, a port in use: one line, exit code 2, before any model loads."""
    port = servers().rsplit(":", 1)[1]
    for flags, message in [
        (["--reward", "nosuch"], "error: unknown reward 'nosuch'; available: shapes, "),
        (["--reward", "ocr,ocr"], "error: a reward named twice in 'ocr,ocr'; available: shapes, "),
        (["--reward", "ocr", "--port", port], f"error: cannot listen on 127.0.0.1:{port} (Address already in use)"),
    ]:
        out = run_script(["-m", "rewards.server", *flags], check=False, timeout=120)
        assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(message), out.stderr[-2000:]
        assert "Traceback" not in out.stderr
