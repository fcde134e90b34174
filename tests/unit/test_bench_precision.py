"""bench/precision.py in --quick mode, and the pure helpers it (and the probe) rests on, against direct computations."""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

from attention.stats import measure_call
from lora.config import LoRAConfig
from lora.lowrank import LoRAAdapter
from probe.attention import measure_attention
from probe.survival import delta_survival, summarize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loader import load_bench  # noqa: E402

def _adapter(width: int, rank: int, up_std: float, seed: int) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    a = LoRAAdapter(width, width, LoRAConfig(rank=rank, alpha=2.0 * rank), init_generator=gen)
    with torch.no_grad():
        a.up.copy_(torch.randn(width, rank, generator=gen) * up_std)
    a.requires_grad_(False)
    a.mark_modified()
    return a


def test_delta_survival_matches_numpy_merge_and_add():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=gen)
    w = torch.randn(64, 64, generator=gen) / 8
    b = torch.randn(64, generator=gen)
    a = _adapter(64, 4, 1e-3, 1)
    s = delta_survival(x, w, b, (a,))
    xb, wb, bb = (t.bfloat16().double().numpy() for t in (x, w, b))
    dw = (a.up.double() @ a.down.double()).numpy() * 2.0  # scale = alpha / rank = 2
    bf = lambda arr: torch.from_numpy(arr).bfloat16().double().numpy()  # noqa: E731
    base = bf(xb @ wb.T + bb)
    ideal = xb @ dw.T
    merged = bf(xb @ bf(wb + dw.astype(np.float32)).T + bb)
    added = bf(base + bf(ideal))
    gain = lambda out: float(((out - base) * ideal).sum() / (ideal * ideal).sum())  # noqa: E731
    assert s.gains["merge"] == pytest.approx(gain(merged), rel=1e-6)
    assert s.gains["add_bf16"] == pytest.approx(gain(added), rel=1e-6)
    assert s.rho == pytest.approx(float(np.sqrt((dw**2).mean()) / np.sqrt((wb**2).mean())), rel=1e-5)
    assert a.training is False and a.fp32_accumulation is True  # left as it was


def test_summarize_weights_layers_by_ideal_energy():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 32, generator=gen)
    w = torch.randn(32, 32, generator=gen) / 6
    small, large = delta_survival(x, w, None, (_adapter(32, 2, 1e-4, 3),)), delta_survival(x, w, None, (_adapter(32, 2, 1e-1, 4),))
    out = summarize({"a": small, "b": large})
    e1, e2 = small.ideal_energy, large.ideal_energy
    assert out["merge"] == pytest.approx((small.gains["merge"] * e1 + large.gains["merge"] * e2) / (e1 + e2))
    assert summarize({}) == {}


def test_measure_attention_matches_stats_module_and_direct_softmax():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(3))
    k[:, :, 3] = k[:, :, 5]  # duplicate keys: exact logit ties in some rows
    q[:, :, :4] = k[:, :, 3:4] * 3  # ... and those rows put their max on the tied keys
    scale = 1.3 / math.sqrt(16)
    got = measure_attention(q, k, v, scale=scale, max_rows=0)
    ref = measure_call(q, k, scale=scale)
    assert got.rows == ref.rows == 48
    assert got.entropy_ratio == pytest.approx(ref.entropy_ratio, rel=1e-5)
    assert got.bf16_one_rows == ref.bf16_one_rows >= 8 and got.shift_rows == ref.shift_rows
    p = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, dim=-1)
    assert got.max_prob == pytest.approx(float(p.max()), rel=1e-6)
    assert load_bench("precision").entropy_ratio_dense(torch.zeros(3, 10)).tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_precision_bench_quick_reproduces_the_claims(capsys):
    bench = load_bench("precision")
    assert bench.main(["--quick"]) == 0
    text = capsys.readouterr().out
    assert "| 16 | 1e-03 |" in text and "quick mode" in text
    tables = bench.run(quick=True)
    by = {(r["rank"], r["rho"]): r for r in tables["survival"]}
    for rank in bench.QUICK["ranks"]:
        small, big = by[(rank, 1e-3)], by[(rank, 1e-2)]
        assert small["merge"] < 0.7 and small["add_bf16"] < 0.7 and small["fp32_unmerged"] > 0.9
        assert big["merge"] == pytest.approx(1.0, abs=0.05) and big["fp32_unmerged"] == pytest.approx(1.0, abs=0.05)
    scale = tables["scale"]
    assert [r["entropy"] for r in scale] == sorted((r["entropy"] for r in scale), reverse=True)
    assert scale[0]["kl"] < scale[-1]["kl"]
    bias = {r["case"]: r for r in tables["bias"]}
    near = bias["4 near-ties (<= 0.0015), kernel-style fp32 Ō"]
    assert near["standard"] < -0.3 and abs(near["stable"]) < 0.15
