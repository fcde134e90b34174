"""What a diffusion model is: family, attention heads, head_dim, default softmax scale.

Of a loaded model (``describe_model``, for the nodes' info outputs), and of a model file from its header
alone (``describe_file``), which the read-only route ``GET /precision_lora/model/info?name=<name in
models/diffusion_models>`` answers as ``{"name", "family", "heads", "head_dim", "default_scale"}`` so the
attention node can show its resolved scale before anything runs. Names are checked by
``file_names.find_model_file`` against the diffusion_models folders; ``register()`` binds the route to
ComfyUI's folder list and server. ComfyUI is imported only inside the functions that need it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ...attention.config import default_scale
from ..checks.file_names import FileRoute, QueryRefused

MODEL_ROUTE = "/precision_lora/model/info"
# Files whose architecture ComfyUI cannot detect from tensor shapes alone (e.g. Flux at other than 24 x 128
# heads) carry their unet config as JSON under this metadata key; the loader builds them from it.
UNET_CONFIG_KEY = "precision_lora.unet_config"

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
        return None if not self.head_dim else default_scale(self.head_dim)

    def describe(self) -> str:
        scale = "unknown" if self.default_scale is None else f"{self.default_scale:.6g}"
        return (f"family: {self.family} ({self.config_name})\nattention heads: {self.heads}\n"
                f"head_dim: {self.head_dim}\ndefault softmax scale 1/sqrt(head_dim): {scale}\n"
                f"parameters: {self.parameters:,}\nweight dtype: {self.dtype}")


def heads_and_dim(unet_config: dict, diffusion_model) -> tuple[int | None, int | None]:
    # MiniMax H3 states both (detection reads them from the weights); its width is not heads x head_dim (5376 wide,
    # 56 heads of 128)
    if unet_config.get("image_model") == "minimax_h3" and unet_config.get("attention_head_dim"):
        heads = unet_config.get("num_attention_heads")
        return (int(heads) if heads else None), int(unet_config["attention_head_dim"])
    # Lumina 2 / Z-Image (NextDiT) name their heads "n_heads"
    heads = (unet_config.get("num_heads") or getattr(diffusion_model, "num_heads", None)
             or (unet_config.get("n_heads") if unet_config.get("image_model") == "lumina2" else None))
    # Wan, Lumina 2 and Z-Image name their width "dim" (their attention modules keep num_heads / head_dim or
    # n_local_heads / head_dim, not heads / dim_head)
    width = (unet_config.get("hidden_size") or unet_config.get("model_channels")
             or getattr(diffusion_model, "hidden_size", None) or getattr(diffusion_model, "model_channels", None)
             or (unet_config.get("dim") if unet_config.get("image_model") in ("wan2.1", "lumina2") else None))
    if heads and width and unet_config.get("image_model"):
        return int(heads), int(width) // int(heads)
    if unet_config.get("num_head_channels", -1) > 0:  # SD-style UNets: fixed head width
        return None, int(unet_config["num_head_channels"])
    return (int(heads) if heads else None), None


def attention_modules_head_dim(diffusion_model) -> tuple[int | None, int | None]:
    """(heads, head_dim) that every attention module of the model states itself (ComfyUI's attention classes keep
    ``heads`` and ``dim_head``), or (None, None) when none does or they differ. For models whose config names
    neither (Qwen-Image: detection gives only its block count; the widths are the class defaults)."""
    found = {(m.heads, m.dim_head) for m in diffusion_model.modules()
             if isinstance(getattr(m, "heads", None), int) and isinstance(getattr(m, "dim_head", None), int)}
    return found.pop() if len(found) == 1 else (None, None)


def describe_model(model) -> ModelInfo:
    """Describe a ComfyUI ModelPatcher (or BaseModel)."""
    base = getattr(model, "model", model)
    config = base.model_config
    name = type(config).__name__
    heads, head_dim = heads_and_dim(dict(config.unet_config), base.diffusion_model)
    if head_dim is None:
        module_heads, head_dim = attention_modules_head_dim(base.diffusion_model)
        heads = heads or module_heads
    params = sum(p.numel() for p in base.diffusion_model.parameters())
    dtype = str(base.get_dtype()).replace("torch.", "")
    return ModelInfo(FAMILY_BY_CONFIG.get(name, name), name, heads, head_dim, params, dtype)


def _file_unet_config(path: str) -> dict:
    """The unet config of a model file: embedded in its metadata, else detected by ComfyUI from tensors on
    the meta device that have the file's shapes (nothing is read but the header)."""
    import torch
    from safetensors import safe_open

    import comfy.model_detection

    try:
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:
        raise QueryRefused(422, f"model info: not a readable safetensors file ({type(e).__name__}: {e})") from e
    if UNET_CONFIG_KEY in metadata:
        return json.loads(metadata[UNET_CONFIG_KEY])
    sd = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    try:
        # As ComfyUI's diffusion-model loader: strip a checkpoint prefix only when keys carry it.
        prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
        if not any(k.startswith(prefix) for k in sd):
            prefix = ""
        unet_config = comfy.model_detection.detect_unet_config(sd, prefix, metadata=metadata)
    except Exception as e:
        raise QueryRefused(422, f"model info: ComfyUI could not detect the model type ({type(e).__name__}: {e})") from e
    if unet_config is None:
        raise QueryRefused(422, "model info: not a diffusion model ComfyUI recognises")
    return dict(unet_config)


def describe_file(path: str) -> dict[str, object]:
    """Family, heads, head_dim and default scale of a diffusion model file, from its header (ComfyUI needed).

    Raises QueryRefused(422) when the file is unreadable or not a model ComfyUI recognises.
    """
    import comfy.model_detection

    unet_config = _file_unet_config(path)
    if "num_heads" not in unet_config and unet_config.get("image_model") in ("cosmos_predict2", "anima"):
        # Detection leaves heads to the model class's default (not stored in the file).
        import inspect

        from comfy.ldm.cosmos.predict2 import MiniTrainDIT

        unet_config["num_heads"] = inspect.signature(MiniTrainDIT.__init__).parameters["num_heads"].default
    heads, head_dim = heads_and_dim(unet_config, None)
    config = comfy.model_detection.model_config_from_unet_config(unet_config, None)
    config_name = type(config).__name__ if config is not None else str(unet_config.get("image_model", "unknown"))
    return {
        "family": FAMILY_BY_CONFIG.get(config_name, config_name),
        "heads": heads,
        "head_dim": head_dim,
        "default_scale": default_scale(head_dim) if head_dim else None,
    }


MODEL_INFO_ROUTE = FileRoute(MODEL_ROUTE, "diffusion_models", "model info", describe_file)
lookup = MODEL_INFO_ROUTE.lookup
register = MODEL_INFO_ROUTE.register  # idempotent
