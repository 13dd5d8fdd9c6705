"""GenEval (Ghosh et al. 2023, "GenEval: An Object-Focused Framework for Evaluating Text-to-Image Alignment",
arXiv:2310.11513) on real images without mmdet/mmcv, whose installs break (djghosh13/geneval #6, #8, #12).

What is GenEval's (djghosh13/geneval@main, evaluation/evaluate_images.py and summary_scores.py), rewritten here:
a detection counts when its score is > 0.3 (> 0.9 for counting prompts), at most 16 per class, most confident first,
no NMS (its default max_overlap=1.0); an `include` clause needs `count` objects of the class, of which the `count` most
confident must have the asked colour (CLIP ViT-L/14 zero-shot over 10 colours, 3 templates, on the crop of the box with
the pixels outside the mask set to grey #999) and, for position, lie in the asked direction of every object of the
target clause (`relative_position`, threshold 0.1); an `exclude` clause fails when `count` or more are found. An image is
correct when every clause holds; a tag's score is the mean over its images and the overall score the mean over tags.

What differs: the detector is transformers' Mask2Former (default the Swin-S COCO-instance checkpoint, the architecture
GenEval loads through mmdet, but Meta's weights rather than mmdet's own training run), post-processed here as mmdet's
Mask2Former head does (top-100 (query, class) pairs, score = class probability x mean mask probability inside the mask,
box = the mask's extent); images are resized as mmdet's test pipeline does (shorter side 800, longer at most 1333),
on tensors (bilinear, antialiased) instead of by mmcv; only the normalisation and padding come from the hub processor.
Scores are therefore close to, not equal to, the mmdet original (see the README). `geneval_strict` is GenEval's own
all-or-nothing `correct`; `geneval`, the training reward, is the fraction of the prompt's clauses met (our choice: a
denser signal than 0/1, equal to it when every clause holds).

Prompts are parsed back into GenEval's metadata (`parse_prompt`: its prompt grammar, prompts/create_prompts.py), so the
reward needs only the prompt text. $CLEANFLOW_GENEVAL_DETECTOR and $CLEANFLOW_GENEVAL_CLIP point the two models at local
copies (or another Mask2Former COCO-instance checkpoint).
"""

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from common import UserError, short
from rewards import _clip

DETECTOR, DETECTOR_ENV = "facebook/mask2former-swin-small-coco-instance", "CLEANFLOW_GENEVAL_DETECTOR"
CLIP, CLIP_ENV = "openai/clip-vit-large-patch14", "CLEANFLOW_GENEVAL_CLIP"
THRESHOLD = 0.3  # GenEval's --options threshold
COUNTING_THRESHOLD = 0.9  # counting prompts: a stricter detector score, so that near-duplicates do not count twice
MAX_OBJECTS = 16  # detections kept per class
POSITION_THRESHOLD = 0.1  # share of the two boxes' summed size that an offset must exceed to count as a direction
MAX_PER_IMAGE = 100  # mmdet Mask2Former test_cfg.max_per_image: (query, class) pairs kept before the threshold
SHORT_EDGE, LONG_EDGE = 800, 1333  # mmdet's (and Detectron2's) COCO test resize; the hub processors say 384 or 800
BACKGROUND = 0x99 / 255  # GenEval's bgcolor "#999": pixels outside the object's mask in the colour crop

COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
COLOR_TEMPLATES = ["a photo of a {c} {obj}", "a photo of a {c}-colored {obj}", "a photo of a {c} object"]
POSITIONS = ["left of", "right of", "above", "below"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
# GenEval's object_names.txt: the 80 COCO thing classes in COCO's order, which is the label order of COCO-instance
# detectors (transformers' id2label says "mouse", "remote", "keyboard" where GenEval's prompts say the names below)
CLASSES = [
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant",
    "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
    "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli", "carrot",
    "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet", "tv",
    "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# GenEval's rules, on detections
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Detection:
    box: tuple  # (x1, y1, x2, y2) in pixels, x2/y2 exclusive
    score: float
    mask: Optional[torch.Tensor] = None  # [H, W] bool


@dataclass
class Verdict:
    correct: bool  # GenEval's score of the image: every clause holds
    met: int  # clauses that hold
    clauses: int  # include + exclude clauses of the prompt
    reasons: List[str] = field(default_factory=list)


def keep_confident(detections: Dict[str, List[Detection]], tag: str) -> Dict[str, List[Detection]]:
    """Per class, the detections above the tag's threshold, most confident first, at most MAX_OBJECTS; classes
    left with none are dropped (evaluate_image's loop, with NMS off as in GenEval's default)."""
    threshold = COUNTING_THRESHOLD if tag == "counting" else THRESHOLD
    kept = {}
    for name, dets in detections.items():
        dets = sorted((d for d in dets if d.score > threshold), key=lambda d: -d.score)[:MAX_OBJECTS]
        if dets:
            kept[name] = dets
    return kept


def relative_position(box_a: Sequence[float], box_b: Sequence[float], threshold: float = POSITION_THRESHOLD) -> set:
    """Directions of box a from box b: the centre offset with `threshold` x (size a + size b) taken off each axis
    (so touching or overlapping objects are in no direction), then normalised by the full offset's length; a direction
    holds when its component of that unit-scaled vector exceeds 0.5 (about 60 degrees either side of the axis)."""
    ax1, ay1, ax2, ay2 = (float(v) for v in box_a[:4])
    bx1, by1, bx2, by2 = (float(v) for v in box_b[:4])
    offset = ((ax1 + ax2 - bx1 - bx2) / 2, (ay1 + ay2 - by1 - by2) / 2)
    sizes = (abs(ax2 - ax1) + abs(bx2 - bx1), abs(ay2 - ay1) + abs(by2 - by1))
    revised = [max(abs(o) - threshold * s, 0.0) * (1 if o > 0 else -1 if o < 0 else 0) for o, s in zip(offset, sizes)]
    if all(abs(r) < 1e-3 for r in revised):
        return set()
    norm = (offset[0] ** 2 + offset[1] ** 2) ** 0.5
    dx, dy = revised[0] / norm, revised[1] / norm
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def judge(metadata: dict, objects: Dict[str, List[Detection]], colors_of: Callable) -> Verdict:
    """GenEval's `evaluate` on the kept detections `objects`: include clauses in order (each may name a colour, and a
    position relative to an earlier clause's matched objects), then exclude clauses. `colors_of(classname,
    detections)` -> one colour name per detection. Also counts the clauses met, for the partial score."""
    verdict = Verdict(True, 0, len(metadata.get("include", [])) + len(metadata.get("exclude", [])))
    matched_groups = []
    for req in metadata.get("include", []):
        name, count = req["class"], req["count"]
        found = objects.get(name, [])[:count]  # colour and position are judged on the most confident ones only
        ok = True
        if len(found) < count:
            ok = False
            verdict.reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in req:
                colors = colors_of(name, found)
                if colors.count(req["color"]) < count:
                    ok = False
                    verdict.reasons.append(f"expected {req['color']} {name}>={count}, found colours {colors}")
            if "position" in req and ok:
                relation, target = req["position"]
                if matched_groups[target] is None:
                    ok = False
                    verdict.reasons.append(f"no target for {name} to be {relation}")
                elif not all(relation in relative_position(o.box, t.box) for o in found for t in matched_groups[target]):
                    ok = False
                    verdict.reasons.append(f"expected {name} {relation} target")
        matched_groups.append(found if ok else None)
        verdict.met += ok
        verdict.correct &= ok
    for req in metadata.get("exclude", []):
        found = len(objects.get(req["class"], []))
        ok = found < req["count"]
        if not ok:
            verdict.reasons.append(f"expected {req['class']}<{req['count']}, found {found}")
        verdict.met += ok
        verdict.correct &= ok
    return verdict


def summary(tags: Sequence[str], correct: Sequence[float]) -> Dict[str, float]:
    """summary_scores.py: {tag: mean correct over its images} in first-seen order, then "overall": the mean over tags
    (not over images: each of GenEval's six tasks weighs the same whatever its prompt count)."""
    per_tag = {}
    for tag, c in zip(tags, correct):
        per_tag.setdefault(tag, []).append(float(c))
    out = {tag: sum(v) / len(v) for tag, v in per_tag.items()}
    out["overall"] = sum(out.values()) / len(out) if out else float("nan")
    return out


# ----------------------------------------------------------------------------------------------------------------
# prompts -> GenEval metadata (the grammar of prompts/create_prompts.py)
# ----------------------------------------------------------------------------------------------------------------
def _plural(name: str) -> str:
    return f"{name}es" if name.endswith("s") else f"{name}s"  # create_prompts.make_plural ("skis" -> "skises")


_CLASS = "|".join(re.escape(c) for c in sorted(CLASSES, key=len, reverse=True))
_COLOR = "|".join(COLORS)
_PLURALS = {_plural(c): c for c in CLASSES}
_OBJECT = rf"an? (?:(?P<{{c}}>{_COLOR}) )?(?P<{{o}}>{_CLASS})"
_GRAMMAR = [
    ("counting", re.compile(rf"a photo of (?P<n>{'|'.join(NUMBERS[2:])}) (?P<p>.+)")),
    ("position", re.compile(rf"a photo of an? (?P<a>{_CLASS}) (?P<r>{'|'.join(POSITIONS)}) an? (?P<b>{_CLASS})")),
    ("pair", re.compile(rf"a photo of {_OBJECT.format(c='ca', o='a')} and {_OBJECT.format(c='cb', o='b')}")),
    ("single", re.compile(rf"a photo of {_OBJECT.format(c='ca', o='a')}")),
]


def _clause(name: str, color: Optional[str]) -> dict:
    return {"class": name, "count": 1, **({"color": color} if color else {})}


def parse_prompt(prompt: str) -> dict:
    """GenEval's metadata ({"tag", "include", ["exclude"], "prompt"}) of a prompt of its grammar: "a photo of a bench",
    "... of a bench and a cat", "... of two benchs", "... of a red bench", "... of a cat left of a bench", "... of a red
    bench and a blue cat". A bare class name wins over colour + class ("an orange" is the fruit)."""
    text = prompt.strip()
    for kind, pattern in _GRAMMAR:
        m = pattern.fullmatch(text)
        if m is None:
            continue
        if kind == "counting":
            if m["p"] not in _PLURALS:
                continue
            n, name = NUMBERS.index(m["n"]), _PLURALS[m["p"]]
            include, exclude = [{"class": name, "count": n}], [{"class": name, "count": n + 1}]
            return {"tag": "counting", "include": include, "exclude": exclude, "prompt": prompt}
        if kind == "position":  # the target (b) is clause 0, as create_prompts writes it
            include = [{"class": m["b"], "count": 1}, {"class": m["a"], "count": 1, "position": [m["r"], 0]}]
            return {"tag": "position", "include": include, "prompt": prompt}
        if kind == "pair":
            if bool(m["ca"]) != bool(m["cb"]):
                continue  # GenEval colours both objects or neither
            tag = "color_attr" if m["ca"] else "two_object"
            return {"tag": tag, "include": [_clause(m["a"], m["ca"]), _clause(m["b"], m["cb"])], "prompt": prompt}
        return {"tag": "colors" if m["ca"] else "single_object", "include": [_clause(m["a"], m["ca"])], "prompt": prompt}
    raise UserError(
        f"the geneval reward needs GenEval's prompts ('a photo of two benchs', 'a photo of a red car'), got {short(prompt)}"
    )


# ----------------------------------------------------------------------------------------------------------------
# the detector: Mask2Former COCO-instance, post-processed as mmdet's Mask2Former head
# ----------------------------------------------------------------------------------------------------------------
def mask2former_instances(class_logits: torch.Tensor, mask_logits: torch.Tensor, max_per_image: int = MAX_PER_IMAGE):
    """One image's detections {class index: [Detection]} from its query logits [Q, C + 1] (last: no object) and mask
    logits [Q, H, W] at the image's size: the top `max_per_image` (query, class) pairs by class probability, each scored
    probability x the mean mask probability over its mask (mask logit > 0), boxed by the mask's extent
    (mmdet MaskFormerFusionHead.instance_postprocess)."""
    num_classes = class_logits.shape[-1] - 1
    probs = class_logits.float().softmax(-1)[:, :-1]
    top, index = probs.flatten().topk(min(max_per_image, probs.numel()))
    query, label = index // num_classes, index % num_classes
    logits = mask_logits[query].float()
    masks = logits > 0
    area = masks.flatten(1).sum(1)
    mask_score = (logits.sigmoid() * masks).flatten(1).sum(1) / (area + 1e-6)
    scores = (top * mask_score).tolist()
    rows, cols = masks.any(2), masks.any(1)  # [K, H], [K, W]
    out = {}
    for k in range(len(scores)):
        if area[k] == 0:  # no pixel: score 0, never above a threshold
            continue
        ys, xs = rows[k].nonzero()[:, 0], cols[k].nonzero()[:, 0]
        box = (int(xs[0]), int(ys[0]), int(xs[-1]) + 1, int(ys[-1]) + 1)
        out.setdefault(int(label[k]), []).append(Detection(box, scores[k], masks[k]))
    return out


def _mask2former_class():
    """Mask2FormerForUniversalSegmentation without its training loss: the loss's Hungarian matcher needs scipy at
    construction, and inference never calls it (the module names and state_dict keys are the checkpoint's)."""
    from torch import nn
    from transformers import Mask2FormerForUniversalSegmentation, Mask2FormerModel, Mask2FormerPreTrainedModel

    class Mask2FormerInference(Mask2FormerForUniversalSegmentation):
        def __init__(self, config):
            Mask2FormerPreTrainedModel.__init__(self, config)
            self.model = Mask2FormerModel(config)
            self.class_predictor = nn.Linear(config.hidden_dim, config.num_labels + 1)
            self.post_init()

    return Mask2FormerInference


class Detector:
    """fn(images [B, 3, H, W] in [0, 1]) -> per image {GenEval class name: [Detection]} (all of mmdet's top pairs)."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32):
        from transformers import AutoConfig, Mask2FormerConfig, Mask2FormerImageProcessorPil

        config = _clip.load(AutoConfig.from_pretrained, DETECTOR_ENV, DETECTOR, "GenEval detector config")
        if not isinstance(config, Mask2FormerConfig) or config.num_labels != len(CLASSES):
            what = (
                f"has {config.num_labels} classes"
                if isinstance(config, Mask2FormerConfig)
                else f"is a {type(config).__name__}"
            )
            raise UserError(f"GenEval detector {config.name_or_path!r} {what}: expected a Mask2Former of COCO's 80 classes")
        load = lambda name: _mask2former_class().from_pretrained(name, config=config)  # noqa: E731
        self.model = _clip.load(load, DETECTOR_ENV, DETECTOR, "GenEval detector")
        self.model = self.model.eval().requires_grad_(False).to(device=device, dtype=dtype)
        p = _clip.load(Mask2FormerImageProcessorPil.from_pretrained, DETECTOR_ENV, DETECTOR, "GenEval detector processor")
        self.divisor = p.size_divisor or 1
        self.mean = torch.tensor(p.image_mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(p.image_std, device=device).view(1, 3, 1, 1)
        self.device, self.dtype = device, dtype

    @staticmethod
    def resized(h: int, w: int) -> tuple:
        """mmdet's keep-ratio Resize to scale (1333, 800), the test pipeline of GenEval's config: the shorter side to
        SHORT_EDGE unless the longer would then exceed LONG_EDGE (a 512 x 512 image is detected at 800 x 800)."""
        scale = min(SHORT_EDGE / min(h, w), LONG_EDGE / max(h, w))
        return int(h * scale + 0.5), int(w * scale + 0.5)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> List[Dict[str, List[Detection]]]:
        h, w = images.shape[-2:]
        rh, rw = self.resized(h, w)
        x = images.to(self.device, torch.float32)
        if (rh, rw) != (h, w):
            x = F.interpolate(x, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False).clamp(0, 1)
        x = (x - self.mean) / self.std
        ph, pw = -(-rh // self.divisor) * self.divisor, -(-rw // self.divisor) * self.divisor
        x = F.pad(x, (0, pw - rw, 0, ph - rh))  # zeros after normalising, bottom and right, as both processors pad
        pixel_mask = torch.zeros(len(x), ph, pw, dtype=torch.long, device=self.device)
        pixel_mask[:, :rh, :rw] = 1
        out = self.model(pixel_values=x.to(self.dtype), pixel_mask=pixel_mask)
        result = []
        for cls, masks in zip(out.class_queries_logits, out.masks_queries_logits):
            # masks come at 1/4 of the padded input: to the padded size, crop the padding, then to the image's size
            m = F.interpolate(masks[None].float(), size=(ph, pw), mode="bilinear", align_corners=False)[..., :rh, :rw]
            m = F.interpolate(m, size=(h, w), mode="bilinear", align_corners=False)[0]
            found = mask2former_instances(cls, m)
            result.append({CLASSES[k]: dets for k, dets in found.items()})
        return result


# ----------------------------------------------------------------------------------------------------------------
# colours: CLIP zero-shot on the masked crop
# ----------------------------------------------------------------------------------------------------------------
class ColorClassifier:
    """colors_of(image [3, H, W] in [0, 1], classname, detections) -> a colour of COLORS per detection: CLIP's
    zero-shot choice (clip_benchmark's zero_shot_classifier: per colour the mean of the unit text embeddings of the three
    templates, renormalised) for the box crop of the image with the pixels outside the mask grey."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32):
        self.model = _clip.load_clip(CLIP_ENV, CLIP, "GenEval CLIP model", device, dtype)
        self.tokenizer = _clip.load_tokenizer(CLIP_ENV, CLIP, "GenEval CLIP tokenizer")
        self.preprocess = _clip.load_preprocess(CLIP_ENV, CLIP, "GenEval CLIP image processor", device)
        self.device, self.classifiers = device, {}

    def classifier(self, classname: str) -> torch.Tensor:
        if classname not in self.classifiers:
            texts = [t.format(c=c, obj=classname) for c in COLORS for t in COLOR_TEMPLATES]
            emb = _clip.text_embeds(self.model, self.tokenizer, texts, self.device).view(len(COLORS), len(COLOR_TEMPLATES), -1)
            mean = emb.mean(1)
            self.classifiers[classname] = mean / mean.norm(dim=-1, keepdim=True)
        return self.classifiers[classname]

    @staticmethod
    def crop(image: torch.Tensor, det: Detection) -> torch.Tensor:
        x1, y1, x2, y2 = (int(round(float(v))) for v in det.box[:4])
        if det.mask is not None:
            image = torch.where(det.mask.to(image.device), image, torch.full_like(image, BACKGROUND))
        return image[:, y1:y2, x1:x2]

    @torch.no_grad()
    def __call__(self, image: torch.Tensor, classname: str, detections: List[Detection]) -> List[str]:
        crops = [self.preprocess(self.crop(image, d)[None]) for d in detections]  # crops differ in size: one at a time
        pixels = torch.cat(crops).to(next(self.model.parameters()).dtype)
        emb = _clip._pooled(self.model.get_image_features(pixel_values=pixels)).float()
        emb = emb / emb.norm(dim=-1, keepdim=True)
        return [COLORS[k] for k in (emb @ self.classifier(classname).T).argmax(1).tolist()]


# ----------------------------------------------------------------------------------------------------------------
# the scorer and the two rewards
# ----------------------------------------------------------------------------------------------------------------
class GenEval:
    """verdicts(images [B, 3, H, W] in [0, 1], metadata [B]) -> [Verdict]; images are quantised to uint8 first, as the
    PNG files GenEval reads would be. Both models on `device` (default: the GPU if any) in `dtype`, `batch_size` images
    per detector call."""

    def __init__(self, device=None, dtype: torch.dtype = torch.float32, batch_size: int = 8):
        device = _clip.pick_device(device)
        self.detector, self.colors, self.batch_size = Detector(device, dtype), ColorClassifier(device, dtype), batch_size

    def verdicts(self, images: torch.Tensor, metadata: Sequence[dict]) -> List[Verdict]:
        _clip.check_batch(images, list(metadata))
        pixels = (images.detach().float().clamp(0, 1) * 255).round() / 255
        out = []
        for chunk, meta in zip(pixels.split(self.batch_size), _chunks(metadata, self.batch_size)):
            for image, found, m in zip(chunk, self.detector(chunk), meta):
                objects = keep_confident(found, m["tag"])
                image = image.to(self.detector.device)
                out.append(judge(m, objects, lambda name, dets, image=image: self.colors(image, name, dets)))
        return out


def _chunks(items: Sequence, n: int) -> list:
    return [list(items[k : k + n]) for k in range(0, len(items), n)]


def _reward(strict: bool, device, dtype: torch.dtype, batch_size: int) -> Callable:
    scorer = GenEval(device, dtype, batch_size)

    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        verdicts = scorer.verdicts(images, [parse_prompt(p) for p in prompts])
        values = [float(v.correct) if strict else v.met / v.clauses for v in verdicts]
        return torch.tensor(values, dtype=torch.float32, device=images.device)

    def check_prompts(prompts):
        """Run before the model loads (rewards.load_rewards): every prompt is one of GenEval's grammar."""
        for p in prompts:
            parse_prompt(p)

    fn.check_prompts = check_prompts
    return fn


def geneval(device=None, dtype: torch.dtype = torch.float32, batch_size: int = 8) -> Callable:
    """The `geneval` reward: fn(images [B, 3, H, W] float in [0, 1], GenEval prompts) -> the fraction of the prompt's
    GenEval clauses met [B] float32 in [0, 1] on the images' device."""
    return _reward(False, device, dtype, batch_size)


def geneval_strict(device=None, dtype: torch.dtype = torch.float32, batch_size: int = 8) -> Callable:
    """The `geneval_strict` reward: GenEval's own per-image score, 1 when every clause holds, else 0 [B] float32."""
    return _reward(True, device, dtype, batch_size)
