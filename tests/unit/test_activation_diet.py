"""The fp32 LoRA path keeps a layer's input for backward in its own dtype (bf16), not as an fp32 copy.

Before the diet, ``x.float()`` fed the down projection and autograd kept that fp32 copy until backward: on
real models about as much again as all other activations together (#29). Two claims are checked here:

- values: outputs and gradients are bit-identical to the old composition (``x.float()`` fed to the same
  GEMMs), on every route of the fp32 path (fused base+delta, extra adapters, rank dropout, ``delta_fp32``);
- memory: the bytes autograd saves for a stack of adapted bf16 layers are within 5 % of a plain bf16
  LoRA's, where the old composition saved well over that (so the bound could fail).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lora.config import LoRAConfig
from lora.lowrank import LoRAAdapter, lora_linear
from lora.linear import base_linear_fp32, upcast_linear

N_IN, N_OUT, RANK = 96, 80, 8


def _adapter(seed: int, n_in: int = N_IN, n_out: int = N_OUT, **cfg) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    a = LoRAAdapter(n_in, n_out, LoRAConfig(rank=RANK, alpha=4.0, **cfg), init_generator=g)
    with torch.no_grad():
        a.up.copy_(torch.randn(n_out, RANK, generator=g) * 0.1)
    a.mark_modified()
    return a


def _inputs(seed: int = 0, shape=(2, 7)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, N_IN, generator=g).bfloat16()
    w = (torch.randn(N_OUT, N_IN, generator=g) / N_IN**0.5).bfloat16()
    b = (torch.randn(N_OUT, generator=g) * 0.1).bfloat16()
    return x, w, b


def _old_down(a: LoRAAdapter, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """What ``_down`` did before the diet: the fp32 copy of x enters autograd (and is saved)."""
    h = F.linear(x.float(), a.down)
    return h if mask is None else h * mask


def _old_fused(a: LoRAAdapter, x, w, b) -> torch.Tensor:
    """The old ``linear_fp32``: base GEMM with fp32 output, then ``x2.float() @ down.t()`` added in place."""
    x2 = x.reshape(-1, x.shape[-1])
    acc = base_linear_fp32(x2, w, b)
    acc.addmm_(torch.mm(x2.float(), a.down.t()), a.up.t(), alpha=a.scale)
    return acc.view(*x.shape[:-1], w.shape[0])


def _old_add(a: LoRAAdapter, acc: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The old ``add_delta_fp32``."""
    h = _old_down(a, x, mask)
    out = torch.addmm(acc.reshape(-1, N_OUT), h.reshape(-1, RANK), a.up.t(), alpha=a.scale)
    return out.view(acc.shape)


def _grads(fn, x: torch.Tensor, adapters) -> list[torch.Tensor]:
    """[output, x.grad, each adapter's down.grad and up.grad] after a backward of a fixed weighting."""
    x = x.clone().requires_grad_(True)
    for a in adapters:
        a.zero_grad(set_to_none=True)
    out = fn(x)
    g = torch.Generator().manual_seed(7)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return [out.detach(), x.grad] + [t for a in adapters for t in (a.down.grad, a.up.grad)]


def _assert_identical(new: list[torch.Tensor], old: list[torch.Tensor]) -> None:
    assert len(new) == len(old)
    for i, (n, o) in enumerate(zip(new, old)):
        assert n.dtype == o.dtype and n.shape == o.shape, i
        assert torch.equal(n, o), f"tensor {i} differs: max |diff| {(n.float() - o.float()).abs().max().item()}"


@pytest.mark.parametrize("shape", [(2, 7), (13,)])
def test_fused_path_is_bit_identical(shape):
    a = _adapter(1)
    x, w, b = _inputs(shape=shape)
    new = _grads(lambda xx: lora_linear(xx, w, b, (a,)), x, [a])
    old = _grads(lambda xx: _old_fused(a, xx, w, b).bfloat16(), x, [a])
    _assert_identical(new, old)
    assert new[1].dtype == torch.bfloat16 and new[1].abs().sum() > 0


def test_stacked_adapters_are_bit_identical():
    """A second adapter on the same layer goes through ``add_delta_fp32``; x's gradient sums three terms."""
    a, c = _adapter(1), _adapter(2)
    x, w, b = _inputs(3)
    new = _grads(lambda xx: lora_linear(xx, w, b, (a, c)), x, [a, c])
    old = _grads(lambda xx: _old_add(c, _old_fused(a, xx, w, b), xx).bfloat16(), x, [a, c])
    _assert_identical(new, old)


def test_rank_dropout_route_is_bit_identical():
    """Rank dropout leaves the fused route (``linear_fp32`` returns None): base GEMM + ``add_delta_fp32``."""
    a = _adapter(1, rank_dropout=0.3)
    a.train()
    x, w, b = _inputs(4)
    state = a._rng.get_state()
    new = _grads(lambda xx: lora_linear(xx, w, b, (a,)), x, [a])
    a._rng.set_state(state)

    def old(xx):
        h = _old_down(a, xx)
        h = h * a._mask((h.shape[0], 1, RANK), 0.3, h)  # the same draw _down makes, from the same state
        acc = base_linear_fp32(xx, w, b)
        out = torch.addmm(acc.reshape(-1, N_OUT), h.reshape(-1, RANK), a.up.t(), alpha=a.scale)
        return out.view(acc.shape).bfloat16()

    _assert_identical(new, _grads(old, x, [a]))


def test_delta_fp32_is_bit_identical():
    a = _adapter(5)
    x, _w, _b = _inputs(6)
    new = _grads(a.delta_fp32, x, [a])
    old = _grads(lambda xx: F.linear(_old_down(a, xx), a.up) * a.scale, x, [a])
    _assert_identical(new, old)


def test_upcast_linear_keeps_fp32_inputs_on_the_plain_op():
    """fp32 inputs are not wrapped (nothing to save in another dtype); the result is F.linear's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 16, generator=g), torch.randn(4, 16, generator=g)
    assert torch.equal(upcast_linear(x, w), F.linear(x, w))
    assert torch.equal(upcast_linear(x.bfloat16(), w), F.linear(x.bfloat16().float(), w))


# ---- memory: bytes autograd saves ------------------------------------------------------------------------

def _saved_activation_bytes(fn, exclude: list[torch.Tensor], *, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves while ``fn(x)`` runs (what stays alive until backward),
    leaving out ``exclude`` (parameters and frozen weights: not activations)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x.clone().requires_grad_(True))
    out.float().sum().backward()  # the graph was real: it backpropagates
    return sum(seen.values())


def _stack(fp32: bool, old: bool = False):
    """Three adapted bf16 layers with a GELU between: (fn, tensors that are not activations)."""
    layers = []
    for i in range(3):
        a = _adapter(10 + i, N_IN, N_IN, fp32_accumulation=fp32)
        g = torch.Generator().manual_seed(20 + i)
        w = (torch.randn(N_IN, N_IN, generator=g) / N_IN**0.5).bfloat16()
        layers.append((a, w, (torch.randn(N_IN, generator=g) * 0.1).bfloat16()))

    def fn(x):
        for a, w, b in layers:
            y = _old_fused(a, x, w, b).bfloat16() if old else lora_linear(x, w, b, (a,))
            x = F.gelu(y)
        return x

    return fn, [t for a, w, b in layers for t in (a.down, a.up, w, b)]


def test_fp32_path_saves_within_5_percent_of_a_plain_bf16_lora():
    x = torch.randn(4, 64, N_IN, generator=torch.Generator().manual_seed(0)).bfloat16()
    plain = _saved_activation_bytes(*_stack(False), x=x)
    fp32 = _saved_activation_bytes(*_stack(True), x=x)
    before = _saved_activation_bytes(*_stack(True, old=True), x=x)
    assert fp32 <= 1.05 * plain, (fp32, plain)
    # the old composition's fp32 copies of x (1.48x here; more in the real old code, whose base GEMM also kept
    # x in bf16): the 5 % bound can fail
    assert before > 1.4 * plain, (before, plain)
