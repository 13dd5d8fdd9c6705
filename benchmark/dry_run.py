"""A real-size dry run without a GPU or a download: each algorithm script trains SD3.5-Medium's transformer for one epoch.

    OMP_NUM_THREADS=1 python benchmark/dry_run.py                     # all five algorithms, 128 px, ~15-20 min on 1 core
    OMP_NUM_THREADS=1 python benchmark/dry_run.py --algos grpo,nft --gc-algos grpo --out benchmark/results/dry_run.md

The transformer is `SD3Transformer2DModel` built from SD3.5-Medium's published config (below) with random weights in
bf16; LoRA r32 on the attention projections as in the paper scripts. The text encoders and the VAE are stand-ins
(two one-layer CLIPs with SD3.5's pooled width, SD3.5's VAE architecture with random weights), because only the
transformer's size matters for what is measured; T5 is absent, so the text is 77 CLIP tokens + 1 zero T5 token.
Each algorithm runs `algos/<algo>.py`'s own `main` (sampling, reward, loss, optimizer step, eval, checkpoint) in a
child process: 1 prompt x group of 2, 2 sampling steps, 1 trained timestep, micro-batch 1 (2 for CRD and DGPO, which
need whole groups), jpeg_compressibility reward. Reported per run: wall time of the sampling and training sections
(from the run's own `time/*` scalars), peak RSS, and the peak bytes autograd held for the backward pass (saved
activations, measured with `torch.autograd.graph.saved_tensors_hooks`; the frozen weights are not counted).

The GPU estimate for 512 px (one H100 process at micro-batch 1) = the bf16 transformer + the LoRA weights with their
fp32 grads and AdamW moments + the saved activations scaled linearly in tokens (flash/memory-efficient attention keeps
O(tokens) per layer) from this run's 64 image + 78 text tokens to 1024 image + 205 text tokens (T5 at 128 tokens) +
the text encoders (CLIP-L, CLIP-G, T5-XXL: 11.2 GB in bf16, 0 with --offload-text-encoders) + the VAE (0.17 GB).
With --gradient-checkpointing only one block's activations are alive during the backward, plus each block's input:
saved / 24 + 24 x tokens x 1536 x 2 streams x 2 bytes. CUDA context and allocator slack (~1-3 GB) are not included.
Not part of CI.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# stabilityai/stable-diffusion-3.5-medium transformer/config.json (diffusers SD3Transformer2DModel): 2.24B parameters
SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
TEXT_ENCODERS_GB = (123e6 + 695e6 + 4762e6) * 2 / 1e9  # CLIP-L + CLIP-G + T5-XXL parameters, bf16
VAE_GB = 84e6 * 2 / 1e9
EXTRA = {  # per-algorithm flags that keep one epoch to one trained timestep; CFG as in each paper script
    "grpo": "--sde-window 0 1 --num-sde-steps 1 --micro-batch 1 --guidance-scale 4.5",
    "nft": "--num-train-timesteps 1 --micro-batch 1",
    "awm": "--num-train-timesteps 1 --micro-batch 1",
    "crd": "--num-train-timesteps 1 --micro-batch 2",
    "dgpo": "--num-train-timesteps 1 --micro-batch 2 --guidance-scale 4.5",
}


def build_standin_pipeline(path: Path):
    """Tiny CLIPs with SD3.5's pooled width (768 + 1280), SD3.5's VAE layout, and a 1-layer transformer placeholder."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from assets import build_tiny_shapes as recipe

    tok = recipe.build_tokenizer(["a", "red", "circle"], max_tokens=77)
    encoders = []
    for seed, proj in ((0, 768), (1, 1280)):
        torch.manual_seed(seed)
        encoders.append(
            CLIPTextModelWithProjection(
                CLIPTextConfig(
                    vocab_size=len(tok),
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    projection_dim=proj,
                    max_position_embeddings=77,
                    bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
            )
        )
    vae = AutoencoderKL(  # SD3.5's VAE architecture (vae/config.json), random weights
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        norm_num_groups=32,
        sample_size=1024,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    small = {
        **SD35_MEDIUM,
        "num_layers": 1,
        "num_attention_heads": 2,
        "caption_projection_dim": 128,
        "dual_attention_layers": (),
    }
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**small),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=tok,
        text_encoder_2=encoders[1],
        tokenizer_2=tok,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.save_pretrained(path)


class SavedTensorMeter:
    """Peak bytes of the tensors autograd keeps for backward, each storage counted once, parameters excluded."""

    def __init__(self):
        self.live, self.peak, self.storages, self.param_ptrs = 0, 0, {}, set()

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or isinstance(t, torch.nn.Parameter):
            return t
        entry = self.storages.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        holder = _Held(t)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr):
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[ptr]

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def child(algo: str, folder: str, resolution: int, gc: bool, out_dir: str):
    """One epoch of `algos/<algo>.py` with the SD3.5-M transformer swapped into the stand-in pipeline."""
    import importlib

    import tyro
    from diffusers import SD3Transformer2DModel

    import models

    meter = SavedTensorMeter()
    load = models.load_pipeline

    def load_with_sd35(model, device, dtype=torch.float32, resolution=None, **sizes):
        pipe = load(model, device, dtype, resolution, **sizes)
        t0 = time.perf_counter()
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build in bf16 directly: no 9 GB fp32 copy
        try:
            big = SD3Transformer2DModel(**SD35_MEDIUM)
        finally:
            torch.set_default_dtype(default)
        pipe.transformer = big.requires_grad_(False).eval().to(device)
        meter.param_ptrs = {p.untyped_storage().data_ptr() for p in big.parameters()}
        print(
            f"built SD3.5-M transformer: {sum(p.numel() for p in big.parameters()) / 1e9:.2f}B params in "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        return pipe

    models.load_pipeline = load_with_sd35
    prompts = Path(out_dir) / "prompts.txt"
    prompts.write_text("a red circle\n")
    flags = (
        f"--model {folder} --resolution {resolution} --base-dtype bfloat16 --mixed-precision --lora-rank 32 "
        f"--lora-alpha 64 --reward jpeg_compressibility --train-prompts {prompts} --test-prompts {prompts} "
        f"--num-prompts 1 --group-size 2 --num-steps 2 --grad-steps-per-epoch 1 --num-epochs 1 --eval-every 1000 "
        f"--eval-num-steps 1 --save-every 1000 --keep-checkpoints 0 --output-dir {out_dir}/runs {EXTRA[algo]}"
        + (" --gradient-checkpointing" if gc else "")
    ).split()
    module = importlib.import_module(f"algos.{algo}")
    args = tyro.cli(module.Args, args=flags)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        module.main(args)
    total = time.perf_counter() - t0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (Path(out_dir) / "runs").iterdir()
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    times = {tag.split("/")[1]: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"] if tag.startswith("time/")}
    lora = sd35_lora_params(args)
    print(
        "RESULT "
        + json.dumps(
            {
                "algo": algo,
                "gc": gc,
                "resolution": resolution,
                "total_s": total,
                **times,
                "lora_params": lora,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                "saved_gb": meter.peak / 1e9,
                "tokens": (resolution // 16) ** 2 + 78,
                "micro_batch": args.micro_batch,
            }
        ),
        flush=True,
    )


def sd35_lora_params(args) -> int:
    """LoRA parameter count of the run's targets on the SD3.5-M transformer (rebuilt on the meta device: no memory)."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    with torch.device("meta"):
        t = SD3Transformer2DModel(**SD35_MEDIUM)
    from models import sd3

    targets = sd3.FAMILY.lora_targets if args.lora_targets is None else args.lora_targets
    t.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=list(targets)))
    return sum(p.numel() for n, p in t.named_parameters() if "lora_" in n)


def gpu_estimate(r: dict, gc: bool, offload: bool) -> float:
    """GB on one GPU at 512 px, micro-batch as in the run (see the module docstring for the terms)."""
    weights = SD35_MEDIUM_PARAMS * 2 / 1e9
    lora = r["lora_params"] * 16 / 1e9  # fp32 weight + grad + two AdamW moments
    tokens_512 = 32**2 + 205
    act = r["saved_gb"] * tokens_512 / r["tokens"]
    if gc:
        act = act / SD35_MEDIUM["num_layers"] + SD35_MEDIUM["num_layers"] * tokens_512 * 1536 * 2 * 2 * r["micro_batch"] / 1e9
    return weights + lora + act + VAE_GB + (0 if offload else TEXT_ENCODERS_GB)


SD35_MEDIUM_PARAMS = 2_243_171_520  # measured: sum of numel of the model built from SD35_MEDIUM


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", default="grpo,nft,awm,crd,dgpo")
    ap.add_argument("--gc-algos", default="", help="also run these with --gradient-checkpointing")
    ap.add_argument("--resolution", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--child", nargs=4, metavar=("ALGO", "FOLDER", "GC", "DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.resolution, a.child[2] == "1", a.child[3])
    runs = [(x, False) for x in a.algos.split(",") if x] + [(x, True) for x in a.gc_algos.split(",") if x]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "standin"
        build_standin_pipeline(folder)
        for algo, gc in runs:
            work = Path(tmp) / f"{algo}{'_gc' if gc else ''}"
            work.mkdir()
            cmd = [
                sys.executable,
                __file__,
                "--resolution",
                str(a.resolution),
                "--child",
                algo,
                str(folder),
                str(int(gc)),
                str(work),
            ]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                print(f"{algo} (gc={gc}) failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}", file=sys.stderr)
                continue
            r = json.loads(line[0][7:])
            r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            print(json.dumps(r), flush=True)
    rows = [
        "| algorithm | grad. ckpt | sampling s | training s | peak RSS GB | saved activations GB | GPU est. 512 px GB "
        "(text enc. offloaded) | GPU est. 512 px + grad. ckpt GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["gc"]:  # checkpointing hides the saved activations from the meter: estimates come from the run without
            rows.append(
                f"| {r['algo']} | yes | {r.get('sampling', float('nan')):.0f} | {r.get('training', float('nan')):.0f} | "
                f"{r['peak_rss_gb']:.1f} | - | - | - |"
            )
            continue
        rows.append(
            f"| {r['algo']} | {'yes' if r['gc'] else 'no'} | {r.get('sampling', float('nan')):.0f} | "
            f"{r.get('training', float('nan')):.0f} | {r['peak_rss_gb']:.1f} | {r['saved_gb']:.2f} | "
            f"{gpu_estimate(r, False, False):.1f} ({gpu_estimate(r, False, True):.1f}) | "
            f"{gpu_estimate(r, True, True):.1f} |"
        )
    table = "\n".join(rows)
    print(table)
    if a.out:
        Path(a.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
