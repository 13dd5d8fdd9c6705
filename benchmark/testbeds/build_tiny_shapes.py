"""Recipe for the embedded models tiny-shapes and tiny-text: data, tokenizer, autoencoder, text encoders, transformer.

    # ~25 min on 2 CPU cores, writes assets/tiny-shapes/:
    python benchmark/testbeds/build_tiny_shapes.py
    python benchmark/testbeds/build_tiny_shapes.py --world text --threads 1    # 45 min, writes assets/tiny-text/ (OCR)

The result is a plain `StableDiffusion3Pipeline` folder (save_pretrained layout, safetensors) that loads with
`StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None)`, so every line that handles
SD3.5 on a GPU runs on it too. Built into assets/ (no `--out`) it also writes the prompt splits:
`assets/{train,test}.jsonl` for shapes, `assets/text_{train,test}.jsonl` for text (`rewards/worlds/text.py`: one 2-4
letter word per image, test words unseen).
`--world mixed` trains one model on half of each world: at the same budget it scored 0.397 on held-out shapes prompts
(tiny-shapes: 0.488) and spelled no better than a text-only build, so tiny-text is a separate pipeline (docs/ocr.md).
A build is deterministic for a given thread count. The times above are of a CPU with native bf16 (the shipped models
were built with bf16 autocast); on one without it (AMD EPYC without avx512_bf16, measured: 7.2 s against 0.92 s per
flow step of batch 64 on one thread) `--no-autocast` trains in fp32, 8x faster there, but is a different build.

Stages: (1) render a fixed dataset of captioned images from the world; (2) a CLIP tokenizer, word-level for the shapes
vocabulary and character-level for everything else (so a quoted word is spelled one letter per token); (3) a tiny
`AutoencoderKL` (64x64x3 -> 16x16x4) trained on the images; (4) two tiny CLIP text encoders and a tiny
`SD3Transformer2DModel`, trained jointly with the rectified-flow loss on the latents (logit-normal sigma, 10% caption
dropout so that CFG works), keeping an EMA of the weights that is what we ship.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
ASSETS = Path(__file__).resolve().parents[2] / "assets"  # what this writes: data only
from rewards.worlds import shapes as world  # noqa: E402
from rewards.worlds import text as text_world  # noqa: E402

MAX_TOKENS = 16  # CLIP context length of tiny-shapes; the longest caption has 11 words
TEXT_MAX_TOKENS = 32  # with text captions: 'a label with the text "ABCD"' is 27 characters, each a token
SCHEDULER_SHIFT = 2.0
TEXT_DIM = 64  # per CLIP; SD3 concatenates the two encoders' hidden states (and projections)


def build_tokenizer(words, max_tokens=MAX_TOKENS):
    """CLIP byte-level BPE whose merges assemble every world word into one token; other text falls back to characters."""
    specials = ["<|startoftext|>", "<|endoftext|>"]
    chars = [chr(i) for i in range(33, 127)]
    vocab = {tok: i for i, tok in enumerate(specials + chars + [c + "</w>" for c in chars])}
    merges = []
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_tokens)
    for word in sorted(words):
        # add merges until the word is one token; a later merge never fires inside an earlier word, which is already
        # fully merged by lower-ranked merges, so words built before stay single tokens
        while len(pieces := tok.tokenize(word)) > 1:
            merges.append((pieces[0], pieces[1]))
            vocab.setdefault(pieces[0] + pieces[1], len(vocab))
            tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_tokens)
    assert all(len(tok.tokenize(w)) == 1 for w in words)
    return tok


def build_text_encoder(tok, seed):
    torch.manual_seed(seed)
    cfg = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=TEXT_DIM,
        intermediate_size=2 * TEXT_DIM,
        num_hidden_layers=3,
        num_attention_heads=4,
        projection_dim=TEXT_DIM,
        max_position_embeddings=tok.model_max_length,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return CLIPTextModelWithProjection(cfg)


def build_vae(seed, **overrides):
    """The tiny autoencoder (64 px -> 16 x 16 x 4); `overrides` replace config values (the tests' FLUX.1 build sets
    FLUX.1's scaling and shift factors)."""
    torch.manual_seed(seed)
    config = dict(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        sample_size=world.SIZE,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64),
        layers_per_block=1,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=1.0,
        shift_factor=0.0,
    )
    return AutoencoderKL(**{**config, **overrides})


def build_transformer(seed, layers):
    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=world.SIZE // 4,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=layers,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=2 * TEXT_DIM,
        caption_projection_dim=128,
        pooled_projection_dim=2 * TEXT_DIM,
        pos_embed_max_size=16,
    )


def lr_at(step, total, peak, warmup=200):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def train_vae(vae, images, steps, batch, log, autocast=True):
    """L1 + MSE reconstruction with a small KL so that the latent space stays smooth for the diffusion model."""
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 1e-3, warmup=100)
        idx = torch.randint(len(images), (batch,), generator=gen)
        x = images[idx].permute(0, 3, 1, 2).float() / 127.5 - 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            post = vae.encode(x).latent_dist
            z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
            rec = vae.decode(z).sample.float()
        kl = 0.5 * (post.mean.float() ** 2 + post.var.float() - 1 - post.logvar.float()).mean()
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + 1e-4 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            log(f"vae step {step}/{steps} loss {loss.item():.4f} kl {kl.item():.3f} ({time.time() - t0:.0f}s)")


@torch.no_grad()
def encode_images(vae, images, batch=256):
    out = []
    for i in range(0, len(images), batch):
        x = images[i : i + batch].permute(0, 3, 1, 2).float() / 127.5 - 1
        out.append(vae.encode(x).latent_dist.mode())
    return torch.cat(out)


def text_embeddings(pipe, ids1, ids2):
    """Differentiable copy of the SD3 pipeline's CLIP branch for cached token ids (no T5: max_sequence_length=1 zeros)."""
    o1 = pipe.text_encoder(ids1, output_hidden_states=True)
    o2 = pipe.text_encoder_2(ids2, output_hidden_states=True)
    clip = torch.cat([o1.hidden_states[-2], o2.hidden_states[-2]], dim=-1)
    t5 = torch.zeros(clip.shape[0], 1, clip.shape[-1])
    return torch.cat([clip, t5], dim=1), torch.cat([o1.text_embeds, o2.text_embeds], dim=-1)


def train_flow(pipe, latents, caption_idx, unique_prompts, steps, batch, lr, log, autocast=True):
    """Rectified flow: x_t = (1 - s) x0 + s eps, target eps - x0, s ~ logit-normal(0, 1) (SD3's choice)."""
    tok = pipe.tokenizer
    ids = tok(unique_prompts, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt")
    ids = ids.input_ids
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(2)
    empty = unique_prompts.index("")
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr)
        idx = torch.randint(len(latents), (batch,), generator=gen)
        x0 = latents[idx]
        cap = caption_idx[idx].clone()
        cap[torch.rand(batch, generator=gen) < 0.1] = empty  # caption dropout -> unconditional model for CFG
        sigma = torch.sigmoid(torch.randn(batch, generator=gen))
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * eps
        # encode each distinct caption of the batch once (the text world has thousands of captions)
        distinct, where = torch.unique(cap, return_inverse=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            embeds, pooled = text_embeddings(pipe, ids[distinct], ids[distinct])
            v = pipe.transformer(
                hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=embeds[where], pooled_projections=pooled[where]
            ).sample.float()
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p.detach(), 1 - decay)
        if step % 200 == 0 or step == steps - 1:
            log(
                f"flow step {step}/{steps} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e} ({time.time() - t0:.0f}s)"
            )
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    for m in modules:
        m.eval().requires_grad_(False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", choices=("shapes", "text", "mixed"), default="shapes")
    ap.add_argument("--out", default=None, help="default: assets/tiny-<world>")
    ap.add_argument("--num-images", type=int, default=20000)
    ap.add_argument("--vae-steps", type=int, default=1500)
    ap.add_argument("--flow-steps", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--vae-from",
        default=None,
        help="reuse the autoencoder of this pipeline folder (same world) instead of training one: a build that differs "
        "only in its transformer and text encoders, 1,500 VAE steps (~30 min on 2 cores) sooner",
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2, help="fixed thread count keeps the CPU run deterministic")
    ap.add_argument(
        "--autocast",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bf16 autocast of the forwards (how the shipped models were built); --no-autocast: fp32",
    )
    args = ap.parse_args()
    if args.vae_from:
        config = Path(args.vae_from) / "vae" / "config.json"
        try:  # a crafted or truncated config is the same wrong input as a missing one
            scaled = json.loads(config.read_text()).get("scaling_factor") is not None
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            scaled = False
        if not scaled:
            ap.error(f"--vae-from {args.vae_from}: not a pipeline folder with a scaled autoencoder (vae/config.json)")
    torch.set_num_threads(args.threads)
    t_start = time.time()
    here = ASSETS
    out = args.out or str(here / f"tiny-{args.world}")

    def log(msg):
        print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)

    def write_split(name, rows):
        if args.out is not None:  # a build elsewhere (an experiment) leaves the repository's prompt files alone
            return
        with open(here / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    # (1) data and prompt splits (written by the single-world builds; mixed reuses them)
    captions, images, words = [], [], []
    if args.world in ("shapes", "mixed"):
        train, test = world.splits()
        if args.world == "shapes":
            for name, rows in (("train", train), ("test", test)):
                write_split(name, [{"prompt": p, "category": c, "held_out": world.is_held_out(c, p)} for c, p, _ in rows])
        n = args.num_images // 2 if args.world == "mixed" else args.num_images
        c, im = world.make_dataset(train, n, seed=0)
        captions, images = captions + c, images + [im]
        words = sorted({w for _, p, _ in world.all_prompts() for w in p.split()})
        log(f"shapes: {len(train)} train / {len(test)} test prompts, {n} images")
    if args.world in ("text", "mixed"):
        train, test = text_world.splits()
        if args.world == "text":
            write_split("text_train", [{"prompt": p, "category": c, "held_out": False} for c, p, _ in train])
            write_split("text_test", [{"prompt": p, "category": c, "held_out": True} for c, p, _ in test])
        n = args.num_images - len(captions)
        c, im = text_world.make_dataset(train, n, seed=0)
        captions, images = captions + c, images + [im]
        log(f"text: {len(train)} train / {len(test)} test words, {n} images")
    images = torch.from_numpy(np.concatenate(images))
    unique_prompts = sorted(set(captions)) + [""]
    index = {p: i for i, p in enumerate(unique_prompts)}
    caption_idx = torch.tensor([index[c] for c in captions])

    # (2) tokenizer and text encoders
    tok = build_tokenizer(words, MAX_TOKENS if args.world == "shapes" else TEXT_MAX_TOKENS)
    te1, te2 = build_text_encoder(tok, seed=10), build_text_encoder(tok, seed=11)

    # (3) autoencoder; latents normalised to unit variance like SD3's scaling/shift factors
    if args.vae_from:
        vae = AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae").eval().requires_grad_(False)
        latents = encode_images(vae, images)
        shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    else:
        vae = build_vae(seed=12)
        train_vae(vae, images, args.vae_steps, 32, log, args.autocast)
        vae.eval().requires_grad_(False)
        latents = encode_images(vae, images)
        shift, scale = latents.mean().item(), 1.0 / latents.std().item()
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    latents = (latents - shift) * scale
    log(f"latents {tuple(latents.shape)} shift {shift:.4f} scale {scale:.4f}")

    # (4) transformer + text encoders
    pipe = StableDiffusion3Pipeline(
        transformer=build_transformer(seed=13, layers=args.layers),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT),
        vae=vae,
        text_encoder=te1,
        tokenizer=tok,
        text_encoder_2=te2,
        tokenizer_2=tok,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    log(f"transformer {n_params / 1e6:.2f}M params, vae {sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M")
    train_flow(pipe, latents, caption_idx, unique_prompts, args.flow_steps, args.batch, args.lr, log, args.autocast)
    pipe.save_pretrained(out, safe_serialization=True)
    log(f"saved {out}")


if __name__ == "__main__":
    main()
