"""What a run reports: the `Logger` (TensorBoard, wandb with --track, the run folder's args.json and resumes.jsonl),
its captioned grids, the timers. The held-out evaluation is in evaluation.py."""

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from common import UserError
from harness.checkpoints import check_run_folder, rng_state, script_name, set_rng_state
from harness.distributed import busy_cpu_hint, check_device
from harness.export import git_commit
from harness.prompt_files import load_prompts
from harness.run import lock_run, release_run_locks


class Logger:
    """TensorBoard scalars and captioned image grids under runs/<run_name>/; a no-op on ranks other than 0.

    With `args.track` the run is mirrored to wandb (CleanRL's `--track`): `wandb.init(sync_tensorboard=True)` before
    the SummaryWriter exists patches it, so every scalar and image written here also goes to wandb. The newest value
    of every scalar and the newest grid of every image tag are kept (`last_scalars`, `last_images`) for the model card."""

    def __init__(self, run_dir: Path, args, ckpt: Optional[dict] = None, enabled: bool = True):
        """A fresh run (`ckpt` None): creates the run folder (exclusively: never someone else's), locks it, writes
        args.json. A resumed run (`ckpt` from `start_run`, which locked the folder): appends the checkpoint's resume
        record to resumes.jsonl instead, args.json stays as the run began."""
        self.enabled, self.run_dir = enabled, Path(run_dir)
        self.writer = self.wandb = None
        self.last_scalars, self.last_images = {}, {}  # tag -> (value, step); tag -> ([H, W, 3] uint8 grid, captions, step)
        # the side metrics rank 0 scores at each eval (`evaluation.evaluate_and_log`), loaded before the first write: a
        # model that cannot be loaded stops the run with one line and nothing written
        self.eval_rewards = load_eval_rewards(args, enabled)
        if not enabled:
            return
        rng = rng_state()  # created after a resume restored the RNGs: whatever wandb or TensorBoard draws is given back
        try:
            self._start(args, ckpt)
        finally:
            set_rng_state(rng)

    def _start(self, args, ckpt: Optional[dict]):
        from torch.utils.tensorboard import SummaryWriter

        run_dir = self.run_dir
        config = asdict(args) if is_dataclass(args) else dict(vars(args))
        config["git_commit"] = git_commit()
        if ckpt is not None:
            with open(run_dir / "resumes.jsonl", "a") as f:
                f.write(json.dumps({**ckpt["resume_record"], "git_commit": config["git_commit"]}, default=str) + "\n")
        else:
            try:
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                run_dir.mkdir()
            except FileExistsError:
                raise UserError(f"run folder {run_dir} exists already (another run of the same name); start again")
            except OSError as e:
                raise UserError(f"cannot create the run folder {run_dir} ({e.strerror})")
            lock_run(run_dir)
            config["algo"] = script_name(args)
            (run_dir / "args.json").write_text(json.dumps(config, indent=2, default=str))
        device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        if torch.device(device).type == "cpu" and (hint := busy_cpu_hint()):  # once every check passed, as training starts
            print(hint, file=sys.stderr)
        if getattr(args, "track", False):
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                name=run_dir.name,
                config=config,
                sync_tensorboard=True,
            )
        self.writer = SummaryWriter(str(run_dir))
        table = "\n".join(f"|{k}|{v}|" for k, v in config.items())
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")

    def scalars(self, values: dict, step: int):
        if self.enabled:
            check_run_folder(self.run_dir)
            for k, v in values.items():
                self.writer.add_scalar(k, float(v), step)
                self.last_scalars[k] = (float(v), step)

    def images(self, tag: str, images: torch.Tensor, captions: Sequence[str], step: int, ncol: int = 8):
        """A grid of images with each caption drawn under its image, to TensorBoard and as
        runs/<run>/samples/<eval|train>_<images seen>.png (so that hacking, e.g. extra objects, is seen at a glance)."""
        if not self.enabled:
            return
        from PIL import Image

        check_run_folder(self.run_dir)
        grid = captioned_grid(images, captions, ncol)
        self.writer.add_image(tag, grid, step, dataformats="HWC")
        self.writer.add_text(tag + "/captions", "\n".join(f"{i}: {cap}  " for i, cap in enumerate(captions)), step)
        (self.run_dir / "samples").mkdir(exist_ok=True)
        Image.fromarray(grid).save(self.run_dir / "samples" / f"{tag.split('/')[0]}_{step:07d}.png")
        self.last_images[tag] = (grid, list(captions), step)

    def close(self):
        if self.enabled:
            self.writer.close()
            if self.wandb is not None:
                import wandb

                self.wandb.finish()
                wandb.tensorboard.unpatch()  # finish() leaves SummaryWriter patched: a later run in this process would fail
        release_run_locks()


def load_eval_rewards(args, enabled: bool):
    """The side metrics of --eval-rewards as one MultiReward (None without any), on rank 0 only (`enabled`): only the
    logger's rank evaluates."""
    names = tuple(getattr(args, "eval_rewards", ()))
    if not enabled or not names:
        return None
    from rewards import MultiReward

    multi = MultiReward(dict.fromkeys(names, 1.0), check_device(getattr(args, "device", None)))
    for fn in multi.fns.values():  # a reward that needs something of its prompts (ocr: a quoted text) sees the eval ones
        if hasattr(fn, "check_prompts"):
            fn.check_prompts(load_prompts(args.test_prompts))
    return multi


def captioned_grid(images: torch.Tensor, captions: Sequence[str], ncol: int = 8, scale: int = 2) -> np.ndarray:
    """images [N, 3, H, W] in [0, 1] -> uint8 [H', W', 3]: a grid, each image upscaled `scale` times (nearest) with its
    caption wrapped under it ("prompt | scores": the prompt on the first lines, the scores on the next)."""
    import textwrap

    from PIL import Image, ImageDraw

    if images.dim() == 5:  # video [N, F, 3, H, W]: its middle frame
        images = images[:, images.shape[1] // 2]
    n = images.shape[0]
    ncol = min(ncol, n)
    h, w = images.shape[2] * scale, images.shape[3] * scale
    width = max(w, 128) + 8
    chars = width // 6  # PIL's default bitmap font is ~6 px wide
    wrapped = [sum((textwrap.wrap(part.strip(), chars) or [""] for part in c.split("|")), []) for c in captions]
    lines = max((len(x) for x in wrapped), default=0)
    cell_h = h + 4 + 11 * lines
    canvas = Image.new("RGB", (ncol * width, -(-n // ncol) * cell_h), "white")
    draw = ImageDraw.Draw(canvas)
    pixels = (images.detach().float().cpu().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy()
    for i in range(n):
        r, k = divmod(i, ncol)
        x0, y0 = k * width + (width - w) // 2, r * cell_h + 2
        canvas.paste(Image.fromarray(pixels[i]).resize((w, h), Image.NEAREST), (x0, y0))
        for j, line in enumerate(wrapped[i] if i < len(wrapped) else []):
            draw.text((k * width + 3, y0 + h + 2 + 11 * j), line, fill="black")
    return np.asarray(canvas)


class Timer:
    """Accumulates wall-clock per section: `with timer("sampling"): ...`; `timer.pop()` returns and resets."""

    def __init__(self):
        self.totals = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict:
        out, self.totals = self.totals, {}
        return out


def nanmean(values) -> float:
    """Mean ignoring NaNs; NaN (without numpy's warning) when nothing is left."""
    finite = [float(v) for v in values if not math.isnan(float(v))]
    return sum(finite) / len(finite) if finite else float("nan")


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------------------------------
# held-out sampling: the fixed noises every evaluation shares
# ----------------------------------------------------------------------------------------------------------------
