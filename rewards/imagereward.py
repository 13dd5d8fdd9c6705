"""ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation",
arXiv:2304.05977): BLIP (ViT-L/16 image encoder, BERT-base text encoder cross-attending to the image) and an MLP head
on the text encoder's [CLS] feature, trained on 137k expert comparisons.

score = (mlp(text_encoder(prompt, image)[:, 0]) - 0.16717) / 1.03334, `ImageReward.score` of THUDM/ImageReward
(`ImageReward/ImageReward.py`): the prompt padded to 35 BERT tokens, [CLS] kept as the first token, the image resized
(shortest edge, bicubic) and centre cropped to 224 and normalised with CLIP's mean and std. Higher is better; the
two constants are the mean and std of the raw head output that the authors normalise by.

There is no transformers port of the checkpoint, so this file reads the released `ImageReward.pt` (a plain state_dict
of the BLIP and MLP modules, from the hub repository THUDM/ImageReward) and renames its keys onto transformers'
BlipVisionModel and BlipTextModel, whose layers compute what BLIP's ViT and BERT layers compute; the architecture is
read off the tensor shapes. $CLEANFLOW_IMAGEREWARD_CKPT points at a local `ImageReward.pt` (default: downloaded from
the hub, or the hub cache when offline); the tokenizer is `bert-base-uncased` ($CLEANFLOW_IMAGEREWARD_TOKENIZER), as
BLIP's `init_tokenizer` (whose two added tokens, [DEC] and [ENC], the score never uses).
"""

import os
import re
from typing import Callable, Dict, Tuple

import torch

from common import UserError
from rewards import _clip
from rewards.aesthetic import AestheticMLP

CKPT_REPO, CKPT_FILE, CKPT_ENV = "THUDM/ImageReward", "ImageReward.pt", "CLEANFLOW_IMAGEREWARD_CKPT"
TOKENIZER, TOKENIZER_ENV = "bert-base-uncased", "CLEANFLOW_IMAGEREWARD_TOKENIZER"
MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward.__init__: the reward's normalisation
MAX_TOKENS = 35  # ImageReward.score: padding="max_length", max_length=35
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
HEAD_DIM = 64  # per attention head, in BLIP's ViT-L/16 (1024 / 16) and BERT-base (768 / 12): heads = width / 64
VIT_EPS, BERT_EPS = 1e-6, 1e-12  # BLIP's VisionTransformer norm_layer and med_config.json's layer_norm_eps

# BLIP's timm-style ViT names -> transformers' BlipVisionModel names; BERT names are the same on both sides
_VISION_RENAMES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


def _layers(state: dict, pattern: str) -> int:
    return 1 + max(int(m.group(1)) for k in state if (m := re.match(pattern, k)))


def split_checkpoint(state: dict) -> Tuple[Dict[str, dict], Dict[str, dict], dict]:
    """An ImageReward.pt state_dict -> (vision {config, state}, text {config, state}, MLP head state), in transformers'
    names. Keys outside `blip.visual_encoder.`, `blip.text_encoder.` and `mlp.` (the contrastive projections the
    score does not use) are left out, as `ImageReward.load` leaves them (load_state_dict(strict=False))."""
    vision, text, head = {}, {}, {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            name = key[len("blip.visual_encoder.") :]
            for pattern, new in _VISION_RENAMES:
                if re.match(pattern, name):
                    vision[re.sub(pattern, new, name)] = value
                    break
            else:
                raise KeyError(f"unexpected ViT weight {key}")
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):  # a buffer, not a weight
            text[key[len("blip.text_encoder.") :]] = value
        elif key.startswith("mlp."):
            head[key[len("mlp.") :]] = value
    if not vision or not text or not head:
        raise KeyError("no blip.visual_encoder., blip.text_encoder. or mlp. weights")
    patch = vision["embeddings.patch_embedding.weight"]
    width, patches = vision["embeddings.position_embedding"].shape[-1], vision["embeddings.position_embedding"].shape[1] - 1
    vision_config = dict(
        hidden_size=width,
        intermediate_size=vision["encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=_layers(vision, r"encoder\.layers\.(\d+)\."),
        num_attention_heads=width // HEAD_DIM,
        patch_size=patch.shape[-1],
        image_size=patch.shape[-1] * round(patches**0.5),
        layer_norm_eps=VIT_EPS,
        hidden_act="gelu",  # timm Mlp's nn.GELU (erf)
    )
    vocab, hidden = text["embeddings.word_embeddings.weight"].shape
    text_config = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=text["encoder.layer.0.intermediate.dense.weight"].shape[0],
        num_hidden_layers=_layers(text, r"encoder\.layer\.(\d+)\."),
        num_attention_heads=hidden // HEAD_DIM,
        max_position_embeddings=text["embeddings.position_embeddings.weight"].shape[0],
        encoder_hidden_size=text["encoder.layer.0.crossattention.self.key.weight"].shape[1],
        layer_norm_eps=BERT_EPS,
        hidden_act="gelu",
    )
    return {"config": vision_config, "state": vision}, {"config": text_config, "state": text}, head


def read_checkpoint(name: str) -> dict:
    """The state_dict of `name`, a local file or a hub repository holding ImageReward.pt."""
    path = name
    if not os.path.isfile(name):
        from huggingface_hub import hf_hub_download

        if os.sep in name and not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
            raise FileNotFoundError(f"no file {name}")
        path = hf_hub_download(name, CKPT_FILE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle / zip errors of a file that is not a saved state_dict
        raise UserError(f"cannot read ImageReward weights {path!r} ({_clip.first_line(e)})") from e


def build(state: dict):
    """(BlipVisionModel, BlipTextModel, MLP head) in eval mode, float32, loaded strictly from an ImageReward.pt
    state_dict; a checkpoint of another layout fails here with one line."""
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    try:
        vision, text, head_state = split_checkpoint(state)
        vision_model = BlipVisionModel(BlipVisionConfig(**vision["config"]))
        vision_model.load_state_dict(vision["state"])
        text_model = BlipTextModel(BlipTextConfig(**text["config"]), add_pooling_layer=False)
        # transformers keeps position_ids as a persistent buffer in some versions: the one BLIP saves is dropped above
        missing = text_model.load_state_dict(text["state"], strict=False)
        if missing.unexpected_keys or [k for k in missing.missing_keys if not k.endswith("position_ids")]:
            raise RuntimeError(f"text encoder weights do not fit: {missing}")
        head = AestheticMLP(text["config"]["hidden_size"])
        head.load_state_dict(head_state)
    except (KeyError, RuntimeError, ValueError) as e:
        raise UserError(f"the ImageReward weights do not have ImageReward's BLIP + MLP layout ({_clip.first_line(e)})") from e
    return tuple(m.eval().requires_grad_(False) for m in (vision_model, text_model, head))


def imagereward(device=None, dtype: torch.dtype = torch.float32, batch_size: int = 32) -> Callable:
    """The `imagereward` reward: fn(images [B, 3, H, W] float in [0, 1], prompts) -> ImageReward score [B] float32 on
    the images' device. BLIP runs on `device` (default: the GPU if any) in `dtype` (float32, the original's, is the
    default), `batch_size` images at a time; the head stays float32, as the original's `.float()` features."""
    import transformers

    device = _clip.pick_device(device)
    state = _clip.load(read_checkpoint, CKPT_ENV, CKPT_REPO, "ImageReward weights", f"the file {CKPT_FILE}")
    vision_model, text_model, head = build(state)
    vision_model, text_model, head = vision_model.to(device, dtype), text_model.to(device, dtype), head.to(device)
    tokenizer = _clip.load_tokenizer(TOKENIZER_ENV, TOKENIZER, "ImageReward tokenizer")
    size = vision_model.config.image_size
    # ImageReward's _transform(224): Resize(224, bicubic) of the shortest edge, CenterCrop(224), CLIP's normalisation
    processor = (getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor)(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, resample=3, image_mean=CLIP_MEAN,
        image_std=CLIP_STD
    )  # fmt: skip
    preprocess = _clip.tensor_preprocess(processor, device)

    @torch.no_grad()
    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        _clip.check_batch(images, prompts)
        tokens = tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        out = []
        for start in range(0, len(images), batch_size):
            chunk = slice(start, start + batch_size)
            image = vision_model(pixel_values=preprocess(images[chunk]).to(dtype)).last_hidden_state
            text = text_model(
                input_ids=ids[chunk],
                attention_mask=mask[chunk],
                encoder_hidden_states=image,
                encoder_attention_mask=torch.ones(image.shape[:-1], dtype=torch.long, device=device),
            ).last_hidden_state
            out.append(head(text[:, 0].float())[:, 0])
        return ((torch.cat(out) - MEAN) / STD).to(images.device)

    return fn
