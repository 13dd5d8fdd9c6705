"""Model-family registry: pipeline class name (model_index.json's `_class_name`) -> `common.Family`.

One file per family holds only what differs from SD3 (the transformer call, prompt encoding, guidance mode, schedule
shift, latent layout, latent un-normalisation, default LoRA targets). Importing this package registers them with
`common`, whose sampler, `PromptEncoder`, `load_pipeline` and `decode` call what the family holds; common never imports
models/, so the arrows point one way: algos -> models -> common.
"""

import common

from . import cogview4, flux, flux2, lumina2, qwenimage, sana, sd3, wan, zimage

FAMILIES = {}
for _module in (sd3, flux, flux2, qwenimage, zimage, wan, sana, lumina2, cogview4):
    common.register(_module.FAMILY)
    FAMILIES.update({name: _module.FAMILY for name in _module.FAMILY.pipelines})

load = common.load_pipeline
