"""A cast base weight is cast again in backward, not kept (issue 29, the activation diet's other half).

ComfyUI multiplies an fp8 / scaled-fp8 / offloaded layer's input with a fresh model-dtype copy of its weight
(``comfy.ops.cast_bias_weight``). The LoRA layer's base GEMM used to save that copy for the input gradient,
so every adapted layer of the block being trained held a bf16 copy of its weight from forward to backward.
``lora.linear.recomputable`` marks the copy; the backward casts it again (same bits: the cast is
deterministic). Here, on a ComfyUI fp8 Linear with the pack's LoRA forward: gradients are bit-identical to
keeping the copy, and the saved tensors no longer include a weight-sized bf16 tensor.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(pack_module, dtype):
    import comfy.ops

    torch.manual_seed(0)
    layer = comfy.ops.manual_cast.Linear(64, 48, bias=True, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64) * 0.05)
        layer.bias.copy_(torch.randn(48) * 0.01)
    layer.weight = torch.nn.Parameter(layer.weight.detach().to(dtype), requires_grad=False)
    layer.bias = torch.nn.Parameter(layer.bias.detach().to(torch.bfloat16), requires_grad=False)
    cfg = pack_module("lora.config").LoRAConfig(rank=4, alpha=4.0)
    with torch.inference_mode(False):
        lora_set = pack_module("lora.layer").LoRASet(cfg, {"l": (64, 48)})
        for p in lora_set.parameters():
            with torch.no_grad():
                p.copy_(torch.randn_like(p) * 0.1)
    return layer, lora_set.adapters()["l"]


def _run(pack_module, dtype, keep: bool):
    """(x grad, lora grads, saved tensor sizes) of one forward/backward through the pack's LoRA forward."""
    glue = pack_module("nodes.lora.glue")
    layer, adapter = _layer(pack_module, dtype)
    forward = glue.LoRAForward(layer, (adapter,))
    x = (torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16).requires_grad_(True)
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    original = glue.recomputable
    if keep:
        glue.recomputable = lambda weight, recast: weight  # the old behaviour: the copy is kept
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(x)
        (out.float() ** 2).sum().backward()
    finally:
        glue.recomputable = original
    return out.detach(), x.grad, [p.grad.clone() for p in adapter.parameters()], saved


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_recast_weight_gives_bit_identical_gradients_and_keeps_no_weight_copy(pack_module, dtype):
    out_a, gx_a, gl_a, saved_a = _run(pack_module, dtype, keep=False)
    out_b, gx_b, gl_b, saved_b = _run(pack_module, dtype, keep=True)
    assert torch.equal(out_a, out_b)
    assert torch.equal(gx_a, gx_b)
    assert all(torch.equal(a, b) for a, b in zip(gl_a, gl_b))
    assert gx_a.abs().sum() > 0
    weight_copy = ((48, 64), torch.bfloat16)
    assert weight_copy in saved_b, saved_b  # the old path keeps the bf16 copy of the fp8 weight ...
    assert weight_copy not in saved_a, saved_a  # ... the new one does not


def test_a_stored_bf16_weight_is_not_marked(pack_module):
    """A layer whose weight needs no cast multiplies with the Parameter itself: nothing to recast, and no
    attribute is put on the Parameter."""
    glue = pack_module("nodes.lora.glue")
    linear = pack_module("lora.linear")
    layer = torch.nn.Linear(64, 48, dtype=torch.bfloat16).requires_grad_(False)
    cfg = pack_module("lora.config").LoRAConfig(rank=4, alpha=4.0)
    adapter = pack_module("lora.layer").LoRASet(cfg, {"l": (64, 48)}).adapters()["l"]
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    glue.LoRAForward(layer, (adapter,))(x).float().sum().backward()
    assert not hasattr(layer.weight, linear._RECAST)
    assert x.grad is not None and x.grad.abs().sum() > 0
