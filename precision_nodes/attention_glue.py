"""ComfyUI glue for the attention override (COMFYUI.md §2, §3).

``patch_attention(model, cfg)`` returns a clone whose ``transformer_options["optimized_attention_override"]``
is a ``PrecisionAttentionOverride``. ComfyUI's ``wrap_attn`` calls it as
``override(func, q, k, v, heads, *rest, **kwargs)`` for every attention call of the model, with ``func``
the backend ComfyUI selected. Layouts: q/k/v are (B, L, H·D) unless ``skip_reshape`` (then (B, H, L, D));
the output is (B, L, H·D) unless ``skip_output_reshape`` (then (B, H, L, D)). The mask comes as the
``mask`` keyword or as the 5th positional argument.

Backend ``auto`` delegates to ``func`` (q multiplied by scale·sqrt(d) in fp32 for a non-default scale);
``func`` is the undecorated backend and kwargs keep ``_inside_attn_wrapper``, so it never re-enters the
override. When autograd needs gradients and ``func`` is ComfyUI's sage or flash path (no usable backward),
``auto`` falls back to our ``sdpa`` with a logged warning. An explicitly chosen ``sage`` raises instead.

Keywords newer ComfyUI passes (0.33): ``scale`` (a model's own base scale, which every backend there
honours) is the base of the default and multiplier modes; ``enable_gqa`` (k/v with fewer heads than q)
is forwarded to ComfyUI's backend, and our backends get k/v heads repeated; ``low_precision_attention``
False (the model needs full precision there) runs an explicitly chosen ``sage`` on sdpa for that call.
Everything else is forwarded untouched.
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable

import torch

from ..attention.config import AttentionConfig
from ..attention.dispatch import AttentionDispatcher, grads_needed, scale_query
from ..attention.stats import AttentionStats
from .comfy_compat import has_backward

log = logging.getLogger(__name__)

OVERRIDE_KEY = "optimized_attention_override"
# ComfyUI's backends take these after (q, k, v, heads), in this order.
POSITIONAL_NAMES = ("mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def _bind(rest: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Name the optional arguments whether they came by position or keyword."""
    if len(rest) > len(POSITIONAL_NAMES):
        raise TypeError(f"[Precision LoRA] attention override got {4 + len(rest)} positional arguments; expected at most 8")
    bound = dict(zip(POSITIONAL_NAMES, rest))
    for name in POSITIONAL_NAMES:
        if name in kwargs:
            bound[name] = kwargs[name]
    return bound


def _to_4d(x: torch.Tensor, heads: int, skip_reshape: bool) -> tuple[torch.Tensor, str]:
    """ComfyUI q/k/v -> (4-D view, layout). (B, H, L, D) stays; (B, L, H·D) becomes (B, L, H, D)."""
    if skip_reshape:
        return x, "bhld"
    b, length, inner = x.shape
    return x.reshape(b, length, heads, inner // heads), "blhd"  # a view unless x is oddly strided


def k_heads(k: torch.Tensor, head_dim: int, skip_reshape: bool) -> int:
    """Heads of a key/value tensor: fewer than the query's under grouped-query attention."""
    return k.shape[1] if skip_reshape else k.shape[-1] // head_dim


def _expand_heads(kv: torch.Tensor, q: torch.Tensor, layout: str) -> torch.Tensor:
    """k or v (4-D, ``layout``) with its heads repeated to q's head count (a no-op without GQA)."""
    axis = 1 if layout == "bhld" else 2
    groups = q.shape[axis] // kv.shape[axis]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=axis)


def _from_4d(out: torch.Tensor, layout: str, skip_output_reshape: bool) -> torch.Tensor:
    """Our output (in ``layout``) -> what ComfyUI's backend would return."""
    if skip_output_reshape:
        return out if layout == "bhld" else out.transpose(1, 2)
    blhd = out.transpose(1, 2) if layout == "bhld" else out
    b, length, heads, dim = blhd.shape
    return blhd.reshape(b, length, heads * dim)


class PrecisionAttentionOverride:
    """The callable stored in transformer_options. Deep copies return the same object (COMFYUI.md §3),
    so clones share its dispatcher and statistics."""

    def __init__(self, cfg: AttentionConfig, stats: AttentionStats | None = None) -> None:
        self.dispatcher = AttentionDispatcher(cfg, stats)
        self._label_lock = threading.Lock()
        self._last_options: dict | None = None
        self._call_index = 0

    @property
    def cfg(self) -> AttentionConfig:
        return self.dispatcher.cfg

    def __deepcopy__(self, memo: dict) -> PrecisionAttentionOverride:
        return self

    def __call__(self, func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 heads: int, *rest: Any, **kwargs: Any) -> torch.Tensor:
        if self.cfg.is_default():
            return func(q, k, v, heads, *rest, **kwargs)
        bound = _bind(rest, kwargs)
        layer = self._layer_label(kwargs.get("transformer_options"))
        if self.cfg.backend == "auto" and not self._auto_needs_fallback(func, q, k, v):
            return self._delegate(func, q, k, v, heads, rest, kwargs, bound, layer)
        return self._run_ours(q, k, v, heads, bound, kwargs, layer)

    def target_scale(self, head_dim: int, model_scale: float | None) -> float:
        """The softmax scale of one call. ``model_scale``: the ``scale`` a model passes itself (ComfyUI
        0.33+ backends honour it); it replaces 1/sqrt(head_dim) as the base of default and multiplier
        modes, while an absolute scale stays absolute."""
        resolved = self.cfg.resolve_scale(head_dim)
        if model_scale is None or self.cfg.scale_mode == "absolute":
            return resolved
        return resolved * float(model_scale) * math.sqrt(head_dim)

    def _auto_needs_fallback(self, func: Callable[..., torch.Tensor], q, k, v) -> bool:
        if not has_backward(func) and grads_needed(q, k, v):
            name = getattr(func, "__name__", "")
            self.dispatcher.warn_once(
                f"auto-fallback:{name}",
                f"[Precision LoRA] ComfyUI's attention backend {name} has no usable backward; while gradients "
                "are needed, the override runs these calls on sdpa instead",
            )
            return True
        return False

    def _delegate(self, func, q, k, v, heads, rest, kwargs, bound, layer) -> torch.Tensor:
        """backend auto: ComfyUI's own backend with the scale folded into q (fp32 before the cast). The
        backend applies the model's own ``scale`` kwarg (if any) or 1/sqrt(d): q is scaled relative to it."""
        skip = bool(bound.get("skip_reshape", False))
        q4, layout = _to_4d(q, heads, skip)
        head_dim = q4.shape[-1]
        k4, _ = _to_4d(k, k_heads(k, head_dim, skip), skip)
        model_scale = kwargs.get("scale")
        scale = self.target_scale(head_dim, model_scale)
        mask = bound.get("mask")
        self.dispatcher.observe(q4, _expand_heads(k4, q4, layout), scale, mask, layout, layer)
        out_dtype = q.dtype
        if self.cfg.fp32_softmax and q.dtype != torch.float64:
            q, k, v = q.float(), k.float(), v.float()
            if mask is not None and mask.dtype != torch.bool:
                mask = mask.float()
        if not self.cfg.scale_is_default():
            base = float(model_scale) if model_scale is not None else head_dim ** -0.5
            q = scale_query(q, scale / (base * math.sqrt(head_dim)), head_dim)
        rest = list(rest)
        if rest:
            rest[0] = mask
        elif "mask" in kwargs:
            kwargs = {**kwargs, "mask": mask}
        return func(q, k, v, heads, *rest, **kwargs).to(out_dtype)

    def _run_ours(self, q, k, v, heads, bound, kwargs, layer) -> torch.Tensor:
        skip = bool(bound.get("skip_reshape", False))
        q4, layout = _to_4d(q, heads, skip)
        head_dim = q4.shape[-1]
        kv_heads = k_heads(k, head_dim, skip)
        # grouped-query attention (``enable_gqa``): each k/v head serves heads/kv_heads query heads
        k4 = _expand_heads(_to_4d(k, kv_heads, skip)[0], q4, layout)
        v4 = _expand_heads(_to_4d(v, kv_heads, skip)[0], q4, layout)
        backend = None
        if self.cfg.backend == "auto":  # the logged fallback of _auto_needs_fallback
            backend = "sdpa"
        elif kwargs.get("low_precision_attention") is False and self.cfg.backend == "sage":
            backend = "sdpa"  # the model asks for full-precision attention here (sage would quantise q/k)
        out = self.dispatcher.run(q4, k4, v4, mask=bound.get("mask"), layout=layout, layer=layer,
                                  scale=self.target_scale(head_dim, kwargs.get("scale")), backend_name=backend)
        return _from_4d(out, layout, bool(bound.get("skip_output_reshape", False)))

    def _layer_label(self, options: dict | None) -> str:
        """"double.3" from Flux's block_type/block_index, else "call.N": the N-th call seen with the same
        transformer_options dict (one dict per model forward)."""
        if not self.cfg.collect_stats:
            return "call"
        if options is not None and "block_type" in options and "block_index" in options:
            return f"{options['block_type']}.{options['block_index']}"
        with self._label_lock:
            if options is not self._last_options:
                self._last_options, self._call_index = options, 0
            index = self._call_index
            self._call_index += 1
        return f"call.{index}"


def patch_attention(model: Any, cfg: AttentionConfig) -> Any:
    """A clone of the ModelPatcher ``model`` whose every attention call follows ``cfg``.

    The override lives in the clone's model_options only: the shared module is never touched, so
    bypassing the node (or using the original model) gives stock attention.
    """
    cfg.validate()
    clone = model.clone()
    options = clone.model_options.setdefault("transformer_options", {})
    options[OVERRIDE_KEY] = PrecisionAttentionOverride(cfg)
    log.info("[Precision LoRA] attention patched: backend=%s scale_mode=%s scale_value=%s",
             cfg.backend, cfg.scale_mode, cfg.scale_value)
    return clone


def _override(model: Any) -> PrecisionAttentionOverride | None:
    options = getattr(model, "model_options", {}).get("transformer_options", {})
    override = options.get(OVERRIDE_KEY)
    return override if isinstance(override, PrecisionAttentionOverride) else None


def get_attention_config(model: Any) -> AttentionConfig | None:
    """The AttentionConfig ``patch_attention`` set on ``model`` (None when not patched by this pack)."""
    override = _override(model)
    return None if override is None else override.cfg


def get_attention_stats(model: Any) -> AttentionStats | None:
    """The statistics collector of a patched model (filled only when cfg.collect_stats)."""
    override = _override(model)
    return None if override is None else override.dispatcher.stats
