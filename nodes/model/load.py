"""PrecisionLoadDiffusionModel: load a diffusion model file into weights training can use."""
from __future__ import annotations

import json
import logging
import os

import torch

import comfy.model_detection
import comfy.model_management
import comfy.model_patcher
import comfy.sd
import comfy.supported_models
import comfy.utils
import folder_paths

from ..checks.gate import PrecisionNode
from ..host.comfy_compat import fit_flux_config, set_reload
from ..host.comfy_io import io
from ..host.gguf import GGUF_NODE, gguf_file_advice, refuse_gguf_file
from ..host.quantized import prepare_state_dict, quantized_as_inference
from .info import UNET_CONFIG_KEY, describe_model

log = logging.getLogger(__name__)

NODE = "PrecisionLoadDiffusionModel"
WEIGHT_DTYPES: dict[str, torch.dtype | None] = {
    "default": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


# Metadata naming the ComfyUI model class of a tiny UNet file (demo.tiny_models' "sdxl"): SD1.x/SDXL detection
# matches full-size configs only (320 channels, ...), so a tiny one says which class it is
MODEL_CLASS_KEY = "precision_lora.model_class"
TINY_UNET_CLASSES = ("SDXL",)


def build_model_from_config(unet_config: dict, state_dict: dict | None = None,
                            dtype: torch.dtype | None = torch.float32,
                            metadata: dict | None = None) -> comfy.model_patcher.ModelPatcher:
    """A ModelPatcher around the real ComfyUI model class for ``unet_config`` (weights from state_dict if given).

    Flux configs are fitted to this ComfyUI's ``FluxParams`` (files written on one version load on another).
    A quantized state dict (fp8, ComfyUI's scaled fp8, per-layer ``comfy.quant_ops`` formats) gets the layers
    ComfyUI's own loader builds for it (``host.quantized.prepare_state_dict``); dtype None chooses as
    ComfyUI's loader does, from the file's weight dtype (docs/quantized.md)."""
    if unet_config.get("image_model") in ("flux", "flux2"):
        unet_config = fit_flux_config(unet_config)
    model_config = comfy.model_detection.model_config_from_unet_config(unet_config, state_dict)
    model_class = (metadata or {}).get(MODEL_CLASS_KEY)
    if model_config is None and model_class in TINY_UNET_CLASSES:  # a tiny UNet stock detection cannot match
        model_config = getattr(comfy.supported_models, model_class)(dict(unet_config))
    if model_config is None:
        raise ValueError(f"ComfyUI has no model class matching config {unet_config}")
    per_layer = False
    if state_dict is not None:
        state_dict, per_layer = prepare_state_dict(model_config, state_dict, metadata)
    load_device = comfy.model_management.get_torch_device()
    supported = list(model_config.supported_inference_dtypes)
    if dtype is None:
        stored = None if per_layer or getattr(model_config, "scaled_fp8", None) else comfy.utils.weight_dtype(state_dict or {})
        dtype = comfy.model_management.unet_dtype(model_params=comfy.utils.calculate_parameters(state_dict or {}),
                                                  supported_dtypes=supported, weight_dtype=stored)
    manual_cast = comfy.model_management.unet_manual_cast(None if per_layer else dtype, load_device, supported)
    model_config.set_inference_dtype(dtype, manual_cast)
    model = model_config.get_model(state_dict or {}, "")
    model = model.to(comfy.model_management.unet_offload_device())
    if state_dict is not None:
        model.load_model_weights(state_dict, "")
    return comfy.model_patcher.ModelPatcher(
        model, load_device=load_device, offload_device=comfy.model_management.unet_offload_device()
    )


def _read_file(path: str) -> tuple[dict, dict]:
    if not os.path.isfile(path):
        raise ValueError(f"{NODE}: model file {path!r} does not exist; "
                         "put the file into models/diffusion_models and refresh")
    try:
        sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    except Exception as exc:  # corrupt / truncated / not a tensor file
        raise ValueError(f"{NODE}: cannot read {os.path.basename(path)!r} as a model file "
                         f"({type(exc).__name__}: {exc}); re-download or choose another file") from exc
    return sd, metadata or {}


def load_model_file(path: str, weight_dtype: str = "default"):
    """Load a diffusion model file as a ModelPatcher whose weights are ordinary (non-inference) tensors.

    Files that carry ``precision_lora.unet_config`` metadata (tiny test/demo models) are built from that
    config; everything else goes through ComfyUI's stock detection.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{NODE}: weight_dtype {weight_dtype!r} unknown; "
                         f"choose one of {', '.join(WEIGHT_DTYPES)}")
    dtype = WEIGHT_DTYPES[weight_dtype]
    # Nodes run under inference_mode; tensors created there cannot be saved for backward.
    refuse_gguf_file(path, NODE, gguf_installed())
    with torch.inference_mode(False):
        sd, metadata = _read_file(path)
        if UNET_CONFIG_KEY in metadata:
            model = build_model_from_config(json.loads(metadata[UNET_CONFIG_KEY]), sd, dtype, metadata)
        else:
            try:
                model = comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": dtype} if dtype else {}, metadata)
            except Exception as exc:
                raise ValueError(f"{NODE}: {os.path.basename(path)!r} failed to load as a "
                                 f"diffusion model ({type(exc).__name__}: {exc})") from exc
    if model is None:
        raise ValueError(f"{NODE}: {os.path.basename(path)!r} is not a diffusion model ComfyUI "
                         "recognises (no model type detected); choose a diffusion model (UNet/DiT) file")
    quantized_as_inference(model.model.diffusion_model)  # as ComfyUI's own loader makes them (see there)
    return set_reload(model, _reload, path, weight_dtype)


def _reload(path: str, weight_dtype: str, disable_dynamic: bool = False):
    """The same file loaded again, for ComfyUI's deep copies of the model (``comfy_compat.set_reload``)."""
    return load_model_file(path, weight_dtype)


def gguf_installed() -> bool:
    """Whether ComfyUI-GGUF's loader node is registered in this ComfyUI (its node id in ComfyUI's registry)."""
    import nodes as comfy_nodes  # ComfyUI's nodes.py (the pack's own nodes/ is only reached relatively)

    return GGUF_NODE in comfy_nodes.NODE_CLASS_MAPPINGS


def _gguf_name(value: object) -> bool:
    return isinstance(value, str) and value.lower().endswith(".gguf")


class PrecisionLoadDiffusionModel(PrecisionNode):
    NODE = NODE
    FILE_LIST_INPUTS = {"model_name": "models/diffusion_models"}

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE,
            display_name="Load Diffusion Model (Precision)",
            category="precision_lora/loaders",
            description="Loads a diffusion model from models/diffusion_models for training or inference. "
                        "Weights are ordinary tensors (usable by autograd). Reports family, heads and head_dim.",
            inputs=[
                io.Combo.Input("model_name", options=folder_paths.get_filename_list("diffusion_models"),
                               tooltip="File in models/diffusion_models."),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default="default",
                               tooltip="Storage dtype of the base weights. 'default' lets ComfyUI choose for "
                                       "your device; fp32 is the most exact (and largest)."),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The loaded diffusion model."),
                io.String.Output(display_name="info",
                                 tooltip="Family, attention heads, head_dim and default softmax scale."),
            ],
        )

    @classmethod
    def validate_inputs(cls, **values: object) -> bool | str:
        """A ``.gguf`` name (never listed here: ComfyUI's list of models/diffusion_models leaves GGUF files out) is
        answered with ComfyUI-GGUF's loader, before the gate would call it a missing file."""
        if _gguf_name(values.get("model_name")):
            return gguf_file_advice(str(values["model_name"]), NODE, gguf_installed())
        return super().validate_inputs(**values)

    @classmethod
    def execute(cls, model_name: str, weight_dtype: str) -> io.NodeOutput:
        path = folder_paths.get_full_path("diffusion_models", model_name)
        if path is None:
            raise ValueError(f"{NODE}: model_name {model_name!r} is not in models/diffusion_models; "
                             "put the file there and refresh the node list")
        model = load_model_file(path, weight_dtype)
        info = describe_model(model)
        log.info("loaded %s: %s", model_name, info.describe().replace("\n", "; "))
        return io.NodeOutput(model, info.describe())


NODES = [PrecisionLoadDiffusionModel]
