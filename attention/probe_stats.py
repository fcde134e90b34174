"""Attention statistics for the precision probe: saturation, bf16(P̄) == 1 ties, and what the stable
backend would change (PRECISION.md §2, §3).

Per call, on the first ``max_rows`` query rows of every (batch, head): logits S = q·kᵀ·scale (+ softclamp,
+ mask) in fp32; per row the entropy of softmax(S) / ln(live keys), the max probability, the max logit,
whether >= 2 entries of bf16(exp(S − rowmax)) equal 1 (the bias condition), and whether >= 2 logits lie
within ``TIE_TOLERANCE`` of the max (the stable shift fires). "What stable changes": the bias of a
low-precision Ō = P̄V (bf16 P̄ and bf16 tile products, ``emulate="paper"``) against an fp64 reference,
as mean signed error / mean absolute error, for the standard shift and for the stable shift.

Pure torch; never imports ComfyUI.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .masks import additive_mask, prepare_mask, to_bhld
from .stable import TIE_TOLERANCE, StableOptions, stable_forward


@dataclass
class ProbeAttentionStats:
    """Running sums for one attention layer; properties give the reported values."""

    calls: int = 0
    rows: int = 0
    entropy_sum: float = 0.0
    max_prob: float = 0.0
    max_logit: float = float("-inf")
    bf16_one_rows: int = 0
    shift_rows: int = 0
    err_sum_standard: float = 0.0
    abs_sum_standard: float = 0.0
    err_sum_stable: float = 0.0
    abs_sum_stable: float = 0.0

    @property
    def entropy_ratio(self) -> float:
        """Mean entropy / ln(keys): 1 = uniform attention, 0 = one key takes everything."""
        return self.entropy_sum / self.rows if self.rows else 0.0

    @property
    def bf16_one_fraction(self) -> float:
        return self.bf16_one_rows / self.rows if self.rows else 0.0

    @property
    def shift_fraction(self) -> float:
        return self.shift_rows / self.rows if self.rows else 0.0

    @property
    def bias_standard(self) -> float:
        """Bias/MAE of emulated bf16 Ō with the standard shift (0 = unbiased, ±1 = all errors one sign)."""
        return self.err_sum_standard / self.abs_sum_standard if self.abs_sum_standard else 0.0

    @property
    def bias_stable(self) -> float:
        return self.err_sum_stable / self.abs_sum_stable if self.abs_sum_stable else 0.0

    def add(self, other: ProbeAttentionStats) -> None:
        for name in ("calls", "rows", "entropy_sum", "bf16_one_rows", "shift_rows", "err_sum_standard",
                     "abs_sum_standard", "err_sum_stable", "abs_sum_stable"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_prob = max(self.max_prob, other.max_prob)
        self.max_logit = max(self.max_logit, other.max_logit)

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "rows": self.rows, "entropy_ratio": self.entropy_ratio,
                "max_prob": self.max_prob, "max_logit": self.max_logit,
                "bf16_one_fraction": self.bf16_one_fraction, "shift_fraction": self.shift_fraction,
                "bias_standard": self.bias_standard, "bias_stable": self.bias_stable}


def _logits(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None, softclamp: float) -> torch.Tensor:
    """(B,H,R,Lk) fp32 logits with softclamp and additive mask."""
    s = torch.matmul(q.float() * scale, k.float().transpose(-1, -2))
    if softclamp > 0:
        s = softclamp * torch.tanh(s / softclamp)
    return s if mask is None else s + mask


def _row_stats(s: torch.Tensor, live: torch.Tensor, tau: float) -> dict[str, float]:
    """Saturation and tie statistics of logits s (…, Lk) over live rows (…, 1)."""
    row_max = s.amax(dim=-1, keepdim=True)
    r = torch.where(live, row_max, torch.zeros_like(row_max))
    logp = torch.log_softmax(torch.where(live, s, torch.zeros_like(s)), dim=-1)
    p = logp.exp()
    keys = torch.isfinite(s).sum(dim=-1, keepdim=True).clamp_min(2).double()
    entropy = -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(dim=-1, keepdim=True).double() / keys.log()
    ones = (torch.exp(s - r).to(torch.bfloat16) == 1).sum(dim=-1, keepdim=True)
    near = (s >= r - tau).sum(dim=-1, keepdim=True)
    return {
        "rows": int(live.sum()),
        "entropy_sum": float(entropy[live].sum()),
        "max_prob": float(p.amax(dim=-1, keepdim=True)[live].max()) if bool(live.any()) else 0.0,
        "max_logit": float(row_max[live].max()) if bool(live.any()) else float("-inf"),
        "bf16_one_rows": int(((ones >= 2) & live).sum()),
        "shift_rows": int(((near >= 2) & live).sum()),
    }


def _bias_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, live: torch.Tensor,
               scale: float, mask: torch.Tensor | None, softclamp: float) -> dict[str, float]:
    """Signed and absolute error sums of emulated bf16 Ō (standard and stable shift) vs fp64."""
    ref = torch.matmul(torch.softmax(torch.where(live, s, torch.zeros_like(s)).double(), dim=-1), v.double())
    out: dict[str, float] = {}
    for name, shift in (("standard", False), ("stable", True)):
        opts = StableOptions(softclamp=softclamp, shift=shift, emulate="paper")
        o, _lse, _t = stable_forward(q.float(), k.float(), v.float(), scale, mask, opts)
        err = (o.double() - ref) * live
        out[f"err_sum_{name}"] = float(err.sum())
        out[f"abs_sum_{name}"] = float(err.abs().sum())
    return out


@torch.no_grad()
def measure_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                      mask: torch.Tensor | None = None, layout: str = "bhld", softclamp: float = 0.0,
                      max_rows: int = 256, tau: float = TIE_TOLERANCE, with_bias: bool = True) -> ProbeAttentionStats:
    """Statistics of one attention call (calls = 1).

    q (…Lq…D), k (…Lk…D), v (…Lk…Dv) in ``layout`` ("bhld" or "blhd"), any float dtype; ``mask`` as the
    backends take it. Only the first ``max_rows`` queries of each (batch, head) are measured (0 = all).
    Fully masked rows are left out. Inputs are not modified.
    """
    qb, kb, vb = to_bhld(q, layout), to_bhld(k, layout), to_bhld(v, layout)
    m4 = prepare_mask(mask, qb, kb)
    add = None if m4 is None else additive_mask(m4, torch.float32)
    if max_rows > 0 and qb.shape[2] > max_rows:
        qb = qb[:, :, :max_rows]
        add = None if add is None or add.shape[2] == 1 else add[:, :, :max_rows]
    if add is not None:
        add = add.expand(qb.shape[0], qb.shape[1], qb.shape[2], kb.shape[2])
    s = _logits(qb, kb, scale, add, softclamp)
    live = torch.isfinite(s.amax(dim=-1, keepdim=True))
    stats = ProbeAttentionStats(calls=1, **_row_stats(s, live, tau))
    if with_bias:
        for name, value in _bias_sums(qb, kb, vb, s, live, scale, add, softclamp).items():
            setattr(stats, name, value)
    return stats


def entropy_ratio_dense(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) / ln(N) per row, fp64. logits (…, N) → (…)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1) / math.log(logits.shape[-1])
