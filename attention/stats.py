"""Per-call attention row statistics: the one measurement behind the collector the dispatcher fills when
``AttentionConfig.collect_stats`` is on, the softclamp check, and the precision probe.

For one call, from the logits S = q·kᵀ·scale (+ softclamp, + mask), per row (fully masked rows are
left out): the max logit, the max probability, the entropy of softmax(S) divided by ln(keys), whether
>= 2 logits lie within ``TIE_TOLERANCE`` of the row max (the stable shift fires) and whether >= 2
entries of bf16(exp(S − rowmax)) equal 1 (the condition under which bf16 P̄·V is biased). Two passes
over key tiles, so memory stays O(rows × tile).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from .masks import additive_mask, finish_logits, prepare_mask, to_bhld
from .stable import TIE_TOLERANCE

STATS_TILE_ELEMENTS = 1 << 24


@dataclass
class LayerStats:
    """Running totals for one attention layer (or for all layers, see ``AttentionStats.total``)."""

    calls: int = 0
    rows: int = 0
    max_logit: float = float("-inf")
    shift_rows: int = 0
    bf16_one_rows: int = 0
    entropy_sum: float = 0.0
    max_prob: float = 0.0

    @property
    def shift_fraction(self) -> float:
        """Fraction of rows where the stable shift triggers (>= 2 logits within tau of the max)."""
        return self.shift_rows / self.rows if self.rows else 0.0

    @property
    def bf16_one_fraction(self) -> float:
        """Fraction of rows with >= 2 entries bf16(P̄) == 1 under the standard shift."""
        return self.bf16_one_rows / self.rows if self.rows else 0.0

    @property
    def entropy_ratio(self) -> float:
        """Mean over rows of entropy / ln(keys): 1 = uniform attention, 0 = one key."""
        return self.entropy_sum / self.rows if self.rows else 0.0

    def add(self, other: LayerStats) -> None:
        self.calls += other.calls
        self.rows += other.rows
        self.max_logit = max(self.max_logit, other.max_logit)
        self.shift_rows += other.shift_rows
        self.bf16_one_rows += other.bf16_one_rows
        self.entropy_sum += other.entropy_sum
        self.max_prob = max(self.max_prob, other.max_prob)

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls, "rows": self.rows, "max_logit": self.max_logit, "max_prob": self.max_prob,
            "shift_fraction": self.shift_fraction, "bf16_one_fraction": self.bf16_one_fraction,
            "entropy_ratio": self.entropy_ratio,
        }


def _tiled_logits(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None, softclamp: float):
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    tile = max(64, STATS_TILE_ELEMENTS // max(rows, 1))
    qs = q.float() * scale
    for start in range(0, k.shape[2], tile):
        s = torch.matmul(qs, k[:, :, start:start + tile].float().transpose(-1, -2))
        yield finish_logits(s, softclamp, None if mask is None else mask[..., start:start + tile])


@torch.no_grad()
def measure_call(
    q: torch.Tensor, k: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None, layout: str = "bhld",
    softclamp: float = 0.0, tau: float = TIE_TOLERANCE,
) -> LayerStats:
    """Statistics of one attention call (calls = 1). q (…Lq…D), k (…Lk…D) in ``layout``."""
    qb, kb = to_bhld(q, layout), to_bhld(k, layout)
    m4 = prepare_mask(mask, qb, kb)
    add = None if m4 is None else additive_mask(m4, torch.float32)
    row_max = lse = None
    for s in _tiled_logits(qb, kb, scale, add, softclamp):
        t_max = s.amax(dim=-1, keepdim=True)
        t_lse = torch.logsumexp(s, dim=-1, keepdim=True)
        row_max = t_max if row_max is None else torch.maximum(row_max, t_max)
        lse = t_lse if lse is None else torch.logaddexp(lse, t_lse)
    live = torch.isfinite(row_max)
    r = torch.where(live, row_max, torch.zeros_like(row_max))
    lse_safe = torch.where(live, lse, torch.zeros_like(lse))
    near = ones = torch.zeros_like(r)
    p_logit = torch.zeros_like(r)
    for s in _tiled_logits(qb, kb, scale, add, softclamp):
        near = near + (s >= r - tau).sum(dim=-1, keepdim=True)
        ones = ones + (torch.exp(s - r).to(torch.bfloat16) == 1).sum(dim=-1, keepdim=True)
        p = torch.exp(s - lse_safe)
        p_logit = p_logit + torch.where(p > 0, p * s, torch.zeros_like(s)).sum(dim=-1, keepdim=True)
    keys = kb.shape[2]
    entropy = (lse_safe - p_logit) / math.log(keys) if keys > 1 else torch.zeros_like(r)
    any_live = bool(live.any())
    return LayerStats(
        calls=1,
        rows=int(live.sum()),
        max_logit=float(row_max[live].max()) if any_live else float("-inf"),
        max_prob=float(torch.exp(r - lse_safe)[live].max()) if any_live else 0.0,
        shift_rows=int(((near >= 2) & live).sum()),
        bf16_one_rows=int(((ones >= 2) & live).sum()),
        entropy_sum=float(entropy[live].sum()),
    )


@dataclass
class AttentionStats:
    """Collector shared by reference across ModelPatcher clones (deepcopy returns itself).

    ``layers`` maps a layer label ("double.3", "single.0", or "call.N" = N-th call of a forward) to its
    totals. Read ``total()`` for all layers, ``rows()`` for a table.
    """

    layers: dict[str, LayerStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, layer: str, call: LayerStats) -> None:
        with self._lock:
            self.layers.setdefault(layer, LayerStats()).add(call)

    def reset(self) -> None:
        with self._lock:
            self.layers.clear()

    def total(self) -> LayerStats:
        out = LayerStats()
        with self._lock:
            for layer in self.layers.values():
                out.add(layer)
        return out

    def rows(self) -> list[dict[str, float | str]]:
        """One dict per layer: {"layer", "calls", "rows", "max_logit", "shift_fraction", ...}."""
        with self._lock:
            return [{"layer": name, **stats.as_dict()} for name, stats in self.layers.items()]

    def __deepcopy__(self, memo: dict) -> AttentionStats:
        return self
