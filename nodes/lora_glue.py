"""ComfyUI glue for LoRA: attach/detach adapters on a ModelPatcher clone, find the LoRA set, build metadata.

Adapters are installed as object patches on each target Linear's ``forward``
(``diffusion_model.<path>.forward``), so ComfyUI applies them in ``patch_model`` and restores the original
forward in ``unpatch_model``; the shared ``nn.Module`` is never changed permanently. The LoRASet lives in
``set_attachments("precision_lora", lora_set)`` (shared by reference across clones). Nothing of ours is
placed in ``model_options``, so ComfyUI's ``.to(model_dtype)`` on patches at sampling start never casts
the fp32 LoRA parameters.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import torch

from ..training.lora import LoRAAdapter, LoRAConfig, LoRASet, lora_linear
from ..training.lora_file import (LoRAFactors, default_key_style, file_rank, lora_metadata, parse_lora_tensors,
                                  read_lora_file)
from ..training.targets import select_targets
from .model_info import describe_model

log = logging.getLogger(__name__)

ATTACHMENT_KEY = "precision_lora"
_PREFIX = "diffusion_model."


class LoRAForward:
    """Replacement ``forward`` for one Linear: base (ComfyUI-cast weights) + adapters, numerics in training.lora."""

    def __init__(self, module: torch.nn.Linear, adapters: Sequence[LoRAAdapter]) -> None:
        self.module = module
        self.adapters = tuple(adapters)

    def __call__(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        import comfy.ops

        comfy.ops.run_every_op()
        m = self.module
        for a in self.adapters:
            if a.down.device != x.device:
                a.to(x.device)  # adapters are not submodules of the model: follow the input's device
        cast = getattr(m, "comfy_cast_weights", False) or getattr(m, "weight_function", None) or getattr(m, "bias_function", None)
        if cast:
            weight, bias, stream = comfy.ops.cast_bias_weight(m, x, offloadable=True)
        else:
            weight, bias, stream = m.weight, m.bias, None
        if torch.is_grad_enabled() and weight.is_inference():
            weight = weight.clone()  # autograd cannot save inference tensors (weights loaded inside a node)
            bias = None if bias is None else bias.clone()
        out = lora_linear(x, weight, bias, self.adapters)
        if cast:
            comfy.ops.uncast_bias_weight(m, weight, bias, stream)
        return out


def linear_layers(model) -> dict[str, tuple[int, int]]:
    """Every Linear of the diffusion model: path → (in_features, out_features)."""
    dm = model.model.diffusion_model
    return {name: (m.in_features, m.out_features) for name, m in dm.named_modules() if isinstance(m, torch.nn.Linear)}


def model_family(model) -> str:
    return describe_model(model).family


def plan_targets(model, cfg: LoRAConfig) -> dict[str, tuple[int, int]]:
    """The modules ``cfg`` selects in this model (ValueError listing module names when none)."""
    cfg.validate()
    return select_targets(linear_layers(model), model_family(model), cfg.targets, cfg.include, cfg.exclude, cfg.blocks)


def _new_lora_set(cfg: LoRAConfig, shapes: Mapping[str, tuple[int, int]]) -> LoRASet:
    # Nodes run under inference_mode; trainable parameters must be ordinary tensors.
    with torch.inference_mode(False):
        return LoRASet(cfg, shapes)


def install(model, lora_set: LoRASet):
    """Clone ``model`` and patch every adapter of ``lora_set`` in (stacking on adapters already there)."""
    patched = model.clone()
    dm = model.model.diffusion_model
    modules = dict(dm.named_modules())
    for path, adapter in lora_set.adapters().items():
        if path not in modules or not isinstance(modules[path], torch.nn.Linear):
            raise ValueError(f"[Precision LoRA] LoRA module '{path}' is not a linear layer of this model")
        key = f"{_PREFIX}{path}.forward"
        previous = patched.object_patches.get(key)
        earlier = previous.adapters if isinstance(previous, LoRAForward) else ()
        patched.add_object_patch(key, LoRAForward(modules[path], earlier + (adapter,)))
    patched.set_attachments(ATTACHMENT_KEY, lora_set)
    return patched


def attach_lora(model, cfg: LoRAConfig, init_file: str | None = None):
    """A clone of ``model`` with a new trainable LoRASet (eval mode; ``train()`` it for dropouts).

    ``init_file``: continue from a LoRA file: its rank must equal ``cfg.rank`` and its modules must be
    among the selected targets. Raises ValueError before anything is attached.
    """
    shapes = plan_targets(model, cfg)
    factors: dict[str, LoRAFactors] = {}
    if init_file:
        tensors, _md = read_lora_file(init_file)
        factors = parse_lora_tensors(tensors, linear_layers(model), name=f"init LoRA '{init_file}'")
        rank = file_rank(factors)
        if rank != cfg.rank:
            raise ValueError(
                f"[Precision LoRA] PrecisionAttachLoRA: init_lora '{init_file}' has rank {rank} but rank={cfg.rank}: set rank to {rank}"
            )
    lora_set = _new_lora_set(cfg, shapes)
    if factors:
        with torch.inference_mode(False):
            lora_set.load_factors({p: (f.down, f.up, f.scale) for p, f in factors.items()})
    log.info("[Precision LoRA] attached rank-%d LoRA to %d modules (%d parameters, fp32_accumulation=%s)",
             cfg.rank, len(shapes), lora_set.num_parameters(), cfg.fp32_accumulation)
    return install(model, lora_set)


def lora_set_from_factors(factors: Mapping[str, LoRAFactors], cfg: LoRAConfig, strength: float) -> LoRASet:
    """An inference LoRASet holding a file's factors at ``strength`` (frozen parameters)."""
    shapes = {p: (int(f.down.shape[1]), int(f.up.shape[0])) for p, f in factors.items()}
    lora_set = _new_lora_set(cfg, shapes)
    with torch.inference_mode(False):
        lora_set.load_factors({p: (f.down, f.up, f.scale) for p, f in factors.items()})
        lora_set.requires_grad_(False)
    lora_set.set_multiplier(strength)
    return lora_set


def detach_lora(model):
    """A clone of ``model`` without any Precision LoRA object patch or attachment (base forward restored)."""
    patched = model.clone()
    for key in [k for k, v in patched.object_patches.items() if isinstance(v, LoRAForward)]:
        del patched.object_patches[key]
    patched.remove_attachments(ATTACHMENT_KEY)
    return patched


def get_lora_set(model) -> LoRASet | None:
    """The LoRASet most recently attached to this model (or one of its ancestors), or None."""
    return model.get_attachment(ATTACHMENT_KEY)


def _mixed_precision(model) -> str:
    dtype = model.model.get_dtype()
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")


def attention_metadata(model) -> dict[str, str]:
    """The model's attention settings as metadata (default settings when it was never patched)."""
    from ..attention.config import AttentionConfig
    from .attention_glue import get_attention_config

    head_dim = describe_model(model).head_dim
    cfg = get_attention_config(model) or AttentionConfig()
    return cfg.to_metadata(head_dim) if head_dim else {"ss_attn_mode": cfg.backend}


def build_lora_metadata(model, lora_set: LoRASet, extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """Metadata for saving ``lora_set`` trained on ``model``: kohya ss_* keys, attention settings, pack version.

    ``extra`` holds metadata keys verbatim, e.g. ``{"ss_steps": 500, "ss_training_started_at": t0}``.
    """
    family = model_family(model)
    md = {"ss_training_finished_at": str(time.time())}
    md.update(attention_metadata(model))
    md.update({str(k): v for k, v in (extra or {}).items()})
    return lora_metadata(lora_set.config, family=family, key_style=default_key_style(family),
                         mixed_precision=_mixed_precision(model), extra=md)
