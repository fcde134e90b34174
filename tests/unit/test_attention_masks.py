"""The helpers every backend shares (``attention.masks``), each against values written out by hand: a wrong
mask shape, sign or softclamp here would otherwise reach every backend and its reference at once."""
from __future__ import annotations

import math

import pytest
import torch

from attention.masks import (additive_mask, dead_rows, expand_heads, finish_logits, from_bhld, prepare_mask,
                             to_bhld, unmask_dead_rows)

B, H, LQ, LK, D = 2, 3, 4, 5, 8


def _qk():
    return torch.zeros(B, H, LQ, D), torch.zeros(B, H, LK, D)


@pytest.mark.parametrize("shape, expected", [
    ((LQ, LK), (1, 1, LQ, LK)),       # 2-D: one mask for every batch and head
    ((B, LQ, LK), (B, 1, LQ, LK)),    # 3-D: per batch, every head
    ((1, LQ, LK), (1, 1, LQ, LK)),
    ((B, H, LQ, LK), (B, H, LQ, LK)),
    ((B, 1, 1, LK), (B, 1, 1, LK)),   # key padding
])
def test_prepare_mask_puts_each_dim_where_it_belongs(shape, expected):
    q, k = _qk()
    mask = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    m4 = prepare_mask(mask, q, k)
    assert tuple(m4.shape) == expected
    assert m4.dtype == torch.float32
    full = m4.expand(B, H, LQ, LK)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 3, 4), (1, 0, 2, 1), (0, 2, 1, 3)]:
        index = {2: (i, j), 3: (b if shape[0] > 1 else 0, i, j),
                 4: tuple(x if n > 1 else 0 for x, n in zip((b, h, i, j), shape))}[len(shape)]
        assert full[b, h, i, j] == mask[index]


def test_prepare_mask_keeps_bool_and_passes_none():
    q, k = _qk()
    mask = torch.tensor([[True, False, True, True, False]] * LQ)
    m4 = prepare_mask(mask, q, k)
    assert m4.dtype == torch.bool and torch.equal(m4[0, 0], mask)
    assert prepare_mask(None, q, k) is None


@pytest.mark.parametrize("shape, message", [
    ((LK, LQ), r"attention mask of shape \(5, 4\) does not broadcast to \(B, H, Lq, Lk\) = \(2, 3, 4, 5\)"),
    ((3, LQ, LK), r"attention mask of shape \(3, 4, 5\) does not broadcast"),
    ((LK,), r"attention mask must be 2-D, 3-D or 4-D, got shape \(5,\)"),
    ((1, 1, 1, LQ, LK), r"must be 2-D, 3-D or 4-D"),
])
def test_prepare_mask_rejects_what_does_not_broadcast(shape, message):
    q, k = _qk()
    with pytest.raises(ValueError, match=message):
        prepare_mask(torch.zeros(shape), q, k)


def test_additive_mask_bool_false_is_minus_inf_true_is_zero():
    mask = torch.tensor([[True, False], [False, True]])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        out = additive_mask(mask, dtype)
        assert out.dtype == dtype
        assert out.tolist() == [[0.0, -math.inf], [-math.inf, 0.0]]


def test_additive_mask_float_is_cast_not_changed():
    mask = torch.tensor([[0.5, -2.0], [float("-inf"), 3.25]], dtype=torch.float64)
    out = additive_mask(mask, torch.float32)
    assert out.dtype == torch.float32 and out.tolist() == [[0.5, -2.0], [-math.inf, 3.25]]


@pytest.mark.parametrize("grad", [False, True], ids=["in_place", "autograd"])
def test_finish_logits_softclamp_is_c_tanh_s_over_c_then_mask(grad):
    s = torch.tensor([[-9.0, -1.0, 0.0, 0.5, 2.0, 30.0]], dtype=torch.float64, requires_grad=grad)
    mask = torch.tensor([[0.0, 1.0, -2.0, 0.0, float("-inf"), 0.25]], dtype=torch.float64)
    c = 3.0
    expected = [c * math.tanh(x / c) + m for x, m in zip(s.tolist()[0], mask.tolist()[0])]
    out = finish_logits(s.clone() if grad else s.detach().clone(), c, mask)
    assert out.tolist()[0] == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert out.abs()[torch.isfinite(out)].max() < c + 1  # the clamp bounds every logit by c (+ its mask)
    if grad:  # d/ds c·tanh(s/c) = 1 - tanh²(s/c)
        out[torch.isfinite(out)].sum().backward()
        slope = [1 - math.tanh(x / c) ** 2 for x in s.tolist()[0]]
        slope[4] = 0.0  # the -inf entry was left out of the sum
        assert s.grad.tolist()[0] == pytest.approx(slope, rel=1e-12, abs=1e-15)


def test_finish_logits_without_softclamp_only_adds_the_mask():
    s = torch.tensor([[1.5, -7.0, 40.0]])
    assert finish_logits(s.clone(), 0.0, None).tolist() == [[1.5, -7.0, 40.0]]
    assert finish_logits(s.clone(), 0.0, torch.tensor([[1.0, 0.0, -1.0]])).tolist() == [[2.5, -7.0, 39.0]]


def test_finish_logits_broadcasts_the_mask():
    s = torch.zeros(B, H, LQ, LK)
    mask = torch.arange(LK, dtype=torch.float32).reshape(1, 1, 1, LK)
    out = finish_logits(s, 0.0, mask)
    assert torch.equal(out, mask.expand(B, H, LQ, LK))


def test_dead_rows_finds_rows_with_no_key_and_unmask_opens_only_them():
    m = torch.tensor([[True, False, False], [False, False, False], [False, True, True]])
    dead = dead_rows(m)
    assert dead.tolist() == [[False], [True], [False]]
    assert unmask_dead_rows(m, dead).tolist() == [[True, False, False], [True, True, True], [False, True, True]]
    inf = float("-inf")
    f = torch.tensor([[0.0, inf], [inf, inf]])
    fdead = dead_rows(f)
    assert fdead.tolist() == [[False], [True]]
    assert unmask_dead_rows(f, fdead).tolist() == [[0.0, inf], [0.0, 0.0]]
    assert dead_rows(torch.ones(2, 3, dtype=torch.bool)) is None and dead_rows(None) is None


def test_layouts_and_grouped_heads():
    x = torch.arange(2 * 5 * 3 * 4).reshape(2, 5, 3, 4)  # (B, L, H, D)
    b = to_bhld(x, "blhd")
    assert b.shape == (2, 3, 5, 4) and b[1, 2, 4, 3] == x[1, 4, 2, 3]
    assert torch.equal(from_bhld(b, "blhd"), x) and to_bhld(x, "bhld") is x
    with pytest.raises(ValueError, match=r"layout='lbhd' is unknown; use one of bhld, blhd"):
        to_bhld(x, "lbhd")
    q, kv = torch.zeros(1, 6, 2, 4), torch.arange(3.0).reshape(1, 3, 1, 1).expand(1, 3, 2, 4)
    assert expand_heads(kv, q, "bhld")[0, :, 0, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
