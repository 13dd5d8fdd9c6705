"""Tiny random pipelines of the model families (models/), built offline from small configs and saved with
`save_pretrained` (reference/model-families.md §1). Tokenizers cannot be downloaded here: transformers 5 tokenizer
classes take an in-memory vocabulary, so a byte-level BPE without merges plus the family's special tokens and a
small ChatML chat template stands in for Qwen's."""

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer(max_length: int = 32, padding_side: str = "right"):
    """Byte-level BPE with no merges (one token per byte) and Qwen's special tokens; ChatML chat template."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=max_length,
        padding_side=padding_side,
    )
    tok.chat_template = CHATML
    return tok


def qwen3(tok, layers: int, hidden: int = 16, causal_lm: bool = True, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
    )
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config)


def flux2_parts(guidance_embeds: bool):
    """The tiny FLUX.2 transformer, VAE (with non-trivial BatchNorm statistics, so a missing un-normalisation would
    show) and scheduler shared by the klein (no guidance embedding) and dev (guidance embedding) builds."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    torch.manual_seed(1)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
    vae.bn.running_mean.normal_(0, 0.5)
    vae.bn.running_var.uniform_(0.5, 2.0)
    return (
        transformer,
        vae,
        FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential"),
    )


def flux2_klein(path):
    """Flux2KleinPipeline (base: two-pass CFG), Qwen3 text encoder deep enough for layers 9/18/27 (hidden 16, so the
    transformer's joint_attention_dim is 3 x 16), a 2-block VAE (factor 2) with random BatchNorm statistics."""
    from diffusers import Flux2KleinPipeline

    tok = qwen_tokenizer()
    text_encoder = qwen3(tok, layers=27)
    transformer, vae, scheduler = flux2_parts(guidance_embeds=False)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer)
    pipe.save_pretrained(path)
    return str(path)


def qwen_image(path):
    """QwenImagePipeline: a tiny Qwen2.5-VL text encoder (its vision tower is never called for text-to-image), a 3-D
    Wan-style VAE (factor 2) with non-trivial latents_mean/std, the released scheduler config (dynamic shift with
    base 0.5 / max 0.9 over 256..8192 tokens, shift_terminal 0.02)."""
    from diffusers import QwenImagePipeline

    tok = qwen_tokenizer(max_length=256)  # the 34 dropped template tokens + the prompt fit (one token per byte)
    parts = qwen_image_parts(tok, vae_downsamples=1)
    QwenImagePipeline(tokenizer=tok, **parts).save_pretrained(path)
    return str(path)


def qwen_image_parts(tok, vae_downsamples: int, vae_base: int = 8) -> dict:
    """Qwen-Image's parts on `tok`: the tiny Qwen2.5-VL (vision tower: 2-pixel patches, no merge, one frame per patch;
    the image token ids of `tok`, where it has them), the transformer, a VAE of factor 2^`vae_downsamples` (`vae_base`
    channels at full resolution) and the released scheduler config."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    text = dict(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        max_position_embeddings=512,
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        num_heads=2,
        out_hidden_size=16,
        patch_size=2,
        spatial_merge_size=1,
        temporal_patch_size=1,
    )
    ids = {
        f"{name}_token_id": tok.convert_tokens_to_ids(token)
        for name, token in VISION_TOKENS.items()
        if token in tok.get_vocab()
    }
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **text, **ids)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    torch.manual_seed(1)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=vae_base,
        z_dim=4,
        dim_mult=[1, 2] + [2] * (vae_downsamples - 1),
        num_res_blocks=1,
        temperal_downsample=[False] * vae_downsamples,
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.7, 1.2, 2.0],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer)


# Qwen2.5-VL's vision special tokens, by the config field that holds each id
VISION_TOKENS = {
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image": "<|image_pad|>",
    "video": "<|video_pad|>",
}


def qwen_image_edit(path):
    """QwenImageEditPipeline: Qwen-Image's parts (`qwen_image_parts`) with a VAE of factor 16, so that the ~1024^2-pixel
    copy the pipeline makes of every input image (`calculate_dimensions`) is ~32 x 32 tokens; the tokenizer with
    Qwen2.5-VL's vision tokens, and a Qwen2VLProcessor whose image processor matches the tiny vision tower (2-pixel
    patches, no merge, one frame) and shrinks the encoder's copy to at most 24^2 pixels (144 patches). Saved as a
    Qwen2VLProcessor without its video processor (Qwen2VLVideoProcessor needs torchvision, absent here; editing never
    calls it): the folder's processor loads with `qwenimage_edit.load_processor` (and with Qwen2VLProcessor where
    torchvision is installed)."""
    import json
    from pathlib import Path

    from diffusers import QwenImageEditPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = qwen_tokenizer(max_length=1024)
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS.values())})
    parts = qwen_image_parts(tok, vae_downsamples=4, vae_base=4)  # 4 channels: the 1024^2 encode in ~1 s
    QwenImageEditPipeline(tokenizer=tok, processor=None, **parts).save_pretrained(path)
    images = Qwen2VLImageProcessorPil(patch_size=2, merge_size=1, temporal_patch_size=1, min_pixels=64, max_pixels=576)
    folder = Path(path) / "processor"
    tok.save_pretrained(folder)
    images.save_pretrained(folder)
    index = json.loads((Path(path) / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (Path(path) / "model_index.json").write_text(json.dumps(index, indent=2))
    return str(path)


def z_image(path):
    """ZImagePipeline: a Qwen3 text encoder (hidden_states[-2]), a FLUX.1-style VAE (factor 2, scale/shift factors),
    Z-Image-Turbo's static shift 3."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tok = qwen_tokenizer(max_length=64)
    text_encoder = qwen3(tok, layers=2, causal_lm=False)
    torch.manual_seed(1)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=16,
        axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer
    ).save_pretrained(path)
    return str(path)


def wan(path):
    """WanPipeline (Wan2.1 T2V layout): UMT5 encoder (the byte-level tokenizer stands in for umt5's), a 3-D VAE with
    one spatial-and-temporal downsampling (factors 2 and 2), FlowMatchEuler with a static shift 3 (the released
    configs ship UniPC; models/wan.py samples with this Euler scheduler at the same flow_shift)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tok = qwen_tokenizer(max_length=32)
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tok), d_model=16, d_kv=8, num_heads=2, num_layers=1, d_ff=32, pad_token_id=tok.pad_token_id)
    )
    torch.manual_seed(1)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=1,
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.7, 1.2, 2.0],
        scale_factor_temporal=2,
        scale_factor_spatial=2,
    )
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipe.save_pretrained(path)
    return str(path)


def flux2_dev(path):
    """Flux2Pipeline (guidance embedding): a Mistral-3 text encoder deep enough for layers 10/20/30 (hidden 16) whose
    tokenizer is the byte-level one with a chat template (the real one is a PixtralProcessor; for text alone both
    answer `apply_chat_template` the same way); transformer, VAE and scheduler as klein's."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = qwen_tokenizer(max_length=256)  # the system message (~190 bytes) and the prompt fit
    torch.manual_seed(0)
    text = dict(
        model_type="mistral",
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=30,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        model_type="pixtral",
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=16,
        patch_size=4,
    )
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision))
    transformer, vae, scheduler = flux2_parts(guidance_embeds=True)
    Flux2Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer
    ).save_pretrained(path)
    return str(path)


def sana(path):
    """SanaPipeline: Gemma-2 text encoder (the byte-level tokenizer stands in for Gemma's), a 2-stage deep-compression
    autoencoder (factor 2), the released DPM-Solver flow scheduler (flow_shift 3), which the family swaps for Euler."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tok = qwen_tokenizer(max_length=2048)  # the instruction (~1000 bytes) + the prompt
    torch.manual_seed(0)
    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=len(tok),
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            max_position_embeddings=4096,
            pad_token_id=tok.pad_token_id,
        )
    )
    torch.manual_seed(1)
    transformer = SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=8,
        sample_size=16,
        timestep_scale=1.0,
    )
    vae = AutoencoderDC(
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        scaling_factor=0.41407,
    )
    scheduler = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    SanaPipeline(
        tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    ).save_pretrained(path)
    return str(path)


def vae_8x(scaling_factor: float, shift_factor: float):
    """A tiny 8x-downsampling AutoencoderKL with 4 latent channels (Lumina 2 and CogView4 use this layout)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        sample_size=64,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )


def lumina2(path):
    """Lumina2Pipeline: Gemma-2 text encoder (hidden_states[-2], so 2 layers), a 4-block VAE (factor 8, which the
    pipeline hard-codes), static shift 6."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tok = qwen_tokenizer(max_length=256)  # the system prompt (~160 bytes) + the prompt
    torch.manual_seed(0)
    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=len(tok),
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            max_position_embeddings=512,
            pad_token_id=tok.pad_token_id,
        )
    )
    torch.manual_seed(1)
    transformer = Lumina2Transformer2DModel(
        sample_size=4,
        patch_size=2,
        in_channels=4,
        hidden_size=16,
        num_layers=1,
        num_refiner_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(4, 2, 2),
        axes_lens=(512, 32, 32),
        cap_feat_dim=8,
    )
    vae = vae_8x(scaling_factor=0.3611, shift_factor=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=6.0)
    Lumina2Pipeline(
        transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder, tokenizer=tok
    ).save_pretrained(path)
    return str(path)


def cogview4(path):
    """CogView4Pipeline: a GLM text encoder with the byte-level tokenizer padding on the left (as GLM-4's), a 4-block
    VAE (factor 8, CogView4's), the released scheduler config (linear time shift, dynamic)."""
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from tokenizers.processors import TemplateProcessing
    from transformers import GlmConfig, GlmModel

    tok = qwen_tokenizer(max_length=1024, padding_side="left")  # as GLM-4's; the pipeline's max_sequence_length
    start = tok.convert_tokens_to_ids("<|im_start|>")  # a leading special token, as GLM-4's [gMASK]: "" is not empty
    tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", start)])
    torch.manual_seed(0)
    text_encoder = GlmModel(
        GlmConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=512,
            pad_token_id=tok.pad_token_id,
        )
    )
    torch.manual_seed(1)
    transformer = CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        text_embed_dim=16,
        time_embed_dim=8,
        condition_dim=4,
        pos_embed_max_size=16,
        sample_size=8,
        rope_axes_dim=(4, 4),
    )
    vae = vae_8x(scaling_factor=1.0, shift_factor=0.0)
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    CogView4Pipeline(
        tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    ).save_pretrained(path)
    return str(path)


def vae_2x(scaling_factor: float, shift_factor=None):
    """A tiny 2x-downsampling AutoencoderKL with 4 latent channels (Chroma's and AuraFlow's layout at tiny size)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )


def chroma(path):
    """ChromaPipeline: a T5 encoder (the byte-level tokenizer stands in for T5's), a FLUX.1-style VAE (factor 2,
    scale/shift factors), FLUX.1-dev's dynamically shifted scheduler config."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    tok = qwen_tokenizer(max_length=32)  # the test prompts and negative prompt (at most 19 bytes) leave padding
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(tok), d_model=16, d_kv=8, num_heads=2, num_layers=1, d_ff=32, pad_token_id=tok.pad_token_id)
    )
    torch.manual_seed(1)
    transformer = ChromaTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=1,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    ChromaPipeline(
        scheduler=scheduler,
        vae=vae_2x(scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    ).save_pretrained(path)
    return str(path)


def auraflow(path):
    """AuraFlowPipeline: a UMT5 encoder (the byte-level tokenizer stands in for Pile-T5's), an SDXL-style VAE (factor
    2, a scaling factor and no shift), the released scheduler config (static shift 1.73)."""
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    tok = qwen_tokenizer(max_length=32)
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tok), d_model=16, d_kv=8, num_heads=2, num_layers=1, d_ff=32, pad_token_id=tok.pad_token_id)
    )
    torch.manual_seed(1)
    transformer = AuraFlowTransformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=1,
        num_single_dit_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=256,
    )
    # AuraFlow adds attention to the residual stream only through its gated feed-forward (`gate_msa`, then `gate_mlp`):
    # at random init the gates are ~0.04 and a LoRA on the attention moves the images by ~1e-5, below the tolerance;
    # gates ~0.4 make the adapted path show (a trained model's gates are not small either)
    with torch.no_grad():
        for name, module in transformer.named_modules():
            if name.endswith(("norm1.linear", "norm1_context.linear")):
                module.weight.mul_(10)
    AuraFlowPipeline(
        tokenizer=tok,
        text_encoder=text_encoder,
        vae=vae_2x(scaling_factor=0.13025),
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.73),
    ).save_pretrained(path)
    return str(path)


def ltx(path):
    """LTXPipeline: a T5 encoder (the byte-level tokenizer stands in for T5's), a timestep-conditioned LTX VAE (0.9.1+)
    with one spatio-temporal halving (ratios 2 and 2) and non-trivial latents_mean/std/scaling_factor, the released
    scheduler config's form (dynamic shift, shift_terminal 0.1)."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    tok = qwen_tokenizer(max_length=32)
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(tok), d_model=16, d_kv=8, num_heads=2, num_layers=1, d_ff=32, pad_token_id=tok.pad_token_id)
    )
    torch.manual_seed(1)
    transformer = LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        caption_channels=16,
    )
    vae = AutoencoderKLLTXVideo(
        latent_channels=4,
        block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, False),
        decoder_spatio_temporal_scaling=(True, False),
        decoder_inject_noise=(False, False, False),
        downsample_type=("conv", "conv"),
        upsample_residual=(False, False),
        upsample_factor=(1, 1),
        timestep_conditioning=True,
        patch_size=1,
        patch_size_t=1,
        scaling_factor=0.8,
    )
    vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    vae.latents_std.copy_(torch.tensor([1.5, 0.7, 1.2, 2.0]))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    LTXPipeline(
        tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    ).save_pretrained(path)
    return str(path)


def word_tokenizer(texts, max_length: int, eos: bool):
    """A word-level tokenizer (whitespace and punctuation split) over the words of `texts`, unknown words -> [UNK];
    `eos`: append </s> (CLIP pools its text at that token, so the pooled vector then depends on the whole prompt)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "</s>"]
    words = dict.fromkeys(w for t in texts for w, _ in Whitespace().pre_tokenize_str(t))
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate([*specials, *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    if eos:
        tok.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>", model_max_length=max_length
    )


def hunyuan_video(path):
    """HunyuanVideoPipeline (the released T2V: guidance embedding): a Llama encoder (hidden_states[-3]) whose word-level
    tokenizer makes the pipeline's prompt template 99 tokens before the prompt, so its fixed crop of 95 keeps the prompt
    and 256 + 95 tokens hold it whole; a CLIP text encoder for the pooled vector (its tokenizer appends </s>, id 2, which
    CLIP pools at); a 3-block causal 3-D VAE (spatial ratio 4, temporal 4); static shift 7."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    words = [DEFAULT_PROMPT_TEMPLATE["template"], "a red circle two blue squares square blurry, low quality"]
    tok, tok_2 = word_tokenizer(words, 1024, eos=False), word_tokenizer(words, 77, eos=True)
    torch.manual_seed(0)
    text_encoder = LlamaModel(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=512,
            pad_token_id=tok.pad_token_id,
        )
    )
    text_encoder_2 = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok_2),
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            pad_token_id=0,
            eos_token_id=2,
        )
    )
    torch.manual_seed(1)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4),
    )
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3,
        block_out_channels=(8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
        mid_block_add_attention=False,
    )
    HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tok_2,
    ).save_pretrained(path)
    return str(path)


def flux_kontext(path, guidance_embeds: bool = True):
    """FluxKontextPipeline on conftest's tiny FLUX.1 parts (`tiny_flux_parts`: a VAE of 32 pixels here, the tokenizer
    with the edit words too); `guidance_embeds` as FLUX.1-Kontext-dev (guidance-distilled)."""
    from conftest import tiny_flux_parts
    from diffusers import FluxKontextPipeline

    words = ["a", "red", "blue", "circle", "square", "and", "make", "the", "remove", "add"]
    FluxKontextPipeline(**tiny_flux_parts(words, guidance_embeds, 32)).save_pretrained(path)
    return str(path)


def flux_kontext_schnell(path):
    """`flux_kontext` without a guidance embedding (the scale is ignored, as FLUX.1-schnell's)."""
    return flux_kontext(path, guidance_embeds=False)
