"""--fsdp: FSDP2 over 2 gloo ranks on the CPU (torchrun) against one process without it, on the tiny model.

Tolerance: none, every tensor is compared bit for bit. Each optimizer step takes one backward per rank (the FLAGS of
test_algos: one trained timestep, one micro-batch per rank), so FSDP's reduce-scatter averages (g1 + g2) / 2 where
one process accumulates g1 / 2 + g2 / 2: halving is exact in floating point, and the sums agree. The gradient-norm
clip agrees by construction (`distributed.clip_grad_norm`, tested below with the clip active). With more backward
passes per rank the two orders of summation differ in rounding (test_algos measured 4e-6 to 7e-6 relative).
Rounding depends on the CPU's kernels, so the bitwise tests also run under forced avx2 and default kernels
(conftest's KERNELS).
"""

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, TORCHRUN, kernel_environ, run_script
from safetensors import safe_open
from safetensors.torch import load_file
from test_algos import assert_same_state, script_argv, write_prompts

import common
from harness.checkpoints import load_checkpoint
from harness.export import LORA_WEIGHTS

# every test here but one starts torchrun's 2 ranks: the slow marker's "2-rank runs" (CI runs them all)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts"))


def only(folder: Path) -> Path:
    (run_dir,) = folder.iterdir()
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prompts):
    """(algo, kernel) -> 2 epochs in one process without --fsdp (`one`) and on 2 ranks with it (`two`, its stdout),
    both under the kernel (conftest's KERNELS), once per module; tests only read them."""
    cache = {}

    def get(algo, kernel="native"):
        if (algo, kernel) not in cache:
            one, two = tmp_path_factory.mktemp(f"one-{algo}"), tmp_path_factory.mktemp(f"two-{algo}")
            env = kernel_environ(kernel)
            run_script(script_argv(algo, prompts, one, "--num-epochs", 2), env=env)
            out = run_script([*TORCHRUN, *script_argv(algo, prompts, two, "--num-epochs", 2, "--fsdp")], env=env)
            cache[algo, kernel] = SimpleNamespace(one=only(one), two=only(two), stdout=out.stdout)
        return cache[algo, kernel]

    return get


def lora_export(run_dir: Path) -> tuple:
    """The exported LoRA's tensors and its safetensors metadata, the adapter's target modules as a set (peft keeps
    them in a set, whose order differs between processes)."""
    path = run_dir / "lora" / LORA_WEIGHTS
    meta = safe_open(str(path), "pt").metadata()
    adapter = json.loads(meta.pop("lora_adapter_metadata"))
    adapter["transformer.target_modules"] = sorted(adapter["transformer.target_modules"])
    return load_file(str(path)), meta, adapter


def transformer_bytes() -> float:
    """The tiny model's transformer parameters in MB, loaded on their own (what every rank holds without --fsdp)."""
    from diffusers import SD3Transformer2DModel

    transformer = SD3Transformer2DModel.from_pretrained(Path(common.TINY_MODEL) / "transformer")
    return sum(p.numel() * p.element_size() for p in transformer.parameters()) / 2**20


# Under the other kernels (conftest's KERNELS), what a rank computes is test_algos' CRD runs on 2 ranks (the kernels'
# rounding reaches the weights through CRD's active clip) and what FSDP adds, the norm and clip of sharded
# gradients, is test_clip_grad_norm_of_fsdp_shards_equals_one_process's under each kernel: gloo's sums do not depend
# on the kernel, so an FSDP run under each kernel would repeat both (it did, at 90 s a pair)
@pytest.mark.parametrize(
    "algo, kernel",
    [
        ("grpo", "native"),
        ("nft", "native"),
        *(pytest.param(a, "native", marks=pytest.mark.slow) for a in ("awm", "crd", "dgpo", "dpo", "elbo_grpo")),
    ],
)
def test_two_sharded_ranks_match_one_process(algo, kernel, runs):
    """After 2 epochs: weights, optimizer moments, snapshots and eval EMA equal bit for bit (the sharded checkpoint
    read whole), one shard file per rank, the same LoRA export, and each rank holding half of the transformer."""
    r = runs(algo, kernel)
    a, b = load_checkpoint(r.one), load_checkpoint(r.two, full=True)
    assert b["shards"]["ranks"] == 2 and "params" not in load_checkpoint(r.two)  # the tensors live in shards/ only
    assert any(v.abs().sum() > 0 for k, v in a["params"].items() if "lora_B" in k)  # it did move
    assert_same_state(a, b, algo)
    shards = r.two / "checkpoints" / "last" / "shards"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in (r.two / "checkpoints").iterdir()) == ["epoch_000001", "epoch_000002", "last"]

    tensors_a, meta_a, adapter_a = lora_export(r.one)
    tensors_b, meta_b, adapter_b = lora_export(r.two)
    assert tensors_a.keys() == tensors_b.keys() and all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)
    assert meta_a == meta_b and adapter_a == adapter_b
    assert r.stdout.count("final eval") == 1  # every rank samples the eval, rank 0 alone prints and logs

    (line,) = [x for x in r.stdout.splitlines() if x.startswith("fsdp: transformer parameter MB per rank")]
    frozen, trainable = line.split(": frozen ")[1].split(", trainable ")
    held, whole = [float(x) for x in frozen.split(" of ")[0].split(" + ")], float(frozen.split(" of ")[1])
    lora = [float(x) for x in trainable.split(" of ")[0].split(" + ")]
    lora_whole = sum(v.numel() * v.element_size() for v in a["params"].values()) / 2**20
    assert whole == pytest.approx(transformer_bytes(), abs=1e-3) and float(trainable.split(" of ")[1]) == pytest.approx(
        lora_whole, abs=1e-3
    )
    # each rank holds its half; rows that do not split evenly leave one rank up to a row more per parameter
    assert len(held) == 2 and sum(held) == pytest.approx(whole, abs=2e-3) and max(held) < 0.52 * whole
    assert sum(lora) == pytest.approx(lora_whole, abs=2e-3) and max(lora) < 0.52 * lora_whole


def test_sharded_resume_is_exact_on_two_ranks_and_on_one(runs, tmp_path):
    """From the 2-rank run's epoch-1 checkpoint: a resume on 2 ranks and one on 1 process (DCP reshards the 2 ranks'
    pieces) both end bit for bit at the uninterrupted run's epoch 2. What a kill in the middle of a sharded save
    leaves (a .tmp-* folder with one rank's shard) is removed, and `last` never pointed at it."""
    r = runs("grpo")
    b = load_checkpoint(r.two, full=True)
    for name, launcher in (("two", TORCHRUN), ("one", [])):
        run_dir = tmp_path / name / r.two.name
        shutil.copytree(r.two, run_dir, symlinks=True)
        shutil.rmtree(run_dir / "checkpoints" / "epoch_000002")
        (run_dir / "checkpoints" / "last").unlink()
        killed = run_dir / "checkpoints" / ".tmp-epoch_000002.123" / "shards"
        killed.mkdir(parents=True)
        (killed / "__0_0.distcp").write_bytes(b"half a shard")
        run_script(  # torchrun itself here (elsewhere its ranks run as fork-server children: conftest.run_script)
            [*launcher, "algos/grpo.py", "--resume", run_dir / "checkpoints" / "epoch_000001", "--num-epochs", 2],
            env=kernel_environ("native"),
            real_torchrun=True,
        )
        assert not list((run_dir / "checkpoints").glob(".tmp-*"))
        c = load_checkpoint(run_dir, full=True)
        assert c["shards"]["ranks"] == (2 if name == "two" else 1)
        assert_same_state(b, c, "grpo")
        tensors, _, _ = lora_export(run_dir)
        assert all(torch.equal(tensors[k], v) for k, v in lora_export(r.two)[0].items())


def test_clipped_steps_on_two_sharded_ranks_equal_one_process(prompts, tmp_path):
    """--max-grad-norm small enough to clip every step: 2 sharded ranks log the same norms as one process and end
    with the same weights, bit for bit. The norm is the global one (a rank's own shards alone would give about
    1/sqrt(2) of it and clip every weight ~40% differently). torch's clip_grad_norm_ sums the squares per shard and
    then over the ranks, in another order than one process, which moved the norm by 1 float32 ulp and every clipped
    gradient with it (what failed here before `distributed.clip_grad_norm`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # this CPU's kernels; the clip under the others: test_clip_grad_norm_of_fsdp_shards_equals_one_process
    flags, env = ["--num-epochs", 2, "--max-grad-norm", 0.01, "--eval-every", 10], kernel_environ("native")
    run_script(script_argv("nft", prompts, tmp_path / "one", *flags), env=env)
    run_script([*TORCHRUN, *script_argv("nft", prompts, tmp_path / "two", *flags, "--fsdp")], env=env)
    a, b = load_checkpoint(only(tmp_path / "one")), load_checkpoint(only(tmp_path / "two"), full=True)
    norms = []
    for run_dir in (only(tmp_path / "one"), only(tmp_path / "two")):
        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        norms.append([e.value for e in acc.Scalars("losses/grad_norm")])
    assert len(norms[0]) == 2 and min(norms[0]) > 0.01  # both steps clipped
    assert norms[1] == norms[0]
    assert_same_state(a, b, "nft")


# 2 gloo ranks hold FSDP's shards (DTensors sharded on dim 0) of gradients with uneven rows (5 = 3 + 2; a 1-D bias of
# 3), a single row (rank 1 holds none) longer than a ROW_BLOCK and than torch's GRAIN_SIZE (a sum torch would split
# over threads), and magnitudes 1e-3 to 1e2 apart; each rank clips them, and clips the whole gradients as one process
# does (also with 2 threads). Rank 0 saves what both gave, with the clip active and inactive.
CLIP_SCRIPT = """
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, sys.argv[1])
from harness import distributed

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
shapes = [(5, 7), (3,), (1, 40_000), (2, 3, 2), (16, 9)]
grads = [torch.randn(s) * 10.0 ** (i - 3) for i, s in enumerate(shapes)]
out = {"grads": grads}
for max_norm in (1.0, 1e9):
    whole = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    sharded = [torch.nn.Parameter(distribute_tensor(torch.zeros(s), mesh, [Shard(0)])) for s in shapes]
    for p, q, g in zip(whole, sharded, grads):
        p.grad, q.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
    norm = distributed.clip_grad_norm(sharded, max_norm)
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, [q.grad.to_local().shape[0] for q in sharded])
    out[max_norm] = {"sharded": (norm, [q.grad.full_tensor() for q in sharded]), "held": held}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        copies = [torch.nn.Parameter(p.detach().clone()) for p in whole]
        for p, c in zip(whole, copies):
            c.grad = p.grad.clone()
        out[max_norm][threads] = (distributed.clip_grad_norm(copies, max_norm), [c.grad for c in copies])
if dist.get_rank() == 0:
    torch.save(out, sys.argv[2])
distributed.cleanup_distributed()
# Then leave without the interpreter's teardown: there, under load, a rank aborted in C++ ("terminate called without
# an active exception", no Python frame) about 1 run in 10, with or without the barrier, after the work was done
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.parametrize("kernel_env", ["native", "avx2", "default"], indirect=True)
def test_clip_grad_norm_of_fsdp_shards_equals_one_process(kernel_env, tmp_path):
    """`distributed.clip_grad_norm` on 2 ranks' shards (CLIP_SCRIPT) gives one process's norm and clipped gradients
    bit for bit, under each kernel; the norm is the float64 norm to 1e-12 and the clip torch's (to float32 rounding:
    torch sums in float32)."""
    (tmp_path / "clip.py").write_text(CLIP_SCRIPT)
    run_script([*TORCHRUN, tmp_path / "clip.py", REPO, tmp_path / "out.pt"], env=kernel_env)
    out = torch.load(tmp_path / "out.pt")
    grads = out["grads"]
    exact = math.sqrt(math.fsum(x**2 for g in grads for x in g.double().flatten().tolist()))
    for max_norm in (1.0, 1e9):
        assert out[max_norm]["held"] == [[3, 2, 1, 1, 8], [2, 1, 0, 1, 8]]  # rows held by each rank
        norm, clipped = out[max_norm]["sharded"]
        assert norm.dtype == torch.float64 and norm.item() == pytest.approx(exact, rel=1e-12)
        for threads in (1, 2):
            one_norm, one_clipped = out[max_norm][threads]
            assert torch.equal(one_norm, norm) and all(torch.equal(x, y) for x, y in zip(one_clipped, clipped))
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        assert torch.nn.utils.clip_grad_norm_(params, max_norm).item() == pytest.approx(exact, rel=1e-6)
        for p, c in zip(params, clipped):
            torch.testing.assert_close(c, p.grad, rtol=1e-6, atol=0)
    assert exact > 1.0 and not torch.equal(out[1.0]["sharded"][1][2], grads[2])  # the clip at 1.0 was active
    assert all(torch.equal(c, g) for c, g in zip(out[1e9]["sharded"][1], grads))  # and at 1e9 changed nothing


def test_clip_grad_norm_in_one_process_is_torchs_clip():
    """Plain tensors (one process, or ranks after `all_reduce_grads`): 0-dim and 1-D gradients, a parameter without
    a gradient, the norm of a NaN or inf gradient (which makes the scripts skip the step), and torch's coefficient
    max_norm / (norm + 1e-6): with the same float32 norm as torch, the clipped gradients are torch's bit for bit."""
    from harness import distributed

    def params(*grads):
        out = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads] + [torch.nn.Parameter(torch.zeros(2))]
        for p, g in zip(out, grads):
            p.grad = g.clone()
        return out

    grads = [torch.tensor(3.0), torch.tensor([4.0, 0.0]), torch.tensor([[12.0]])]
    ours, theirs = params(*grads), params(*grads)
    assert distributed.clip_grad_norm(ours, 2.0).item() == 13.0  # sqrt(9 + 16 + 144)
    assert torch.nn.utils.clip_grad_norm_(theirs, 2.0).item() == 13.0
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours[:3], theirs[:3])) and ours[3].grad is None
    assert ours[0].grad.item() != 3.0  # clipped
    assert distributed.clip_grad_norm(params(torch.tensor([1.0, float("inf")])), 1.0).item() == float("inf")
    assert math.isnan(distributed.clip_grad_norm(params(torch.tensor([1.0, float("nan")])), 1.0).item())
    assert distributed.clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0


def test_bf16_base_is_gathered_in_bf16_and_the_lora_stays_fp32(prompts, tmp_path):
    """--base-dtype bfloat16 (the GPU setting, on the CPU here): FSDP's mixed precision gathers every weight in bf16
    and reduces the gradients in fp32 into fp32 LoRA shards. Each rank holds half of the bf16 base (a quarter of the
    fp32 transformer's bytes) and the checkpoint's LoRA is fp32. Not compared with one process: there peft computes
    the LoRA branch in fp32, here in bf16 (after two steps the weights differ by ~3 Adam steps, 1.7e-3 at lr 5e-4)."""
    out = run_script(
        [*TORCHRUN, *script_argv("grpo", prompts, tmp_path, "--num-epochs", 1, "--base-dtype", "bfloat16", "--fsdp")]
    )
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("fsdp: transformer parameter MB per rank")]
    held = [float(x) for x in line.split(": frozen ")[1].split(" of ")[0].split(" + ")]
    fp32_whole = transformer_bytes()
    assert len(held) == 2 and max(held) < 0.26 * fp32_whole and sum(held) > 0.49 * fp32_whole
    ckpt = load_checkpoint(only(tmp_path), full=True)
    assert ckpt["step"] == 1 and {v.dtype for v in ckpt["params"].values()} == {torch.float32}


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated shard", "no metadata"])
def test_damaged_shards_stop_a_resume_with_one_line(damage, runs, tmp_path):
    """A shard file cut short (a disk that filled after the rename, a partial copy) or a lost .metadata: the resume
    stops with one line and exit code 2 and leaves the run folder as it was."""
    r = runs("grpo")
    run_dir = tmp_path / r.two.name
    shutil.copytree(r.two, run_dir, symlinks=True)
    shards = run_dir / "checkpoints" / "epoch_000002" / "shards"
    if damage == "truncated shard":
        data = (shards / "__1_0.distcp").read_bytes()
        (shards / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    else:
        (shards / ".metadata").unlink()
    before = sorted((p.relative_to(run_dir), p.read_bytes() if p.is_file() else None) for p in run_dir.rglob("*"))
    out = run_script(["algos/grpo.py", "--resume", run_dir, "--num-epochs", 3], check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint") and "cannot be read" in last, last
    after = sorted((p.relative_to(run_dir), p.read_bytes() if p.is_file() else None) for p in run_dir.rglob("*"))
    assert after == before


def test_accumulated_micro_batches_match_one_process_to_rounding(prompts, tmp_path):
    """Two backward passes per rank and optimizer step (two trained timesteps): FSDP reduce-scatters after each
    backward and accumulates the averaged shards, one process sums all four gradients, so they agree to rounding
    only. Measured after one step (relative L2 distance of all LoRA weights): 8e-9, and 1.1e-7 for the unsharded 2-rank
    path; after two steps 1.1e-5 and 9e-6 (Adam enlarges rounding in gradients near 0). Tolerance 1e-5 after one step:
    a micro-batch's gradient lost or counted twice changes the step's direction, and Adam's first step (about lr times
    the sign of each gradient) then moves the weights where the micro-batches disagree by up to 2 lr. A uniform scale
    of the whole gradient is invisible to that step; the global norm is checked by the clip test above."""
    flags = ["--num-epochs", 1, "--num-train-timesteps", 2, "--eval-every", 10]
    run_script(script_argv("nft", prompts, tmp_path / "one", *flags))
    run_script([*TORCHRUN, *script_argv("nft", prompts, tmp_path / "two", *flags, "--fsdp")])
    a, b = load_checkpoint(only(tmp_path / "one")), load_checkpoint(only(tmp_path / "two"), full=True)
    assert a["step"] == b["step"] == 1
    diff = torch.cat([(v - b["params"][n]).flatten() for n, v in a["params"].items()]).norm()
    assert diff / torch.cat([v.flatten() for v in a["params"].values()]).norm() < 1e-5


@pytest.mark.parametrize("algo, flags", [("crd", ()), pytest.param("grpo", ("--kl-beta", "0.04"), marks=pytest.mark.slow)])
def test_full_finetune_on_two_sharded_ranks_matches_one_process(algo, flags, prompts, tmp_path):
    """--full-finetune --fsdp: every weight and the frozen base sharded alike. The reference model (CRD's KL to the
    base; GRPO's, called between its policy forward and backward) copies the base shards in and back out, and after 2
    epochs the weights equal one process without --fsdp to 1e-5 (lr 1e-3 / 100), the exported transformer folder
    (gathered to rank 0) holding exactly the checkpoint's weights. Not bit for bit as with a LoRA: the weights of
    FSDP's root unit (the embeddings and the final projection, frozen under a LoRA) differ by up to 1.1e-6 after one
    epoch even on a single rank with --fsdp (measured: the same 7 of 122 tensors on 1 and on 2 ranks), so that is the
    root's FSDP gradient path, not the sharding; Adam then spreads it. A reference model that were not the base would
    move the weights by the KL's gradient, up to lr per step."""
    argv = ["--num-epochs", 2, "--full-finetune", "--learning-rate", 1e-3, "--weight-decay", 0, "--eval-ema-decay", 0]
    argv += flags  # no decay, no EMA: the export is the weights
    run_script(script_argv(algo, prompts, tmp_path / "one", *argv))
    run_script([*TORCHRUN, *script_argv(algo, prompts, tmp_path / "two", *argv, "--fsdp")])
    one, two = only(tmp_path / "one"), only(tmp_path / "two")
    a, b = load_checkpoint(one), load_checkpoint(two, full=True)
    assert not any("lora_" in k for k in a["params"]) and a["params"].keys() == b["params"].keys()
    base = load_file(str(Path(common.TINY_MODEL) / "transformer" / "diffusion_pytorch_model.safetensors"))
    moved = max((a["params"][k] - base[k]).abs().max().item() for k in a["params"])
    gap = max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])
    print(f"largest weight change {moved:.3g}, largest gap between the runs {gap:.3g}")
    assert moved > 1e-4 and gap <= 1e-5
    x = load_file(str(one / "transformer" / "diffusion_pytorch_model.safetensors"))
    y = load_file(str(two / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert x.keys() == y.keys()
    assert [k for k in a["params"] if not torch.equal(x[k], a["params"][k])] == []
    assert [k for k in a["params"] if not torch.equal(y[k], b["params"][k])] == []
    assert all(torch.equal(x[k], y[k]) for k in x.keys() - a["params"].keys())  # buffers (SD3's position table)
    assert json.loads((one / "transformer" / "config.json").read_text()) == json.loads(
        (two / "transformer" / "config.json").read_text()
    )
