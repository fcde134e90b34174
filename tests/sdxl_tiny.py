"""A tiny SDXL UNet built from ComfyUI's own classes (``comfy.supported_models.SDXL``, ``comfy.model_base.SDXL``,
openaimodel's ``UNetModel``): SDXL's layout (linear transformers, the 2816-wide label embedding, ResBlocks with
3x3 and 1x1 convs, down/upsamplers) 32 channels wide, seeded weights; and its conditioning."""
from __future__ import annotations

import torch

from comfy_harness import pack_module

TINY_SDXL = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
    "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4, "model_channels": 32,
    "num_res_blocks": [1, 1], "transformer_depth": [0, 1], "channel_mult": [1, 2], "transformer_depth_middle": 1,
    "use_linear_in_transformer": True, "context_dim": 64, "num_head_channels": 16,
    "transformer_depth_output": [0, 0, 1, 1], "use_temporal_attention": False, "use_temporal_resblock": False,
}


def tiny_sdxl(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A ModelPatcher around ComfyUI's SDXL model class with the tiny config above (fp32 weights by default)."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    with torch.inference_mode(False):
        config = comfy.supported_models.SDXL(dict(TINY_SDXL))
        config.set_inference_dtype(dtype, None)
        model = config.get_model({}, "")
        pack_module("demo.tiny_models")._init_weights(model.diffusion_model, seed)
        with torch.no_grad():  # _init_weights gives GroupNorm scales (in_layers.0.weight, ...) ~0.02: make them ~1
            for m in model.diffusion_model.modules():
                if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                    m.weight.add_(1.0)
        model.diffusion_model.to(dtype)
    return comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                            offload_device=comfy.model_management.unet_offload_device())


def sdxl_conditioning(seed: int = 0, tokens: int = 8) -> list:
    """CONDITIONING for the tiny SDXL: context (1, tokens, 64) and CLIP-G's pooled output (1, 1280)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn((1, tokens, 64), generator=g), {"pooled_output": torch.randn((1, 1280), generator=g),
                                                          "width": 256, "height": 256}]]


def sdxl_denoise(model, seed: int = 0) -> torch.Tensor:
    """One euler step through ComfyUI's sampler on a 32x32-pixel latent (4 x 4 x 4), as KSampler runs it."""
    import comfy.sample

    latent = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(seed))
    cond = sdxl_conditioning()
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent, disable_pbar=True,
                                   seed=seed)
