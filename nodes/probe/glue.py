"""ComfyUI glue for the precision probe: one instrumented forward of the user's model at a chosen noise level.

The forward runs through ComfyUI's own conditioning path (``convert_cond`` → ``encode_model_conds`` →
``calc_cond_batch``), i.e. what a sampler does for one step. Instrumentation never changes the output:
- attention: the calls take the one attention path, ``AttentionDispatcher.run``, through a twin of the
  model's override (or of a default one) that shares its dispatcher and hands every call, with the scale
  the dispatcher resolved, to a ``ProbeRecorder``; the twin sits in a *copy* of ``model_options`` passed
  to this one call only, and the call then runs exactly as it would have;
- LoRA: forward pre-hooks on the adapted Linear modules record their inputs and are removed in ``finally``.
"""
from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...attention.config import AttentionConfig
from ...attention.dispatch import ObservedCall
from ...probe.attention import ProbeAttentionStats, measure_attention
from ...probe.survival import SurvivalStats, delta_survival
from ..attention.glue import OVERRIDE_KEY, PrecisionAttentionOverride
from ..lora.glue import LoRAForward

log = logging.getLogger(__name__)
_PREFIX = "diffusion_model."


@dataclass
class ProbeResult:
    """What one probe forward measured. ``output``: the model's denoised prediction (B, C, …).
    ``scale``/``base_scale``: the softmax scale of the last attention call and the model's own scale
    there (0.0 / 0.0 when no attention call was seen)."""

    output: torch.Tensor
    sigma: float
    attention_cfg: AttentionConfig
    head_dim: int
    scale: float = 0.0
    base_scale: float = 0.0
    lora: dict[str, SurvivalStats] = field(default_factory=dict)
    attention: dict[str, ProbeAttentionStats] = field(default_factory=dict)
    weight_patches: int = 0  # ComfyUI weight patches (merged LoRAs): not measurable as adapters


class ProbeRecorder:
    """Measures every attention call the dispatcher hands it, labelled in call order."""

    def __init__(self, softclamp: float, max_rows: int) -> None:
        self.softclamp, self.max_rows = softclamp, max_rows
        self.layers: dict[str, ProbeAttentionStats] = {}
        self.head_dim, self.scale, self.base = 0, 0.0, 0.0  # of the last call

    def __call__(self, call: ObservedCall) -> None:
        self.head_dim, self.scale, self.base = call.q.shape[-1], call.scale, call.base
        # The dispatcher's label is "double.3" for a named block, else "call.N" (the order, shown anyway).
        name = "attn" if call.layer.startswith("call") else call.layer
        self.layers[f"{len(self.layers):02d} {name}"] = measure_attention(
            call.q, call.k, call.v, scale=call.scale, mask=call.mask, layout=call.layout,
            softclamp=self.softclamp, max_rows=self.max_rows)


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


def _around(foreign: Callable[..., torch.Tensor], twin: PrecisionAttentionOverride) -> Callable[..., torch.Tensor]:
    """Another pack's override keeps running the calls: the twin observes each one, then runs ``foreign``
    (bound to ComfyUI's function) as its host function."""
    def override(func: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        return twin(functools.partial(foreign, func), *args, **kwargs)

    return override


def _options_with(model, override: Callable[..., torch.Tensor]) -> dict:
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
    inner = model.model_options.get("transformer_options", {}).get(OVERRIDE_KEY)
    ours = inner if isinstance(inner, PrecisionAttentionOverride) else PrecisionAttentionOverride(AttentionConfig())
    recorder = ProbeRecorder(ours.cfg.softclamp, max_rows)
    override = ours.observed_by(recorder)
    if inner is not None and inner is not ours:
        override = _around(inner, override)
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
            log.warning("PrecisionProbe: LoRA layer %s was not called in the forward", path)
    return ProbeResult(output=output, sigma=sigma, attention_cfg=ours.cfg, head_dim=recorder.head_dim,
                       scale=recorder.scale, base_scale=recorder.base, lora=lora, attention=recorder.layers,
                       weight_patches=len(getattr(model, "patches", {})))
