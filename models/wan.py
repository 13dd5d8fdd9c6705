"""Wan2.1 / Wan2.2 text-to-video (WanPipeline): what differs from SD3.

Text: UMT5 embeddings cut to the prompt's true length and zero-padded to `max_sequence_length`, no mask, no pooled
vector (extra = [B, 0]). Latents are video: [C, F', h, w] with F' = (frames - 1) / temporal factor + 1, normalised by
the VAE's latents_mean/std; the transformer patchifies (1, 2, 2) and builds its 3-D rotary embedding inside.
timestep = 1000 sigma, static shift (3 at 480p, 5 at 720p), two-pass CFG (as the pipeline). `decode` returns video
[B, F, 3, H, W]; image rewards score it frame by frame (rewards/video.py). The released configs ship a UniPC
scheduler: we sample with FlowMatchEuler at its `flow_shift`. Frames per video: --num-frames, default 33 (Wan's own
is 81; 4k + 1 for the released VAE's temporal factor 4); size: WanPipeline's default 480 x 832.
Wan2.2-A14B (a second expert `transformer_2` below `boundary_ratio`): `load_pipeline` hands the sampler and the
algorithms one `Experts` module that switches between the two by timestep, as `WanPipeline.__call__` does.
Wan2.2-TI2V-5B (`expand_timesteps`): text-to-video gives every token the step's timestep (the pipeline's mask is all
ones without an image), which is the same computation as one timestep per sample, so we pass that (equal to the
pipeline on the tiny model); its own VAE (48 channels, 16x, residual) is read from its config, untested here.
"""

import copy
import json
from pathlib import Path
from typing import Optional

import torch

import common
from models import shared


def encode(pipe, prompts, device, max_sequence_length):
    e, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length, device=device
    )
    return e, e.new_zeros(e.shape[0], 0)


def max_sequence_length(pipe, requested):
    return shared.capped_tokens(requested, 512, pipe.tokenizer.model_max_length)  # WanPipeline.__call__'s default


def velocity(transformer, x, sigma, embeds, extra, neg, guidance_scale):
    dtype = common.model_dtype(transformer)
    t = sigma * 1000  # float32, bit for bit the scheduler's timesteps (sigmas * num_train_timesteps)

    def call(e):
        out = transformer(hidden_states=x.to(dtype), timestep=t, encoder_hidden_states=e.to(dtype), return_dict=False)
        return out[0].float()

    v = call(embeds)
    if guidance_scale > 1.0:  # the pipeline's do_classifier_free_guidance: the first scale decides for both experts
        assert neg is not None, "CFG needs the negative prompt embeddings"
        if isinstance(transformer, Experts):
            guidance_scale = transformer.guidance_scales(t, guidance_scale).view(-1, *[1] * (x.dim() - 1))
        v = common.cfg(call(neg[0]), v, guidance_scale)
    return v


class Experts(torch.nn.Module):
    """Wan2.2-A14B's two experts as the one transformer the sampler and the algorithms see: `transformer` (high noise)
    at timesteps t >= `boundary` (boundary_ratio x num_train_timesteps), `transformer_2` below, as
    `WanPipeline.__call__` switches them; a batch whose rows fall on both sides (training at per-sample times) is split
    by row. The low-noise expert's CFG scale is `guidance_scale_2` (None: the caller's, the pipeline's default).

    So the algorithm files need no change: `models.add_lora` gives both experts an adapter and returns one parameter
    list (named `transformer.*` and `transformer_2.*` in checkpoints), snapshots and the eval EMA cover both, and the
    reference model (`models.reference_model`) is both with their adapters off. `experts` names each for the export
    (`export.export_lora`: one diffusers LoRA file per expert, the second loaded with `load_into_transformer_2=True`)."""

    transformer_class = "WanTransformer3DModel"  # common.family_of: the family whose velocity calls this module
    _supports_gradient_checkpointing = True
    _repeated_blocks = ["WanTransformerBlock"]  # models.compile_transformer

    def __init__(self, transformer, transformer_2, boundary: float, guidance_scale_2: Optional[float] = None):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary, self.guidance_scale_2 = float(boundary), guidance_scale_2

    @property
    def experts(self) -> dict:
        """The pipeline's component name of each expert -> the expert."""
        return {"transformer": self.transformer, "transformer_2": self.transformer_2}

    @property
    def config(self):
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def guidance_scales(self, timestep: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """Each row's CFG scale: `guidance_scale` on the high-noise expert, `guidance_scale_2` on the low-noise one."""
        low = guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        return torch.where(timestep >= self.boundary, guidance_scale, low).float()

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        high = timestep >= self.boundary  # WanPipeline: `t >= boundary_timestep` -> transformer, else transformer_2
        if bool(high.all()) or not bool(high.any()):  # sampling: one expert for the whole batch, as the pipeline
            expert = self.transformer if bool(high.all()) else self.transformer_2
            return expert(
                hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False
            )
        out = None
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            v = expert(
                hidden_states=hidden_states[rows],
                timestep=timestep[rows],
                encoder_hidden_states=encoder_hidden_states[rows],
                return_dict=False,
            )[0]
            out = v.new_empty((len(high), *v.shape[1:])) if out is None else out
            out[rows] = v
        return (out,)

    def add_adapter(self, config):
        for expert in self.experts.values():
            expert.add_adapter(copy.deepcopy(config))

    def disable_adapters(self):
        for expert in self.experts.values():
            expert.disable_adapters()

    def enable_adapters(self):
        for expert in self.experts.values():
            expert.enable_adapters()

    def enable_gradient_checkpointing(self):
        for expert in self.experts.values():
            expert.enable_gradient_checkpointing()

    def compile_repeated_blocks(self, *args, **kwargs):
        for expert in self.experts.values():
            expert.compile_repeated_blocks(*args, **kwargs)


def sampled_transformer(pipe, scheduler, guidance_scale_2: Optional[float] = None):
    """The module the sampler calls: Wan2.2-A14B's `Experts`, or the one transformer (Wan2.1, Wan2.2-TI2V-5B)."""
    if pipe.config.get("boundary_ratio") is None:
        if guidance_scale_2 is not None:
            raise common.UserError(
                f"--guidance-scale-2 {guidance_scale_2}: this Wan has one expert (no boundary_ratio in model_index.json)"
            )
        return pipe.transformer  # a transformer_2 without a boundary is never called by the pipeline either
    boundary = pipe.config.boundary_ratio * scheduler.config.num_train_timesteps
    return Experts(pipe.transformer, pipe.transformer_2, boundary, guidance_scale_2)


def latent_shape(pipe, height, width, num_frames):
    factor, temporal, patch = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal, pipe.transformer.config.patch_size
    h, w = (shared.latent_side(s, 0, factor, patch[1]) for s in (height or 480, width or 832))  # WanPipeline's defaults
    if num_frames % temporal != 1 % temporal:
        raise common.UserError(f"--num-frames {num_frames} must be {temporal} k + 1 (the VAE's temporal factor {temporal})")
    return pipe.transformer.config.in_channels, (num_frames - 1) // temporal + 1, h, w


def check(config, args):
    """Wan2.2-A14B's folder holds its second expert, and only it takes --guidance-scale-2; image-to-video hub ids are
    refused by name; --num-frames against the VAE's temporal factor, from a local folder's configs before loading."""
    local = (Path(args.model).expanduser() / "model_index.json").is_file()
    name = args.model.lower()
    two_experts = config.get("boundary_ratio") is not None if local else "a14b" in name
    second = (config.get("transformer_2") or [None, None])[-1]
    if local and two_experts and second != FAMILY.transformer:
        raise common.UserError(
            f"model {args.model!r}: boundary_ratio {config['boundary_ratio']} needs a second expert transformer_2 "
            f"({FAMILY.transformer}), the folder has {second}"
        )
    if two_experts and getattr(args, "full_finetune", False):  # the export would need one transformer folder per expert
        raise common.UserError(
            f"model {args.model!r}: --full-finetune of Wan2.2-A14B's two experts is not supported; train a LoRA"
        )
    if two_experts and getattr(args, "fsdp", False):  # fully_shard_transformer shards one transformer's block lists
        raise common.UserError(f"model {args.model!r}: --fsdp of Wan2.2-A14B's two experts is not supported")
    guidance_scale_2 = getattr(args, "guidance_scale_2", None)
    if guidance_scale_2 is not None and not two_experts:
        raise common.UserError(
            f"--guidance-scale-2 {guidance_scale_2}: only Wan2.2-A14B has a second (low-noise) expert "
            f"(boundary_ratio in model_index.json)"
        )
    # HUB_NAMES maps every "wan2" hub id to WanPipeline; a folder names its class (check_model_folder)
    if not local and "i2v" in name.replace("ti2v", ""):
        raise common.UserError(
            f"model {args.model!r}: Wan's image-to-video checkpoints (WanImageToVideoPipeline) are not supported"
        )
    try:
        vae = json.loads((Path(args.model).expanduser() / "vae" / "config.json").read_text())
    except (OSError, ValueError):
        return  # a hub id: latent_shape checks it once loaded
    temporal = vae.get("scale_factor_temporal") or 2 ** sum(vae.get("temperal_downsample", []))
    if args.num_frames is not None and args.num_frames % temporal != 1 % temporal:
        raise common.UserError(
            f"--num-frames {args.num_frames} must be {temporal} k + 1 (the VAE's temporal factor {temporal})"
        )


CARD_SCHEDULER = """from diffusers import FlowMatchEulerDiscreteScheduler


class Euler(FlowMatchEulerDiscreteScheduler):  # cleanflow's grid: sigmas linspace(1, 1/N, N), then the shift
    def set_timesteps(self, num_inference_steps, device=None, **kwargs):
        super().set_timesteps(sigmas=np.linspace(1.0, 1 / num_inference_steps, num_inference_steps).tolist(), device=device)


pipe.scheduler = Euler(shift={shift})"""


def card(pipe, call, settings):
    """WanPipeline takes no sigmas: an Euler scheduler (for the released UniPC) that sets our grid; the frames; A14B's
    second guidance scale where the run set one (else the pipeline's default, the first)."""
    setup = CARD_SCHEDULER.format(shift=pipe.scheduler.config.shift).splitlines()
    call = {**call, "num_frames": str(settings["num_frames"])}
    if getattr(pipe.transformer, "guidance_scale_2", None) is not None:
        call["guidance_scale_2"] = repr(float(pipe.transformer.guidance_scale_2))
    return setup, call, "frames"


def decode(pipe, z):
    """latents * std + mean, decoded to video [B, F, 3, H, W]."""
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return vae.decode((z * std + mean).to(vae.dtype), return_dict=False)[0].transpose(1, 2)


FAMILY = common.Family(
    name="wan",
    pipelines=("WanPipeline",),
    transformer="WanTransformer3DModel",
    encode=encode,
    velocity=velocity,
    latent_shape=latent_shape,
    decode=decode,
    max_sequence_length=max_sequence_length,
    scheduler=common.euler_scheduler,
    tokens=lambda shape: shape[1] * shape[2] * shape[3] // 4,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    num_frames=33,
    card=card,
    check=check,
)
