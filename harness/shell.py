"""The shell every algorithm script runs its loop in, written once: start (the run folder, ranks, seeds), the batch's
layout over the ranks, loading the prompts, rewards and model with what is trained and its optimizer, the progress
bar, saving (checkpoint + export) and closing. What is trained, the snapshots an algorithm keeps and its loop stay in
its file; these are the steps around them, in the order the scripts call them.

The loop's own calls into the run's management are here too, under their names in the modules that define them, so
that an algorithm file imports one module for its shell: the command line and its exit codes (run.run_main, run.cli),
which flags were given (run.given_flags), Ctrl-C/SIGTERM and the non-finite-gradient guard (run.GracefulStop,
run.FiniteGradients), the held-out evaluation (evaluation), the timers (logs), the ranks' sums and the gradient clip
(distributed)."""

import torch
from tqdm import tqdm

import common
import models
from harness import checkpoints, distributed, export, logs, prompt_files, run
from harness.distributed import all_reduce_grads, all_reduce_mean, clip_grad_norm, gather_scores  # noqa: F401
from harness.evaluation import evaluate_and_log  # noqa: F401
from harness.logs import Timer, nanmean  # noqa: F401
from harness.run import FiniteGradients, GracefulStop, cli, given_flags, run_main  # noqa: F401
from rewards import load_rewards


def start(args, script_file: str):
    """The run folder (a resume's flags restored from its checkpoint), the ranks, the seeds (each rank its own).
    Returns (run_dir, checkpoint dict or None, dist)."""
    run_dir, ckpt = run.start_run(args, script_file)
    dist = distributed.setup_distributed(args.device)
    run.seed_everything(args.seed + dist.rank * 7919, args.torch_deterministic)
    return run_dir, ckpt, dist


def batch_layout(args, dist) -> tuple:
    """An epoch's M x K images over the ranks and micro-batches. Returns (total, local_idx, local_samples, num_micro,
    micro_per_step): the epoch's images, this rank's share of every optimizer step's samples (N ranks compute exactly
    what one process computes), their count, this rank's micro-batches and those of one optimizer step."""
    if args.group_size < 2:
        raise common.UserError("group_size must be >= 2: advantages are relative to the other images of a prompt")
    total = args.num_prompts * args.group_size
    per_rank_step = distributed.batch_layout(total, args.grad_steps_per_epoch, dist.world_size, args.micro_batch)
    local_samples = per_rank_step * args.grad_steps_per_epoch
    num_micro, micro_per_step = local_samples // args.micro_batch, per_rank_step // args.micro_batch
    local_idx = distributed.rank_indices(total, args.grad_steps_per_epoch, dist.world_size, dist.rank)
    if dist.is_main:
        print(
            f"group size K={args.group_size}, prompts/epoch M={args.num_prompts}, "
            f"images/epoch={total} ({local_samples}/rank), micro-batch={args.micro_batch} x {num_micro}/rank, "
            f"optimizer steps/epoch={args.grad_steps_per_epoch}, "
            f"world size={dist.world_size}"
        )
    return total, local_idx, local_samples, num_micro, micro_per_step


def load_data(args, device) -> tuple:
    """(train prompts, test prompts, rewards): the cheap checks first, so a bad file fails before a large model loads."""
    train_prompts, test_prompts = prompt_files.load_prompts(args.train_prompts), prompt_files.load_prompts(args.test_prompts)
    rewards = load_rewards(args.reward, device, train_prompts + test_prompts)
    return train_prompts, test_prompts, rewards


def load_model(args, dist, learning_rates: dict, prompts) -> tuple:
    """The pipeline, what is trained (a LoRA, or every transformer weight), its AdamW, the prompt encoder. `args.
    learning_rate` defaults to `learning_rates["full" or "lora"]`. Returns (pipe, params, named params, optimizer,
    encoder); with --fsdp, params are this rank's shards."""
    device = dist.device
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
        args.learning_rate = learning_rates["full" if args.full_finetune else "lora"]
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
        encoder.precompute(prompts)
        encoder.offload()
    if dist.is_main:
        print(f"trainable ({'full' if args.full_finetune else 'LoRA'}) params={sum(p.numel() for p in params):,}")
    return pipe, params, named, optimizer, encoder


def resume(args, run_dir, ckpt, dist, params, named, optimizer, snapshots: dict) -> tuple:
    """The prompt stream (one that every rank follows), the eval EMA, the logger, and a resumed run's state put back:
    weights, optimizer, snapshots, EMA, RNG. Returns (prompt_gen, eval_ema, logger, start_epoch, step, images_seen).
    All noise comes from streams keyed by (seed, epoch, purpose, global sample index), common.keyed_generators, so it
    depends neither on the rank count nor on a resume."""
    prompt_gen = torch.Generator().manual_seed(args.seed)
    eval_ema = models.EvalEMA(params, args.eval_ema_decay, args.eval_ema_interval, args.eval_ema_repeats)  # for eval only
    start_epoch, step, images_seen = checkpoints.restore_state(ckpt, named, optimizer, snapshots, eval_ema, prompt_gen)
    logger = logs.Logger(run_dir, args, ckpt, enabled=dist.is_main)  # the first write: after every check, the checkpoint too
    return prompt_gen, eval_ema, logger, start_epoch, step, images_seen


def save(run_dir, args, pipe, named, optimizer, snapshots, eval_ema, prompt_gen, logger, epoch, step, images_seen, doc):
    """The checkpoint of an exact --resume, then the exported model that users load (rank 0 writes)."""
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
    export.export_model(run_dir, pipe, args, doc, epoch, logger, eval_ema)


def progress(args, dist, start_epoch: int):
    """The epochs left, as a progress bar on rank 0."""
    return tqdm(
        range(start_epoch, args.num_epochs),
        disable=not dist.is_main,
        desc=args.exp_name,
        unit="epoch",
        initial=start_epoch,
        total=args.num_epochs,
    )


def close(args, dist, run_dir, stopped_at, logger, stop):
    """The last line, the hub upload, the logger and the process group closed; after a SIGTERM exit 143 (so that a
    scheduler does not take the run for finished)."""
    if dist.is_main:
        done = "done" if stopped_at is None else f"stopped before epoch {stopped_at}; continue with --resume {run_dir}"
        print(f"{done}  peak RSS {logs.peak_rss_mb():.0f} MB  run: {run_dir}")
        if args.push_to_hub:
            export.push_to_hub(export.export_dir(run_dir, args), args.push_to_hub)
    logger.close()
    distributed.cleanup_distributed()
    stop.exit()
