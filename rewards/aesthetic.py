"""LAION aesthetic predictor v2 (christophschuhmann/improved-aesthetic-predictor, `sac+logos+ava1-l14-linearMSE.pth`),
the aesthetic reward of DDPO and Flow-GRPO: a linear MLP head on L2-normalised CLIP ViT-L/14 image embeddings, trained
to regress mean human ratings on a 1-10 scale (typical images score ~4-7). The score is the head's raw output, as in
both papers; the prompt is ignored.

The head weights are not a transformers model on the hub: download them from
https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac%2Blogos%2Bava1-l14-linearMSE.pth
and point $CLEANFLOW_AESTHETIC_HEAD (or `head_path`) at the file. The CLIP model and image processor are
`openai/clip-vit-large-patch14`; $CLEANFLOW_AESTHETIC_CLIP points them at a local copy.
"""

import os
from typing import Callable, Optional

import torch
from torch import nn

from common import UserError
from rewards import _clip

CLIP, CLIP_ENV = "openai/clip-vit-large-patch14", "CLEANFLOW_AESTHETIC_CLIP"
HEAD_FILE, HEAD_ENV = "sac+logos+ava1-l14-linearMSE.pth", "CLEANFLOW_AESTHETIC_HEAD"
HEAD_URL = "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac%2Blogos%2Bava1-l14-linearMSE.pth"


class AestheticMLP(nn.Module):
    """The improved-aesthetic-predictor head: five linear layers and no activations (so a linear map overall), with
    the attribute name `layers` and the dropouts in place so the released state_dict keys (layers.0, .2, .4, .6, .7)
    load as they are."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


def read_head(path: Optional[str]) -> dict:
    """The head's state_dict from `path`, or one line saying where to get the file."""
    if not path:
        raise UserError(f"the aesthetic reward needs the LAION head {HEAD_FILE}: download {HEAD_URL}, set {HEAD_ENV}")
    if not os.path.isfile(path):
        raise UserError(f"aesthetic head weights {path!r} not found: download {HEAD_URL}, set {HEAD_ENV}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle / zip errors of a file that is not a saved state_dict
        raise UserError(f"cannot read aesthetic head weights {path!r} ({_clip.first_line(e)})") from e


def build_head(state: dict, dim: int, path: str) -> AestheticMLP:
    head = AestheticMLP(dim)
    try:
        head.load_state_dict(state)
    except RuntimeError as e:  # keys or shapes of another head, or of a CLIP of another width
        raise UserError(f"aesthetic head weights {path!r} do not fit a LAION MLP on {dim}-dim CLIP embeddings") from e
    return head


def aesthetic(
    device=None, dtype: torch.dtype = torch.float32, batch_size: int = 32, head_path: Optional[str] = None
) -> Callable:
    """The `aesthetic` reward: fn(images [B, 3, H, W] float in [0, 1], prompts (unused)) -> predicted rating [B] float32
    on the images' device. CLIP runs on `device` (default: the GPU if any) in `dtype`, `batch_size` images at a time;
    the head stays float32. `head_path` defaults to $CLEANFLOW_AESTHETIC_HEAD."""
    device = _clip.pick_device(device)
    head_path = head_path or os.environ.get(HEAD_ENV)
    state = read_head(head_path)  # before CLIP, so a missing file fails fast
    preprocess = _clip.load_preprocess(CLIP_ENV, CLIP, "aesthetic CLIP image processor", device)
    model = _clip.load_clip(CLIP_ENV, CLIP, "aesthetic CLIP model", device, dtype)
    head = build_head(state, model.config.projection_dim, head_path).eval().requires_grad_(False).to(device)

    @torch.no_grad()
    def fn(images: torch.Tensor, prompts: Optional[list] = None) -> torch.Tensor:
        _clip.check_batch(images, prompts)
        return head(_clip.image_embeds(model, preprocess, images, batch_size))[:, 0].to(images.device)

    return fn
