"""Helpers the model family files share (the resolution check, the text-length cap, the SD3/FLUX.1 VAE decode);
the sampler and reward helpers the algorithms share are in common.py."""

from typing import Optional

import torch

from common import UserError


def latent_side(resolution: Optional[int], native: int, factor: int, patch: int) -> int:
    """Latent side for `resolution` pixels (None: `native` latents) with VAE factor `factor` and transformer patch
    `patch`; the families' shared resolution check."""
    if resolution is None:
        return native
    if resolution % (factor * patch) or resolution // factor < patch:
        raise UserError(f"resolution {resolution} must be a multiple of {factor * patch}")
    return resolution // factor


def capped_tokens(requested: Optional[int], default: int, maximum: int) -> int:
    """A family's `max_sequence_length`: --max-sequence-length (None: the pipeline's `default`, capped at the
    tokenizer's `maximum`); more than `maximum` is refused, not cut silently."""
    if requested is not None and requested > maximum:
        raise UserError(f"--max-sequence-length {requested}: this model's tokenizer takes at most {maximum} tokens")
    return min(requested or default, maximum)


def vae_decode(pipe, z: torch.Tensor) -> torch.Tensor:
    """SD3's and FLUX.1's VAE un-normalisation and decode: z / scaling_factor + shift_factor."""
    vae = pipe.vae
    z = z / vae.config.scaling_factor + (getattr(vae.config, "shift_factor", None) or 0.0)
    return vae.decode(z.to(vae.dtype), return_dict=False)[0]
