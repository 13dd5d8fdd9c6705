"""The sampler and reward helpers the algorithm files share: prompt encoding, the velocity call, sigma schedules,
ODE/SDE steps with log-probs, the rollout and the reward scorer. Run management lives in harness/ (the held-out
evaluation in harness/evaluation.py, torchrun plumbing in harness/distributed.py), loading and LoRA in models/. No
algorithm math here: each file forms its own advantages.

Conventions: sigma = 1 is noise, 0 data; x_t = (1 - sigma) x0 + sigma eps; the model predicts v = eps - x0, so
x0_hat = x_t - sigma v; an Euler step is x_next = x + (sigma_next - sigma) v; SD3 takes timestep = 1000 sigma.
Per-step log-probs are means over latent elements (as in Flow-Factory): O(1) at any resolution, so PPO clip ranges on
exp(logp - logp_old) are small (~1e-4 .. 1e-2).
"""

import concurrent.futures
import dataclasses
import hashlib
import math
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

REPO = Path(__file__).resolve().parent
TINY_MODEL = str(REPO / "assets" / "tiny-shapes")
TRAIN_PROMPTS = str(REPO / "assets" / "train.jsonl")
TEST_PROMPTS = str(REPO / "assets" / "test.jsonl")
DYNAMICS = ("ODE", "Flow-SDE", "Dance-SDE", "CPS")


class UserError(ValueError):
    """Bad input from the user: reported as one line, without a traceback (see `run_main`)."""


def short(text: str, n: int = 80) -> str:
    """`text` quoted, cut to `n` characters for one-line error messages."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


def keyed_generator(*key) -> torch.Generator:
    """A CPU generator seeded by what its draws are for, e.g. (seed, epoch, "rollout", global sample index).

    Every random draw of a training epoch comes from such a keyed stream rather than from one stream that each rank
    consumes in its own order, so a run draws the same numbers on 1 or N ranks, and after a resume."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def keyed_generators(*key, indices: Sequence[int]) -> list:
    """One keyed generator per index: `keyed_generators(seed, epoch, "rollout", indices=idx)`."""
    return [keyed_generator(*key, int(i)) for i in indices]


def randn(shape: Sequence[int], generator) -> torch.Tensor:
    """Standard normal [B, *shape[1:]] on the CPU from one generator, or one row per generator from a list of them."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {shape[0]}")
        return torch.stack([torch.randn(tuple(shape[1:]), generator=g) for g in generator])
    return torch.randn(tuple(shape), generator=generator)


@dataclass
class Family:
    """What one model family changes in the sampler; each `models/<family>.py` fills one (common never imports models/).

    `pipe` below is the diffusers pipeline. `encode(pipe, prompts, device, max_sequence_length)` -> (embeds [B, L, D],
    extra [B, ...]), one record per prompt: `extra` is the family's second text input, CLIP's pooled vector (SD3,
    FLUX.1), a token mask (families with variable-length text) or an empty [B, 0]. `velocity(transformer, x, sigma [B],
    embeds, extra, neg, guidance_scale)` -> v = eps - x0 (fp32, x's shape), CFG included; `neg` = the negative prompt's
    (embeds, extra). `latent_shape(pipe, height, width, num_frames)` (pixels and frames, None: the model's default) ->
    what the sampler draws for one sample (the family's own layout, e.g. FLUX.2's patchified, normalised latents);
    `tokens(latent_shape)` -> image tokens (for the shift); `mu(scheduler config, tokens, num_steps)` -> the dynamic
    shift's mu; `decode(pipe, latents)` -> images in [-1, 1], [B, 3, H, W] (video: [B, F, 3, H, W]);
    `max_sequence_length(pipe, requested or None)` -> text tokens encoded;
    `load_kwargs(local folder or None)` -> extra `from_pretrained` keywords; `lora_targets`: the attention projections
    the scripts adapt when `--lora-targets` is not given (peft names: a module name or its dotted suffix; tested);
    `num_frames`: a video family's default frames per video (None: an image family); `check(config, args)`: the
    family's checks of the scripts' flags against the pipeline's model_index.json (`pipeline_config`), before loading;
    `scheduler(pipe)`: the Euler flow-matching scheduler to sample with where the pipeline ships another (Wan's UniPC);
    `encode_negative`: `encode` for the negative prompt, where the pipeline encodes it differently (Sana: no instruction);
    `text_length(pipe, prompts, max_sequence_length)` -> the text length a batch is encoded at, for families whose
    embedding of a prompt depends on the rest of its batch (CogView4: GLM sees the batch's padding, unmasked); `encode`
    then takes it as `length=` and `PromptEncoder` caches per (prompt, length). `no_cfg(pipe)` -> why the loaded
    pipeline samples without CFG (a distilled FLUX.2-klein: its pipeline ignores the scale), or None: `load_pipeline`
    marks the transformer and `velocity` refuses a scale > 1; `no_negative(pipe)` -> why the family takes no negative
    prompt (a guidance embedding, one pass), or None: `PromptEncoder` refuses one. The scripts' `check` refuses both
    before loading; these hooks make every caller of the sampler (the benchmark scripts) refuse them too.
    `encode_image(pipe, pixels [B, 3, H, W] in [-1, 1])` -> reference latents [B, ...] of an edit family (FLUX.1-Kontext),
    which `PromptEncoder` caches per image file and `velocity` then receives as `image=` (see `Prompt`); None: the
    family takes no reference image. `reference_size((width, height))` -> the (width, height) the pipeline resizes a
    reference image to before its VAE sees it (Qwen-Image-Edit: ~1024^2 pixels at the image's aspect ratio); None: the
    image as it is, which must then encode to the sampled latents' shape (FLUX.1-Kontext). `encode_records`: the text
    encoder sees the reference image too (Qwen-Image-Edit's Qwen2.5-VL), so `encode` receives the `Prompt` records
    (text and image) rather than their text, and the negative prompt is encoded on each prompt's image
    (`PromptEncoder.negative`). `check_images(prompts, (width, height) sampled, flag)`: an edit family's check of a
    prompt set's reference images before loading (its `check` runs it on the prompt files, DPO on its pairs file)."""

    name: str
    pipelines: tuple
    transformer: str
    encode: Callable
    velocity: Callable
    latent_shape: Callable
    decode: Callable
    max_sequence_length: Callable
    tokens: Callable = lambda shape: 0
    mu: Optional[Callable] = None
    load_kwargs: Callable = lambda local: {}
    lora_targets: tuple = ("to_q", "to_k", "to_v", "to_out.0")
    scheduler: Optional[Callable] = None  # (pipe) -> the flow-matching scheduler to sample with, if not the pipeline's
    encode_negative: Optional[Callable] = None  # like `encode`, for the negative prompt where the pipeline encodes it apart
    text_length: Optional[Callable] = None  # (pipe, prompts, max_sequence_length) -> a batch's text length (see above)
    card: Optional[Callable] = None  # (Model, call, settings) -> (setup lines, call, output): see `card_call`
    num_frames: Optional[int] = None  # video families: frames per video by default
    check: Optional[Callable] = None  # (model_index.json as a dict, args) -> None, raises UserError
    no_cfg: Optional[Callable] = None  # (pipe) -> why it samples without CFG, or None (see above)
    no_negative: Optional[Callable] = None  # (pipe) -> why it takes no negative prompt, or None (see above)
    encode_image: Optional[Callable] = None  # (pipe, pixels) -> reference latents: an edit family (see above)
    reference_size: Optional[Callable] = None  # ((width, height)) -> the size a reference image is resized to (above)
    encode_records: bool = False  # `encode` takes the `Prompt` records: the text encoder sees the image (see above)
    check_images: Optional[Callable] = None  # (prompts, (width, height), flag) -> None, raises UserError (see above)


FAMILIES: dict = {}  # pipeline class name -> Family, filled by `import models` (register); common never imports models/


def register(family: Family):
    for name in family.pipelines:
        FAMILIES[name] = family


def family_of(transformer) -> Family:
    """The family of `transformer`'s class (LoRA keeps it; FSDP subclasses it; Wan2.2's Experts name it), or the one
    `load_pipeline` marked it with (`cleanflow_family`), where two families share a class (FLUX.1 and FLUX.1-Kontext)."""
    marked = getattr(transformer, "cleanflow_family", None)  # a family's name (a string: copies and pickles keep it)
    for family in (f for f in FAMILIES.values() if marked is not None and f.name == marked):
        return family
    name = getattr(transformer, "transformer_class", None) or type(transformer).__name__
    bases = {name} | {cls.__name__ for cls in type(transformer).__mro__}
    for family in (f for f in FAMILIES.values() if f.transformer in bases):
        return family
    raise UserError(
        f"no model family for {name}; `import models` registers them ({', '.join(sorted(FAMILIES)) or 'none yet'})"
    )


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast for forwards (trainable weights stay fp32); a no-op context when disabled."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


# ----------------------------------------------------------------------------------------------------------------
# text, velocity, decode
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cond:
    """The conditioning of a batch, as `PromptEncoder.cond` returns it: the prompts' token embeddings and the family's
    second text input (`pooled`, see `PromptEncoder`), the same two of the negative prompt for CFG (None when no CFG is
    needed), and for prompts with a reference image (`Prompt`) its VAE latents `image` [B, ...] (None for text-only
    prompts; an edit family's velocity takes it, `Family.encode_image`). `cond[i]` (an index, slice or index tensor)
    takes those samples of every field."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    neg_embeds: Optional[torch.Tensor] = None
    neg_pooled: Optional[torch.Tensor] = None
    image: Optional[torch.Tensor] = None

    def __getitem__(self, idx) -> "Cond":
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Cond(*(None if t is None else t[idx] for t in fields))

    @property
    def neg(self) -> Optional[tuple]:
        """The negative prompt's (embeds, pooled), the form the model families take; None without one."""
        return None if self.neg_embeds is None else (self.neg_embeds, self.neg_pooled)


class PromptEncoder:
    """Encodes prompts once and caches (embeds, extra) per prompt: the token embeddings and the family's second text
    input (`Family`: SD3's pooled projections, FLUX.1's CLIP pooled output, or a token mask). `max_sequence_length`:
    text tokens (default: the family's); `cache_device`: where the cache lives ("cpu" for large prompt sets)."""

    def __init__(self, pipe, max_sequence_length: Optional[int] = None, negative_prompt: str = "", cache_device=None):
        self.pipe, self.family = pipe.pipe, pipe.family
        reason = self.family.no_negative(self.pipe) if negative_prompt and self.family.no_negative else None
        if reason:  # the sampler would drop it without a word
            raise UserError(f"negative prompt {short(negative_prompt)}: {reason}")
        self.max_sequence_length = self.family.max_sequence_length(self.pipe, max_sequence_length)
        self.negative_prompt = negative_prompt
        self.device = pipe.transformer.device
        self.latent_shape = getattr(pipe, "latent_shape", None)  # a reference image's latents must have it
        self.cache_device = torch.device(cache_device) if cache_device is not None else self.device
        self.cache = {}

    def text_encoders(self) -> list:
        return [m for n, m in sorted(self.pipe.components.items()) if n.startswith("text_encoder") and m is not None]

    @torch.no_grad()
    def _encode(self, prompts: Sequence[str], length: Optional[int] = None):
        """Encode `prompts` as one batch into the cache (at text `length`, cached per (prompt, length), if given)."""
        # encode where the text encoders are (the CPU after `offload`), so pass their device, not the pipeline's
        device = self.text_encoders()[0].device
        kwargs = {} if length is None else {"length": length}
        # a list of its own (Z-Image edits it): a `Prompt`'s instruction, or the records where the text encoder sees
        # the image too (`Family.encode_records`)
        texts = list(prompts) if self.family.encode_records else [prompt_text(p) for p in prompts]
        e, p = self.family.encode(self.pipe, texts, device, self.max_sequence_length, **kwargs)
        for i, prompt in enumerate(prompts):
            self.cache[prompt if length is None else (prompt, length)] = (
                e[i].to(self.cache_device),
                p[i].to(self.cache_device),
            )

    def __call__(self, prompts: Sequence[str]):
        # a prompt not cached is encoded alone: the text encoders' output depends (~1e-6) on the batch it is computed in,
        # so batching the prompts that happen to be new would make an embedding depend on the run's history and a
        # resumed run (empty cache) drift from the uninterrupted one. Alone costs ~4 ms/prompt on tiny-text (CPU).
        texts = [prompt_text(p) for p in prompts]
        length = self.family.text_length(self.pipe, texts, self.max_sequence_length) if self.family.text_length else None
        keys = list(prompts) if length is None else [(p, length) for p in prompts]
        for key in dict.fromkeys(k for k in keys if k not in self.cache):
            self._encode([key if length is None else key[0]], length)
        embeds = pad_stack([self.cache[k][0] for k in keys]).to(self.device)
        extra = pad_stack([self.cache[k][1] for k in keys]).to(self.device)
        return embeds, extra

    def cond(self, prompts: Sequence[str], negative: bool = True) -> Cond:
        """The prompts' `Cond`, with the negative prompt repeated for each (for CFG) unless `negative` is False, and
        their reference images' latents (`images`) when they have images."""
        embeds, pooled = self(prompts)
        neg = self.negative(len(prompts), prompts) if negative else (None, None)
        return Cond(embeds, pooled, *neg, image=self.images(prompts))

    def images(self, prompts: Sequence[str]) -> Optional[torch.Tensor]:
        """The reference latents [B, ...] of `prompts` (`Prompt` records), or None when they are text only. Each image
        file is read (`Prompt.pixels`) and encoded by the family's VAE (`Family.encode_image`) once, alone (as each
        prompt's text: its latents do not depend on the batch it came in), and cached by its file, beside the text.
        A family with a `reference_size` resizes each image to it first (as its pipeline does); a batch's images must
        then resize to one size, their latents being stacked."""
        records = [p for p in prompts if _has_image(p)]
        if not records:
            return None
        if len(records) < len(prompts):  # load_prompts makes a file all one or the other
            raise UserError("a batch mixes prompts with and without a reference image")
        if self.family.encode_image is None:  # the scripts refuse it before loading (run.check_args)
            raise UserError(f"prompt {short(records[0])}: {type(self.pipe).__name__} takes no reference image")
        for record in records:
            key = ("image", record.image)
            if key in self.cache:
                continue
            size = self.family.reference_size(record.size) if self.family.reference_size else None
            with torch.no_grad():
                z = self.family.encode_image(self.pipe, record.pixels(size).to(self.pipe.vae.device))[0]
            if size is None and self.latent_shape is not None and tuple(z.shape) != tuple(self.latent_shape):
                raise UserError(
                    f"prompt {short(record)}: its image ({record.size[0]} x {record.size[1]} pixels) encodes to latents "
                    f"{tuple(z.shape)}, not the {tuple(self.latent_shape)} the model samples: give images of the "
                    "training size (--resolution, --height, --width)"
                )
            self.cache[key] = z.to(self.cache_device)
        latents = [self.cache[("image", r.image)] for r in records]
        for record, z in zip(records, latents):
            if z.shape != latents[0].shape:  # a `reference_size` family's check refuses it before loading
                raise UserError(
                    f"prompt {short(record)}: its reference latents {tuple(z.shape)} differ from those of "
                    f"{short(records[0])} {tuple(latents[0].shape)} in one batch: give images of one aspect ratio"
                )
        return torch.stack(latents).to(self.device)

    def negative(self, batch: int, prompts: Optional[Sequence[str]] = None):
        """The negative prompt's (embeds, extra), repeated `batch` times. Where the text encoder sees the reference
        image (`Family.encode_records`) and `prompts` carry images, the negative prompt on each prompt's image instead
        (`Prompt.with_text`), encoded and cached once per image like a prompt."""
        if self.family.encode_records and prompts is not None and _has_image(prompts[0]):
            return self([p.with_text(self.negative_prompt) for p in prompts])
        if self.family.encode_negative is None:
            e, p = self([self.negative_prompt])
        else:  # encoded the family's own way, cached apart from the same text as a prompt
            key = ("negative", self.negative_prompt)
            if key not in self.cache:
                with torch.no_grad():
                    e, p = self.family.encode_negative(
                        self.pipe, [self.negative_prompt], self.text_encoders()[0].device, self.max_sequence_length
                    )
                self.cache[key] = (e[0].to(self.cache_device), p[0].to(self.cache_device))
            e, p = (t[None].to(self.device) for t in self.cache[key])
        return e.expand(batch, *e.shape[1:]), p.expand(batch, *p.shape[1:])

    def precompute(self, prompts: Sequence[str], batch: int = 64):
        """Cache every prompt and the negative prompt now, `batch` at a time (before `offload`). Batched embeddings differ
        from one-by-one ones by ~1e-6, so a run keeps its `--offload-text-encoders` on resume."""
        if self.family.encode_records:  # the negative prompt on each image (`negative`), and no image-less one
            records = [p for p in prompts if _has_image(p)]
            prompts = [*dict.fromkeys(p.with_text(self.negative_prompt) for p in records), *dict.fromkeys(prompts)]
        else:
            prompts = [self.negative_prompt, *dict.fromkeys(prompts)]
        if self.family.text_length is not None:  # a batch's embeddings depend on it: each prompt alone, at its own length
            for prompt in prompts:
                self([prompt])
            return
        for k in range(0, len(prompts), batch):  # fixed chunks of a fixed list: the same embeddings in every run and resume
            self._encode(prompts[k : k + batch])
        if self.family.encode_negative is not None:  # the negative prompt encoded the family's own way, cached too
            self.negative(1)

    def offload(self):
        """Move the text encoders to the CPU (T5-XXL: ~9 GB in bf16) after `precompute`; uncached prompts still work."""
        for m in self.text_encoders():
            m.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _has_image(prompt: str) -> bool:
    """Whether `prompt` is a `prompt_files.Prompt` record (a prompt with a reference image). Known by its attribute:
    prompt_files imports common (`UserError`), so common imports nothing of it (no import cycle)."""
    return hasattr(prompt, "image")


def prompt_text(prompt: str) -> str:
    """What the text encoder sees: a `prompt_files.Prompt` record's instruction, or the prompt itself."""
    return prompt.text if _has_image(prompt) else prompt


def pad_stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack per-prompt tensors, zero-padding dim 0 (text tokens) to the longest: a no-op for fixed-length families;
    for variable-length ones the padded tokens are masked out by the mask in `extra`, padded the same way."""
    n = max(t.shape[0] for t in tensors)
    return torch.stack([t if t.shape[0] == n else torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])]) for t in tensors])


def cfg(v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance: v_uncond + g (v_cond - v_uncond)."""
    return v_uncond + guidance_scale * (v_cond - v_uncond)


_DTYPES = weakref.WeakKeyDictionary()  # transformer -> its compute dtype (see `model_dtype`)


def model_dtype(transformer) -> torch.dtype:
    """`transformer.dtype`, read once per model: diffusers' property walks every submodule and parameter on each read
    (~1 ms on the tiny model with LoRA, ~2% of a sampling step). The base dtype is fixed when `load_pipeline` loads the
    model, so the first answer stays right; a model cast to another dtype afterwards needs `_DTYPES.pop(transformer)`."""
    if transformer not in _DTYPES:
        _DTYPES[transformer] = transformer.dtype
    return _DTYPES[transformer]


def velocity(transformer, x, sigma, cond: Cond, guidance_scale: float = 1.0) -> torch.Tensor:
    """One transformer call v(x, sigma | text) on latents x in the family's layout (`Model.latent_shape`, batched).
    Returns fp32 like x. `cond` is the batch's text (`Cond`); its negative prompt is used for CFG (scale > 1); the
    family's own guidance mode applies (see models/<family>.py); its reference latents, if any, go to the family as
    `image=`."""
    if guidance_scale > 1 and getattr(transformer, "cfg_refused", None):  # a distilled FLUX.2-klein (`Family.no_cfg`)
        raise UserError(f"guidance scale {guidance_scale}: {transformer.cfg_refused}")
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0])
    image = {} if cond.image is None else {"image": cond.image}  # only an edit family takes one (`Family.encode_image`)
    return family_of(transformer).velocity(transformer, x, sigma, cond.embeds, cond.pooled, cond.neg, guidance_scale, **image)


@torch.no_grad()
def decode(pipe, latents: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Latents -> images in [0, 1], float32 [B, 3, H, W] (video: [B, F, 3, H, W]); decoded in chunks to bound memory."""
    out = [pipe.family.decode(pipe.pipe, z).float() for z in latents.split(chunk)]
    return (torch.cat(out) / 2 + 0.5).clamp(0, 1)


def euler_scheduler(pipe):
    """`Family.scheduler` for pipelines released with a multistep flow solver (Wan's UniPC, Sana's DPM-Solver): the
    Euler flow-matching scheduler at the same static `flow_shift`, which the sampler's SDE steps need."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
        return pipe.scheduler
    return FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.get("flow_shift", 3.0))


def linear_mu(config, tokens: int, num_steps: int) -> float:
    """FLUX.1's dynamic shift (FluxPipeline's `calculate_shift`): mu linear in the image's token count, 0.5 at 256
    tokens (512 px), 1.15 at 4096 (1024 px), from the scheduler config's base/max values."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(
        tokens,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def mu_for(family: Family, scheduler, latent_shape, num_steps: int) -> Optional[float]:
    """The dynamic shift's mu for one sample of `latent_shape`, or None for a scheduler with a static shift."""
    if not scheduler.config.get("use_dynamic_shifting", False):
        return None
    return (family.mu or linear_mu)(scheduler.config, family.tokens(tuple(latent_shape)), num_steps)


# ----------------------------------------------------------------------------------------------------------------
# the sampler
# ----------------------------------------------------------------------------------------------------------------
SIGMA_SCHEDULES = ("pipeline", "scheduler")


def sigma_schedule(
    scheduler, num_steps: int, device=None, mu: Optional[float] = None, schedule: str = "pipeline"
) -> torch.Tensor:
    """N+1 sigmas ending in 0. `schedule` "pipeline": linspace(1, 1/N, N) through the scheduler's shift (what the
    FLUX.1/FLUX.2/Qwen-Image/Lumina 2 pipelines pass, and Flow-Factory). "scheduler": the scheduler's own
    `set_timesteps(N)` (what StableDiffusion3Pipeline does with no sigmas, and flow_grpo, DiffusionNFT and AWM, which
    pass `sigmas=None`): linspace from sigma 1 to the shifted 1/1000, then the shift again. At 10 steps with shift 3
    that is 1, 0.960, ..., 0.278, 0.009, 0 against 1, 0.964, ..., 0.429, 0.250, 0, so its last step starts almost at
    the data.

    SD3 has a fixed shift. Schedulers with `use_dynamic_shifting` (FLUX.1, FLUX.2, Qwen-Image) shift by exp(mu), and the
    family computes mu from the image's token count (`mu_for`; `Model.sigmas` passes it for the run's resolution)."""
    import copy

    kwargs = {}
    if scheduler.config.get("use_dynamic_shifting", False):
        if mu is None:
            raise ValueError("a dynamically shifted schedule needs mu (common.mu_for); Model.sigmas passes it")
        kwargs["mu"] = mu
    if schedule not in SIGMA_SCHEDULES:
        raise UserError(f"unknown sigma schedule {schedule!r}; choose one of {', '.join(SIGMA_SCHEDULES)}")
    sched = copy.deepcopy(scheduler)  # set_timesteps mutates the scheduler; keep the pipeline's untouched
    if schedule == "scheduler":
        sched.set_timesteps(num_steps, device=device, **kwargs)
    else:
        sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps).tolist(), device=device, **kwargs)
    return sched.sigmas.float()


LOG_PROB_FORMS = ("gaussian", "mse")


def sde_step(
    x,
    v,
    sigma,
    sigma_next,
    dynamics: str,
    eta: float,
    noise=None,
    x_next=None,
    sigma_cap: Optional[float] = None,
    log_prob_form: str = "gaussian",
):
    """One step of the reverse process as a Gaussian policy N(mean, std^2 I): (x_next, log_prob [B], mean, std).
    If `x_next` is given (training), it is scored instead of sampled.
    ODE and eta = 0 give the Euler step with std 0 and log_prob 0; so does every row whose std is 0 (e.g. a
    per-sample sigma_next = 0 under CPS) while the other rows keep theirs.
    `sigma_cap` guards Flow-SDE's 1/(1 - sigma) at sigma = 1: None uses sigma_next there, flow_grpo's and
    Flow-Factory's `sigma_max = sigmas[1]`; a float clamps sigma to it (0.99: 1.89x that std on SD3.5 at 10 steps).
    `log_prob_form`: "gaussian", the exact log-density (per-element mean); "mse", the CPS authors' surrogate
    -mean (x_next - mean)^2 (also Flow-Factory's for CPS), whose log-ratios are those of "gaussian" times 2 std^2.
    """
    if log_prob_form not in LOG_PROB_FORMS:
        raise UserError(f"unknown log_prob_form {log_prob_form!r}; choose one of {', '.join(LOG_PROB_FORMS)}")
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=x.device)
    if sigma.dim() == 1:  # per-sample sigmas broadcast over the latent dims
        sigma, sigma_next = (s.view(-1, *([1] * (x.dim() - 1))) for s in (sigma, sigma_next))
    dt = sigma_next - sigma  # < 0
    x0_hat, eps_hat = x - sigma * v, x + (1 - sigma) * v
    if dynamics == "ODE" or eta == 0:
        mean, std = x + dt * v, torch.zeros_like(sigma)
    elif dynamics == "Flow-SDE":  # Flow-GRPO's SDE, sigma_t = eta sqrt(sigma / (1 - sigma))
        capped = torch.where(sigma >= 1, sigma_next, sigma) if sigma_cap is None else torch.clamp(sigma, max=sigma_cap)
        std_dev = eta * torch.sqrt(sigma / (1 - capped))
        mean = x + (v + std_dev**2 / (2 * sigma) * eps_hat) * dt
        std = std_dev * torch.sqrt(-dt)
    elif dynamics == "Dance-SDE":  # DanceGRPO: constant diffusion coefficient eta
        mean = x + (v + 0.5 * eta**2 * eps_hat / sigma) * dt
        std = eta * torch.sqrt(-dt) * torch.ones_like(sigma)
    elif dynamics == "CPS":  # coefficients-preserving sampling: re-noise x0_hat to sigma_next with a fresh-noise share
        std = sigma_next * math.sin(eta * math.pi / 2)
        mean = (1 - sigma_next) * x0_hat + torch.sqrt(sigma_next**2 - std**2) * eps_hat
    else:
        raise UserError(f"unknown dynamics {dynamics!r}; choose one of {', '.join(DYNAMICS)}")
    if x_next is None:
        x_next = mean if noise is None or not bool((std > 0).any()) else mean + std * noise
    live = (std > 0).reshape(-1).expand(x.shape[0]) if std.numel() == 1 else (std > 0).reshape(x.shape[0])  # [B]
    if not bool(live.any()):
        return x_next, torch.zeros(x.shape[0], device=x.device), mean, std
    dims = tuple(range(1, x.dim()))
    if log_prob_form == "mse":
        log_prob = -((x_next - mean) ** 2).mean(dim=dims)
    else:
        safe = torch.where(std > 0, std, torch.ones_like(std))  # no 0/0 in the rows masked below
        log_prob = (-((x_next - mean) ** 2) / (2 * safe**2) - torch.log(safe) - 0.5 * math.log(2 * math.pi)).mean(dim=dims)
    return x_next, torch.where(live, log_prob, torch.zeros_like(log_prob)), mean, std


@dataclass
class Rollout:
    latents: torch.Tensor  # [B, C, h, w] final clean latents x0
    sigmas: torch.Tensor  # [N + 1]
    trajectory: Optional[torch.Tensor] = None  # [B, N + 1, C, h, w]; position 0 is the initial noise
    log_probs: Optional[torch.Tensor] = None  # [B, N]; 0 at deterministic steps
    sde_mask: Optional[torch.Tensor] = None  # [N] bool, which steps were stochastic
    means: Optional[torch.Tensor] = None  # [B, N, C, h, w] the Gaussian steps' means (keep_means; GRPO-Guard)


@torch.no_grad()
def sample(
    transformer,
    scheduler,
    cond: Cond,
    *,
    num_steps: int = 10,
    guidance_scale: float = 1.0,
    dynamics: str = "ODE",
    eta: float = 0.7,
    sde_steps: Optional[Sequence[int]] = None,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
    keep_trajectory: bool = False,
    latent_shape: Optional[Sequence[int]] = None,
    use_autocast: bool = False,
    log_prob_form: str = "gaussian",
    keep_means: bool = False,
    chunk: Optional[int] = None,
    on_chunk: Optional[Callable] = None,
    schedule: str = "pipeline",
) -> Rollout:
    """Euler sampling from sigma = 1 to 0 with optional SDE steps (`sde_steps`: the window; None = all but the last),
    deterministic given `generator` (drawn on the CPU, so any device gives the same samples; one generator per sample,
    `keyed_generators`, makes each sample's noise its own). `chunk`: sample this many at a time, calling
    `on_chunk(latents, slice)` after each (a `Scorer`). `keep_means`: every step's mean too (GRPO-Guard).
    """
    if dynamics not in DYNAMICS:
        raise UserError(f"unknown dynamics {dynamics!r}; choose one of {', '.join(DYNAMICS)}")
    device, batch = cond.embeds.device, cond.embeds.shape[0]
    if chunk is not None or on_chunk is not None:
        step = chunk or batch
        if step < batch and generator is not None and not isinstance(generator, (list, tuple)):
            raise ValueError("chunked sampling needs one generator per sample (keyed_generators): one stream would be cut")
        kwargs = dict(
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            dynamics=dynamics,
            eta=eta,
            sde_steps=sde_steps,
            keep_trajectory=keep_trajectory,
            latent_shape=latent_shape,
            use_autocast=use_autocast,
            log_prob_form=log_prob_form,
            keep_means=keep_means,
            schedule=schedule,
        )
        parts = []
        for start in range(0, batch, step):
            sl = slice(start, start + step)
            parts.append(
                sample(
                    transformer,
                    scheduler,
                    cond[sl],
                    generator=_rows(generator, sl),
                    noise=_rows(noise, sl),
                    **kwargs,
                )
            )
            if on_chunk is not None:
                on_chunk(parts[-1].latents, sl)
        return Rollout(
            **{
                f.name: getattr(parts[0], f.name)
                if f.name in ("sigmas", "sde_mask")
                else _cat([getattr(r, f.name) for r in parts])
                for f in dataclasses.fields(Rollout)
            }
        )
    if noise is None:
        shape = latent_shape or (
            transformer.config.in_channels,
            transformer.config.sample_size,
            transformer.config.sample_size,
        )
        noise = randn((batch, *shape), generator)
    x = noise.to(device=device, dtype=torch.float32)
    # a dynamic shift depends on the image's token count: take it from the latents actually sampled
    mu = mu_for(family_of(transformer), scheduler, x.shape[1:], num_steps)
    sigmas = sigma_schedule(scheduler, num_steps, device, mu, schedule)
    if dynamics == "ODE":
        sde_steps = []
    elif sde_steps is None:
        sde_steps = range(num_steps - 1)
    sde_mask = torch.zeros(num_steps, dtype=torch.bool)
    sde_mask[list(sde_steps)] = True
    traj, log_probs, means = [x], torch.zeros(batch, num_steps, device=device), []
    for i in range(num_steps):
        with autocast(device, use_autocast):
            v = velocity(transformer, x, sigmas[i], cond, guidance_scale)
        step_noise = randn(x.shape, generator).to(device) if sde_mask[i] else None
        x, log_probs[:, i], mean, _ = sde_step(
            x,
            v,
            sigmas[i],
            sigmas[i + 1],
            dynamics if sde_mask[i] else "ODE",
            eta,
            step_noise,
            sigma_cap=float(sigmas[1]),
            log_prob_form=log_prob_form,
        )
        if keep_trajectory:
            traj.append(x)
        if keep_means:
            means.append(mean)
    return Rollout(
        x,
        sigmas,
        torch.stack(traj, 1) if keep_trajectory else None,
        log_probs,
        sde_mask,
        torch.stack(means, 1) if keep_means else None,
    )


def _rows(value, sl: slice):
    """Rows `sl` of a batched input: a tensor, a list (of generators), a tuple of them (a negative prompt), or None."""
    if value is None or isinstance(value, torch.Generator):
        return value
    if isinstance(value, tuple):
        return tuple(_rows(v, sl) for v in value)
    return value[sl]


def _cat(values: list):
    return None if values[0] is None else torch.cat(values)


class Scorer:
    """Decodes and scores a rollout chunk by chunk in a worker thread while `sample` draws the next chunk
    (ddpo-pytorch's executor): `sample(..., chunk=scorer.chunk, on_chunk=scorer)`, then `images, scores = scorer.result()`.

    `overlap` False (--no-overlap-reward): no thread; `result()` scores the same chunks after sampling. Both paths call
    the transformer, VAE and reward on identical chunks, so they agree bit for bit on any CPU (a kernel may round
    differently for another batch size: 2.3e-6 on an AVX-512 Intel CPU when the chunks differed). Once sampling is
    over, a reward marked `thread_safe` also scores the last waiting chunks in the main thread (OCR's slow tail uses
    both cores). A reward error is raised in the caller, at the next chunk or at `result()`."""

    def __init__(
        self,
        pipe,
        reward_fn: Callable,
        prompts: Sequence[str],
        chunk: Optional[int] = None,
        overlap: bool = True,
        epoch: Optional[int] = None,
    ):
        self.pipe, self.reward_fn, self.prompts, self.chunk = pipe, reward_fn, list(prompts), chunk
        self.epoch = epoch  # epochs done before this rollout: a reward error names the epoch and how to go on
        self.pool = (
            None if chunk is None or not overlap else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward")
        )
        self.chunks, self.jobs = [], []  # the (latents, slice) of each chunk; with overlap, its future
        self.vae_lock = threading.Lock()  # the main thread may decode beside the worker once sampling is over (result)
        self.seconds = []  # time of each decode and reward call, in either thread (list.append is atomic)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        # one decode at a time: some VAEs keep state across a call (Wan's causal feature cache); grad mode is per thread
        with self.vae_lock, torch.no_grad():
            images = decode(self.pipe, latents)
        self.seconds.append(time.perf_counter() - t0)
        return images

    def _reward(self, images: torch.Tensor, sl: slice) -> tuple:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                scores = self.reward_fn(images, self.prompts[sl])
        except UserError as e:
            if self.epoch is None:
                raise
            err = UserError(f"{e} in epoch {self.epoch + 1}")
            err.resumable = True  # `run_main` adds where the run goes on from
            raise err from None
        self.seconds.append(time.perf_counter() - t0)
        return images, scores

    def _score(self, latents: torch.Tensor, sl: slice) -> tuple:
        return self._reward(self._decode(latents), sl)

    def __call__(self, latents: torch.Tensor, sl: slice):
        self.chunks.append((latents, sl))
        if self.pool is None:
            return
        failed = next((job for job in self.jobs if job.done() and job.exception() is not None), None)
        if failed is not None:  # stop sampling at once when the reward failed
            self.pool.shutdown(cancel_futures=True)
            raise failed.exception()
        self.jobs.append(self.pool.submit(self._score, *self.chunks[-1]))

    def result(self) -> tuple:
        """(images [B, 3, H, W] in [0, 1], {reward name: [B]}) of every chunk, in sample order."""
        try:
            if self.pool is None:
                parts = [self._score(*chunk) for chunk in self.chunks]
            else:
                # sampling is over and the main thread would only wait: it decodes the chunks the worker has not
                # started, and the worker scores them, in order (when the reward is slower than sampling, e.g. OCR)
                waiting = [k for k, job in enumerate(self.jobs) if job.cancel()]
                # a reward that may run in two threads at once (`thread_safe`, e.g. OCR): the main thread scores the
                # last half of the waiting chunks itself (the last one when one waits), beside the worker, which still
                # finishes the chunk it is on; each chunk's numbers are the same in either thread
                mine = waiting[len(waiting) // 2 :] if getattr(self.reward_fn, "thread_safe", False) else []
                for k in waiting:
                    if k not in mine:
                        latents, sl = self.chunks[k]
                        self.jobs[k] = self.pool.submit(self._reward, self._decode(latents), sl)
                for k in mine:
                    self.jobs[k] = self._score(*self.chunks[k])
                parts = [job if isinstance(job, tuple) else job.result() for job in self.jobs]
        finally:
            if self.pool is not None:
                self.pool.shutdown(cancel_futures=True)
        if len(parts) == 1:
            return parts[0]
        images = torch.cat([p[0] for p in parts])
        return images, {name: torch.cat([p[1][name] for p in parts]) for name in parts[0][1]}


# ----------------------------------------------------------------------------------------------------------------
# prompts, groups, timesteps
# ----------------------------------------------------------------------------------------------------------------
def group_prompts(prompts: Sequence[str], num_prompts: int, group_size: int, generator: torch.Generator) -> list:
    """`num_prompts` prompts drawn without replacement (cycling when the set is smaller), each repeated K times,
    contiguously: [p0]*K + [p1]*K + ... so sample i belongs to group i // K."""
    idx = []
    while len(idx) < num_prompts:
        idx += torch.randperm(len(prompts), generator=generator).tolist()
    return [prompts[i] for i in idx[:num_prompts] for _ in range(group_size)]


def stratified_indices(num_indices: int, count: int, generator: torch.Generator) -> list:
    """`count` step indices in [0, num_indices), one per equal-width stratum, each index reachable (Flow-Factory's
    sampler never draws the last one). With count >= num_indices every index appears at least once."""
    edges = torch.linspace(0, num_indices, count + 1)
    u = torch.rand(count, generator=generator)
    idx = (edges[:-1] + u * (edges[1:] - edges[:-1])).floor().long().clamp(max=num_indices - 1)
    return idx.tolist()
