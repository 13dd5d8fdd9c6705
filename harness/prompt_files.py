"""Prompt files: the .txt and .jsonl files of --train-prompts and --test-prompts, and the reference images a jsonl
line may carry (`Prompt`, the record of a prompt with its image). Each image is read and checked here, before any model
loads; `common.PromptEncoder` encodes it by the family's VAE. This module imports common (`UserError`), so common names
nothing of it: the encoder knows a record by its attributes (`text`, `image`, `pixels`; `common.prompt_text`)."""

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from common import UserError, short


class Prompt(str):
    """A prompt with a reference image (an edit instruction, e.g. "make the circle red" and the scene to edit), as
    `load_prompts` reads it from a jsonl line {"prompt": ..., "image": ...}. The string itself is the record's key,
    "<text> [<image as written> <hash of its bytes>]": two records with one key have the same text and image content,
    so everything that takes prompts as strings (group_prompts, the text cache, eval, captions, logs) works unchanged,
    and the same text on two images stays two prompts. `text` is the instruction the text encoder sees, `image` the
    file (resolved), `size` its (width, height) in pixels. `PromptEncoder` encodes the image once by the family's VAE
    into `Cond.image`."""

    def __new__(cls, key: str, text: str, image: Path, size: tuple):
        record = super().__new__(cls, key)
        record.text, record.image, record.size = text, image, size
        return record

    def __getnewargs__(self):  # copy and pickle rebuild the record, not a bare str
        return str(self), self.text, self.image, self.size

    def with_text(self, text: str) -> "Prompt":
        """The record of `text` on this record's image (its key's text replaced): the negative prompt on this image,
        for a text encoder that sees the image (`PromptEncoder.negative`)."""
        return Prompt(text + self[len(self.text) :], text, self.image, self.size)

    def pixels(self, size: Optional[tuple] = None) -> torch.Tensor:
        """The record's image as `image_pixels` reads it (resized to `size` (width, height) if given): what
        `PromptEncoder.images` encodes by the family's VAE."""
        return image_pixels(self.image, size)


# the most pixels an image a script reads may declare (checked from its header, before any pixel is decoded): a PNG
# of a few KB can declare 30000 x 30000 pixels and decode to GBs. 4096 x 4096 is far above any size trained here.
MAX_IMAGE_PIXELS = 4096 * 4096
TOO_MANY = f"more than the {MAX_IMAGE_PIXELS:,} an image may have (a decompression bomb?)"


def load_image(path: Path, where: Optional[str] = None):
    """An image file as an RGB PIL image, as `diffusers.utils.load_image` reads one for a pipeline: its EXIF
    orientation applied, then converted to RGB (alpha dropped, grey and palette images expanded). The stock edit
    pipelines convert nothing (an RGBA array would reach the VAE with 4 channels), so a card's example loads with
    `load_image` too. The one loader of every image a script reads (prompt images, DPO's pairs, edit sources): a path
    that is not a regular file (a FIFO would hang the read), a declared size over MAX_IMAGE_PIXELS, and a file PIL
    cannot decode are each one `UserError` line starting with `where`. 16-bit greyscale (PIL's "I;16" and "I") is
    scaled to 8 bits, where PIL's convert would clip it to white."""
    import warnings

    from PIL import Image, ImageOps

    where = where or f"image {path}"
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise UserError(f"{where} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{where} is not a regular file (a folder, a pipe or a device)")
    try:
        with warnings.catch_warnings():  # PIL's warnings (EXIF, bomb size) would add lines to a one-line refusal
            warnings.simplefilter("ignore")
            with Image.open(path) as image:
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise UserError(f"{where} declares {width} x {height} pixels, {TOO_MANY}")
                image = ImageOps.exif_transpose(image)
                if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
                    wide = np.asarray(image).astype(np.float64)
                    image = Image.fromarray(np.clip(np.round(wide / 257.0), 0, 255).astype(np.uint8), "L")
                return image.convert("RGB")
    except UserError:
        raise
    except Image.DecompressionBombError:  # PIL's own cap, checked as it opens: twice its MAX_IMAGE_PIXELS
        raise UserError(f"{where} declares over {2 * Image.MAX_IMAGE_PIXELS:,} pixels, {TOO_MANY}") from None
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise UserError(f"{where} cannot be read as an image ({reason})") from None


def image_pixels(path: Path, size: Optional[tuple] = None) -> torch.Tensor:
    """`load_image` as a [1, 3, H, W] float32 tensor in [-1, 1], computed as the pipelines' VaeImageProcessor does
    (x / 255, then 2 x - 1), in its memory layout too (channels last: the VAE's convolutions round otherwise, ~4e-7).
    `size` (width, height): resized to it first as VaeImageProcessor.resize resizes a PIL image (Lanczos)."""
    image = load_image(path)
    if size is not None and tuple(size) != image.size:
        from PIL import Image

        image = image.resize(tuple(size), resample=Image.LANCZOS)
    pixels = np.array(image).astype(np.float32)[None] / 255.0
    return 2.0 * torch.from_numpy(pixels.transpose(0, 3, 1, 2)) - 1.0


_IMAGES = {}  # (file, mtime, size in bytes) -> (width, height, digest): read once though load_prompts runs twice


def read_image(path: Path, where: str, written: str) -> tuple:
    """(width, height, blake2b digest of the bytes) of an image file, every pixel decoded (a truncated file fails
    here, not in training); one `UserError` line naming the prompt file's line otherwise. A symbolic link is followed:
    an image is only read (the run folder's no-link rule, `checkpoints.check_no_symlinks`, is about where a run writes)."""
    if not path.exists():
        raise UserError(f"{where}: image {written!r} not found ({path})")
    if not path.is_file():
        raise UserError(f"{where}: image {written!r} is not a regular file ({path})")
    info = path.stat()
    key = (str(path.resolve()), info.st_mtime_ns, info.st_size)
    if key not in _IMAGES:
        width, height = load_image(path, f"{where}: image {written!r}").size
        _IMAGES[key] = (width, height, hashlib.blake2b(path.read_bytes(), digest_size=6).hexdigest())
    return _IMAGES[key]


def image_prompt(text: str, written, folder: Path, where: str) -> Prompt:
    """The `Prompt` record of `text` on the image a jsonl line names (`written`, its "image" field, a path relative to
    `folder`, the file's), the image decoded now (`read_image`); a field that is not a path, a missing file or one
    that is not a readable image is one `UserError` line starting with `where` (the file and line). load_prompts and
    DPO's pairs file (`pair_files.load_pairs`) build their records here."""
    if not isinstance(written, str) or not written.strip():
        raise UserError(
            f"{where}: 'image' is {short(json.dumps(written))}, expected an image file's path (relative to the file's folder)"
        )
    width, height, digest = read_image(folder / written, where, written)
    return Prompt(f"{text} [{written} {digest}]", text, (folder / written).resolve(), (width, height))


def load_prompts(path: str) -> list:
    """Prompts from a .txt (one per line) or .jsonl (a "prompt" field per line) file; blank lines are skipped.

    A jsonl line may carry a reference image, {"prompt": "make the circle red", "image": "scene.png"}, its path
    relative to the file's folder: such a line becomes a `Prompt` record (a str), a plain line a str. A file's lines all
    carry an image or none does (a batch is one or the other). Each image is decoded here, before any model loads: a
    field that is not a string, a missing file or one that is not a readable image is one `UserError` line. Its size is
    checked against the training resolution by the edit family's `check` (before loading) and `PromptEncoder`."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"prompt file {path!r} is a folder; pass a .txt or .jsonl file")
    if not p.exists():
        raise UserError(f"prompt file {path!r} not found")
    if not p.is_file():
        raise UserError(f"prompt file {path!r} is not a regular file (a device or a pipe); pass a .txt or .jsonl file")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is not text
    except UnicodeDecodeError as e:
        raise UserError(f"prompt file {path!r} is not UTF-8 text (byte {e.start}: {e.reason})")
    prompts, with_image = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                record = json.loads(line)
                prompt = record["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"{path}:{n}: expected a JSON object with a 'prompt' field")
            if not isinstance(prompt, str):  # null, a list or a number would be trained on as "None", "['a']", "3"
                raise UserError(f"{path}:{n}: 'prompt' is {short(json.dumps(prompt))}, expected a string")
            with_image.add("image" in record)
            if len(with_image) > 1:
                raise UserError(f"{path}:{n}: every line of a prompt file carries an 'image', or none does")
            if "image" in record:
                prompt = image_prompt(prompt, record["image"], p.parent, f"{path}:{n}")
            prompts.append(prompt)
        else:
            prompts.append(line.strip())
    if not prompts:
        raise UserError(f"prompt file {path!r} has no prompts")
    return prompts


def check_image_sizes(prompts: Sequence[str], width: int, height: int, flag: str):
    """Every reference image of `prompts` is `width` x `height` pixels, the size the model samples at: the reference
    latents share the sampled latents' grid (an edit family's `check`, before the model loads). `flag` names the file."""
    for prompt in prompts:
        if isinstance(prompt, Prompt) and prompt.size != (width, height):
            raise UserError(
                f"{flag}: prompt {short(prompt)}: its image is {prompt.size[0]} x {prompt.size[1]} pixels, but the "
                f"model samples {width} x {height}: resize the image, or train at its size (--height, --width)"
            )
