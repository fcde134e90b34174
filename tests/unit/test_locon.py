"""LoCon (lora/locon.py): a LoRA on a Conv2d against an fp64 reference of stock ComfyUI's conv LoRA (the weight
plus ``alpha / rank * (up.flatten(1) @ down.flatten(1)).reshape(W.shape)``), identity at init, the
delta-survival gain of the fp32 path, the stock file layout and the adapter option's config rules."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lora.config import LoRAConfig
from lora.file import lora_state_dict
from lora.layer import LoRASet
from lora.locon import ConvGeometry, LoConAdapter, lora_conv2d

GEO = ConvGeometry((1, 1), (1, 1), (1, 1), 1)


def _adapter(n_in: int, n_out: int, rank: int = 4, seed: int = 0, **cfg) -> LoConAdapter:
    config = LoRAConfig(rank=rank, alpha=2.0 * rank, adapter="locon", **cfg)
    a = LoConAdapter(n_in, n_out, (3, 3), config, init_generator=torch.Generator().manual_seed(seed))
    return a


def _stock_weight(a: LoConAdapter, w: torch.Tensor) -> torch.Tensor:
    """Stock's patched conv weight in fp64: W + scale * (up (out, r) @ down (r, in*kh*kw)) reshaped to W's shape."""
    down, up = (t.double() for t in a.file_tensors().values())
    return w.double() + a.scale * (up.flatten(1) @ down.flatten(1)).reshape(w.shape)


def test_identity_at_init_and_output_equals_the_stock_weight():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 8, 6, 6, generator=g), torch.randn(12, 8, 3, 3, generator=g), torch.randn(12, generator=g)
    a = _adapter(8, 12)
    assert torch.equal(lora_conv2d(x, w, b, GEO, (a,)), F.conv2d(x, w, b, 1, 1))  # up is zero: the base conv
    with torch.no_grad():
        a.up.copy_(torch.randn(a.up.shape, generator=g))
        a.mark_modified()
    ref = F.conv2d(x.double(), _stock_weight(a, w), b.double(), 1, 1)
    torch.testing.assert_close(lora_conv2d(x, w, b, GEO, (a,)).double(), ref, rtol=1e-5, atol=1e-5)
    strided = ConvGeometry((2, 2), (1, 1), (1, 1), 1)
    ref2 = F.conv2d(x.double(), _stock_weight(a, w), b.double(), 2, 1)
    torch.testing.assert_close(lora_conv2d(x, w, b, strided, (a,)).double(), ref2, rtol=1e-5, atol=1e-5)
    a.multiplier = 0.5
    half = F.conv2d(x.double(), (w.double() + _stock_weight(a, w)) / 2, b.double(), 1, 1)
    torch.testing.assert_close(lora_conv2d(x, w, b, GEO, (a,)).double(), half, rtol=1e-5, atol=1e-5)


def test_gradients_match_the_fp64_reference():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, 4, 5, 5, generator=g), torch.randn(6, 4, 3, 3, generator=g)
    a = _adapter(4, 6, rank=2)
    with torch.no_grad():
        a.up.copy_(torch.randn(a.up.shape, generator=g))
    a.mark_modified()
    lora_conv2d(x, w, None, GEO, (a,)).pow(2).sum().backward()
    down = a.down.detach().double().requires_grad_()
    up = a.up.detach().double().requires_grad_()
    dw = a.scale * (up @ down).reshape(w.shape)
    F.conv2d(x.double(), w.double() + dw, None, 1, 1).pow(2).sum().backward()
    torch.testing.assert_close(a.down.grad.double(), down.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.up.grad.double(), up.grad, rtol=1e-4, atol=1e-4)


def _gain(fp32_accumulation: bool, rho: float, channels: int = 64) -> float:
    """Projection gain of the realised bf16 output change on the fp64 ideal conv(x, dW) at rms(dW)/rms(W) = rho."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, channels, 16, 16, generator=g).bfloat16()
    w = (torch.randn(channels, channels, 3, 3, generator=g) / (9 * channels) ** 0.5).bfloat16()
    a = _adapter(channels, channels, rank=8, fp32_accumulation=fp32_accumulation)
    with torch.no_grad():
        a.up.copy_(torch.randn(a.up.shape, generator=g))
        a.mark_modified()
        dw = a.delta_weight().double()
        a.up.mul_(float(rho * w.double().pow(2).mean().sqrt() / dw.pow(2).mean().sqrt()))
        a.mark_modified()
        ideal = F.conv2d(x.double(), a.delta_weight().double().reshape(w.shape), None, 1, 1)
        change = lora_conv2d(x, w, None, GEO, (a,)).double() - F.conv2d(x, w, None, 1, 1).double()
    return float((change * ideal).sum() / (ideal * ideal).sum())


def test_fp32_accumulation_keeps_a_small_conv_delta_that_a_bf16_delta_loses():
    """The gain test of tests/unit/test_adapters.py on a bf16 3x3 conv: at rms(dW)/rms(W) = 1e-3 a delta added
    in bf16 survives about half; the fp32 path (sum before the one rounding) keeps all of it."""
    assert _gain(True, 1e-3) == pytest.approx(1.0, abs=0.05)
    lost = _gain(False, 1e-3)
    assert 0.3 < lost < 0.7, lost
    assert _gain(False, 1e-2) > 0.95  # a large delta survives either way: the loss is in the small ones


def test_a_set_with_convs_saves_stock_conv_layouts_and_copies():
    shapes = {"input_blocks.1.0.in_layers.2": (8, 16, 3, 3), "input_blocks.1.1.proj_in": (16, 16)}
    s = LoRASet(LoRAConfig(rank=4, alpha=3.0, adapter="locon"), shapes)
    conv, lin = s.adapters()["input_blocks.1.0.in_layers.2"], s.adapters()["input_blocks.1.1.proj_in"]
    assert isinstance(conv, LoConAdapter) and not isinstance(lin, LoConAdapter) and lin.kind == "lora"
    sd = lora_state_dict(s, "diffusion_model")
    p = "diffusion_model.input_blocks.1.0.in_layers.2"
    assert sd[p + ".lora_down.weight"].shape == (4, 8, 3, 3) and sd[p + ".lora_up.weight"].shape == (16, 4, 1, 1)
    assert sd[p + ".alpha"].item() == 3.0 and sd["diffusion_model.input_blocks.1.1.proj_in.lora_down.weight"].dim() == 2
    copy = s.copy()
    assert isinstance(copy.adapters()["input_blocks.1.0.in_layers.2"], LoConAdapter)
    assert all(torch.equal(a, b) for a, b in zip(s.parameters(), copy.parameters()))
    with pytest.raises(ValueError, match=r"rank=40 exceeds the width of 'input_blocks.1.0.in_layers.2' .*use rank <= 16"):
        LoRASet(LoRAConfig(rank=40, alpha=3.0, adapter="locon"), {"input_blocks.1.0.in_layers.2": (8, 16, 3, 3)})


def test_locon_takes_module_dropout_only():
    with pytest.raises(ValueError, match=r"dropout=0.1 .* adapter='locon' has none"):
        LoRAConfig(adapter="locon", dropout=0.1)
    LoRAConfig(adapter="locon", module_dropout=0.1)
    with pytest.raises(ValueError, match=r"use lora_conv2d"):
        _adapter(4, 4).delta_fp32(torch.zeros(1, 4, 2, 2))


def test_training_state_recognises_its_locon_file():
    """resume_from's check (training.checkpoint.state_lora_mismatch) matches a LoCon file's 4-D conv factors to
    the state's flat parameters; one changed tensor is named."""
    from types import SimpleNamespace

    from training.checkpoint import state_lora_mismatch

    s = LoRASet(LoRAConfig(rank=4, adapter="locon"), {"input_blocks.1.0.in_layers.2": (8, 16, 3, 3), "x.proj": (16, 16)})
    with torch.no_grad():
        for p in s.parameters():
            p.add_(0.1)
    state = SimpleNamespace(lora={n: p.detach().clone() for n, p in s.named_parameters()})
    for dtype in ("fp32", "bf16"):
        assert state_lora_mismatch(state, lora_state_dict(s, "diffusion_model", dtype)) is None
    with torch.no_grad():
        s.adapters()["input_blocks.1.0.in_layers.2"].down.add_(1.0)
    assert state_lora_mismatch(state, lora_state_dict(s, "diffusion_model")) == "their LoRA values differ (1 of 4 tensors)"
