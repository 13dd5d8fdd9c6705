"""The flags every script shares, declared once: `SharedArgs` (experiment, run folder, precision, sharding, model,
sampler, optimizer, batch), and the flag types of --help. An algorithm file declares its own flags in a dataclass of
their own and puts them first:

    @dataclass
    class Args(flags.SharedArgs, CRDArgs):   # --help: CRD's flags, then these

A dataclass lists the fields of its bases from the last base to the first, so the algorithm's come first in --help, and
every flag is read as `args.<name>` in the script and in the shared modules alike. Where a script's default or help
differs (GRPO's 40 epochs of SDE rollouts, each script's learning rate), its `Args` declares the field again.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional

import tyro

from common import REPO, TEST_PROMPTS, TINY_MODEL, TRAIN_PROMPTS

# The scripts' optional flags, labelled by their type in --help: tyro's own label ("{None}|INT") is long enough to push
# the flag onto a line of its own. `None` stays the default, and "None" on the command line still means it; --help says
# "(optional)" instead of "(default: None)", and the docstring says what the script does without the flag.
OptionalInt = Annotated[Optional[int], tyro.conf.arg(metavar="INT", help_behavior_hint="(optional)")]
OptionalFloat = Annotated[Optional[float], tyro.conf.arg(metavar="FLOAT", help_behavior_hint="(optional)")]
OptionalStr = Annotated[Optional[str], tyro.conf.arg(metavar="STR", help_behavior_hint="(optional)")]
Names = Annotated[tuple[str, ...], tyro.conf.arg(metavar="NAME ...")]
OptionalNames = Annotated[Optional[tuple[str, ...]], tyro.conf.arg(metavar="NAME ...", help_behavior_hint="(optional)")]
# --max-sequence-length INT is a column too wide
OptionalTokens = Annotated[Optional[int], tyro.conf.arg(metavar="N", help_behavior_hint="(optional)")]
# --full-finetune's default is decided from the model's size once it loads; None is not a value on the command line
AutoBool = Annotated[
    tyro.conf.DisallowNone[Optional[bool]], tyro.conf.arg(help_behavior_hint="(default: on under 50M weights)")
]
# A default inside the repository is shown relative to it: the help reads the same in every clone, and a long clone path
# does not wrap the line
RepoPath = Annotated[str, tyro.conf.arg(help_behavior_hint=lambda path: f"(default: <repo>/{Path(path).relative_to(REPO)})")]
RepoPaths = Annotated[
    tuple[str, ...],
    tyro.conf.arg(
        metavar="PATH ...",
        # tyro hands the hint the default as --help prints it: the paths joined by spaces
        help_behavior_hint=lambda label: (
            "(default: " + " ".join(f"<repo>/{Path(p).relative_to(REPO)}" for p in label.split()) + ")"
        ),
    ),
]


@dataclass
class SharedArgs:
    # Experiment: names, seeds, the run folder, evaluation, checkpoints, tracking
    exp_name: str = "cleanflow"
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, cuDNN uses deterministic kernels"""
    device: OptionalStr = None
    """torch device; default cuda:<rank> or cpu"""
    output_dir: str = "runs"
    """runs go to <output_dir>/<run_name>/"""
    resume: OptionalStr = None
    """a run folder, or its checkpoints/epoch_<E>, to continue from"""
    num_epochs: int = 60
    """epochs; one epoch = one rollout of M x K images + its updates"""
    eval_every: int = 10
    """evaluate every this many epochs"""
    eval_num_steps: OptionalInt = None
    """evaluation steps; default num_steps"""
    eval_guidance_scale: OptionalFloat = None
    """evaluation CFG; default guidance_scale"""
    eval_noises: int = 2
    """noises per held-out prompt"""
    eval_ema_decay: float = 0.0
    """decay of the evaluated weight EMA; 0 = off"""
    eval_ema_interval: int = 1
    """optimizer steps per eval EMA update"""
    eval_ema_repeats: int = 1
    """times each eval EMA update is applied"""
    save_every: int = 10
    """checkpoint every this many epochs"""
    keep_checkpoints: int = 3
    """newest checkpoints to keep (>= 1)"""
    track: bool = False
    """if toggled, mirror the logs to Weights & Biases"""
    wandb_project_name: str = "cleanflow"
    """the wandb project name"""
    wandb_entity: OptionalStr = None
    """the wandb entity (team)"""
    push_to_hub: OptionalStr = None
    """hub repo (user/name) to upload the export to"""

    # Precision, memory and sharding
    mixed_precision: bool = False
    """bf16 autocast of the transformer"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward"""
    overlap_reward: bool = True
    """score in a thread while the next samples"""
    compile: bool = False
    """torch.compile each transformer block"""
    fsdp: bool = False
    """FSDP2: shard the transformer over the ranks"""
    fsdp_cpu_offload: bool = False
    """with fsdp: keep the shards in CPU memory"""
    offload_text_encoders: bool = False
    """encode prompts once, text encoders to cpu"""
    base_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the frozen base model"""

    # Image and text
    resolution: OptionalInt = None
    """image side in pixels; default native"""
    height: OptionalInt = None
    """image height; default resolution"""
    width: OptionalInt = None
    """image width; default resolution"""
    num_frames: OptionalInt = None
    """frames per video (video models)"""
    negative_prompt: str = ""
    """the negative prompt of CFG"""
    max_sequence_length: OptionalTokens = None
    """text tokens per prompt"""

    # Model & sampler
    model: RepoPath = TINY_MODEL
    """diffusers pipeline: a folder or a hub id"""
    reward: str = "shapes_clean"
    """reward name or weighted list "name:w,name:w" (rewards/)"""
    eval_rewards: Names = ()
    """side metrics scored on the eval images only, eval/<name>"""
    train_prompts: RepoPath = TRAIN_PROMPTS
    """training prompts (.txt, or .jsonl "prompt")"""
    test_prompts: RepoPath = TEST_PROMPTS
    """held-out prompts for evaluation"""
    num_steps: int = 10
    """N, sampling steps"""
    sigma_schedule: Literal["pipeline", "scheduler"] = "pipeline"
    """shifted linspace(1, 1/N) (pipeline) or the scheduler's own"""
    guidance_scale: float = 1.0
    """CFG scale of rollout and training forward"""
    guidance_scale_2: OptionalFloat = None
    """Wan2.2-A14B: CFG of the low-noise expert; default guidance_scale"""
    dynamics: Literal["ODE", "Flow-SDE", "Dance-SDE", "CPS"] = "ODE"
    """rollout dynamics"""
    eta: float = 0.7
    """noise level of the SDE dynamics"""
    full_finetune: AutoBool = None
    """train every transformer weight (fp32), no LoRA"""
    lora_rank: int = 16
    """LoRA rank r"""
    lora_alpha: float = 32.0
    """LoRA alpha (scale alpha / r)"""
    lora_targets: OptionalNames = None
    """modules that get LoRA; default the family's"""

    # Optimizer & batch
    learning_rate: OptionalFloat = None
    """AdamW learning rate; default by what is trained (each script's LEARNING_RATES)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    num_prompts: int = 8
    """M, prompts per epoch (global)"""
    group_size: int = 8
    """K, images per prompt"""
    micro_batch: int = 16
    """per-rank micro-batch"""
    grad_steps_per_epoch: int = 2
    """optimizer steps per epoch"""

    # to be filled in runtime
    run_name: tyro.conf.Suppress[str] = ""
    """(computed in runtime)"""
    argv: tyro.conf.Suppress[tuple[str, ...]] = ()
    """the command line, filled by run.run_main: which flags were given (computed in runtime)"""
