"""A run folder is data, never instructions: `--resume` of a crafted one runs no code (DCP's pickled shards index is
read by an allow-listed unpickler), writes nothing outside the folder (no symlinks in it), and sends no image or
prompt to a server the checkpoint names (reward server URLs come from the command line only). Each refusal is one line,
exit code 2, before the model loads, with the run folder and everything around it unchanged.

The runs are tiny nft runs made in-process (test_bad_inputs' `nft_run`, and one scored by a fake reward server here)."""

import dataclasses
import io
import json
import pickle
import shutil
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import test_bad_inputs
import torch
import tyro
from conftest import run_in_process, run_script
from test_algos import script_argv, write_prompts
from test_bad_inputs import TINY, assert_one_line, call, snapshot

import common
import models
from algos import nft
from harness import checkpoints, run, shards

# test_bad_inputs' fixtures: one finished tiny nft run per module (`nft_run`), a fresh copy of it per test (`run_copy`)
nft_run, run_copy = test_bad_inputs.nft_run, test_bad_inputs.run_copy


@pytest.fixture
def no_model_load(monkeypatch):
    """The calls of models.load_pipeline: a refusal must come before the model loads."""
    loaded, load = [], models.load_pipeline
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: loaded.append(a) or load(*a, **k))
    return loaded


def edit_state(run_dir: Path, edit):
    """`edit(state)` applied to the run's last state.pt, saved back as a crafted checkpoint would be."""
    path = (run_dir / "checkpoints" / "last" / "state.pt").resolve()
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def resume(run_dir, *flags) -> list:
    return ["--resume", str(run_dir), "--num-epochs", "2", *map(str, flags)]


def resumes(argv: list, capsys) -> str:
    """A resume that goes on: `python algos/nft.py *argv` in-process ends with exit code 0; its stderr."""
    capsys.readouterr()
    rc = run_in_process(nft, argv)
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    return err


# ----------------------------------------------------------------------------------------------------------------
# item 1: DCP's shards/.metadata is a pickle
# ----------------------------------------------------------------------------------------------------------------
class Payload:
    """What a crafted .metadata holds: unpickling it creates `marker` (pickle calls open(marker, "w"))."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def dcp_metadata(folder: Path, state: dict):
    """Write `state` with DCP into `folder` (as a run's shards/); its Metadata, read by plain pickle (we wrote it)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return pickle.loads((folder / ".metadata").read_bytes())


def piece_moved(shards: Path, name: str):
    """Real DCP shards whose one piece is said to be stored in `name` (outside shards/, or the index itself)."""
    meta = dcp_metadata(shards, {"params/x": torch.zeros(2)})
    meta.storage_data = {k: dataclasses.replace(v, relative_path=name) for k, v in meta.storage_data.items()}
    (shards / ".metadata").write_bytes(pickle.dumps(meta))


SHARDS_CASES = {  # how the plain run's last checkpoint is crafted -> a piece of the one line
    "pickle that runs code": (
        lambda shards, marker: (shards / ".metadata").write_bytes(pickle.dumps(Payload(marker))),
        "is refused (it names io.open, which is not DCP tensor metadata): unpickling it could run code",
    ),
    "bytes entry": (  # DCP stores a non-tensor as a torch.save pickle, loaded with weights_only=False
        lambda shards, marker: dcp_metadata(shards, {"params/x": torch.zeros(2), "blob": io.BytesIO(b"pickled")}),
        "it names torch.distributed.checkpoint.metadata.BytesStorageMetadata, which is not DCP tensor metadata",
    ),
    "piece outside shards/": (
        lambda shards, marker: piece_moved(shards, "../weights.safetensors"),
        "is stored in '../weights.safetensors', not a shard file in",
    ),
    "piece in the index": (lambda shards, marker: piece_moved(shards, ".metadata"), "is stored in '.metadata'"),
    "no shards folder": (lambda shards, marker: shards.rmdir(), "shards/.metadata cannot be read (missing or not a plain"),
}


@pytest.mark.parametrize("case", sorted(SHARDS_CASES) + ["bad shards entry"])
def test_a_crafted_shards_checkpoint_runs_no_code(case, run_copy, tmp_path, capsys, no_model_load):
    """A plain run given a "shards" entry in its state.pt (which routes a resume to shards/) and a crafted shards/:
    the resume and a full read (`load_checkpoint(full=True)`, what tools use) refuse it with one line before the
    model loads; the pickle's marker file is never created; the folder is unchanged."""
    marker = tmp_path / "marker"
    ckpt = (run_copy / "checkpoints" / "last").resolve()
    entry = "x" if case == "bad shards entry" else {"ranks": 1, "params": ["x"]}
    edit_state(run_copy, lambda st: st.update(shards=entry))
    (ckpt / "shards").mkdir()
    if case in SHARDS_CASES:
        craft, expected = SHARDS_CASES[case]
        craft(ckpt / "shards", marker)
    else:
        expected = "its shards entry is 'x', not the ranks and weight names"
    before = snapshot(run_copy)
    rc, err = call("nft", resume(run_copy), capsys)
    line = assert_one_line(rc, err, expected)
    assert line.startswith(f"error: checkpoint {run_copy / 'checkpoints' / 'epoch_000001'}: ")
    with pytest.raises(common.UserError, match="its shards"):
        checkpoints.load_checkpoint(run_copy, full=True)
    assert not marker.exists() and not no_model_load and snapshot(run_copy) == before
    if case == "pickle that runs code":  # the payload is live: what a bare pickle.load (DCP's reader) would do
        pickle.loads((ckpt / "shards" / ".metadata").read_bytes())
        assert marker.exists()


@pytest.mark.slow
def test_a_shards_folder_written_by_dcp_resumes(tmp_path):
    """A sharded checkpoint the code wrote (--fsdp, here on one process) reads back through the checked reader bit for
    bit what DCP's own reader gives, and resumes."""
    import torch.distributed.checkpoint as dcp

    prompts = write_prompts(tmp_path)
    run_script(script_argv("nft", prompts, tmp_path / "runs", "--num-epochs", 1, "--fsdp"))
    (run_dir,) = (tmp_path / "runs").iterdir()
    folder = run_dir / "checkpoints" / "epoch_000001" / "shards"
    meta = shards.read_shards_metadata(folder)
    ours = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    theirs = {k: torch.full_like(v, float("nan")) for k, v in ours.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(ours, storage_reader=shards.shards_reader(folder), no_dist=True)
        dcp.load(theirs, checkpoint_id=str(folder), no_dist=True)  # DCP's reader: the folder is ours, trusted here
    assert any(k.startswith("optimizer/") for k in ours) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    full = checkpoints.load_checkpoint(run_dir, full=True)
    assert all(torch.equal(full["params"][k[len("params/") :]], v) for k, v in ours.items() if k.startswith("params/"))

    run_script(["algos/nft.py", "--resume", run_dir, "--num-epochs", 2])
    assert checkpoints.load_checkpoint(run_dir, full=True)["epoch"] == 2


# ----------------------------------------------------------------------------------------------------------------
# item 2: symlinks in the run folder
# ----------------------------------------------------------------------------------------------------------------
def link_out(run_dir: Path, rel: str, elsewhere: Path) -> None:
    """Move `rel` (a file or folder of the run, made empty when missing) to `elsewhere` and leave a symlink to it."""
    path, target = run_dir / rel, elsewhere / rel.replace("/", "_")
    if path.exists():
        shutil.move(path, target)
    else:
        target.write_text("")
    path.symlink_to(target)


def events_file(run_dir: Path) -> str:
    (events,) = run_dir.glob("events.out.tfevents.*")
    return events.name


PLACES = {  # a symlink where a resumed run writes (or removes) -> what is linked out
    "samples": "samples",
    "sample grid": "samples/eval_0000000.png",
    "checkpoints": "checkpoints",
    "epoch folder": "checkpoints/epoch_000001",
    "lora": "lora",
    "events file": None,  # its name has the time in it
    "resumes.jsonl": "resumes.jsonl",
    ".lock": ".lock",
    "args.json": "args.json",
}


@pytest.mark.parametrize("place", sorted(PLACES) + ["last elsewhere", "kill's temp link elsewhere"])
def test_a_symlink_in_the_run_folder_is_refused(place, run_copy, tmp_path, capsys, no_model_load):
    """A symlink anywhere in the run folder (which a resume would append, save or remove through): one line naming
    it, exit code 2, before the model loads; nothing changes inside the run folder or where the link points."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    last = run_copy / "checkpoints" / "last"
    if place == "last elsewhere":  # `last` naming a copy of the epoch outside the run
        shutil.copytree(last.resolve(), elsewhere / "epoch_000001")
        last.unlink()
        last.symlink_to(elsewhere / "epoch_000001")
        rel = "checkpoints/last"
    elif place == "kill's temp link elsewhere":
        rel = "checkpoints/.tmp-last.4242"
        (run_copy / rel).symlink_to(elsewhere)
    else:
        rel = PLACES[place] or events_file(run_copy)
        link_out(run_copy, rel, elsewhere)
    before, outside = snapshot(run_copy), snapshot(elsewhere)
    rc, err = call("nft", resume(run_copy), capsys)
    line = assert_one_line(rc, err, "is a symbolic link (to ")
    assert f": {rel} is a symbolic link" in line and "a resumed run writes only inside its own folder" in line
    assert snapshot(run_copy) == before and snapshot(elsewhere) == outside and not no_model_load


def test_a_symlinked_run_folder_is_refused(run_copy, tmp_path, capsys, no_model_load):
    link = tmp_path / "link"
    link.symlink_to(run_copy)
    before = snapshot(run_copy)
    for target in (link, link / "checkpoints" / "epoch_000001"):
        rc, err = call("nft", resume(target), capsys)
        assert_one_line(rc, err, f"run folder {link} is a symbolic link (to {run_copy})")
    assert snapshot(run_copy) == before and not no_model_load


def test_the_run_folders_own_links_resume(run_copy, capsys):
    """`checkpoints/last` and the .tmp-last.<pid> a kill between its two renames leaves, each naming an epoch folder
    beside it (or one removed since), are the run's own: a resume through `last` goes on, and removes the leftovers."""
    (run_copy / "checkpoints" / ".tmp-last.4242").symlink_to("epoch_000001")
    (run_copy / "checkpoints" / ".tmp-last.4343").symlink_to("epoch_000009")
    resumes(resume(run_copy / "checkpoints" / "last"), capsys)
    assert checkpoints.load_checkpoint(run_copy)["epoch"] == 2
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["epoch_000001", "epoch_000002", "last"]


# ----------------------------------------------------------------------------------------------------------------
# item 3: reward servers
# ----------------------------------------------------------------------------------------------------------------
class FakeServer(BaseHTTPRequestHandler):
    """A cleanflow reward server (rewards/remote.py's wire format) in this process: serves `server.served`, scores
    every image 0.5, passes every prompt check and records every request (`server.requests`)."""

    def do_GET(self):
        self.server.requests.append(f"GET {self.path}")
        self.reply({"version": 1, "rewards": self.server.served})

    def do_POST(self):
        self.server.requests.append(f"POST {self.path}")
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
        self.reply({} if self.path.endswith("/check") else {"scores": [0.5] * n})

    def reply(self, answer: dict):
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_server():
    """A factory: served reward names -> (base URL, the server, whose `requests` a test may read and clear)."""
    servers = []

    def start(*served):
        server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
        server.served, server.requests, server.daemon_threads = list(served), [], True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def served_run(tmp_path_factory, fake_server):
    """One finished 1-epoch nft run scored by a reward server -> (run folder, the server's URL, the server)."""
    tmp = tmp_path_factory.mktemp("servedrun")
    (tmp / "test.txt").write_text("a red circle\ntwo squares\n")
    url, server = fake_server("jpeg_compressibility")
    argv = [*TINY, "--num-train-timesteps", "1", "--eval-every", "5", "--test-prompts", str(tmp / "test.txt")]
    argv += ["--reward", f"{url}/jpeg_compressibility", "--output-dir", str(tmp / "runs")]
    run.run_main(nft.main, tyro.cli(nft.Args, args=argv), argv=argv)
    (run_dir,) = (tmp / "runs").iterdir()
    return run_dir, url, server


@pytest.fixture
def served_copy(served_run, tmp_path):
    run_dir, url, server = served_run
    dst = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, dst, symlinks=True)
    server.requests.clear()
    return dst, url, server


def test_a_checkpoint_never_sets_the_reward_server(served_copy, run_copy, fake_server, capsys, no_model_load):
    """A served run resumed without --reward, and a local run whose state.pt was edited to name a server: one line
    asking for --reward again; neither server hears from the run, and both folders stay as they were."""
    run_dir, url, server = served_copy
    planted, listening = fake_server("shapes_clean")
    edit_state(run_copy, lambda st: st["args"].update(reward=f"{planted}/shapes_clean"))
    for folder, spec in ((run_dir, f"{url}/jpeg_compressibility"), (run_copy, f"{planted}/shapes_clean")):
        before = snapshot(folder)
        rc, err = call("nft", resume(folder), capsys)
        assert_one_line(rc, err, f"the run's --reward is {spec}; a checkpoint never sets where images go: pass --reward")
        assert snapshot(folder) == before
    assert server.requests == [] and listening.requests == [] and not no_model_load


def test_a_moved_reward_server_resumes(served_copy, fake_server, capsys):
    """The server moved: `--reward <new URL>` (here without the reward's name, which the new server is asked) resumes,
    scores only there, and resumes.jsonl records the change."""
    run_dir, url, server = served_copy
    moved, new_server = fake_server("jpeg_compressibility")
    resumes(resume(run_dir, "--reward", moved), capsys)
    assert server.requests == [] and "POST /jpeg_compressibility" in new_server.requests
    record = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["overrides"]["reward"] == {"saved": f"{url}/jpeg_compressibility", "now": moved}
    ckpt = checkpoints.load_checkpoint(run_dir)
    assert ckpt["epoch"] == 2 and ckpt["args"]["reward"] == moved


def test_a_reward_server_moves_but_the_reward_stays(served_copy, fake_server, capsys, no_model_load):
    """What a moved server may not change: the reward it serves, a weight, the number or kind of rewards."""
    run_dir, url, server = served_copy
    other, _ = fake_server("ocr", "jpeg_compressibility")
    trained = f"{url}/jpeg_compressibility"
    keeps = f"the run was trained on {trained}; a resumed run keeps its rewards and weights"
    cases = {
        f"{other}/ocr": f"{other}/ocr serves 'ocr', the run was trained on 'jpeg_compressibility'",
        f"{other}/jpeg_compressibility:0.5": keeps,
        "jpeg_compressibility": keeps,
        f"{other}/jpeg_compressibility,shapes": keeps,
    }
    before = snapshot(run_dir)
    for spec, expected in cases.items():
        rc, err = call("nft", resume(run_dir, "--reward", spec), capsys)
        assert_one_line(rc, err, f"--reward {spec}: {expected}")
    assert snapshot(run_dir) == before and server.requests == [] and not no_model_load


def test_a_served_reward_is_not_given_to_a_local_run(run_copy, fake_server, capsys, no_model_load):
    """A run trained on a local reward stays on it: a server of the same name is refused before it is asked."""
    url, server = fake_server("shapes_clean")
    before = snapshot(run_copy)
    rc, err = call("nft", resume(run_copy, "--reward", f"{url}/shapes_clean"), capsys)
    assert_one_line(rc, err, "--reward is 'shapes_clean' in the run being resumed")
    assert snapshot(run_copy) == before and server.requests == [] and not no_model_load


@pytest.mark.slow
def test_a_checkpoint_never_sets_an_eval_reward_server(run_copy, fake_server, capsys):
    """A state.pt edited to name an --eval-rewards server: the resume drops it with a note and never calls it; given
    again on the command line, it is used."""
    url, server = fake_server("jpeg_compressibility")
    edit_state(run_copy, lambda st: st["args"].update(eval_rewards=[f"{url}/jpeg_compressibility"]))
    err = resumes(resume(run_copy, "--eval-every", 1), capsys)
    assert f"note: the run had --eval-rewards {url}/jpeg_compressibility; a checkpoint never sets where images go" in err
    assert server.requests == [] and checkpoints.load_checkpoint(run_copy)["args"]["eval_rewards"] == ()
    argv = ["--resume", str(run_copy), "--num-epochs", "3", "--eval-rewards", f"{url}/jpeg_compressibility"]
    resumes(argv, capsys)
    assert "POST /jpeg_compressibility" in server.requests
