"""Base weights stored quantized: the plain weight a LoRA layer computes on, quantized files for the loader.

ComfyUI keeps a quantized base in one of three forms, and each layer's own ``forward`` knows how to turn it
into the weight it multiplies with; the pack's LoRA forward replaces that ``forward``, so it must do the same:

- plain fp8 (``float8_e4m3fn`` / ``float8_e5m2`` weights, no scale): ``comfy.ops.cast_bias_weight`` casts
  the weight to the compute dtype (exact: every fp8 value is a bf16/fp16/fp32 value);
- ComfyUI's scaled fp8 (a ``scaled_fp8`` marker key and a per-layer ``scale_weight``): ComfyUI 0.3.75 keeps
  the fp8 weight and the scale apart (``scale_weight`` on the layer) and the cast returns the *unscaled*
  weight; ComfyUI 0.33 converts the file at load (``comfy.utils.convert_old_quants``) into its per-layer
  format below;
- per-layer quantization (``comfy_quant`` keys or ``_quantization_metadata``; fp8, int8, nvfp4, mxfp8
  layouts of ``comfy.quant_ops``): the weight is a ``QuantizedTensor`` that ``dequantize()`` turns into the
  compute dtype (the cast leaves it quantized when its dtype already equals the input's).

GGUF weights (city96's ComfyUI-GGUF ``GGMLTensor``) are a fourth form: its layers dequantize in their own
``cast_bias_weight`` (``nodes.host.gguf``). ``layer_weight`` returns the dequantized weight for all four, so the
LoRA delta is added in fp32 to the base output computed on it (``lora.lowrank.lora_linear``); see docs/quantized.md.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

import comfy.model_detection
import comfy.ops
import comfy.utils

from . import gguf

try:
    from comfy.quant_ops import QuantizedTensor
except ImportError:  # a ComfyUI without per-layer quantization: no weight is a QuantizedTensor
    QuantizedTensor = ()  # type: ignore[assignment,misc]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALED_FP8_KEY = "scaled_fp8"


def is_quantized(t: object) -> bool:
    """True for a ``comfy.quant_ops.QuantizedTensor`` (per-layer quantized weight)."""
    return bool(QuantizedTensor) and isinstance(t, QuantizedTensor)


def check_layer(module: torch.nn.Module, path: str) -> None:
    """Raise ValueError for a layer whose weight the LoRA forward cannot dequantize: a GGUF weight outside
    ComfyUI-GGUF's layers (they dequantize it themselves, ``nodes.host.gguf``)."""
    problem = gguf.layer_problem(module)
    if problem is not None:
        raise ValueError(f"layer '{path}' {problem}; load the file with {gguf.GGUF_LOADER}, whose "
                         "layers the pack's LoRA layers run on")


def is_linear(module: torch.nn.Module) -> bool:
    """A Linear layer: ``torch.nn.Linear`` or ComfyUI 0.33's per-layer quantized Linear (a plain Module)."""
    if isinstance(module, torch.nn.Linear):
        return True
    return (isinstance(module, comfy.ops.CastWeightBiasOp) and isinstance(getattr(module, "in_features", None), int)
            and isinstance(getattr(module, "out_features", None), int) and hasattr(module, "weight"))


def _needs_cast(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "comfy_cast_weights", False) or getattr(module, "weight_function", None)
                or getattr(module, "bias_function", None) or is_quantized(module.weight)
                or module.weight.dtype in FP8_DTYPES)


def layer_weight(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, Callable[[], None]]:
    """(weight, bias, release) of a Linear as plain tensors in the dtype the layer computes in, dequantized
    and scaled (GGUF: by ComfyUI-GGUF's layer itself): what the layer's own forward multiplies ``x`` with.
    Call ``release()`` after the last use (it hands ComfyUI's cast buffers back). weight (out, in); bias (out,)
    or None."""
    if gguf.dequantizes(module):  # ComfyUI-GGUF's quantized layer dequantizes this one weight itself, per call
        return gguf.layer_weight(module, x)
    if not _needs_cast(module):
        return module.weight, module.bias, lambda: None
    weight, bias, stream = comfy.ops.cast_bias_weight(module, x, offloadable=True)
    cast_weight, cast_bias = weight, bias

    def release() -> None:
        comfy.ops.uncast_bias_weight(module, cast_weight, cast_bias, stream)

    if is_quantized(weight):
        weight = weight.dequantize()
    weight, bias = gguf.plain(weight), gguf.plain(bias)  # an F16 / F32 GGUF layer, cast as its own forward does
    scale = getattr(module, "scale_weight", None)  # ComfyUI 0.3.75's scaled fp8 layer: the cast is unscaled
    if isinstance(scale, torch.Tensor):
        weight = (weight.float() * scale.to(device=weight.device, dtype=torch.float32)).to(weight.dtype)
    if weight.dtype in FP8_DTYPES:  # never multiply in fp8 (a layer reached without ComfyUI's cast)
        weight = weight.to(x.dtype if x.is_floating_point() else torch.float32)
    return weight, bias, release


def quantized_as_inference(dm: torch.nn.Module) -> int:
    """Make every ``QuantizedTensor`` parameter of ``dm`` an inference tensor (values unchanged); returns how
    many. ComfyUI moves quantized layers by re-wrapping each parameter, which fails for a quantized tensor
    made outside inference mode once a node (inference mode) moves it ("Cannot set version_counter for
    inference tensor"); its own loader makes them inside. The LoRA forward dequantizes into a fresh tensor,
    so autograd never needs these (``nodes.train.glue.normal_weights`` leaves them as they are)."""
    count = 0
    with torch.inference_mode():
        for module in dm.modules():
            for name, p in list(module._parameters.items()):
                if is_quantized(p) and not p.is_inference():
                    module._parameters[name] = torch.nn.Parameter(p.clone(), requires_grad=False)
                    count += 1
    return count


def prepare_state_dict(model_config, sd: dict, metadata: dict | None) -> tuple[dict, bool]:
    """Make ``model_config`` build the layers a quantized ``sd`` needs, as ComfyUI's detection does after
    it found the model's config (the pack's loader builds tiny models from a config in the file instead).
    Returns (state dict to load, whether the layers are per-layer quantized, so the compute dtype is
    chosen without the weights' dtype). Feature-detected: 0.33 converts scaled fp8 into its per-layer
    format (``comfy.utils.convert_old_quants``); 0.3.75 reads the marker and ``_quantization_metadata``."""
    convert = getattr(comfy.utils, "convert_old_quants", None)
    if convert is not None:  # ComfyUI 0.33+
        sd, metadata = convert(sd, "", metadata=dict(metadata or {}))
        quant = comfy.utils.detect_layer_quantization(sd, "")
        if quant:
            model_config.quant_config = quant
        return sd, bool(quant)
    marker = sd.pop(SCALED_FP8_KEY, None)
    if marker is not None:  # ComfyUI 0.3.75: scaled fp8 layers keep weight and scale apart
        model_config.scaled_fp8 = torch.float8_e4m3fn if marker.dtype == torch.float32 else marker.dtype
        model_config.optimizations["fp8"] = marker.numel() != 2  # two elements: full-precision matmul
    layers = comfy.model_detection.detect_layer_quantization(dict(metadata or {}))
    if layers:
        model_config.layer_quant_config = layers
    return sd, bool(layers)
