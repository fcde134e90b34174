"""ComfyUI glue for the LoKr / LoHa / DoRA adapters: DoRA's base weights, init_lora from an adapter file, and the
frozen set the pack's loader builds from one (the numerics are in ``lora.adapters``, the file reading in
``lora.adapter_files``)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ...lora.adapter_files import FileAdapter, build_adapter, is_adapter_file, parse_adapter_file
from ...lora.config import LoRAConfig
from ...lora.layer import LoRASet
from ..host.quantized import layer_weight


def base_weights(model, paths) -> dict[str, torch.Tensor]:
    """Path -> the weight the layer computes with (``nodes.host.quantized.layer_weight``: fp8, scaled fp8 and
    per-layer quantized weights dequantized), as fp32 on the CPU: DoRA starts its magnitude at its column norms."""
    modules = dict(model.model.diffusion_model.named_modules())
    out = {}
    for path in paths:
        m = modules[path]
        probe = torch.zeros(1, m.in_features, dtype=torch.float32)  # only tells the cast the device and dtype
        weight, _bias, release = layer_weight(m, probe)
        out[path] = weight.detach().float().cpu().clone()
        release()
    return out


def uses_adapter_files(cfg: LoRAConfig, tensors: Mapping[str, torch.Tensor]) -> bool:
    """True when init_lora must go through the adapter files' reader (an adapter kind, or a file of one)."""
    return cfg.adapter != "lora" or is_adapter_file(tensors)


def init_adapters(tensors: Mapping[str, torch.Tensor], linears: Mapping[str, tuple[int, int]], cfg: LoRAConfig,
                  shapes: Mapping[str, tuple[int, int]], what: str) -> dict[str, FileAdapter]:
    """The file's modules for init_lora, checked against the adapter kind and the targets (ValueError naming
    ``what``, the file's kind and the fix)."""
    parsed = parse_adapter_file(tensors, linears, name=what)
    kinds = sorted({fa.kind for fa in parsed.values()})
    if kinds != [cfg.adapter]:
        raise ValueError(f"{what} holds {'/'.join(kinds)} adapters but adapter={cfg.adapter!r}: set "
                         f"adapter to {kinds[0]!r} (continuing needs the same kind)")
    outside = sorted(set(parsed) - set(shapes))
    if outside:
        raise ValueError(f"{what}: {len(outside)} of its modules are not among the selected targets "
                         f"(e.g. '{outside[0]}'): widen targets / include to cover them")
    return parsed


def load_init(lora_set: LoRASet, parsed: Mapping[str, FileAdapter], what: str) -> None:
    """Copy init_lora's modules into the new set's adapters (ValueError naming the module and the fix)."""
    adapters = lora_set.adapters()
    with torch.inference_mode(False):
        for path, fa in parsed.items():
            try:
                adapters[path].load_file(fa.parts, fa.scale)
            except ValueError as e:
                raise ValueError(f"{what}: {fa.kind} module '{path}': {e}; set rank (and lokr_factor) "
                                 "to the file's") from None


def frozen_adapter_set(tensors: Mapping[str, torch.Tensor], linears: Mapping[str, tuple[int, int]],
                       strength: float, name: str, device: torch.device | None) -> LoRASet:
    """A frozen set holding an adapter file's modules (every kind, plain LoRA modules included) at ``strength``."""
    parsed = parse_adapter_file(tensors, linears, name=name)
    with torch.inference_mode(False):
        adapters = {p: build_adapter(p, fa, linears[p], name) for p, fa in parsed.items()}
        lora_set = LoRASet(LoRAConfig(targets="none"), {}, adapters=adapters)
        if device is not None:
            lora_set.to(device)
        lora_set.requires_grad_(False)
    lora_set.set_multiplier(strength)
    return lora_set
