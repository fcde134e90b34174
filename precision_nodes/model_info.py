"""What a loaded ComfyUI model is: family, attention heads, head_dim, default softmax scale."""
from __future__ import annotations

import math
from dataclasses import dataclass

FAMILY_BY_CONFIG = {
    "Flux": "flux1", "FluxSchnell": "flux1", "FluxInpaint": "flux1", "Flux2": "flux2",
    "Chroma": "chroma", "ChromaRadiance": "chroma",
    "CosmosT2IPredict2": "cosmos_predict2", "CosmosI2VPredict2": "cosmos_predict2",
    # Anima (ComfyUI 0.33+) is a Cosmos-Predict2 DiT plus an LLM adapter: its own family, so a LoRA that
    # holds adapter keys is not labelled as a Cosmos-Predict2 LoRA; its presets are Cosmos's (targets.py).
    "Anima": "anima",
    "QwenImage": "qwen_image", "Lumina2": "lumina2", "ZImage": "lumina2", "HiDream": "hidream",
    "SD15": "sd15", "SDXL": "sdxl", "SD3": "sd3",
}


@dataclass(frozen=True)
class ModelInfo:
    family: str          # short family id ("flux1", "flux2", "cosmos_predict2", ...) or the config class name
    config_name: str     # ComfyUI supported-model class name
    heads: int | None
    head_dim: int | None
    parameters: int
    dtype: str

    @property
    def default_scale(self) -> float | None:
        return None if not self.head_dim else 1.0 / math.sqrt(self.head_dim)

    def describe(self) -> str:
        scale = "unknown" if self.default_scale is None else f"{self.default_scale:.6g}"
        return (f"family: {self.family} ({self.config_name})\nattention heads: {self.heads}\n"
                f"head_dim: {self.head_dim}\ndefault softmax scale 1/sqrt(head_dim): {scale}\n"
                f"parameters: {self.parameters:,}\nweight dtype: {self.dtype}")


def heads_and_dim(unet_config: dict, diffusion_model) -> tuple[int | None, int | None]:
    heads = unet_config.get("num_heads") or getattr(diffusion_model, "num_heads", None)
    width = (unet_config.get("hidden_size") or unet_config.get("model_channels")
             or getattr(diffusion_model, "hidden_size", None) or getattr(diffusion_model, "model_channels", None))
    if heads and width and unet_config.get("image_model"):
        return int(heads), int(width) // int(heads)
    if unet_config.get("num_head_channels", -1) > 0:  # SD-style UNets: fixed head width
        return None, int(unet_config["num_head_channels"])
    return (int(heads) if heads else None), None


def describe_model(model) -> ModelInfo:
    """Describe a ComfyUI ModelPatcher (or BaseModel)."""
    base = getattr(model, "model", model)
    config = base.model_config
    name = type(config).__name__
    heads, head_dim = heads_and_dim(dict(config.unet_config), base.diffusion_model)
    params = sum(p.numel() for p in base.diffusion_model.parameters())
    dtype = str(base.get_dtype()).replace("torch.", "")
    return ModelInfo(FAMILY_BY_CONFIG.get(name, name), name, heads, head_dim, params, dtype)
