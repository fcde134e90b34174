"""One dispatcher applies an AttentionConfig to every attention call (the single place a scale is applied).

Policies (documented in docs/attention.md):
- Training with a backend that has no backward (``sage``): a clear ValueError, never silently stopped
  gradients. (With ``auto``, the ComfyUI glue falls back to ``sdpa`` with a logged warning instead.)
- A masked call on a backend that cannot take masks (flash, sage): that call runs on ``sdpa``, logged once.
- ``fp32_softmax``: the backend runs on fp32 copies of q/k/v; the output is cast back to q's dtype.
- ``softclamp``: warns (once per layer) when c < 10 x the call's max logit, since the clamp then changes
  the pretrained model's output noticeably.
"""
from __future__ import annotations

import logging
import math
import threading

import torch

from .backends import Backend, get_backend
from .config import AttentionConfig
from .masks import to_bhld
from .stats import AttentionStats, measure_call

log = logging.getLogger(__name__)

SOFTCLAMP_SAFETY = 10.0


def grads_needed(*tensors: torch.Tensor) -> bool:
    """True when autograd will record this call (grad mode on and an input requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def no_backward_message(backend: str) -> str:
    return (
        f"[Precision LoRA] attention backend {backend!r} has no backward pass, so training through it would "
        "silently stop the gradients; choose sdpa, stable, math, flash or xformers for training and keep "
        f"{backend!r} for inference"
    )


def scale_query(q: torch.Tensor, scale: float, head_dim: int) -> torch.Tensor:
    """q multiplied by scale·sqrt(head_dim) in fp32 (fp64 stays fp64), cast back once: a backend that applies
    1/sqrt(head_dim) then computes softmax(q·kᵀ·scale)."""
    factor = scale * math.sqrt(head_dim)
    wide = q if q.dtype == torch.float64 else q.float()
    return (wide * factor).to(q.dtype)


class AttentionDispatcher:
    """Runs one attention call under ``cfg``; shared by reference across clones (deepcopy returns self).

    ``stats`` is filled only when ``cfg.collect_stats``.
    """

    def __init__(self, cfg: AttentionConfig, stats: AttentionStats | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.stats = stats if stats is not None else AttentionStats()
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> AttentionDispatcher:
        return self

    def warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message)

    def observe(self, q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None,
                layout: str, layer: str) -> None:
        """Statistics and the softclamp check; costs nothing unless stats or softclamp are on."""
        if not (self.cfg.collect_stats or self.cfg.softclamp > 0):
            return
        call = measure_call(q, k, scale=scale, mask=mask, layout=layout)
        if self.cfg.collect_stats:
            self.stats.record(layer, call)
        c = self.cfg.softclamp
        if c > 0 and c < SOFTCLAMP_SAFETY * call.max_logit:
            self.warn_once(
                f"softclamp:{layer}",
                f"[Precision LoRA] softclamp={c} is below 10x the max logit {call.max_logit:.3g} seen in attention "
                f"layer {layer}: it changes the pretrained model's output; use softclamp >= "
                f"{SOFTCLAMP_SAFETY * call.max_logit:.3g} or 0 (off)",
            )

    def backend_for(self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None) -> Backend:
        """The backend that runs this call, applying the training and mask policies."""
        backend = get_backend(name, require_available=True)
        if grads_needed(q, k, v) and not backend.trainable:
            raise ValueError(no_backward_message(name))
        if mask is not None and not backend.supports_mask:
            self.warn_once(
                f"mask:{name}",
                f"[Precision LoRA] attention backend {name!r} cannot take masks; masked calls run on sdpa",
            )
            backend = get_backend("sdpa")
        return backend

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
            layout: str = "bhld", layer: str = "call", scale: float | None = None,
            backend_name: str | None = None) -> torch.Tensor:
        """Attention of q/k/v (``layout``) with the configured backend and scale; output like q.

        ``scale`` replaces ``cfg.resolve_scale(head_dim)`` when the caller resolved it (a model that brings
        its own base scale); ``backend_name`` replaces ``cfg.backend`` for this call. Not for backend "auto"
        (the ComfyUI glue delegates that to ComfyUI's own backend).
        """
        name = backend_name or self.cfg.backend
        if name == "auto":
            raise ValueError("AttentionDispatcher.run cannot run backend 'auto'; the ComfyUI glue delegates it")
        if scale is None:
            scale = self.cfg.resolve_scale(to_bhld(q, layout).shape[-1])
        self.observe(q, k, scale, mask, layout, layer)
        backend = self.backend_for(name, q, k, v, mask)
        out_dtype = q.dtype
        if self.cfg.fp32_softmax and q.dtype != torch.float64:
            q, k, v = q.float(), k.float(), v.float()
            mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
        out = backend(q, k, v, scale=scale, mask=mask, layout=layout,
                      softclamp=self.cfg.softclamp, beta=self.cfg.stable_beta)
        return out.to(out_dtype)
