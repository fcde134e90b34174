"""Dispatcher policies: scale, training with a backend that has no backward, masks, fp32 softmax."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from attention import backends
from attention.backends import Backend
from attention.config import AttentionConfig
from attention.dispatch import AttentionDispatcher, scale_query
from attention.reference import reference_attention


def _qkv(dtype=torch.float32, layout="bhld"):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen).to(dtype) for _ in range(3))
    if layout == "blhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return q, k, v


def _fake(name: str, trainable: bool, supports_mask: bool, calls: list) -> Backend:
    def fn(q, k, v, *, scale, mask=None, layout="bhld", softclamp=0.0, beta=2.0):
        calls.append(name)
        return backends.BACKENDS["math"](q, k, v, scale=scale, mask=mask, layout=layout).detach()

    return Backend(name, fn, trainable, supports_mask, False, (), "test double")


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("backend", ["sdpa", "math", "stable"])
def test_run_applies_the_resolved_scale(backend, layout):
    q, k, v = _qkv(layout=layout)
    cfg = AttentionConfig(backend=backend, scale_mode="multiplier", scale_value=0.5)
    out = AttentionDispatcher(cfg).run(q, k, v, layout=layout)
    ref = reference_attention(q.double(), k.double(), v.double(), scale=0.5 / math.sqrt(8), layout=layout)
    assert (out.double() - ref).abs().max().item() < 2e-6


def test_scale_query_equals_scaled_attention():
    q, k, v = _qkv(torch.float64)
    folded = reference_attention(scale_query(q, 0.3, 1 / math.sqrt(8)), k, v, scale=1 / math.sqrt(8))
    direct = reference_attention(q, k, v, scale=0.3)
    assert (folded - direct).abs().max().item() < 1e-12


def test_training_through_a_backend_without_backward_is_a_clear_error(monkeypatch):
    calls: list = []
    monkeypatch.setitem(backends.BACKENDS, "sage", _fake("sage", False, False, calls))
    q, k, v = _qkv()
    dispatcher = AttentionDispatcher(AttentionConfig(backend="sage"))
    out = dispatcher.run(q, k, v)  # inference: fine
    assert calls == ["sage"] and out.shape == q.shape
    with pytest.raises(ValueError) as info:
        dispatcher.run(q.requires_grad_(True), k, v)
    assert "attention backend 'sage' has no backward pass" in str(info.value)
    assert "choose sdpa, stable, math, flash or xformers for training" in str(info.value)
    with torch.no_grad():  # grad disabled: no gradients to lose
        dispatcher.run(q, k, v)


def test_masked_call_on_a_backend_without_masks_runs_on_sdpa_and_logs(monkeypatch, caplog):
    calls: list = []
    monkeypatch.setitem(backends.BACKENDS, "flash", _fake("flash", True, False, calls))
    q, k, v = _qkv()
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    with caplog.at_level(logging.WARNING):
        out = AttentionDispatcher(AttentionConfig(backend="flash")).run(q, k, v, mask=mask)
    assert calls == []
    ref = reference_attention(q.double(), k.double(), v.double(), scale=1 / math.sqrt(8), mask=mask)
    assert (out.double() - ref).abs().max().item() < 2e-6
    assert "attention backend 'flash' cannot take masks; masked calls run on sdpa" in caplog.text


@pytest.mark.skipif(backends.available()["xformers"] is None, reason="xformers is installed here")
def test_unavailable_backend_names_the_package():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="attention backend 'xformers' is unavailable: .*xformers"):
        AttentionDispatcher(AttentionConfig(backend="xformers")).run(q, k, v)


def test_fp32_softmax_runs_the_backend_in_fp32_and_returns_the_input_dtype():
    q, k, v = _qkv(torch.bfloat16)
    out = AttentionDispatcher(AttentionConfig(backend="sdpa", fp32_softmax=True)).run(q, k, v)
    assert out.dtype == torch.bfloat16
    exact = reference_attention(q.double(), k.double(), v.double(), scale=1 / math.sqrt(8))
    # fp32 compute + one rounding: within half a bf16 ulp of the exact result (plus fp32 noise).
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


def test_softclamp_warns_when_below_ten_times_the_max_logit(caplog):
    q, k, v = _qkv()
    with caplog.at_level(logging.WARNING):
        AttentionDispatcher(AttentionConfig(backend="math", softclamp=1.0)).run(q, k, v, layer="double.0")
    assert "softclamp=1.0 is below 10x the max logit" in caplog.text
    assert "attention layer double.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        AttentionDispatcher(AttentionConfig(backend="math", softclamp=1000.0)).run(q, k, v)
    assert "softclamp" not in caplog.text


def test_stats_only_when_requested():
    q, k, v = _qkv()
    quiet = AttentionDispatcher(AttentionConfig(backend="sdpa"))
    quiet.run(q, k, v)
    assert quiet.stats.total().calls == 0
    loud = AttentionDispatcher(AttentionConfig(backend="sdpa", collect_stats=True))
    loud.run(q, k, v, layer="a")
    loud.run(q, k, v, layer="a")
    assert loud.stats.layers["a"].calls == 2 and loud.stats.layers["a"].rows == 2 * 2 * 6


def test_auto_is_not_run_by_the_pure_dispatcher():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="cannot run backend 'auto'"):
        AttentionDispatcher(AttentionConfig(backend="auto", scale_mode="multiplier", scale_value=2.0)).run(q, k, v)


def test_attention_package_imports_no_comfyui():
    import subprocess
    import sys

    code = ("import sys, attention, attention.dispatch, attention.stats; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('comfy', 'comfy_api', 'folder_paths', 'server', 'nodes', 'execution')]; print(bad)")
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
