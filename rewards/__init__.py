"""Reward registry: `name -> factory(device) -> fn(images [B,3,H,W] in [0,1], prompts) -> FloatTensor[B]`.

`load_rewards("shapes:1.0,jpeg_compressibility:0.1", device)` builds a weighted set. Factories import their heavy
dependencies themselves, so importing this package stays cheap.
"""

import importlib
import math
from typing import Callable, Dict, Iterable, Sequence

import torch

from common import UserError
from rewards import remote
from rewards.video import per_frame


def _lazy(module: str, name: str) -> Callable:
    def factory(device):
        return getattr(importlib.import_module(f"rewards.{module}"), name)(device)

    return factory


REWARDS: Dict[str, Callable] = {
    "shapes": _lazy("shapes", "shapes"),
    "shapes_clean": _lazy("shapes", "shapes_clean"),
    "edit": _lazy("edit", "edit"),
    "jpeg_compressibility": _lazy("jpeg", "jpeg_compressibility"),
    "jpeg_incompressibility": _lazy("jpeg", "jpeg_incompressibility"),
    "pickscore": _lazy("pickscore", "pickscore"),
    "clipscore": _lazy("clipscore", "clipscore"),
    "aesthetic": _lazy("aesthetic", "aesthetic"),
    "hpsv2": _lazy("hpsv2", "hpsv2"),
    "imagereward": _lazy("imagereward", "imagereward"),
    "ocr": _lazy("ocr", "ocr"),
    "vlm": _lazy("vlm", "vlm"),
    "hpsv3": _lazy("hpsv3", "hpsv3"),
    "geneval": _lazy("geneval", "geneval"),
    "geneval_strict": _lazy("geneval", "geneval_strict"),
}


def parse_reward_spec(spec: str) -> Dict[str, float]:
    """ "a:1.0,b:0.1" -> {"a": 1.0, "b": 0.1}; a name without weight gets 1.0. A reward server's URL stands for a name
    (`http://host:8000/ocr:0.5`; see rewards/remote.py)."""
    weights = {}
    shown = ",".join(remote.masked(part) for part in spec.split(","))  # the spec as messages may print it
    for part in spec.split(","):
        if remote.is_url(part.strip()):  # a reward server: http://host:port[/name][:weight]
            name, weight = remote.split_weight(part.strip())
        else:
            name, _, weight = part.strip().partition(":")
        if not name:
            raise UserError(f"empty reward name in {shown!r}; available: {', '.join(REWARDS)}")
        if name not in REWARDS and not remote.is_url(name):
            raise UserError(
                f"unknown reward {remote.masked(name)!r}; available: {', '.join(REWARDS)} or a server's http://HOST:PORT[/name]"
            )
        if name in weights:  # one weight per reward: a second would silently replace the first
            raise UserError(f"reward {name!r} is named twice in {shown!r}; give it one weight")
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise UserError(f"bad weight {weight!r} for reward {name!r} (expected a number, e.g. {name}:0.5)")
        if not math.isfinite(weights[name]):
            raise UserError(f"bad weight {weight!r} for reward {name!r} (expected a finite number, e.g. {name}:0.5)")
        if weights[name] == 0:  # it would be computed every batch and change nothing: leave it out instead
            raise UserError(f"bad weight {weight!r} for reward {name!r}: a zero weight trains nothing; leave the reward out")
    return weights


class MultiReward:
    """Calls each reward once per batch and checks its output; `total` is the weighted sum."""

    def __init__(self, weights: Dict[str, float], device):
        fns = {key: remote.remote(key) if remote.is_url(key) else REWARDS[key](device) for key in weights}
        # a served reward is logged under its own name, so a run through a server reports what the local run reports
        names = {key: getattr(fn, "reward_name", key) for key, fn in fns.items()}
        for key, name in names.items():
            twice = [k for k in names if names[k] == name and k != key]
            if twice:
                raise UserError(f"reward {name!r} is given twice ({key} and {twice[0]}); give each reward once")
        self.weights = {names[key]: w for key, w in weights.items()}
        self.fns = {names[key]: fn for key, fn in fns.items()}
        # every reward may run in two threads at once (common.Scorer then scores the last chunks in two threads)
        self.thread_safe = all(getattr(fn, "thread_safe", False) for fn in self.fns.values())

    def __call__(self, images: torch.Tensor, prompts) -> Dict[str, torch.Tensor]:
        out = {}
        for name, fn in self.fns.items():
            try:
                value = (per_frame(fn) if images.dim() == 5 else fn)(images, list(prompts))  # video [B, F, 3, H, W]: per frame
            except UserError:
                raise
            except Exception as e:  # one line naming the reward (a hub model, a missing file, a bug in a custom reward)
                reason = (str(e).strip().splitlines() or [""])[0][:160]
                raise UserError(f"reward {name!r} failed ({type(e).__name__}: {reason})") from e
            if not isinstance(value, torch.Tensor) or value.shape != (images.shape[0],):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise UserError(f"reward {name!r} returned {shape}, expected a tensor of shape ({images.shape[0]},)")
            if not torch.isfinite(value).all():
                raise UserError(
                    f"reward {name!r} returned NaN or inf for {int((~torch.isfinite(value)).sum())} of {len(value)} images"
                )
            out[name] = value.float().to(images.device)
        return out

    def total(self, scores: Dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(w * scores[name] for name, w in self.weights.items())

    def evaluate(self, images: torch.Tensor, prompts) -> Dict[str, torch.Tensor]:
        """Eval metrics: every reward, plus for `ocr` the word spelled exactly (`ocr_strict`) and, whenever a shapes
        reward is trained, every shapes metric whatever the training reward (the hacking-sensitive ones included):
        `shapes` (GenEval-style partial score), `shapes_strict` (all requirements met), `shapes_clean`, `shapes_exact`
        (the asked objects and nothing else), `objects` and `objects_extra` (detected and extra objects per image),
        `prompt_specific_gap` (score against the image's own prompt minus against another prompt of its category);
        whenever `edit` is trained, the edit metrics: `edit_exact` (the asked change and nothing else), `edit_asked`,
        `rest_unchanged` (every object not named kept) and `objects_extra`."""
        out = self(images, prompts)
        if {"shapes", "shapes_clean"} & set(self.weights):  # SHAPES_METRICS
            from rewards import shapes

            m = shapes.evaluate(images, list(prompts), [shapes.wrong_prompt(p) for p in prompts])
            out.update(
                {
                    "shapes": m["score"],
                    "shapes_strict": m["strict"],
                    "shapes_clean": m["clean"],
                    "shapes_exact": m["exact"],
                    "objects": m["objects"],
                    "objects_extra": m["extra"],
                    "prompt_specific_gap": m["score"] - m["wrong"],
                }
            )
        if "edit" in self.weights:  # EDIT_METRICS
            from rewards import edit

            m = edit.evaluate(images, list(prompts))
            out.update({name: m[name] for name in EDIT_METRICS})
        if "ocr" in self.weights:
            out["ocr_strict"] = (out["ocr"] == 1).float()
        return out


SHAPES_METRICS = ("shapes", "shapes_strict", "shapes_clean", "shapes_exact", "objects", "objects_extra", "prompt_specific_gap")
EDIT_METRICS = ("edit", "edit_exact", "edit_asked", "rest_unchanged", "objects_extra")


def eval_metrics(names: Iterable[str]) -> set:
    """The metrics `MultiReward.evaluate` logs for the rewards logged under `names` (a served reward's name is the
    server's, not its URL): what an --eval-rewards side metric must not log again."""
    out = set(names)
    if {"shapes", "shapes_clean"} & out:
        out.update(SHAPES_METRICS)
    if "edit" in out:
        out.update(EDIT_METRICS)
    if "ocr" in out:
        out.add("ocr_strict")
    return out


def load_rewards(spec: str, device, prompts: Sequence[str] = ()) -> MultiReward:
    """The rewards of `spec`; a reward that needs something of its prompts (ocr: a quoted text) checks `prompts` here,
    so that a wrong prompt file fails with one line before the model loads, not at the first reward call."""
    multi = MultiReward(parse_reward_spec(spec), device)
    for fn in multi.fns.values():
        if hasattr(fn, "check_prompts"):
            fn.check_prompts(prompts)
    return multi
