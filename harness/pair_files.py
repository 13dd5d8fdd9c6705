"""DPO's offline pairs file (`algos/dpo.py --pairs`): reading and checking it before the model loads, and encoding its
images to the sampler's latents once the model is loaded. Beside prompt_files.py, whose one image loader it uses."""

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

import common
import models
from harness import prompt_files


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
