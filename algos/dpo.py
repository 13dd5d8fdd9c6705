"""Diffusion-DPO (Wallace et al. 2023, arXiv 2311.12908) for flow-matching models, online or offline -- docs/dpo.md

python algos/dpo.py                                                    # tiny-shapes on CPU, a few minutes
python algos/dpo.py --pairs pairs.jsonl                                # offline: {"prompt", "chosen", "rejected"} images
python algos/dpo.py --model <FLUX.1-Kontext> --pairs edits.jsonl       # offline edits: lines with "image", the one to edit
torchrun --nproc-per-node 8 algos/dpo.py --model stabilityai/stable-diffusion-3.5-medium --reward pickscore  # see benchmark/
"""

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoints  # noqa: E402
import common  # noqa: E402
import distributed  # noqa: E402
import export  # noqa: E402
import logs  # noqa: E402
import models  # noqa: E402  (also registers the model families with common)
import prompt_files  # noqa: E402
import run  # noqa: E402
from rewards import load_rewards  # noqa: E402

# --learning-rate's default, by what is trained: every weight (benchmark/results/convergence) or a LoRA
# (benchmark/results/shapes_clean/tuning.md)
LEARNING_RATES = {"full": 1e-4, "lora": 1e-3}


@dataclass
class Args:
    # Experiment
    exp_name: str = Path(__file__).stem
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, cuDNN uses deterministic kernels"""
    device: run.OptionalStr = None
    """torch device; default cuda:<rank> or cpu"""
    output_dir: str = "runs"
    """runs go to <output_dir>/<run_name>/"""
    resume: run.OptionalStr = None
    """a run folder, or its checkpoints/epoch_<E>, to continue from"""
    num_epochs: int = 60
    """epochs; one epoch = one rollout of M x K images + its updates"""
    eval_every: int = 10
    """evaluate every this many epochs"""
    eval_num_steps: run.OptionalInt = None
    """evaluation steps; default num_steps"""
    eval_guidance_scale: run.OptionalFloat = None
    """evaluation CFG; default guidance_scale"""
    eval_noises: int = 2
    """noises per held-out prompt"""
    eval_ema_decay: float = 0.0
    """decay of the evaluated weight EMA; 0 = off"""
    eval_ema_interval: int = 1
    """optimizer steps per eval EMA update"""
    eval_ema_repeats: int = 1
    """times each eval EMA update is applied"""
    save_every: int = 10
    """checkpoint every this many epochs"""
    keep_checkpoints: int = 3
    """newest checkpoints to keep (>= 1)"""
    track: bool = False
    """if toggled, mirror the logs to Weights & Biases"""
    wandb_project_name: str = "cleanflow"
    """the wandb project name"""
    wandb_entity: run.OptionalStr = None
    """the wandb entity (team)"""
    push_to_hub: run.OptionalStr = None
    """hub repo (user/name) to upload the export to"""
    mixed_precision: bool = False
    """bf16 autocast of the transformer"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward"""
    overlap_reward: bool = True
    """score in a thread while the next samples"""
    compile: bool = False
    """torch.compile each transformer block"""
    fsdp: bool = False
    """FSDP2: shard the transformer over the ranks"""
    fsdp_cpu_offload: bool = False
    """with fsdp: keep the shards in CPU memory"""
    offload_text_encoders: bool = False
    """encode prompts once, text encoders to cpu"""
    base_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the frozen base model"""
    resolution: run.OptionalInt = None
    """image side in pixels; default native"""
    height: run.OptionalInt = None
    """image height; default resolution"""
    width: run.OptionalInt = None
    """image width; default resolution"""
    num_frames: run.OptionalInt = None
    """frames per video (video models)"""
    negative_prompt: str = ""
    """the negative prompt of CFG"""
    max_sequence_length: run.OptionalTokens = None
    """text tokens per prompt"""

    # Model & sampler
    model: run.RepoPath = common.TINY_MODEL
    """diffusers pipeline: a folder or a hub id"""
    reward: str = "shapes_clean"
    """reward name or weighted list "name:w,name:w" (rewards/)"""
    eval_rewards: run.Names = ()
    """side metrics scored on the eval images only, eval/<name>"""
    train_prompts: run.RepoPath = common.TRAIN_PROMPTS
    """training prompts (.txt, or .jsonl "prompt")"""
    test_prompts: run.RepoPath = common.TEST_PROMPTS
    """held-out prompts for evaluation"""
    num_steps: int = 10
    """N, sampling steps"""
    sigma_schedule: Literal["pipeline", "scheduler"] = "pipeline"
    """shifted linspace(1, 1/N) (pipeline) or the scheduler's own"""
    guidance_scale: float = 1.0
    """CFG scale of the rollout (training forwards use none)"""
    guidance_scale_2: run.OptionalFloat = None
    """Wan2.2-A14B: CFG of the low-noise expert; default guidance_scale"""
    dynamics: Literal["ODE", "Flow-SDE", "Dance-SDE", "CPS"] = "ODE"
    """rollout dynamics"""
    eta: float = 0.7
    """noise level of the SDE dynamics"""
    full_finetune: run.AutoBool = None
    """train every transformer weight (fp32), no LoRA"""
    lora_rank: int = 16
    """LoRA rank r"""
    lora_alpha: float = 32.0
    """LoRA alpha (scale alpha / r)"""
    lora_targets: run.OptionalNames = None
    """modules that get LoRA; default the family's"""

    # Optimizer & batch
    learning_rate: run.OptionalFloat = None
    """AdamW learning rate; default 1e-4 (every weight) or 1e-3 (LoRA)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    num_prompts: int = 8
    """M, prompts per epoch (global); offline: M K / 2 pairs (M K chosen images for SFT) per epoch"""
    group_size: int = 8
    """K, images per prompt"""
    micro_batch: int = 16
    """per-rank micro-batch (whole groups online, whole pairs offline)"""
    grad_steps_per_epoch: int = 2
    """optimizer steps per epoch"""
    num_train_timesteps: int = 4
    """T, noised copies (sigma, eps) of every pair trained per epoch"""

    # Algorithm specific arguments
    dpo_beta: float = 50.0
    """beta of Eq. (14), T omega(lambda_t) folded in; flow_grpo's SD3.5 value is 100 x its 0.5 = 50 (docs/dpo.md)"""
    pairs: run.OptionalStr = None
    """offline: a .jsonl of {"prompt", "chosen", "rejected"} image paths; without "rejected": SFT; with "image": edits"""
    pairs_per_group: Literal["best-worst", "all"] = "best-worst"
    """online pairs: each group's best vs worst rollout, or every ordered pair of unequal rewards"""
    rollout_policy: Literal["current", "base"] = "current"
    """online rollouts from the current weights, or from the frozen base (flow_grpo's DPO)"""
    timestep_sampling: Literal["logit-normal", "uniform"] = "logit-normal"
    """u of sigma = shifted(1 - u), per pair: sigmoid(N(mean, std)) (SD3's training) or U(0, 1)"""
    logit_mean: float = 0.0
    """mean of the logit-normal u"""
    logit_std: float = 1.0
    """std of the logit-normal u"""

    # to be filled in runtime
    run_name: tyro.conf.Suppress[str] = ""
    """(computed in runtime)"""
    argv: tyro.conf.Suppress[tuple[str, ...]] = ()
    """the command line, filled by run.run_main: which flags were given (computed in runtime)"""


# ALGO LOGIC: Diffusion-DPO's math as small pure functions
# Conventions: sigma = 1 is noise, x_t = (1 - sigma) x0 + sigma eps, velocity target u = eps - x0. The paper writes the
# denoising error on eps (Eq. 14); in velocity form ||v - u||^2 = ||eps_hat - eps||^2 / (1 - sigma)^2, a per-timestep
# factor of the kind its omega(lambda_t) holds. Like flow_grpo's and Flow-Factory's DPO we take the plain velocity
# error, mean over latent elements, and fold T omega(lambda_t) and the element count into one beta.
def fm_error(v, v_target) -> torch.Tensor:
    """||v - u||^2 per sample, mean over latent elements: the flow-matching loss, and -log p up to scale (Eq. 14)."""
    return (v - v_target).pow(2).flatten(1).mean(1)


def dpo_loss(err_w, err_l, err_ref_w, err_ref_l, beta: float):
    """Eq. (14) per pair: -log sigmoid(-beta ((err_w - err_ref_w) - (err_l - err_ref_l))).

    err_* are the policy's and the frozen base's errors on the chosen (w) and rejected (l) image, noised with the same
    sigma and eps. The logit z = -beta (...) is the implicit reward margin r(w) - r(l), r(x) = -beta (err - err_ref):
    z > 0 when the policy lowered its error on w, relative to the base, more than on l. Returns (loss [P], z [P])."""
    z = -beta * ((err_w - err_ref_w) - (err_l - err_ref_l))
    return -F.logsigmoid(z), z.detach()


def select_pairs(rewards: torch.Tensor, group_size: int, mode: str) -> torch.Tensor:
    """(chosen, rejected) sample indices [P, 2] within each group of K contiguous samples, in group order.

    "best-worst": the group's highest and lowest reward (the first of equals), flow_grpo's DPO pairs; "all": every
    ordered pair (i, j) with r_i > r_j, i.e. each unordered pair of unequal rewards once, best first. Ties are skipped:
    a group whose rewards are all equal gives no pair (flow_grpo then pairs samples 0 and 1 anyway)."""
    pairs = []
    for g, row in enumerate(rewards.view(-1, group_size).tolist()):
        base = g * group_size
        if mode == "best-worst":
            hi = max(range(group_size), key=lambda i: row[i])
            lo = min(range(group_size), key=lambda i: row[i])
            candidates = [(hi, lo)]
        elif mode == "all":
            candidates = [(i, j) for i in range(group_size) for j in range(group_size)]
        else:
            raise common.UserError(f"unknown pairs mode {mode!r}; choose best-worst or all")
        pairs += [(base + i, base + j) for i, j in candidates if row[i] > row[j]]
    return torch.tensor(pairs, dtype=torch.long).view(-1, 2)


def train_sigma(generator: torch.Generator, grid: torch.Tensor, sampling: str, mean: float, std: float) -> float:
    """One training sigma: u in (0, 1) (logit-normal or uniform), then grid[floor(u len(grid))], the model's shifted
    1000-step schedule, as flow_grpo indexes its scheduler's timesteps (train_sd3_dpo.py)."""
    if sampling == "logit-normal":
        u = torch.sigmoid(mean + std * torch.randn(1, generator=generator))
    else:
        u = torch.rand(1, generator=generator)
    return float(grid[min(int(u * len(grid)), len(grid) - 1)])


def draw_lines(num_lines: int, count: int, generator: torch.Generator) -> list:
    """`count` line indices of the pairs file, without replacement, cycling when the file is shorter (group_prompts)."""
    idx = []
    while len(idx) < count:
        idx += torch.randperm(num_lines, generator=generator).tolist()
    return idx[:count]


def load_pairs(path: str, height: Optional[int], width: Optional[int]) -> tuple:
    """--pairs: one JSON object a line, {"prompt": str, "chosen": image path, "rejected": image path}, paths relative
    to the file's folder; every line with a "rejected" (DPO) or none (SFT). An edit family's line adds the image to
    edit, "image": its path: the prompt is then a `prompt_files.Prompt` record, as a prompt file's line with an
    "image" (so `PromptEncoder.cond` gives the reference latents, `Cond.image`); every line has one or none does. Every
    image is read here, before the model loads; the chosen and rejected ones must be RGB-convertible and of one size
    (--height/--width when given). Returns (prompts, chosen [N, H, W, 3] uint8, rejected or None). A problem is one
    UserError naming the line."""
    file = Path(path).expanduser()
    if file.exists() and not file.is_file():  # a FIFO would hang the read
        raise common.UserError(f"--pairs {path}: not a regular file (a folder, a pipe or a device)")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise common.UserError(f"--pairs {path}: cannot be read ({type(e).__name__}: {e.strerror or e})")
    except UnicodeDecodeError as e:
        raise common.UserError(f"--pairs {path}: not UTF-8 text (byte {e.start}: {e.reason})")
    prompts, images, sizes, kinds, with_image = [], {"chosen": [], "rejected": []}, set(), set(), set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--pairs {path}, line {n}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise common.UserError(f"{where}: not JSON ({e})")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise common.UserError(f'{where}: needs an object with a non-empty "prompt"')
        keys = [k for k in ("chosen", "rejected") if row.get(k) is not None]
        if "chosen" not in keys:
            raise common.UserError(f'{where}: needs a "chosen" image path')
        kinds.add(len(keys))
        if len(kinds) > 1:
            raise common.UserError(f'{where}: every line needs a "rejected" image (DPO), or none does (SFT)')
        with_image.add("image" in row)
        if len(with_image) > 1:
            raise common.UserError(f'{where}: every line carries an "image" (the image to edit), or none does')
        if "image" in row:  # read and checked as a prompt file's image (prompt_files.load_prompts)
            prompts.append(prompt_files.image_prompt(row["prompt"], row["image"], file.parent, where))
        else:
            prompts.append(row["prompt"])
        for key in keys:
            if not isinstance(row[key], str):
                raise common.UserError(f'{where}: "{key}" must be an image path')
            image_path = file.parent / row[key]
            # read as every image is (EXIF orientation, 16-bit, a size cap before decoding): the one loader
            pixels = np.asarray(prompt_files.load_image(image_path, f"{where}: {key} image {image_path}"))
            if pixels.shape[0] % 8 or pixels.shape[1] % 8:  # the resolution rule of every script (`check_args`)
                raise common.UserError(
                    f"{where}: {key} image is {pixels.shape[1]}x{pixels.shape[0]}; sizes must be multiples of 8 pixels"
                )
            sizes.add(pixels.shape[:2])
            if len(sizes) > 1:
                raise common.UserError(
                    f"{where}: {key} image is {pixels.shape[1]}x{pixels.shape[0]}; the file's images differ in size"
                )
            if (height and pixels.shape[0] != height) or (width and pixels.shape[1] != width):
                raise common.UserError(f"{where}: {key} image is {pixels.shape[1]}x{pixels.shape[0]}, not {width}x{height}")
            images[key].append(pixels)
    if not prompts:
        raise common.UserError(f"--pairs {path}: no lines")
    rejected = np.stack(images["rejected"]) if images["rejected"] else None
    chosen = np.stack(images["chosen"])
    if rejected is not None:
        same = int((chosen == rejected).reshape(len(chosen), -1).all(1).sum())
        if same == len(chosen):  # no preference in any pair: Eq. 14's two sides are one image, its gradient ~0
            raise common.UserError(f"--pairs {path}: every pair's chosen and rejected images are the same; DPO learns nothing")
        if same:
            print(f"note: --pairs {path}: {same} of {len(chosen)} pairs have the same chosen and rejected image", flush=True)
    return prompts, chosen, rejected


def check_pair_images(model: str, prompts: list, size: tuple, flag: str):
    """Before the model loads (its model_index.json names the family): lines with an image to edit need an edit family
    (`Family.encode_image`), whose `check_images` then checks them as it takes them: FLUX.1-Kontext each at the sampled
    size, `size` (width, height) of the chosen images; Qwen-Image-Edit resizes each, to one size for the whole file."""
    name = models.pipeline_config(model).get("_class_name")
    family = common.FAMILIES.get(name)
    if family is None:  # load_pipeline reports it
        return
    if family.encode_image is None and isinstance(prompts[0], prompt_files.Prompt):
        edit = ", ".join(sorted(k for k, f in common.FAMILIES.items() if f.encode_image))
        raise common.UserError(f"{flag}: its lines carry an image to edit, but {name} takes none (edit families: {edit})")
    if family.check_images is not None:
        family.check_images(prompts, size, flag)


@torch.no_grad()
def encode_images(pipe, pixels: np.ndarray, chunk: int) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> the sampler's latents, the inverse of `decode`: an edit family's `encode_image` (the
    reference latents are the sampled ones' form: FLUX.1-Kontext, Qwen-Image-Edit), else that of
    models.shared.vae_decode, (mode of the VAE posterior - shift_factor) x scaling_factor, for the families that decode
    with it, whose sampler latents are the VAE's own (SD3, FLUX.1, ...; tested on SD3)."""
    family = pipe.family
    if family.encode_image is None and family.decode is not models.shared.vae_decode:
        raise common.UserError(f"--pairs: offline pairs need a family that samples the VAE's own latents, not {family.name}")
    vae = pipe.vae
    out = []
    for part in torch.from_numpy(pixels).split(chunk):
        if family.encode_image is not None:  # pixels as image_pixels makes them: x / 255 * 2 - 1 in float32
            out.append(family.encode_image(pipe.pipe, 2.0 * (part.permute(0, 3, 1, 2).float().to(vae.device) / 255.0) - 1.0))
            continue
        x = part.permute(0, 3, 1, 2).to(vae.device, vae.dtype) / 127.5 - 1
        z = vae.encode(x).latent_dist.mode().float()
        out.append((z - (getattr(vae.config, "shift_factor", None) or 0.0)) * vae.config.scaling_factor)
    z = torch.cat(out)
    if tuple(z.shape[1:]) != tuple(pipe.latent_shape):
        side = pipe.vae_scale_factor
        raise common.UserError(
            f"--pairs: images of {pixels.shape[2]}x{pixels.shape[1]} pixels, but the model samples "
            f"{pipe.latent_shape[-1] * side}x{pipe.latent_shape[-2] * side} (--resolution/--height/--width)"
        )
    return z


def main(args: Args):
    # TRY NOT TO MODIFY: setup, seeding, logging
    run_dir, ckpt = run.start_run(args, __file__)
    dist = distributed.setup_distributed(args.device)
    device = dist.device
    run.seed_everything(args.seed + dist.rank * 7919, args.torch_deterministic)

    # ALGO LOGIC: flag checks and the offline pairs file, read before the model loads so a bad one fails first
    if args.dpo_beta <= 0 or args.logit_std <= 0:
        name, value = ("dpo-beta", args.dpo_beta) if args.dpo_beta <= 0 else ("logit-std", args.logit_std)
        raise common.UserError(f"--{name} {value}: must be > 0")
    offline = None
    if args.pairs is None:
        if args.micro_batch % args.group_size:
            raise common.UserError(
                f"micro_batch ({args.micro_batch}) must hold whole groups (a multiple of group_size {args.group_size}): "
                "the pairs are drawn within a group"
            )
    else:
        online_flags = sorted(run.given_flags(args) & {"pairs_per_group", "rollout_policy"})
        if online_flags:
            raise common.UserError(f"--{online_flags[0].replace('_', '-')}: an online setting, but --pairs trains offline")
        offline = load_pairs(args.pairs, args.height or args.resolution, args.width or args.resolution)
        check_pair_images(args.model, offline[0], offline[1].shape[2:0:-1], f"--pairs {args.pairs}")
        if offline[2] is not None and args.micro_batch % 2:
            raise common.UserError(
                f"micro_batch ({args.micro_batch}) must be even with --pairs: a pair's two images train together"
            )

    # TRY NOT TO MODIFY: batch geometry
    if args.group_size < 2:
        raise common.UserError("group_size must be >= 2: advantages are relative to the other images of a prompt")
    total = args.num_prompts * args.group_size
    per_rank_step = distributed.batch_layout(total, args.grad_steps_per_epoch, dist.world_size, args.micro_batch)
    local_samples = per_rank_step * args.grad_steps_per_epoch
    num_micro, micro_per_step = local_samples // args.micro_batch, per_rank_step // args.micro_batch
    # this rank's share of every optimizer step's samples: N ranks compute exactly what one process computes
    local_idx = distributed.rank_indices(total, args.grad_steps_per_epoch, dist.world_size, dist.rank)
    if dist.is_main:
        print(
            f"group size K={args.group_size}, prompts/epoch M={args.num_prompts}, "
            f"images/epoch={total} ({local_samples}/rank), micro-batch={args.micro_batch} x {num_micro}/rank, "
            f"optimizer steps/epoch={args.grad_steps_per_epoch}, "
            f"world size={dist.world_size}"
        )

    # TRY NOT TO MODIFY: prompts, rewards, model (the cheap checks first: a bad flag fails before a large model loads)
    train_prompts, test_prompts = prompt_files.load_prompts(args.train_prompts), prompt_files.load_prompts(args.test_prompts)
    rewards = load_rewards(args.reward, device, train_prompts + test_prompts)
    pipe = models.load_pipeline(
        args.model,
        device,
        models.DTYPES[args.base_dtype],
        args.resolution,
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        guidance_scale_2=args.guidance_scale_2,
        shard=args.fsdp,
    )
    transformer = pipe.transformer
    torch.manual_seed(args.seed)  # identical LoRA init on every rank
    params = models.trainable_params(transformer, args)
    if args.learning_rate is None:
        args.learning_rate = LEARNING_RATES["full" if args.full_finetune else "lora"]
    distributed.check_same_on_all_ranks(params)
    if args.fsdp:  # every rank keeps 1/N of every weight, the LoRA's too: params become this rank's shards
        params = models.fully_shard_transformer(transformer, device, args.fsdp_cpu_offload)
    named = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    if args.gradient_checkpointing:
        models.enable_gradient_checkpointing(transformer)
    if args.compile:
        models.compile_transformer(transformer)
    encoder = common.PromptEncoder(pipe, args.max_sequence_length, args.negative_prompt)
    if args.offload_text_encoders:
        encoder.precompute(train_prompts + test_prompts)
        encoder.offload()
    if dist.is_main:
        print(f"trainable ({'full' if args.full_finetune else 'LoRA'}) params={sum(p.numel() for p in params):,}")

    # ALGO LOGIC: the reference is the frozen base (models.reference_model), so no snapshot is kept; the offline images
    # are encoded once and scored once (their reward is what charts/reward_* shows offline), then their pixels dropped
    snapshots = {}
    train_grid = pipe.sigmas(1000, device)[:-1].cpu()  # the shifted 1000-step schedule the training sigmas come from
    sft = offline is not None and offline[2] is None
    if offline is not None:
        data_prompts, sides = offline[0], [p for p in offline[1:] if p is not None]
        data_latents = [encode_images(pipe, p, args.micro_batch) for p in sides]
        data_scores = []  # per side: {reward name: [N]}
        for p in sides:
            parts = [
                rewards(
                    torch.from_numpy(p[k : k + args.micro_batch]).permute(0, 3, 1, 2).float() / 255,
                    data_prompts[k : k + args.micro_batch],
                )
                for k in range(0, len(p), args.micro_batch)
            ]
            data_scores.append({name: torch.cat([s[name] for s in parts]).float().cpu() for name in parts[0]})
        offline = None  # the pixels
    if dist.is_main:
        mode = "online" if args.pairs is None else f"offline {'SFT' if sft else 'DPO'} ({len(data_prompts)} lines)"
        print(f"{mode}; T={args.num_train_timesteps} noised copies of every pair per epoch, beta={args.dpo_beta}")

    # TRY NOT TO MODIFY: generators, resume
    # prompts come from one stream that every rank follows; all noise comes from streams keyed by (seed, epoch, purpose,
    # global sample index) -- common.keyed_generators -- so it does not depend on the rank count or on a resume
    prompt_gen = torch.Generator().manual_seed(args.seed)
    eval_ema = models.EvalEMA(params, args.eval_ema_decay, args.eval_ema_interval, args.eval_ema_repeats)  # for eval only
    start_epoch, step, images_seen = checkpoints.restore_state(ckpt, named, optimizer, snapshots, eval_ema, prompt_gen)
    logger = logs.Logger(run_dir, args, ckpt, enabled=dist.is_main)  # the first write: after every check, the checkpoint too

    def save(epoch):  # the checkpoint of an exact --resume, then the exported model that users load (rank 0 writes)
        checkpoints.save_state(
            run_dir,
            args,
            pipe,
            named,
            optimizer,
            snapshots,
            eval_ema,
            prompt_gen,
            logger,
            epoch=epoch,
            step=step,
            images_seen=images_seen,
        )
        export.export_model(run_dir, pipe, args, __doc__, epoch, logger, eval_ema)

    timer, stop, finite_grads = logs.Timer(), run.GracefulStop(), run.FiniteGradients()
    stopped_at = None
    pbar = tqdm(
        range(start_epoch, args.num_epochs),
        disable=not dist.is_main,
        desc=args.exp_name,
        unit="epoch",
        initial=start_epoch,
        total=args.num_epochs,
    )
    for epoch in pbar:
        if stop.requested:
            save(epoch)
            stopped_at = epoch
            break
        if epoch % args.eval_every == 0:
            logs.evaluate_and_log(args, pipe, encoder, test_prompts, rewards, eval_ema, logger, images_seen)
        if epoch % args.save_every == 0 and epoch > start_epoch:
            save(epoch)

        # ---- sampling ----
        with timer("sampling"):
            if args.pairs is None:  # online: K rollouts of each of M prompts, with the current weights or the base's
                prompts = common.group_prompts(train_prompts, args.num_prompts, args.group_size, prompt_gen)
                prompts = [prompts[j] for j in local_idx]
                cond = encoder.cond(prompts)
                scorer = common.Scorer(pipe, rewards, prompts, args.micro_batch, overlap=args.overlap_reward, epoch=epoch)
                with models.reference_model(transformer) if args.rollout_policy == "base" else contextlib.nullcontext():
                    rollout = common.sample(
                        transformer,
                        pipe.scheduler,
                        cond,
                        num_steps=args.num_steps,
                        guidance_scale=args.guidance_scale,
                        dynamics=args.dynamics,
                        eta=args.eta,
                        generator=common.keyed_generators(args.seed, epoch, "rollout", indices=local_idx),
                        latent_shape=pipe.latent_shape,
                        use_autocast=args.mixed_precision,
                        schedule=args.sigma_schedule,
                        chunk=scorer.chunk,
                        on_chunk=scorer,
                    )
                x0 = rollout.latents
            else:  # offline: sample s is line lines[s // 2]'s chosen (s even) or rejected image; SFT: line lines[s]
                lines = draw_lines(len(data_prompts), total if sft else total // 2, prompt_gen)
                line_of = [lines[s] for s in range(total)] if sft else [lines[s // 2] for s in range(total)]
                side_of = [0] * total if sft else [s % 2 for s in range(total)]
                prompts = [data_prompts[line_of[j]] for j in local_idx]
                cond = encoder.cond(prompts)
                x0 = torch.stack([data_latents[side_of[j]][line_of[j]] for j in local_idx]).to(device)
                images = common.decode(pipe, x0[:16]) if epoch % args.eval_every == 0 else None  # for the logged grid

        # ---- reward ----
        with timer("reward"):
            if args.pairs is None:
                # each rank scores its own images (during sampling: --overlap-reward); the pairs use the whole epoch's batch
                images, local_scores = scorer.result()
                scores = distributed.gather_scores(local_scores, total, args.grad_steps_per_epoch)
                pairs = select_pairs(rewards.total(scores), args.group_size, args.pairs_per_group)
            else:
                scores = {
                    k: torch.stack([data_scores[side_of[s]][k][line_of[s]] for s in range(total)]) for k in rewards.weights
                }
                pairs = None if sft else torch.arange(total).view(-1, 2)  # (chosen, rejected) = (2i, 2i + 1)
            images_seen += args.num_prompts * args.group_size

        # ---- training ----
        with timer("training"):
            stats = (
                {"policy_loss": [], "grad_norm": []}
                if sft
                else {"policy_loss": [], "grad_norm": [], "implicit_acc": [], "margin": []}
            )
            per_step = micro_per_step * args.num_train_timesteps
            position = {int(j): i for i, j in enumerate(local_idx)}  # global sample index -> row of this rank's x0
            k = 0
            for mb in range(num_micro):
                sl = slice(mb * args.micro_batch, (mb + 1) * args.micro_batch)
                mine = set(local_idx[sl].tolist())
                # the micro-batch's pairs (whole groups or pairs, so none straddles two); SFT: each sample alone
                rows = [(s,) for s in sorted(mine)] if pairs is None else [tuple(p) for p in pairs.tolist() if p[0] in mine]
                for i in range(args.num_train_timesteps):
                    if not rows:  # only ties here: a zero gradient keeps every rank's optimizer step in lockstep
                        loss = sum(p.sum() for p in params) * 0.0
                        (loss / per_step).backward()
                    else:
                        # one (sigma, eps) per pair, shared by its two images (the paper's x_t^w and x_t^l), keyed by
                        # the pair's global samples: any rank count and a resume draw the same ones
                        gens = [common.keyed_generator(args.seed, epoch, "train", i, *row) for row in rows]
                        sig = torch.tensor(
                            [train_sigma(g, train_grid, args.timestep_sampling, args.logit_mean, args.logit_std) for g in gens]
                        )
                        eps = common.randn((len(rows), *x0.shape[1:]), gens)
                        sides = len(rows[0])  # 2: (chosen, rejected); 1: SFT
                        idx = [position[row[side]] for side in range(sides) for row in rows]  # [chosen..., rejected...]
                        x, mb_cond = x0[idx], cond[idx]
                        sigma = sig.repeat(sides).to(device)
                        noise = eps.repeat(sides, *[1] * (eps.dim() - 1)).to(device)
                        sb = sigma.view(-1, *[1] * (x.dim() - 1))  # broadcast over the latent dims
                        xt = (1 - sb) * x + sb * noise
                        if pairs is not None:
                            with (
                                torch.no_grad(),
                                common.autocast(device, args.mixed_precision),
                                models.reference_model(transformer),
                            ):
                                err_ref = fm_error(common.velocity(transformer, xt, sigma, mb_cond), noise - x)
                        with common.autocast(device, args.mixed_precision):
                            v = common.velocity(transformer, xt, sigma, mb_cond)  # training forwards: no CFG
                        err = fm_error(v, noise - x)
                        if pairs is None:  # SFT: the plain flow-matching loss on the chosen images
                            policy_loss = err.mean()
                        else:
                            n = len(rows)
                            pair_loss, z = dpo_loss(err[:n], err[n:], err_ref[:n], err_ref[n:], args.dpo_beta)
                            policy_loss = pair_loss.mean()
                            stats["implicit_acc"].append((z > 0).float().mean().item())
                            stats["margin"].append(z.mean().item())
                        (policy_loss / per_step).backward()
                        stats["policy_loss"].append(policy_loss.item())
                    # TRY NOT TO MODIFY: an optimizer step every per_step backward passes; a non-finite gradient skips it
                    k += 1
                    if k % per_step == 0:
                        distributed.all_reduce_grads(params)
                        grad_norm = distributed.clip_grad_norm(params, args.max_grad_norm)
                        if finite_grads(grad_norm, lambda: save(epoch)):
                            optimizer.step()
                            step += 1
                            eval_ema.update(step)
                            stats["grad_norm"].append(grad_norm.item())
                        optimizer.zero_grad(set_to_none=True)
            reward_all = rewards.total(scores)
            diagnostics = {"pairs": 0.0 if pairs is None else float(len(pairs))}
            if pairs is not None and len(pairs):
                diagnostics["pair_reward_gap"] = (reward_all[pairs[:, 0]] - reward_all[pairs[:, 1]]).mean().item()

        # ---- logging ----
        # TRY NOT TO MODIFY: global means of every metric, at x = images seen; rank 0 writes
        times = timer.pop()
        reward_total = rewards.total(scores)
        metrics = {
            "charts/reward_mean": reward_total.mean(),
            "charts/reward_std": reward_total.std(),
            **{f"charts/{k}": v.mean() for k, v in scores.items()},
            "charts/images_per_sec": args.num_prompts * args.group_size / sum(times.values()),
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            **{f"charts/{k}": v for k, v in diagnostics.items()},
            **{f"losses/{k}": logs.nanmean(v) for k, v in stats.items()},
            **{f"time/{k}": v for k, v in times.items()},
        }
        metrics = {k: distributed.all_reduce_mean(torch.tensor(float(v), device=device)).item() for k, v in metrics.items()}
        logger.scalars(metrics, images_seen)
        if dist.is_main and epoch % args.eval_every == 0:
            logger.images(
                "train/images",
                images[:16],
                [f"{p} | {r:.2f}" for p, r in zip(prompts[:16], reward_total[local_idx][:16])],
                images_seen,
            )
        pbar.set_postfix(reward=f"{metrics['charts/reward_mean']:.3g}", loss=f"{metrics['losses/policy_loss']:.3g}")

    # TRY NOT TO MODIFY: final eval, checkpoint, close
    if stopped_at is None:
        logs.evaluate_and_log(args, pipe, encoder, test_prompts, rewards, eval_ema, logger, images_seen, "final eval")
        save(args.num_epochs)
    if dist.is_main:
        done = "done" if stopped_at is None else f"stopped before epoch {stopped_at}; continue with --resume {run_dir}"
        print(f"{done}  peak RSS {logs.peak_rss_mb():.0f} MB  run: {run_dir}")
        if args.push_to_hub:
            export.push_to_hub(export.export_dir(run_dir, args), args.push_to_hub)
    logger.close()
    distributed.cleanup_distributed()
    stop.exit()  # exit code 143 after a SIGTERM, so that a scheduler does not take the run for finished


if __name__ == "__main__":
    run.run_main(main, run.cli(Args))
