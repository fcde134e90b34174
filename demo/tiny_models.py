"""Tiny random-weight models built from ComfyUI's real model classes (tests and the demo server).

Nothing here is downloaded or committed: weights come from a seeded generator. Cosmos-Predict2 files
load through ComfyUI's stock detection (model_channels 192, 16 heads), and so do Anima files (the same tiny
DiT plus ComfyUI's LLM adapter at its one real size, ~135 M parameters; ComfyUI 0.33+ only, see
docs/anima.md); Flux.1 / Flux.2 detection fixes
heads at 24 x 128, so tiny Flux files carry their config in the safetensors metadata key
``precision_lora.unet_config``, which ``PrecisionLoadDiffusionModel`` reads (stock ComfyUI cannot load them).
"""
from __future__ import annotations

import json
import math
import os

import torch

import comfy.model_detection
import comfy.model_management
import comfy.model_patcher

from ..nodes.host.comfy_compat import comfyui_version, fit_flux_config, set_reload
from ..nodes.model.load import MODEL_CLASS_KEY, UNET_CONFIG_KEY, build_model_from_config


_FLUX_COMMON = {
    "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 64, "hidden_size": 64,
    "mlp_ratio": 4.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "axes_dim": [8, 12, 12],
    "theta": 10000, "patch_size": 2, "qkv_bias": True,
}
TINY_UNET_CONFIGS: dict[str, dict] = {
    "flux1_dev": {"image_model": "flux", **_FLUX_COMMON, "guidance_embed": True},
    "flux1_schnell": {"image_model": "flux", **_FLUX_COMMON, "guidance_embed": False},
    "flux2": {
        "image_model": "flux2", "in_channels": 128, "out_channels": 128, "vec_in_dim": None,
        "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 3.0, "num_heads": 2, "depth": 1,
        "depth_single_blocks": 1, "axes_dim": [8, 8, 8, 8], "theta": 2000, "patch_size": 1,
        "qkv_bias": False, "ops_bias": False, "global_modulation": True, "mlp_silu_act": True,
        "default_ref_method": "index", "ref_index_scale": 10.0, "guidance_embed": True,
    },
}
# The smallest Flux.1 that ComfyUI's stock detection accepts (heads fixed at 24 x 128): ~389 M parameters.
TINY_UNET_CONFIGS["flux1_stock"] = {
    **TINY_UNET_CONFIGS["flux1_dev"], "hidden_size": 3072, "num_heads": 24, "axes_dim": [16, 56, 56],
    "context_in_dim": 4096, "vec_in_dim": 768, "depth": 1, "depth_single_blocks": 0,
}
# SDXL's layout (linear transformers, the 2816-wide label embedding, ResBlocks, down/upsamplers), 32 channels wide:
# ComfyUI's SDXL class, named in the file's metadata (MODEL_CLASS_KEY): detection matches full-size SDXL only
TINY_UNET_CONFIGS["sdxl"] = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
    "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4, "model_channels": 32,
    "num_res_blocks": [1, 1], "transformer_depth": [0, 1], "channel_mult": [1, 2], "transformer_depth_middle": 1,
    "use_linear_in_transformer": True, "context_dim": 64, "num_head_channels": 16,
    "transformer_depth_output": [0, 0, 1, 1], "use_temporal_attention": False, "use_temporal_resblock": False,
}
MODEL_CLASSES = {"sdxl": "SDXL"}
STOCK_DETECTABLE = ("cosmos", "anima", "flux1_stock")  # files of these need no config in their metadata
COSMOS_CHANNELS = 192
COSMOS_BLOCKS = 10
FAMILIES = ("cosmos", "anima", *TINY_UNET_CONFIGS)
# The key by which ComfyUI's detection tells an Anima file from a plain Cosmos-Predict2 one.
ANIMA_ADAPTER_KEY = "llm_adapter.blocks.0.cross_attn.q_proj.weight"


def cosmos_unet_config(anima: bool = False) -> dict:
    """The config ComfyUI's own detection derives for a 192-channel Cosmos-Predict2 DiT (``anima``: with
    Anima's LLM adapter)."""
    # Newer ComfyUI counts the blocks in the file; 0.3.75 takes MiniTrainDIT's default of 10.
    probe = {f"blocks.{i}.mlp.layer1.weight": torch.empty(0) for i in range(COSMOS_BLOCKS)}
    probe["x_embedder.proj.1.weight"] = torch.empty(COSMOS_CHANNELS, 4 * 17)
    if anima:
        probe[ANIMA_ADAPTER_KEY] = torch.empty(0)
    return comfy.model_detection.detect_unet_config(probe, "")


def anima_unavailable() -> str | None:
    """Why this ComfyUI cannot build Anima (it has no ``comfy.ldm.anima``: 0.3.75), or None."""
    try:
        import comfy.ldm.anima.model  # noqa: F401
    except ImportError:
        return f"Anima does not exist in ComfyUI {'.'.join(map(str, comfyui_version()))}"
    return None


def anima_unet_config() -> dict:
    """The config ComfyUI's detection derives for a tiny Anima: the 192-channel DiT + the LLM adapter."""
    reason = anima_unavailable()
    config = cosmos_unet_config(anima=True) if reason is None else None
    if config is None or config.get("image_model") != "anima":
        raise ValueError(f"tiny model family 'anima': {reason or 'detection did not give anima'}; "
                         "use ComfyUI 0.33 or newer")
    return config


def cosmos_width_config(width: int, blocks: int) -> dict:
    """A Cosmos-Predict2 config of ``width`` channels in heads of 128 (the released 2B model: 2048 channels,
    16 heads, 28 blocks) and ``blocks`` blocks: real layer widths at a size a CPU can train (benchmarks)."""
    if width < 128 or width % 128 or blocks < 1:
        raise ValueError(f"cosmos width={width!r}, blocks={blocks!r}: use a multiple of 128 and >= 1 block")
    return {**cosmos_unet_config(), "model_channels": width, "num_blocks": blocks, "num_heads": width // 128}


def unet_config_for(family: str) -> dict:
    if family == "cosmos":
        return cosmos_unet_config()
    if family == "anima":
        return anima_unet_config()
    if family not in TINY_UNET_CONFIGS:
        raise ValueError(f"unknown tiny model family {family!r}; known: {', '.join(FAMILIES)}")
    if family in MODEL_CLASSES:
        return dict(TINY_UNET_CONFIGS[family])
    return fit_flux_config(TINY_UNET_CONFIGS[family])


def _init_weights(module: torch.nn.Module, seed: int) -> None:
    """ComfyUI ops leave weights as torch.empty: fill them deterministically (fan-in scaled)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            elif name.endswith(("scale", "norm.weight")) or ".norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def build_tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                     unet_config: dict | None = None) -> comfy.model_patcher.ModelPatcher:
    """A tiny random-weight model of ``family`` (see FAMILIES), built in-process, training-safe tensors.

    ``unet_config`` replaces the family's tiny config (e.g. ``cosmos_width_config``)."""
    config = unet_config or unet_config_for(family)
    with torch.inference_mode(False):
        metadata = {MODEL_CLASS_KEY: MODEL_CLASSES[family]} if family in MODEL_CLASSES else None
        patcher = build_model_from_config(config, None, torch.float32, metadata)
        _init_weights(patcher.model.diffusion_model, seed)
        if dtype != torch.float32:
            sd = tiny_state_dict(patcher)
            patcher = build_model_from_config(config, None, dtype, metadata)
            patcher.model.load_model_weights(sd, "")
    return set_reload(patcher, _rebuild_tiny, family, seed, dtype, unet_config)


def _rebuild_tiny(family: str, seed: int, dtype: torch.dtype, unet_config: dict | None,
                  disable_dynamic: bool = False) -> comfy.model_patcher.ModelPatcher:
    """The same tiny model again (seeded weights), for ComfyUI's deep copies (``comfy_compat.set_reload``)."""
    return build_tiny_model(family, seed, dtype, unet_config)


def tiny_state_dict(patcher: comfy.model_patcher.ModelPatcher) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in patcher.model.diffusion_model.state_dict().items()}


def write_tiny_model(family: str, path: str, seed: int = 0) -> str:
    """Write a tiny model file that PrecisionLoadDiffusionModel loads (atomically). Returns the path."""
    import safetensors.torch

    patcher = build_tiny_model(family, seed)
    metadata = {"precision_lora.tiny_family": family}
    if family not in STOCK_DETECTABLE:
        metadata[UNET_CONFIG_KEY] = json.dumps(unet_config_for(family))
    if family in MODEL_CLASSES:
        metadata[MODEL_CLASS_KEY] = MODEL_CLASSES[family]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.partial"
    safetensors.torch.save_file(tiny_state_dict(patcher), tmp, metadata=metadata)
    os.replace(tmp, path)
    return path


def demo_model_filename(family: str) -> str:
    return f"precision_tiny_{family}.safetensors"
