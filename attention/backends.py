"""Backend registry: one signature for every attention kernel.

``fn(q, k, v, *, scale, mask=None, layout="bhld", softclamp=0.0, beta=2.0) -> out`` with q/k/v and out in
``layout`` (``"bhld"`` = (B, H, L, D), ``"blhd"`` = (B, L, H, D)), out in q's dtype. ``softclamp`` is
honoured by math and stable only, ``beta`` by stable only; the others reject a non-default value.
Optional kernels are imported lazily inside their function; ``available()`` says why one is missing.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .masks import additive_mask, dead_rows, from_bhld, prepare_mask, to_bhld, unmask_dead_rows
from .reference import math_attention
from .stable import StableOptions, stable_attention

BackendFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Backend:
    """A registered kernel. ``requires``: (import name, pip package) pairs; ``needs_cuda``: GPU only.
    ``trainable``: has a backward; ``supports_mask``: honours masks (else the dispatcher falls back)."""

    name: str
    fn: BackendFn
    trainable: bool
    supports_mask: bool
    needs_cuda: bool
    requires: tuple[tuple[str, str], ...]
    description: str

    def unavailable_reason(self) -> str | None:
        """None when usable here, else a sentence naming what is missing."""
        for module, package in self.requires:
            if not _module_present(module):
                return f"package '{package}' is not installed (pip install {package})"
        if self.needs_cuda and not _cuda_present():
            return "needs a CUDA GPU (torch.cuda.is_available() is False)"
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return self.fn(q, k, v, **kwargs)


@functools.lru_cache(maxsize=None)
def _module_present(module: str) -> bool:
    """Looked up once per process: the dispatcher asks on every attention call of a chosen GPU backend, and a
    package installed while ComfyUI runs needs a restart to be imported anyway."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _cuda_present() -> bool:
    return torch.cuda.is_available()


def _no_logit_options(name: str, softclamp: float, beta: float) -> None:
    if softclamp:
        raise ValueError(f"backend {name!r} cannot apply softclamp={softclamp}; use backend math or stable")
    del beta  # beta only matters to stable; other backends accept and ignore the default


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
        layout: str = "bhld", softclamp: float = 0.0, beta: float = 2.0) -> torch.Tensor:
    """torch SDPA with ``scale=``; fully masked rows give zeros (not NaN)."""
    _no_logit_options("sdpa", softclamp, beta)
    qb, kb, vb = to_bhld(q, layout), to_bhld(k, layout), to_bhld(v, layout)
    m4 = prepare_mask(mask, qb, kb)
    dead = dead_rows(m4)
    if m4 is not None:
        m4 = unmask_dead_rows(m4, dead) if dead is not None else m4
        m4 = m4 if m4.dtype == torch.bool else m4.to(qb.dtype)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m4, scale=scale)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
    return from_bhld(out, layout)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
        layout: str = "bhld", softclamp: float = 0.0, beta: float = 2.0) -> torch.Tensor:
    del beta
    return math_attention(q, k, v, scale=scale, mask=mask, layout=layout, softclamp=softclamp)


def _stable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
        layout: str = "bhld", softclamp: float = 0.0, beta: float = 2.0) -> torch.Tensor:
    """The fused Triton kernel (attention.stable_triton, imported here lazily) for fp16/bf16 CUDA
    tensors when triton is installed; otherwise, and for softclamp, the PyTorch path."""
    opts = StableOptions(beta=beta, softclamp=softclamp)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _module_present("triton"):
        from .stable_triton import fused_stable_attention, unsupported_reason

        if unsupported_reason(to_bhld(q, layout), to_bhld(k, layout), to_bhld(v, layout), opts) is None:
            return fused_stable_attention(q, k, v, scale=scale, mask=mask, layout=layout, options=opts)
    return stable_attention(q, k, v, scale=scale, mask=mask, layout=layout, options=opts)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
        layout: str = "bhld", softclamp: float = 0.0, beta: float = 2.0) -> torch.Tensor:
    """flash-attn 2/3 ``flash_attn_func`` (or flash-attn-4's cute entry point); layout (B, L, H, D)."""
    _no_logit_options("flash", softclamp, beta)
    if mask is not None:
        raise ValueError("backend 'flash' does not take masks; the dispatcher routes masked calls to sdpa")
    fn = _flash_fn()
    ql, kl, vl = (t.transpose(1, 2) if layout == "bhld" else t for t in (q, k, v))
    out = fn(ql, kl, vl, softmax_scale=scale)
    if isinstance(out, tuple):  # flash-attn 3 / 4 return (out, lse)
        out = out[0]
    return out.transpose(1, 2) if layout == "bhld" else out


def _flash_fn() -> BackendFn:
    for module in ("flash_attn", "flash_attn_interface", "flash_attn.cute"):
        if _module_present(module):
            mod = importlib.import_module(module)
            if hasattr(mod, "flash_attn_func"):
                return mod.flash_attn_func
    raise RuntimeError("backend 'flash' is unavailable: package 'flash-attn' is not installed (pip install flash-attn)")


def _sage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
        layout: str = "bhld", softclamp: float = 0.0, beta: float = 2.0) -> torch.Tensor:
    """sageattention ``sageattn(sm_scale=)``: inference only (no backward), ignores masks."""
    _no_logit_options("sage", softclamp, beta)
    if mask is not None:
        raise ValueError("backend 'sage' ignores masks; the dispatcher routes masked calls to sdpa")
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="HND" if layout == "bhld" else "NHD", is_causal=False, sm_scale=scale)


def _xformers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
        layout: str = "bhld", softclamp: float = 0.0, beta: float = 2.0) -> torch.Tensor:
    """xformers ``memory_efficient_attention(scale=)``; layout (B, M, H, K); masks as additive bias."""
    _no_logit_options("xformers", softclamp, beta)
    import xformers.ops

    qb, kb = to_bhld(q, layout), to_bhld(k, layout)
    bias = None
    m4 = prepare_mask(mask, qb, kb)
    if m4 is not None:
        b, h, lq, lk = qb.shape[0], qb.shape[1], qb.shape[2], kb.shape[2]
        pad = (lk + 7) // 8 * 8  # xformers wants the bias's last dim 8-aligned in memory
        bias = torch.zeros((b, h, lq, pad), dtype=q.dtype, device=q.device)[..., :lk]
        bias.copy_(additive_mask(m4, q.dtype).expand(b, h, lq, lk))
    ql, kl, vl = (t.transpose(1, 2) if layout == "bhld" else t for t in (q, k, v))
    out = xformers.ops.memory_efficient_attention(ql, kl, vl, attn_bias=bias, scale=scale)
    return out.transpose(1, 2) if layout == "bhld" else out


BACKENDS: dict[str, Backend] = {
    "sdpa": Backend("sdpa", _sdpa, True, True, False, (), "torch scaled_dot_product_attention"),
    "math": Backend("math", _math, True, True, False, (), "fp32-softmax reference, exact masks, softclamp"),
    "stable": Backend("stable", _stable, True, True, False, (),
                      "stable softmax (Qiu & Yao fix): fused Triton kernel on CUDA, tiled PyTorch elsewhere"),
    "flash": Backend("flash", _flash, True, False, True, (("flash_attn", "flash-attn"),), "flash-attn"),
    "sage": Backend("sage", _sage, False, False, True, (("sageattention", "sageattention"),), "SageAttention, inference only"),
    "xformers": Backend("xformers", _xformers, True, True, True, (("xformers", "xformers"),), "xformers memory-efficient"),
}


def available() -> dict[str, str | None]:
    """Every registered backend -> None (usable here) or the reason it is not."""
    return {name: backend.unavailable_reason() for name, backend in BACKENDS.items()}


def get_backend(name: str, require_available: bool = False) -> Backend:
    """The backend called ``name``. ValueError listing the known names; with ``require_available`` a
    RuntimeError naming what is missing."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; known backends: {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if require_available:
        reason = backend.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"attention backend {name!r} is unavailable: {reason}")
    return backend
