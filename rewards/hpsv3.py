"""HPSv3 (Ma et al. 2025, "HPSv3: Towards Wide-Spectrum Human Preference Score", arXiv:2508.03789): Qwen2-VL-7B with
a reward head, trained with an uncertainty-aware ranking loss on HPDv3.

score = mu, the first of the head's two outputs (mu, sigma) at the `<|Reward|>` token that ends the instruction
(MizzenAI/HPSv3 `hpsv3/inference.py`: "miu and sigma. we select miu as the final output"); ~0-15 on real images.
What the released checkpoint expects, read off MizzenAI/HPSv3 (`train.py`, `model/qwen2vl_trainer.py`,
`dataset/data_collator_qwen.py`, `config/HPSv3_7B.yaml`):
  * the Qwen2-VL-7B-Instruct tokenizer plus one added special token `<|Reward|>` (embeddings resized to fit);
  * the image resized to 256 x 28 x 28 pixels exactly (`min_pixels = max_pixels`: 448 x 448 for a square image,
    256 merged image tokens), normalised as Qwen2-VL's processor does;
  * the user turn: image, then the instruction with the prompt, then "Please provide the overall ratings of this
    image: <|Reward|>";
  * the language model run on sequential 1-D positions (its forward calls the decoder with position_ids=None and
    inputs_embeds, so Qwen2-VL's 3-D M-RoPE is not used), right padding;
  * head Linear(3584, 1024) -> ReLU -> Dropout -> Linear(1024, 16) -> ReLU -> Linear(16, 2), in float32.
The checkpoint is one state_dict (`HPSv3.safetensors` in MizzenAI/HPSv3, 16 GB) of that model; keys in the layout of
transformers < 4.52 (`model.layers.*`, `visual.*`) are renamed to today's (`model.language_model.*`, `model.visual.*`).
$CLEANFLOW_HPSV3_CKPT points at a local file, $CLEANFLOW_HPSV3_BASE at a local copy of Qwen2-VL-7B-Instruct (only its
config, tokenizer and image processor settings are read: the weights all come from the checkpoint).
"""

import os
from typing import Callable, Optional

import torch
import torch.nn as nn

from common import UserError
from rewards import _clip
from rewards.vlm import patchify

CKPT_REPO, CKPT_FILE, CKPT_ENV = "MizzenAI/HPSv3", "HPSv3.safetensors", "CLEANFLOW_HPSV3_CKPT"
BASE, BASE_ENV = "Qwen/Qwen2-VL-7B-Instruct", "CLEANFLOW_HPSV3_BASE"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28

# The instruction the checkpoint was trained with (MizzenAI/HPSv3 hpsv3/dataset/data_collator_qwen.py, MIT licence):
# model input, so kept character for character, trailing spaces included.
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall "
    "score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being "
    "the best. \n\n**Visual Quality:**  \nEvaluate the overall visual quality of the image. The following "
    "sub-dimensions should be considered:\n- **Reasonableness:** The image should not contain any significant "
    "biological or logical errors, such as abnormal body structures or nonsensical environmental setups.\n- "
    "**Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, "
    "with no blurring or indistinct areas.\n- **Detail Richness:** Consider the level of detail in textures, materials, "
    "lighting, and other visual elements (e.g., hair, clothing, shadows).\n- **Aesthetic and Creativity:** Assess the "
    "artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the "
    "overall creative appeal. The scene should convey a sense of harmony and balance.\n- **Safety:** The image should "
    "not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is "
    "present, the image quality and satisfaction score should be the lowest possible. \n\n**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n- **Subject "
    "Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the "
    "textual description. The subject should match the description in terms of number, appearance, and behavior.\n- "
    "**Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image "
    "adheres to this style.\n- **Contextual Consistency**: Assess whether the background, setting, and surrounding "
    "elements in the image logically fit the scenario described in the prompt. The environment should support and "
    "enhance the subject without contradictions.\n- **Attribute Fidelity**: Check if specific attributes mentioned in "
    "the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. "
    "Minor deviations may be acceptable, but critical attributes should be preserved.\n- **Semantic Coherence**: "
    "Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content "
    "should not introduce elements that conflict with or distort the original description.\nTextual prompt - "
    "{prompt}\n\n\n"
)
RATE = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"


def head(width: int) -> nn.Sequential:
    """The checkpoint's `rm_head` (its `ranknet` head; Identity where training had Dropout, keeping the indices)."""
    return nn.Sequential(nn.Linear(width, 1024), nn.ReLU(), nn.Identity(), nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2))


def current_keys(state: dict) -> dict:
    """Keys of transformers < 4.52's Qwen2VLForConditionalGeneration (`model.layers`, `visual`) renamed to today's."""
    if not any(k.startswith("visual.") for k in state):
        return state
    renamed = {}
    for key, value in state.items():
        if key.startswith("visual."):
            key = "model." + key
        elif key.startswith("model.") and not key.startswith("model.language_model."):
            key = "model.language_model." + key[len("model.") :]
        renamed[key] = value
    return renamed


def load_checkpoint() -> dict:
    """The checkpoint's state_dict on the CPU (it is copied into the model on its device, so it never sits there twice)."""
    from safetensors.torch import load_file

    path = os.environ.get(CKPT_ENV)
    if not path:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(CKPT_REPO, CKPT_FILE)
        except Exception as e:  # offline, no cache, no access: one line
            raise UserError(f"cannot download {CKPT_REPO}/{CKPT_FILE} ({_clip.first_line(e)}); set {CKPT_ENV} to a local copy")
    if not os.path.isfile(path):
        raise UserError(f"HPSv3 checkpoint {path!r} not found ({CKPT_ENV})")
    try:
        return current_keys(load_file(path, device="cpu"))
    except Exception as e:
        raise UserError(f"cannot read the HPSv3 checkpoint {path!r} ({type(e).__name__}: {_clip.first_line(e)})") from e


def hpsv3(device=None, dtype: Optional[torch.dtype] = None, batch_size: int = 8, pixels: int = PIXELS) -> Callable:
    """The `hpsv3` reward: fn(images [B, 3, H, W] float in [0, 1], prompts) -> HPSv3 mu [B] float32 on the images'
    device. The model runs on `device` (default: the GPU if any) in `dtype` (default bfloat16 on a GPU as released,
    float32 on the CPU; the head always in float32), `batch_size` images at a time, each resized to `pixels`."""
    import transformers

    device = _clip.pick_device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer = _clip.load(transformers.AutoTokenizer.from_pretrained, BASE_ENV, BASE, "HPSv3 base tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    reward_id = tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    processor = _clip.load(transformers.Qwen2VLImageProcessorPil.from_pretrained, BASE_ENV, BASE, "HPSv3 image processor")
    config = _clip.load(transformers.AutoConfig.from_pretrained, BASE_ENV, BASE, "HPSv3 base config")
    state = load_checkpoint()
    rm_head = head(config.text_config.hidden_size).to(device)
    try:
        rm_head.load_state_dict({k[len("rm_head.") :]: v.float() for k, v in state.items() if k.startswith("rm_head.")})
        config.text_config.vocab_size = state["model.language_model.embed_tokens.weight"].shape[0]
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build the 7B model directly in its dtype on its device, then fill it
        try:
            with torch.device(device):
                model = transformers.Qwen2VLForConditionalGeneration(config)
        finally:
            torch.set_default_dtype(default_dtype)
        model.load_state_dict({k: v for k, v in state.items() if not k.startswith("rm_head.")}, strict=True)
    except (RuntimeError, KeyError) as e:
        raise UserError(f"the HPSv3 checkpoint does not fit {BASE}'s architecture ({_clip.first_line(e)})") from e
    del state
    model = model.eval().requires_grad_(False)
    if reward_id >= config.text_config.vocab_size:
        raise UserError(
            f"{REWARD_TOKEN} has id {reward_id}, outside the checkpoint's {config.text_config.vocab_size} embeddings"
        )
    image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)

    @torch.no_grad()
    def fn(images: torch.Tensor, prompts: list) -> torch.Tensor:
        _clip.check_batch(images, prompts)
        patches, grid = patchify(images, processor, device, max_pixels=pixels, min_pixels=pixels)
        n_tokens = grid[0] * grid[1] * grid[2] // processor.merge_size**2
        out = []
        for start in range(0, len(prompts), batch_size):
            texts = []
            for prompt in prompts[start : start + batch_size]:
                text = INSTRUCTION.format(prompt=prompt) + RATE
                messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
                chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                texts.append(chat.replace(image_token, image_token * n_tokens))
            tokens = tokenizer(texts, padding=True, padding_side="right", return_tensors="pt").to(device)
            ids = tokens.input_ids
            # HPSv3's forward: sequential positions 0..L-1 on all three M-RoPE axes (right padding keeps them right)
            positions = torch.arange(ids.shape[1], device=device).expand(3, *ids.shape)
            hidden = model.model(
                input_ids=ids,
                attention_mask=tokens.attention_mask,
                pixel_values=patches[start : start + len(texts)].flatten(0, 1).to(dtype),
                image_grid_thw=torch.tensor([grid] * len(texts), device=device),
                position_ids=positions,
            ).last_hidden_state
            at = ids == reward_id
            if not (at.sum(1) == 1).all():
                raise ValueError(f"expected one {REWARD_TOKEN} per sequence, got {at.sum(1).tolist()}")
            out.append(rm_head(hidden[at].float())[:, 0])
        return torch.cat(out).to(images.device)

    return fn
