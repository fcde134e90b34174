"""Reference attention: the fp64 oracle for tests and the ``math`` backend (fp32 softmax).

Both compute softmax(q·kᵀ·scale [+ mask]) · v in full and zero the rows whose keys are all masked
(instead of NaN). Memory is O(B·H·Lq·Lk): use them for references and small inputs.
"""
from __future__ import annotations

import torch

from .masks import additive_mask, finish_logits, from_bhld, prepare_mask, to_bhld


def _softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
    softclamp: float, dtype: torch.dtype,
) -> torch.Tensor:
    """q (B,H,Lq,D), k (B,H,Lk,D), v (B,H,Lk,Dv) -> (B,H,Lq,Dv) in ``dtype``."""
    m4 = prepare_mask(mask, q, k)
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    s = finish_logits(s, softclamp, None if m4 is None else additive_mask(m4, dtype))
    row_max = s.amax(dim=-1, keepdim=True).detach()
    # Rows with every key masked have max -inf: shift by 0 so exp gives 0 instead of NaN.
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.matmul(p, v.to(dtype)) / denom


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
    layout: str = "bhld", softclamp: float = 0.0,
) -> torch.Tensor:
    """fp64 oracle. Inputs in ``layout``; output float64 in the same layout."""
    out = _softmax_attention(
        to_bhld(q, layout), to_bhld(k, layout), to_bhld(v, layout), scale, mask, softclamp, torch.float64
    )
    return from_bhld(out, layout)


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
    layout: str = "bhld", softclamp: float = 0.0,
) -> torch.Tensor:
    """The ``math`` backend: logits and softmax in fp32 (fp64 for fp64 inputs), output in q's dtype.

    Differentiable. Exact masks (bool or additive); fully masked rows give zeros.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = _softmax_attention(
        to_bhld(q, layout), to_bhld(k, layout), to_bhld(v, layout), scale, mask, softclamp, dtype
    )
    return from_bhld(out.to(q.dtype), layout)
