"""DDPO's JPEG tasks: reward the (in)compressibility of the image, a reward every generator can move fast.

The score is the JPEG size at quality 95 in kB, divided by SCALE_KB so that 64x64 images give O(1) values
(DDPO used -kB / +kB on 512x512 images). Runs on the CPU with PIL; the result is returned on the images' device.
"""

import io

import numpy as np
import torch
from PIL import Image

QUALITY = 95
SCALE_KB = 2.0  # a 64x64 tiny-shapes sample is ~1-3 kB at quality 95


def jpeg_kilobytes(images: torch.Tensor) -> torch.Tensor:
    """JPEG sizes in kB of images [B, 3, H, W] in [0, 1]."""
    arr = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    sizes = []
    for img in arr:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=QUALITY)
        sizes.append(buf.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32, device=images.device)


def jpeg_compressibility(device=None):
    """Smaller files score higher: -kB / SCALE_KB."""
    return lambda images, prompts: -jpeg_kilobytes(images) / SCALE_KB


def jpeg_incompressibility(device=None):
    """Larger files score higher: +kB / SCALE_KB."""
    return lambda images, prompts: jpeg_kilobytes(images) / SCALE_KB
