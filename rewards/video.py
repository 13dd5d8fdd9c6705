"""Image rewards on video: `per_frame(fn)` scores every frame of [B, F, 3, H, W] with an image reward and averages.

The mean over frames is the reduction (Flow-Factory's and DanceGRPO's video runs score frames with image models the
same way); a reward that returns per-sample details is reduced on its total only. `MultiReward` applies it to 5-D
inputs, so every image reward works on the video families (models/wan.py) unchanged."""

import torch


def per_frame(fn):
    def video_reward(videos: torch.Tensor, prompts) -> torch.Tensor:
        b, f = videos.shape[:2]
        scores = fn(videos.flatten(0, 1), [p for p in prompts for _ in range(f)])  # frame-major within each video
        return scores.view(b, f).float().mean(1)

    return video_reward
