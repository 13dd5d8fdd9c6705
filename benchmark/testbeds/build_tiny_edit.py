"""Recipe for the embedded edit model tiny-edit: a FLUX.1-Kontext-style pipeline pretrained on the edit world.

    # the full build, writes assets/tiny-edit/ (see below):
    python benchmark/testbeds/build_tiny_edit.py
    # the same world's autoencoder: no VAE stage:
    python benchmark/testbeds/build_tiny_edit.py --vae-from assets/tiny-shapes
    python benchmark/testbeds/build_tiny_edit.py --num-pairs 512 --vae-steps 20 --flow-steps 20 --out /tmp/tiny-edit-smoke

README section:

`assets/tiny-edit/` is a plain `FluxKontextPipeline` folder (save_pretrained layout, safetensors): a tiny
`FluxTransformer2DModel` (2 double-stream and 4 single-stream blocks of width 128, no guidance embedding), a tiny
`AutoencoderKL` (64x64x3 -> 16x16x4, the tiny-shapes design), a tiny `CLIPTextModel` (pooled) and a tiny
`T5EncoderModel` (sequence), both reading a word-level CLIP tokenizer of the edit grammar (a T5 tokenizer cannot be
built offline; the pipeline only calls it). It is pretrained on 20,000 (source, instruction, edited) pairs of the
edit world (`rewards/worlds/edit.py`: recolor, add, remove, move) that never perform a held-out edit and show each of
the 203 other instructions, with Kontext's conditioning: the source image's latents are extra tokens after the noisy
ones, with position ids (1, row, col) where the noisy tokens have (0, row, col), and the transformer's output on them
is dropped. 10% of the pairs drop the instruction (never the image), so that two-pass CFG (`true_cfg_scale` with
`negative_prompt=""`) works. It loads and samples with the stock pipeline:

    pipe = FluxKontextPipeline.from_pretrained("assets/tiny-edit")
    pipe(image=scene, prompt="make the circle red", height=64, width=64, max_area=64 * 64, _auto_resize=False,
         max_sequence_length=16, num_inference_steps=16).images[0]

(`_auto_resize=False` and `max_area`: the stock call resizes to FLUX.1-Kontext's 1024-pixel resolutions otherwise;
`max_sequence_length=16`: the length the encoders were trained at, as our `models/` loader caps it.)
The prompt files are `assets/edit/{train,test}.jsonl` (203 instructions seen in pretraining, 28 held out), each with
its source image, and the `edit` reward scores the result (`rewards/edit.py`). The build prints the base's held-out
and seen-instruction metrics at the end, sampled by the stock pipeline.

Time (bf16 autocast, --threads 1, one AMD EPYC core while the other ran a training job): the flow stage took 1.0 s per
step of batch 64, 100 min for the default 6,000 steps (earlier, beside more jobs, 1.6 s); rendering and encoding the
20,000 pairs 2 min; the VAE stage (1,500 steps of batch 32) ~30 min as for tiny-shapes, or nothing with --vae-from
assets/tiny-shapes (the same world's renders, how the committed build was made: 102 min in all). The log prints the
flow stage's estimate after its first 10 steps, and progress every 200. A build is deterministic for a given thread
count and autocast setting. The flow stage saves its state to `<out>.checkpoint.pt` every 250 steps
(`--checkpoint-every`); the same command run again resumes from it and ends with the same weights as an unbroken build
(so the build can span sessions); the file is deleted when the pipeline is saved.
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

_verbosity = transformers.logging.get_verbosity()
transformers.logging.set_verbosity_error()  # importing the pipelines warns about torchvision for an unused image encoder
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel  # noqa: E402

transformers.logging.set_verbosity(_verbosity)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
ASSETS = Path(__file__).resolve().parents[2] / "assets"  # what this writes: data only
from benchmark.testbeds import build_tiny_shapes as recipe  # noqa: E402
from common import UserError  # noqa: E402
from rewards import edit as edit_reward  # noqa: E402
from rewards.worlds import edit as edit_world  # noqa: E402
from rewards.worlds import shapes as world  # noqa: E402

MAX_TOKENS = 16  # both encoders' sequence length; the longest instruction has 7 words
TEXT_DIM = 64  # CLIP width (the pooled vector) and T5 width (the sequence)
HEAD_DIM = 32  # attention head width; FLUX splits it over its three rotary axes (index, row, column)
ROPE_AXES = (8, 12, 12)
BASE_SHIFT = math.log(2.0)  # mu at 64 image tokens (our 64x64 images): the time shift of tiny-shapes (2.0)
CAPTION_DROPOUT = 0.1
# the flags that change the weights a build ends with: a checkpoint resumes only a build with the same ones
BUILD_FLAGS = ("num_pairs", "vae_steps", "vae_from", "flow_steps", "layers", "single_layers", "heads", "batch", "lr")
BUILD_FLAGS += ("threads", "autocast")


def build_text_encoders(tok, seed):
    """FLUX's pair: CLIP (its pooled output conditions the modulation) and T5 (its sequence is the text stream)."""
    torch.manual_seed(seed)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=TEXT_DIM,
            intermediate_size=2 * TEXT_DIM,
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tok),
            d_model=TEXT_DIM,
            d_kv=16,
            num_heads=4,
            num_layers=3,
            d_ff=2 * TEXT_DIM,
            dropout_rate=0.0,  # as the CLIP encoder: the flow loss trains both without dropout
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    return clip, t5


def build_transformer(seed, layers, single_layers, heads):
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels x a 2x2 patch per token
        num_layers=layers,
        num_single_layers=single_layers,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=heads,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        guidance_embeds=False,  # not guidance-distilled: two-pass CFG instead (caption dropout)
        axes_dims_rope=ROPE_AXES,
    )


def build_scheduler():
    """FLUX's dynamic shift, mu linear in the image token count, anchored so that our 64 tokens get shift 2."""
    return FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=BASE_SHIFT,
        max_shift=1.15,
        base_image_seq_len=(world.SIZE // 8) ** 2,
        max_image_seq_len=4096,
    )


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] latents -> [B, h/2 * w/2, 4C] tokens, one per 2x2 patch (FluxKontextPipeline._pack_latents)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def kontext_ids(h: int, w: int) -> torch.Tensor:
    """Position ids of the noisy tokens, (0, row, col), then of the reference tokens, (1, row, col)
    (FluxKontextPipeline.prepare_latents: the image ids are the latent ids with the first component set to 1)."""
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).view(-1, 3).float()
    reference = ids.clone()
    reference[:, 0] = 1
    return torch.cat([ids, reference])


def text_embeddings(pipe, ids):
    """Differentiable copy of FluxPipeline.encode_prompt for cached token ids: T5's last hidden states (the text
    tokens) and CLIP's pooled output."""
    return pipe.text_encoder_2(ids)[0], pipe.text_encoder(ids).pooler_output


def train_flow(
    pipe,
    sources,
    targets,
    instruction_idx,
    instructions,
    steps,
    batch,
    lr,
    log,
    autocast=True,
    checkpoint=None,
    every=0,
    config=None,
):
    """Rectified flow on the edited latents given the source latents: x_t = (1 - s) x0 + s eps, target eps - x0,
    s ~ logit-normal(0, 1). The noisy and the reference tokens go through the transformer together (Kontext's
    sequence concatenation); the loss reads the noisy tokens' outputs only, as the pipeline keeps only those.
    With `checkpoint` (a file path) the stage saves its whole state there every `every` steps and starts from it when
    it exists, so that a stopped build goes on where it stopped and ends with the same weights."""
    tok = pipe.tokenizer
    ids = tok(instructions, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt").input_ids
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(2)
    empty = instructions.index("")
    h, w = sources.shape[-2:]
    img_ids, tokens = kontext_ids(h, w), (h // 2) * (w // 2)
    start = 0
    if checkpoint is not None and Path(checkpoint).exists():
        state = torch.load(checkpoint, weights_only=True)  # tensors only: a crafted file cannot run code
        for m, sd in zip(modules, state["modules"]):
            m.load_state_dict(sd)
        opt.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for e, saved in zip(ema, state["ema"], strict=True):
                e.copy_(saved)
        gen.set_state(state["generator"])
        start = int(state["step"])
        log(f"flow: resumed from {checkpoint} at step {start}/{steps}")
    t0 = time.time()
    for step in range(start, steps):
        for g in opt.param_groups:
            g["lr"] = recipe.lr_at(step, steps, lr)
        idx = torch.randint(len(targets), (batch,), generator=gen)
        x0, reference = targets[idx], sources[idx]
        cap = instruction_idx[idx].clone()
        cap[torch.rand(batch, generator=gen) < CAPTION_DROPOUT] = empty  # the unconditional branch of CFG keeps the image
        sigma = torch.sigmoid(torch.randn(batch, generator=gen))
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * eps
        distinct, where = torch.unique(cap, return_inverse=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            embeds, pooled = text_embeddings(pipe, ids[distinct])
            v = (
                pipe.transformer(
                    hidden_states=torch.cat([pack(xt), pack(reference)], dim=1),
                    timestep=sigma,  # FLUX takes sigma and scales it by 1000 itself (the pipeline passes t / 1000)
                    guidance=None,
                    pooled_projections=pooled[where],
                    encoder_hidden_states=embeds[where],
                    txt_ids=torch.zeros(MAX_TOKENS, 3),
                    img_ids=img_ids,
                )
                .sample[:, :tokens]
                .float()
            )
        loss = F.mse_loss(v, pack(eps - x0))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p.detach(), 1 - decay)
        if checkpoint is not None and every and (step + 1) % every == 0 and step + 1 < steps:
            state = {
                "step": step + 1,
                "modules": [m.state_dict() for m in modules],
                "optimizer": opt.state_dict(),
                "ema": ema,
                "generator": gen.get_state(),
                "config": config,
            }
            torch.save(state, f"{checkpoint}.tmp")
            os.replace(f"{checkpoint}.tmp", checkpoint)  # a kill mid-save leaves the previous checkpoint whole
        if step == min(start + 10, steps - 1):  # the first steps' mean (warm-up included): the stage's time estimate
            per_step = (time.time() - t0) / (step + 1 - start)
            log(f"flow: {per_step:.1f}s per step, ~{per_step * (steps - start) / 60:.0f} min for steps {start}-{steps}")
        if step % 200 == 0 or step == steps - 1:
            log(
                f"flow step {step}/{steps} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e} ({time.time() - t0:.0f}s)"
            )
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    for m in modules:
        m.eval().requires_grad_(False)


@torch.no_grad()
def evaluate(pipe, instructions, steps, seed, true_cfg_scale=1.0) -> dict:
    """The edit metrics of the stock FluxKontextPipeline's outputs on each instruction's canonical scene."""
    images = [Image.fromarray(world.render(list(edit_world.task(i)[0]))) for i in instructions]
    out = pipe(
        image=images,
        prompt=list(instructions),
        negative_prompt=[""] * len(instructions) if true_cfg_scale > 1 else None,
        true_cfg_scale=true_cfg_scale,
        height=world.SIZE,
        width=world.SIZE,
        max_area=world.SIZE**2,
        _auto_resize=False,
        max_sequence_length=MAX_TOKENS,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
    ).images
    return {k: v.mean().item() for k, v in edit_reward.evaluate(out.float(), list(instructions)).items()}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2 (main), not argparse's usage block
        raise UserError(message)


def parse_args(argv=None):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="default: assets/tiny-edit")
    ap.add_argument("--num-pairs", type=int, default=20000, help="pretraining (source, instruction, edited) pairs")
    ap.add_argument("--vae-steps", type=int, default=1500)
    ap.add_argument(
        "--vae-from", default=None, help="reuse this pipeline folder's autoencoder (same world: assets/tiny-shapes)"
    )
    ap.add_argument("--flow-steps", type=int, default=6000)
    ap.add_argument("--layers", type=int, default=2, help="double-stream (MM-DiT) blocks")
    ap.add_argument("--single-layers", type=int, default=4, help="single-stream blocks")
    ap.add_argument("--heads", type=int, default=4, help=f"attention heads of width {HEAD_DIM}")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2, help="fixed thread count keeps the CPU run deterministic")
    ap.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast of the forwards")
    ap.add_argument("--eval-steps", type=int, default=16, help="sampling steps of the closing evaluation (0: none)")
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=250,
        help="flow steps between saves of <out>.checkpoint.pt, from which a rerun of the same command resumes (0: none)",
    )
    args = ap.parse_args(argv)
    for name in ("num_pairs", "layers", "single_layers", "heads", "batch", "threads"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be > 0")
    for name in ("vae_steps", "flow_steps", "eval_steps", "checkpoint_every"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UserError(f"--lr {args.lr}: must be a positive number")
    if args.vae_from is not None:
        try:
            vae = AutoencoderKL.load_config(str(Path(args.vae_from) / "vae"))
        except (OSError, ValueError):
            vae = None
        if not isinstance(vae, dict) or vae.get("scaling_factor") is None or vae.get("latent_channels") != 4:
            raise UserError(f"--vae-from {args.vae_from}: not a pipeline folder with a 4-channel scaled autoencoder (vae/)")
    out = Path(args.out or ASSETS / "tiny-edit")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: its folder {out.parent} does not exist")
    args.out = str(out)
    return args


def main(args):
    torch.set_num_threads(args.threads)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)

    # a stopped build resumes its flow stage from here, but only into the same build (same weights at the end)
    checkpoint = f"{args.out}.checkpoint.pt"
    config = {k: getattr(args, k) for k in BUILD_FLAGS}
    if Path(checkpoint).exists():
        try:
            saved = torch.load(checkpoint, weights_only=True)["config"]
        except Exception as e:  # truncated, foreign or crafted: say so before the long data stage
            raise UserError(f"{checkpoint}: not a readable build checkpoint ({type(e).__name__}); delete it to start over")
        if saved != config:
            diff = ", ".join(
                f"--{k.replace('_', '-')} {saved.get(k)} (now {v})" for k, v in config.items() if saved.get(k) != v
            )
            raise UserError(f"{checkpoint} is from another build ({diff}); rerun with its flags or delete it")

    # (1) data: rendered (source, edited) pairs, no held-out edit among them
    pairs = edit_world.make_dataset(args.num_pairs, seed=0)
    sources = torch.from_numpy(np.stack([world.render(s) for _, s, _ in pairs]))
    targets = torch.from_numpy(np.stack([world.render(t) for _, _, t in pairs]))
    instructions = sorted({i for i, _, _ in pairs}) + [""]
    index = {p: k for k, p in enumerate(instructions)}
    instruction_idx = torch.tensor([index[i] for i, _, _ in pairs])
    log(f"{len(pairs)} pairs, {len(instructions) - 1} distinct instructions")

    # (2) tokenizer (both encoders read it) and text encoders
    words = sorted({w for i in edit_world.all_instructions() for w in i.split()})
    tok = recipe.build_tokenizer(words, MAX_TOKENS)
    clip, t5 = build_text_encoders(tok, seed=10)

    # (3) autoencoder on sources and targets alike; latents normalised to unit variance (FLUX's scale/shift factors)
    if args.vae_from:
        vae = AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae").eval().requires_grad_(False)
        shift, scale = vae.config.shift_factor, vae.config.scaling_factor
        source_latents, target_latents = recipe.encode_images(vae, sources), recipe.encode_images(vae, targets)
    else:
        vae = recipe.build_vae(seed=12)
        recipe.train_vae(vae, torch.cat([sources, targets]), args.vae_steps, 32, log, args.autocast)
        vae.eval().requires_grad_(False)
        source_latents, target_latents = recipe.encode_images(vae, sources), recipe.encode_images(vae, targets)
        both = torch.cat([source_latents, target_latents])
        shift, scale = both.mean().item(), 1.0 / both.std().item()
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    source_latents, target_latents = (source_latents - shift) * scale, (target_latents - shift) * scale
    log(f"latents {tuple(target_latents.shape)} shift {shift:.4f} scale {scale:.4f}")

    # (4) transformer + text encoders, trained together on the edit pairs
    pipe = FluxKontextPipeline(
        scheduler=build_scheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=tok,
        text_encoder_2=t5,
        tokenizer_2=tok,
        transformer=build_transformer(seed=13, layers=args.layers, single_layers=args.single_layers, heads=args.heads),
    )
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    log(f"transformer {n_params / 1e6:.2f}M params, vae {sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M")
    train_flow(
        pipe,
        source_latents,
        target_latents,
        instruction_idx,
        instructions,
        args.flow_steps,
        args.batch,
        args.lr,
        log,
        args.autocast,
        checkpoint,
        args.checkpoint_every,
        config,
    )
    pipe.save_pretrained(args.out, safe_serialization=True)
    Path(checkpoint).unlink(missing_ok=True)
    log(f"saved {args.out}")

    # (5) the base, sampled by the stock pipeline: held-out instructions, and as many seen ones
    if args.eval_steps:
        pipe.set_progress_bar_config(disable=True)
        held_out = edit_world.held_out_instructions()
        seen = [i for i in edit_world.all_instructions() if i not in set(held_out)][::7][: len(held_out)]
        for name, rows in (("held-out", held_out), ("seen", seen)):
            m = evaluate(pipe, rows, args.eval_steps, seed=0)
            log(f"{name} ({len(rows)} instructions): " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()))


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
