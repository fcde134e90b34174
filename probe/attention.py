"""What the stable backend would change in one attention call: the probe's measurement on top of the row
statistics of ``attention.stats`` (entropy, max probability, max logit, bf16(P̄) == 1 ties, stable shift).

"What stable changes": the bias of a low-precision Ō = P̄V (bf16 P̄ and bf16 tile products,
``emulate="paper"``) against an fp64 reference, as mean signed error / mean absolute error, for the
standard shift and for the stable shift. Measured on the first ``max_rows`` query rows of every
(batch, head), which keeps the probe's cost bounded on long sequences.

Pure torch; never imports ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.masks import additive_mask, finish_logits, prepare_mask, to_bhld
from ..attention.stable import TIE_TOLERANCE, StableOptions, stable_forward
from ..attention.stats import LayerStats, measure_call


@dataclass
class ProbeAttentionStats(LayerStats):
    """The row statistics of one attention layer plus the signed and absolute error sums of emulated
    bf16 Ō; properties give the reported values."""

    err_sum_standard: float = 0.0
    abs_sum_standard: float = 0.0
    err_sum_stable: float = 0.0
    abs_sum_stable: float = 0.0

    @property
    def bias_standard(self) -> float:
        """Bias/MAE of emulated bf16 Ō with the standard shift (0 = unbiased, ±1 = all errors one sign)."""
        return self.err_sum_standard / self.abs_sum_standard if self.abs_sum_standard else 0.0

    @property
    def bias_stable(self) -> float:
        return self.err_sum_stable / self.abs_sum_stable if self.abs_sum_stable else 0.0

    def add(self, other: LayerStats) -> None:
        super().add(other)
        if isinstance(other, ProbeAttentionStats):
            for name in ("err_sum_standard", "abs_sum_standard", "err_sum_stable", "abs_sum_stable"):
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, float]:
        return {**super().as_dict(), "bias_standard": self.bias_standard, "bias_stable": self.bias_stable}


def _bias_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
               softclamp: float) -> dict[str, float]:
    """Signed and absolute error sums of emulated bf16 Ō (standard and stable shift) vs fp64, over the
    rows that are not fully masked. q/k/v (B,H,·,D) bhld; mask additive fp32 (B,H,Lq,Lk) or None."""
    s = finish_logits(torch.matmul(q.float() * scale, k.float().transpose(-1, -2)), softclamp, mask)
    live = torch.isfinite(s.amax(dim=-1, keepdim=True))
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
    rows = measure_call(qb, kb, scale=scale, mask=add, softclamp=softclamp, tau=tau)
    stats = ProbeAttentionStats(**vars(rows))
    if with_bias:
        for name, value in _bias_sums(qb, kb, vb, scale, add, softclamp).items():
            setattr(stats, name, value)
    return stats
