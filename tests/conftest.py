import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a hub
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def random_pipeline_dir(tmp_path_factory):
    """A small random-weight SD3 pipeline built from configs (shift 3 like SD3.5), saved and reloadable offline."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from assets import build_tiny_shapes as recipe

    words = ["a", "red", "blue", "circle", "square", "and"]
    tok = recipe.build_tokenizer(words)
    pipe = StableDiffusion3Pipeline(
        transformer=recipe.build_transformer(seed=0, layers=2),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=recipe.build_vae(seed=1),
        text_encoder=recipe.build_text_encoder(tok, seed=2),
        tokenizer=tok,
        text_encoder_2=recipe.build_text_encoder(tok, seed=3),
        tokenizer_2=tok,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    path = tmp_path_factory.mktemp("pipe") / "random-sd3"
    pipe.save_pretrained(path)
    return str(path)
