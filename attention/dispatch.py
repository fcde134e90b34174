"""The one attention call path: resolves the softmax scale, observes, upcasts and runs the kernel.

Every attention call of a patched model, and every call the precision probe measures, goes through
``AttentionDispatcher.run``: the single place a scale is resolved and applied. The kernel is a
registered backend, or with backend ``auto`` the host's own attention function (ComfyUI's, bound by the
ComfyUI glue as a ``HostAttention``), which applies its base scale itself, so a different scale is
folded into q.

Policies (documented in docs/attention.md):
- Training with a backend that has no backward (``sage``): a clear ValueError, never silently stopped
  gradients. With ``auto`` and a host function without a usable backward: ``sdpa``, logged once.
- A masked call on a backend that cannot take masks (flash, sage): that call runs on ``sdpa``, logged once.
- A call whose model needs full precision (``low_precision=False``) on a quantising backend (sage) runs
  on ``sdpa``.
- ``fp32_softmax``: the kernel runs on fp32 copies of q/k/v; the output is cast back to q's dtype.
- ``softclamp``: warns (once per layer) when c < 10 x the call's max logit, since the clamp then changes
  the pretrained model's output noticeably.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .backends import Backend, get_backend
from .config import AUTO_BACKEND, SOFTCLAMP_SAFETY, AttentionConfig, default_scale
from .masks import expand_heads, to_bhld
from .stats import AttentionStats, measure_call

log = logging.getLogger(__name__)

# Backends that quantise q/k below the input precision: not for calls whose model needs full precision.
QUANTISING_BACKENDS = ("sage",)


def grads_needed(*tensors: torch.Tensor) -> bool:
    """True when autograd will record this call (grad mode on and an input requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def no_backward_message(backend: str) -> str:
    return (
        f"attention backend {backend!r} has no backward pass, so training through it would "
        "silently stop the gradients; choose sdpa, stable, math, flash or xformers for training and keep "
        f"{backend!r} for inference"
    )


def scale_query(q: torch.Tensor, scale: float, base: float) -> torch.Tensor:
    """q multiplied by scale/base in fp32 (fp64 stays fp64), cast back once: a kernel that applies
    ``base`` itself then computes softmax(q·kᵀ·scale). q itself when the two scales are equal."""
    if scale == base:
        return q
    wide = q if q.dtype == torch.float64 else q.float()
    return (wide * (scale / base)).to(q.dtype)


@dataclass(frozen=True)
class HostAttention:
    """The host's own attention function, for backend ``auto``.

    ``fn(q, k, v, mask)`` takes q/k/v in the dispatcher's layout (k/v with their own head count) and
    returns the output in that layout; it applies the call's base scale itself. ``trainable``: False when
    its gradients do not work (the dispatcher then runs ``sdpa`` while gradients are needed).
    """

    name: str
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    trainable: bool


@dataclass(frozen=True)
class ObservedCall:
    """One call as the kernel will see it, for an observer (the probe): q/k/v in ``layout`` (k/v heads
    repeated to q's), before any fp32 upcast; ``scale`` the resolved scale, ``base`` the model's own."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    layout: str
    layer: str
    scale: float
    base: float


Observer = Callable[[ObservedCall], None]


class AttentionDispatcher:
    """Runs one attention call under ``cfg``; shared by reference across clones (deepcopy returns self).

    ``stats`` is filled only when ``cfg.collect_stats``.
    """

    def __init__(self, cfg: AttentionConfig, stats: AttentionStats | None = None) -> None:
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

    def observe(self, call: ObservedCall, observer: Observer | None = None) -> None:
        """The observer, statistics and the softclamp check; costs nothing unless one of them is on."""
        if observer is not None:
            observer(call)
        if not (self.cfg.collect_stats or self.cfg.softclamp > 0):
            return
        measured = measure_call(call.q, call.k, scale=call.scale, mask=call.mask, layout=call.layout)
        if self.cfg.collect_stats:
            self.stats.record(call.layer, measured)
        c = self.cfg.softclamp
        if c > 0 and c < SOFTCLAMP_SAFETY * measured.max_logit:
            self.warn_once(
                f"softclamp:{call.layer}",
                f"softclamp={c} is below 10x the max logit {measured.max_logit:.3g} seen in "
                f"attention layer {call.layer}: it changes the pretrained model's output; use softclamp >= "
                f"{SOFTCLAMP_SAFETY * measured.max_logit:.3g} or 0 (off)",
            )

    def kernel_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   host: HostAttention | None = None, low_precision: bool = True) -> Backend | HostAttention:
        """What runs this call, applying the training, mask and precision policies."""
        name = self.cfg.backend
        if name == AUTO_BACKEND:
            if host is None:
                raise ValueError("AttentionDispatcher.run cannot run backend 'auto' without the host's own "
                                 "attention function (host=HostAttention(...))")
            if host.trainable or not grads_needed(q, k, v):
                return host
            self.warn_once(
                f"auto-fallback:{host.name}",
                f"ComfyUI's attention backend {host.name} has no usable backward; while gradients "
                "are needed, the override runs these calls on sdpa instead",
            )
            name = "sdpa"
        elif not low_precision and name in QUANTISING_BACKENDS:
            name = "sdpa"  # the model asks for full-precision attention here
        backend = get_backend(name, require_available=True)
        if grads_needed(q, k, v) and not backend.trainable:
            raise ValueError(no_backward_message(name))
        if mask is not None and not backend.supports_mask:
            self.warn_once(
                f"mask:{name}",
                f"attention backend {name!r} cannot take masks; masked calls run on sdpa",
            )
            backend = get_backend("sdpa")
        return backend

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
            layout: str = "bhld", layer: str = "call", base_scale: float | None = None,
            low_precision: bool = True, host: HostAttention | None = None,
            observer: Observer | None = None) -> torch.Tensor:
        """Attention of q/k/v (4-D, ``layout``; k/v may have fewer heads than q) under the config; output
        like q.

        ``base_scale``: the scale the model asks for itself (None: 1/sqrt(head_dim)); the config's default
        and multiplier modes are relative to it. ``low_precision``: False when the model needs
        full-precision attention at this call. ``host``: the host's own function, which backend ``auto``
        runs. ``observer``: called with the call before it runs.
        """
        head_dim = to_bhld(q, layout).shape[-1]
        base = default_scale(head_dim) if base_scale is None else float(base_scale)
        scale = self.cfg.resolve_scale(head_dim, base)
        k_all, v_all = expand_heads(k, q, layout), expand_heads(v, q, layout)
        self.observe(ObservedCall(q, k_all, v_all, mask, layout, layer, scale, base), observer)
        kernel = self.kernel_for(q, k, v, mask, host, low_precision)
        out_dtype = q.dtype
        if isinstance(kernel, HostAttention):
            q, k, v, mask = self._upcast(q, k, v, mask)
            return kernel.fn(scale_query(q, scale, base), k, v, mask).to(out_dtype)
        q, k, v, mask = self._upcast(q, k_all, v_all, mask)
        out = kernel(q, k, v, scale=scale, mask=mask, layout=layout,
                     softclamp=self.cfg.softclamp, beta=self.cfg.stable_beta)
        return out.to(out_dtype)

    def _upcast(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        """fp32 copies of q/k/v and a float mask under ``fp32_softmax`` (fp64 stays fp64)."""
        if not self.cfg.fp32_softmax or q.dtype == torch.float64:
            return q, k, v, mask
        mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
        return q.float(), k.float(), v.float(), mask
