"""ComfyUI glue for the precision probe: one instrumented forward of the user's model at a chosen noise level.

The forward runs through ComfyUI's own conditioning path (``convert_cond`` → ``encode_model_conds`` →
``calc_cond_batch``), i.e. what a sampler does for one step. Instrumentation never changes the output:
- attention: a ``ProbeAttentionOverride`` wraps whatever override the model has (ours or none) in a
  *copy* of ``model_options`` that is passed to this one call only; it measures q/k/v and then calls the
  wrapped override (or ComfyUI's backend) with the untouched arguments;
- LoRA: forward pre-hooks on the adapted Linear modules record their inputs and are removed in ``finally``.
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..attention.config import AttentionConfig
from ..attention.probe_stats import ProbeAttentionStats, measure_attention
from ..probe.survival import SurvivalStats, delta_survival
from .attention_glue import OVERRIDE_KEY, POSITIONAL_NAMES, get_attention_config
from .lora_glue import LoRAForward

log = logging.getLogger(__name__)
_PREFIX = "diffusion_model."


@dataclass
class ProbeResult:
    """What one probe forward measured. ``output``: the model's denoised prediction (B, C, …)."""

    output: torch.Tensor
    sigma: float
    attention_cfg: AttentionConfig
    head_dim: int
    lora: dict[str, SurvivalStats] = field(default_factory=dict)
    attention: dict[str, ProbeAttentionStats] = field(default_factory=dict)
    weight_patches: int = 0  # ComfyUI weight patches (merged LoRAs): not measurable as adapters


class ProbeAttentionOverride:
    """Measures every attention call, then runs it exactly as the model would have (``inner`` or ``func``)."""

    def __init__(self, inner: Callable[..., torch.Tensor] | None, cfg: AttentionConfig, max_rows: int) -> None:
        self.inner, self.cfg, self.max_rows = inner, cfg, max_rows
        self.layers: dict[str, ProbeAttentionStats] = {}
        self.head_dim = 0

    def __deepcopy__(self, memo: dict) -> ProbeAttentionOverride:
        return self

    def __call__(self, func, q, k, v, heads, *rest: Any, **kwargs: Any) -> torch.Tensor:
        self._measure(q, k, v, heads, rest, kwargs)
        if self.inner is not None:
            return self.inner(func, q, k, v, heads, *rest, **kwargs)
        return func(q, k, v, heads, *rest, **kwargs)

    def _measure(self, q, k, v, heads: int, rest: tuple, kwargs: dict) -> None:
        named = dict(zip(POSITIONAL_NAMES, rest))
        named.update({n: kwargs[n] for n in POSITIONAL_NAMES if n in kwargs})
        if named.get("skip_reshape", False):
            layout, qs, ks, vs = "bhld", q, k, v
        else:  # (B, L, H·D) → (B, L, H, D); reshape, since some models pass non-contiguous q/k/v
            layout = "blhd"
            qs, ks, vs = (t.reshape(t.shape[0], t.shape[1], heads, t.shape[2] // heads) for t in (q, k, v))
        head_dim = qs.shape[-1]
        self.head_dim = head_dim
        stats = measure_attention(qs, ks, vs, scale=self.cfg.resolve_scale(head_dim), mask=named.get("mask"),
                                  layout=layout, softclamp=self.cfg.softclamp, max_rows=self.max_rows)
        self.layers[self._label(kwargs.get("transformer_options") or {})] = stats

    def _label(self, options: dict) -> str:
        index = len(self.layers)
        if "block_type" in options and "block_index" in options:
            return f"{index:02d} {options['block_type']}.{options['block_index']}"
        return f"{index:02d} attn"


def lora_layers(model) -> dict[str, tuple]:
    """Module path → adapters for every Linear the model's Precision LoRA object patches adapt."""
    out = {}
    for key, patch in model.object_patches.items():
        if isinstance(patch, LoRAForward) and key.startswith(_PREFIX) and key.endswith(".forward"):
            out[key[len(_PREFIX):-len(".forward")]] = patch.adapters
    return out


def _conds(model, conditioning: list, noise: torch.Tensor, latent: torch.Tensor, device) -> list[dict]:
    import comfy.sampler_helpers
    import comfy.samplers

    conds = comfy.sampler_helpers.convert_cond(conditioning)
    return comfy.samplers.encode_model_conds(model.model.extra_conds, conds, noise, device, "positive",
                                             latent_image=latent)


def sigma_for(model, noise_level: float) -> float:
    """The model's sigma at ``noise_level`` of its schedule (1 = pure noise, 0 = clean)."""
    return float(model.model.model_sampling.percent_to_sigma(1.0 - noise_level))


def model_forward(model, latent: dict, conditioning: list, noise_level: float, seed: int,
                  model_options: dict | None = None) -> tuple[torch.Tensor, float]:
    """One denoising prediction at ``noise_level`` with seeded noise; returns (denoised, sigma)."""
    import comfy.model_management
    import comfy.samplers

    comfy.model_management.load_models_gpu([model], force_full_load=True)
    device = model.load_device
    x0 = model.model.process_latent_in(latent["samples"]).to(device)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(device=device, dtype=x0.dtype)
    sigma = sigma_for(model, noise_level)
    sigmas = torch.full((x0.shape[0],), sigma, device=device)
    xt = model.model.model_sampling.noise_scaling(sigmas, noise, x0)
    conds = _conds(model, conditioning, noise, x0, device)
    options = model.model_options if model_options is None else model_options
    model.pre_run()  # as a sampler does: sets model.current_patcher, runs ON_PRE_RUN callbacks
    try:
        out = comfy.samplers.calc_cond_batch(model.model, [conds], xt, sigmas, options)[0]
    finally:
        model.cleanup()
    return out, sigma


def _options_with(model, override: ProbeAttentionOverride) -> dict:
    options = copy.copy(model.model_options)
    transformer = dict(options.get("transformer_options", {}))
    transformer[OVERRIDE_KEY] = override
    options["transformer_options"] = transformer
    return options


def _capture_inputs(model, paths, max_rows: int) -> tuple[dict[str, torch.Tensor], list]:
    """Forward pre-hooks recording the first ``max_rows`` input rows of each module (removed by the caller)."""
    modules = dict(model.model.diffusion_model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for path in paths:
        def hook(_module, args, path=path):
            if path not in seen:  # first call per forward
                seen[path] = args[0].detach().reshape(-1, args[0].shape[-1])[:max_rows].clone()
        handles.append(modules[path].register_forward_pre_hook(hook))
    return seen, handles


def probe_model(model, latent: dict, conditioning: list, noise_level: float = 0.5, seed: int = 0,
                max_rows: int = 256) -> ProbeResult:
    """Run one instrumented forward and measure LoRA survival per adapted layer and attention per call."""
    cfg = get_attention_config(model) or AttentionConfig()
    inner = model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY)
    override = ProbeAttentionOverride(inner, cfg, max_rows)
    adapted = lora_layers(model)
    inputs, handles = _capture_inputs(model, adapted, max_rows)
    try:
        output, sigma = model_forward(model, latent, conditioning, noise_level, seed, _options_with(model, override))
    finally:
        for h in handles:
            h.remove()
    modules = dict(model.model.diffusion_model.named_modules())
    lora = {}
    for path, adapters in adapted.items():
        if path in inputs:
            m = modules[path]
            lora[path] = delta_survival(inputs[path], m.weight, m.bias, adapters)
        else:
            log.warning("[Precision LoRA] PrecisionProbe: LoRA layer %s was not called in the forward", path)
    head_dim = override.head_dim or 0
    return ProbeResult(output=output, sigma=sigma, attention_cfg=cfg, head_dim=head_dim, lora=lora,
                       attention=override.layers, weight_patches=len(getattr(model, "patches", {})))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim else 0.0
