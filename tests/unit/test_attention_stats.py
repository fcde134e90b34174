"""Per-call attention statistics against brute-force values; the collector's aggregation."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from attention.stats import AttentionStats, LayerStats, measure_call


def _brute(q, k, scale, mask=None):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    s = s.reshape(-1, s.shape[-1])
    live = torch.isfinite(s.amax(-1))
    s = s[live]
    r = s.amax(-1, keepdim=True)
    p = torch.softmax(s, -1)
    ent = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1) / math.log(s.shape[-1])
    near = (s >= r - 0.00196).sum(-1)
    ones = (torch.exp(s.float() - r.float()).to(torch.bfloat16) == 1).sum(-1)
    return s.shape[0], r.max().item(), int((near >= 2).sum()), int((ones >= 2).sum()), ent.sum().item()


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_measure_call_matches_brute_force(layout):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 11, 8, generator=gen), torch.randn(2, 3, 13, 8, generator=gen)
    k[:, :, 5] = k[:, :, 2]  # exact ties in every row
    q[:, :, 0] = 0.0  # all-equal rows: ties and uniform attention
    mask = torch.ones(11, 13, dtype=torch.bool)
    mask[3] = False  # a fully masked row is left out
    mask[:, 5] = False  # and breaks the 2-5 tie for every row
    for m in (None, mask):
        rows, max_logit, shift_rows, ones_rows, ent = _brute(q, k, 0.7, m)
        qq, kk = (q.transpose(1, 2), k.transpose(1, 2)) if layout == "blhd" else (q, k)
        got = measure_call(qq, kk, scale=0.7, mask=m, layout=layout)
        assert (got.calls, got.rows) == (1, rows)
        assert got.max_logit == pytest.approx(max_logit, rel=1e-5)
        assert got.shift_rows == shift_rows
        assert got.bf16_one_rows == ones_rows
        assert got.entropy_sum == pytest.approx(ent, rel=1e-4)
        assert got.shift_rows >= 2 * 3  # at least the all-zero rows (one per batch and head) tie


def test_collector_aggregates_per_layer_and_survives_deepcopy():
    stats = AttentionStats()
    stats.record("double.0", LayerStats(calls=1, rows=10, max_logit=3.0, shift_rows=2, bf16_one_rows=1, entropy_sum=5.0))
    stats.record("double.0", LayerStats(calls=1, rows=10, max_logit=7.0, shift_rows=0, bf16_one_rows=1, entropy_sum=3.0))
    stats.record("single.0", LayerStats(calls=1, rows=20, max_logit=1.0, shift_rows=20, bf16_one_rows=0, entropy_sum=20.0))
    assert copy.deepcopy(stats) is stats
    layer = stats.layers["double.0"]
    assert (layer.calls, layer.max_logit, layer.shift_fraction, layer.bf16_one_fraction) == (2, 7.0, 0.1, 0.1)
    assert layer.entropy_ratio == pytest.approx(0.4)
    total = stats.total()
    assert (total.calls, total.rows, total.max_logit) == (3, 40, 7.0)
    assert total.shift_fraction == pytest.approx(22 / 40)
    rows = stats.rows()
    assert [r["layer"] for r in rows] == ["double.0", "single.0"] and rows[1]["shift_fraction"] == 1.0
    stats.reset()
    assert stats.total().calls == 0
