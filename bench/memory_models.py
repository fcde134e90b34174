"""The models ``bench/memory.py`` estimates: real ComfyUI classes at the released files' configs.

Each config comes from ComfyUI's own detection (``comfy.model_detection.detect_unet_config``) run on a
*probe*: the few keys and shapes of the released checkpoint that detection reads (shapes on the meta
device, so nothing is allocated). SDXL's UNet detection reads hundreds of keys; its config is the one
detection returns for the released file (the ``SDXL`` entry of ComfyUI's ``unet_config_from_diffusers_unet``
list, the same dict ``supported_models.SDXL`` matches). The model is then built by
``model_config_from_unet_config`` (the class ComfyUI's supported_models picks), under the caller's
FakeTensorMode when real sizes are estimated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _flux_probe(hidden: int, depth: int, single: int, context: int, *, flux2: bool, vec: int | None,
                guidance: bool) -> dict[str, torch.Tensor]:
    in_ch = 128 if flux2 else 64  # img_in input: Flux.2 128 latent channels (patch 1); Flux.1 16 x 2 x 2
    sd = {"img_in.weight": _meta(hidden, in_ch), "txt_in.weight": _meta(hidden, context)}
    sd.update({f"double_blocks.{i}.img_attn.norm.key_norm.scale": _meta(128) for i in range(depth)})
    sd.update({f"single_blocks.{i}.linear1.weight": _meta(1) for i in range(single)})
    if flux2:
        sd["double_stream_modulation_img.lin.weight"] = _meta(1)
    if vec:
        sd["vector_in.in_layer.weight"] = _meta(hidden, vec)
    if guidance:
        sd["guidance_in.in_layer.weight"] = _meta(hidden, 256)
    return sd


def _cosmos_probe(channels: int, blocks: int, anima: bool) -> dict[str, torch.Tensor]:
    sd = {"x_embedder.proj.1.weight": _meta(channels, 4 * 17)}
    sd.update({f"blocks.{i}.mlp.layer1.weight": _meta(1) for i in range(blocks)})
    if anima:
        sd["llm_adapter.blocks.0.cross_attn.q_proj.weight"] = _meta(1)
    return sd


def _qwen_image_probe() -> dict[str, torch.Tensor]:
    sd = {"txt_norm.weight": _meta(3584), "img_in.weight": _meta(3072, 64), "proj_out.weight": _meta(64, 3072)}
    sd.update({f"transformer_blocks.{i}.attn.to_q.weight": _meta(1) for i in range(60)})
    return sd


def _z_image_probe() -> dict[str, torch.Tensor]:
    sd = {"cap_embedder.1.weight": _meta(3840, 2560), "noise_refiner.0.attention.k_norm.weight": _meta(128),
          "x_embedder.weight": _meta(3840, 64)}
    sd.update({f"layers.{i}.ffn_norm1.weight": _meta(3840) for i in range(30)})
    return sd


SDXL_CONFIG = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
    "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
    "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
    "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}


@dataclass(frozen=True)
class ModelSpec:
    """A released model: its probe (or config), text tokens, and what it is."""

    name: str
    about: str
    probe: Callable[[], dict[str, torch.Tensor]] | None
    config: dict | None = None
    text_tokens: int = 512


MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("flux1-dev", "Flux.1 dev, 12 B: 19 double + 38 single blocks, 3072 wide",
              lambda: _flux_probe(3072, 19, 38, 4096, flux2=False, vec=768, guidance=True)),
    ModelSpec("flux2-klein-4b", "Flux.2 klein 4B: 5 double + 20 single blocks, 3072 wide, Qwen3-4B text",
              lambda: _flux_probe(3072, 5, 20, 7680, flux2=True, vec=None, guidance=False)),
    ModelSpec("flux2-klein-9b", "Flux.2 klein 9B: 8 double + 24 single blocks, 4096 wide, Qwen3-8B text",
              lambda: _flux_probe(4096, 8, 24, 12288, flux2=True, vec=None, guidance=False)),
    ModelSpec("flux2-dev", "Flux.2 dev, 32 B: 8 double + 48 single blocks, 6144 wide, Mistral-24B text",
              lambda: _flux_probe(6144, 8, 48, 15360, flux2=True, vec=None, guidance=True)),
    ModelSpec("cosmos-predict2-2b", "Cosmos-Predict2 2B text-to-image: 28 blocks, 2048 wide",
              lambda: _cosmos_probe(2048, 28, anima=False)),
    ModelSpec("anima", "Anima: Cosmos-Predict2 2B DiT + LLM adapter (ComfyUI 0.33+)",
              lambda: _cosmos_probe(2048, 28, anima=True)),
    ModelSpec("qwen-image", "Qwen-Image, 20 B: 60 blocks, 3072 wide", _qwen_image_probe),
    ModelSpec("z-image", "Z-Image (Turbo), 6 B: 30 layers, 3840 wide", _z_image_probe),
    ModelSpec("sdxl", "SDXL base UNet, 2.6 B", None, config=SDXL_CONFIG, text_tokens=77),
)}


def unet_config(name: str) -> dict:
    """The config ComfyUI's detection derives for the released ``name`` (ValueError for unknown names, or
    when this ComfyUI does not know the family)."""
    import comfy.model_detection

    spec = MODELS.get(name)
    if spec is None:
        raise ValueError(f"bench/memory.py: --model {name!r} is unknown; known: {', '.join(MODELS)}")
    if spec.config is not None:
        return dict(spec.config)
    config = comfy.model_detection.detect_unet_config(spec.probe(), "")
    if config is None or comfy.model_detection.model_config_from_unet_config(config) is None:
        raise ValueError(f"bench/memory.py: this ComfyUI cannot build {name} ({spec.about}); use ComfyUI 0.33 or newer")
    return config


def build(config: dict, weight_dtype: torch.dtype, compute_dtype: torch.dtype | None,
          fit_flux: Callable[[dict], dict] = lambda c: c, operations: Any = None) -> Any:
    """A ModelPatcher around the real class for ``config``: weights stored in ``weight_dtype``, computed in
    ``compute_dtype`` (ComfyUI's manual cast, e.g. fp8 weights computed in bf16; None = the weight dtype).
    Weights are ``torch.empty`` as ComfyUI's ops leave them (fake under a FakeTensorMode). ``fit_flux``:
    the pack's ``comfy_compat.fit_flux_config`` (Flux configs fitted to this ComfyUI's FluxParams).
    ``operations``: the layers' ops, as a loader's ``custom_operations`` (ComfyUI-GGUF's ``GGMLOps``: its Linear
    layers start without weights, ``bench/memory.py``'s ``gguf_layout`` says what to give them)."""
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher

    if config.get("image_model") in ("flux", "flux2"):
        config = fit_flux(config)
    model_config = comfy.model_detection.model_config_from_unet_config(config)
    if model_config is None:
        raise ValueError(f"bench/memory.py: ComfyUI has no model class for {config}")
    model_config.set_inference_dtype(weight_dtype, compute_dtype)
    if operations is not None:
        model_config.custom_operations = operations
    model = model_config.get_model({}, "")
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)
