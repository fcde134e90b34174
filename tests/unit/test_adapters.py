"""LoKr / LoHa / DoRA adapters (lora/adapters.py): outputs and gradients against fp64 references written from
stock ComfyUI's formulas, identity at init, the delta-survival gain of the fp32 path per adapter, the file
round trip, LoRA+ groups and config errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lora.adapter_files import build_adapter, parse_adapter_file
from lora.adapters import DoRAAdapter, LoHaAdapter, LoKrAdapter, lokr_factors, make_adapter
from lora.config import LoRAConfig
from lora.file import lora_state_dict
from lora.layer import LoRASet

from lora.lowrank import DropoutRNG, lora_linear

KINDS = ("lokr", "loha", "dora")
EPS = torch.finfo(torch.float32).eps


def _adapter(kind: str, n_in: int, n_out: int, w: torch.Tensor, seed: int = 0, rank: int = 4, **cfg):
    g = torch.Generator().manual_seed(seed)
    config = LoRAConfig(rank=rank, alpha=2.0 * rank, adapter=kind, **cfg)
    return make_adapter(n_in, n_out, config, rng=DropoutRNG(0), init_generator=g, init=True, base_weight=w)


def _randomize(a, seed: int, std: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in a.named_parameters():
            if name != "magnitude":
                p.add_(torch.randn(p.shape, generator=g) * std)
            else:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    a.mark_modified()


def _ref_delta(kind: str, params: dict[str, torch.Tensor], scale: float, w: torch.Tensor) -> torch.Tensor:
    """Stock ComfyUI's delta (lokr.py / loha.py / base.weight_decompose), written here in fp64 from the formulas."""
    if kind == "lokr":
        return scale * torch.kron(params["lokr_w1"], params["lokr_w2_a"] @ params["lokr_w2_b"])
    if kind == "loha":
        return scale * (params["hada_w1_a"] @ params["hada_w1_b"]) * (params["hada_w2_a"] @ params["hada_w2_b"])
    v = w + scale * params["up"] @ params["down"]
    norm = v.transpose(0, 1).reshape(v.shape[1], -1).norm(dim=1, keepdim=True).transpose(0, 1) + EPS
    return v * (params["magnitude"] / norm) - w


def _data(n_in=64, n_out=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 5, n_in, generator=g), torch.randn(n_out, n_in, generator=g) / n_in**0.5,
            torch.randn(n_out, generator=g) * 0.1)


@pytest.mark.parametrize("kind", KINDS)
def test_output_and_gradients_match_fp64_reference_of_stock_formulas(kind):
    x, w, b = _data()
    a = _adapter(kind, 64, 96, w, lokr_factor=4)
    _randomize(a, 2)
    a.train()
    x = x.requires_grad_(True)
    out = lora_linear(x, w, b, (a,))
    out.pow(2).sum().backward()
    p64 = {n: p.detach().double().requires_grad_(True) for n, p in a.named_parameters()}
    x64 = x.detach().double().requires_grad_(True)
    ref = F.linear(x64, w.double() + _ref_delta(kind, p64, a.scale, w.double()), b.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    ref.pow(2).sum().backward()
    for n, p in a.named_parameters():
        torch.testing.assert_close(p.grad.double(), p64[n].grad, rtol=1e-4, atol=1e-5, msg=f"{kind}.{n}")
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fp32_accumulation", [True, False])
def test_identity_at_init_is_bit_equal_and_training_reaches_the_zero_factor(kind, fp32_accumulation):
    x, w, b = _data()
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    a = _adapter(kind, 64, 96, wb, fp32_accumulation=fp32_accumulation)
    with torch.inference_mode():
        assert torch.equal(lora_linear(xb, wb, bb, (a,)), F.linear(xb, wb, bb))
    lora_linear(x, w, b, (a,)).pow(2).sum().backward()
    zero = a.param_split()[1]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in zero), "training must reach the zero factor"
    assert not a.delta_is_zero()


def _gain(kind: str, fp32_accumulation: bool, rho: float, width: int = 512, tokens: int = 256) -> float:
    """Projection gain of the realised bf16 output change on the fp64 ideal x dW^T at rms(dW)/rms(W) = rho."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=g).bfloat16()
    w = (torch.randn(width, width, generator=g) / width**0.5).bfloat16()
    a = _adapter(kind, width, width, w, rank=8, fp32_accumulation=fp32_accumulation)
    zero = a.param_split()[1][0]
    with torch.no_grad():
        zero.copy_(torch.randn(zero.shape, generator=g))
        a.mark_modified()
        for _ in range(2):  # DoRA is not linear in up: a second pass lands rho within a few per cent
            dw = a.delta_weight(w).double()
            zero.mul_(float(rho * w.double().pow(2).mean().sqrt() / dw.pow(2).mean().sqrt()))
        dw = a.delta_weight(w).double()
        ideal = x.double() @ dw.t()
        change = lora_linear(x, w, None, (a,)).double() - F.linear(x, w).double()
    return float((change * ideal).sum() / (ideal * ideal).sum())


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_accumulation_keeps_a_small_delta_that_a_bf16_delta_loses(kind):
    """The gain test of tests/unit/test_lora_layer.py per adapter: at rms(dW)/rms(W) = 1e-3 a delta added in bf16
    survives about half; the fp32 path (sum before the one rounding) keeps all of it."""
    assert _gain(kind, True, 1e-3) == pytest.approx(1.0, abs=0.05)
    lost = _gain(kind, False, 1e-3)
    assert 0.3 < lost < 0.7, lost
    assert _gain(kind, False, 1e-2) > 0.95  # a large delta survives either way: the loss is in the small ones


def test_lokr_factorisation_and_full_matrix_mode():
    assert lokr_factors(3072, -1) == (48, 64) and lokr_factors(96, 4) == (4, 24) and lokr_factors(7, -1) == (1, 7)
    assert lokr_factors(96, 5) == (4, 24) and lokr_factors(16, 64) == (1, 16)
    w = torch.randn(96, 64)
    low = _adapter("lokr", 64, 96, w, rank=4, lokr_factor=4)
    assert low.decomposed and low.lokr_w1.shape == (4, 4) and low.lokr_w2_b.shape == (4, 16) and low.scale == 2.0
    full = _adapter("lokr", 64, 96, w, rank=16, lokr_factor=4)  # rank >= min(24, 16): one full w2, scale 1 (stock)
    assert not full.decomposed and full.lokr_w2.shape == (24, 16) and full.scale == 1.0 and full.file_alpha() is None


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_keys_round_trip_through_the_file_parser(kind):
    shapes = {"double_blocks.0.img_attn.qkv": (64, 96), "double_blocks.0.img_attn.proj": (64, 64)}
    weights = {p: torch.randn(o, i) for p, (i, o) in shapes.items()}
    s = LoRASet(LoRAConfig(rank=4, alpha=3.0, adapter=kind, lokr_factor=4), shapes, weights=weights)
    for a in s.adapters().values():
        _randomize(a, 3)
    sd = lora_state_dict(s, "kohya")
    expect = {"lokr": {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"},
              "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
              "dora": {"lora_down.weight", "lora_up.weight", "dora_scale", "alpha"}}[kind]
    assert {k.split(".", 1)[1] for k in sd} == expect
    parsed = parse_adapter_file(sd, shapes)
    for path, a in s.adapters().items():
        back = build_adapter(path, parsed[path], shapes[path])
        assert type(back) is type(a)
        torch.testing.assert_close(back.delta_weight(weights[path]), a.delta_weight(weights[path]), rtol=1e-5, atol=1e-6)


def test_loraplus_groups_put_the_zero_factors_in_lora_up():
    w = torch.randn(16, 16)
    cases = {"lokr": ["lokr_w2_a"], "loha": ["hada_w2_a"], "dora": ["up"], "lora": ["up"]}
    for kind, up in cases.items():
        s = LoRASet(LoRAConfig(rank=2, adapter=kind), {"x.q": (16, 16)}, weights={"x.q": w})
        down_g, up_g = s.param_groups(1e-3, 4.0)
        names = {id(p): n.rsplit(".", 1)[1] for n, p in s.named_parameters()}
        assert [names[id(p)] for p in up_g["params"]] == up and up_g["lr"] == 4e-3
        assert len(down_g["params"]) + len(up_g["params"]) == len(list(s.parameters()))


def test_copy_keeps_values_and_dora_needs_the_base_weight():
    w = torch.randn(16, 16)
    s = LoRASet(LoRAConfig(rank=2, adapter="dora"), {"x.q": (16, 16)}, weights={"x.q": w})
    _randomize(s.adapters()["x.q"], 4)
    c = s.copy()
    assert all(torch.equal(p, q) for p, q in zip(s.parameters(), c.parameters()))
    with pytest.raises(ValueError, match="DoRA needs the base weight"):
        LoRASet(LoRAConfig(rank=2, adapter="dora"), {"x.q": (16, 16)})


def test_config_errors_name_field_value_and_fix():
    with pytest.raises(ValueError, match=r"adapter='oft' is unknown: use one of \['lora', 'lokr', 'loha', 'dora', 'locon'\]"):
        LoRAConfig(adapter="oft")
    with pytest.raises(ValueError, match=r"lokr_factor=0 is invalid: use -1"):
        LoRAConfig(adapter="lokr", lokr_factor=0)
    with pytest.raises(ValueError, match=r"dropout=0.1 .* adapter='loha' has none: set both to 0"):
        LoRAConfig(adapter="loha", dropout=0.1)
    LoRAConfig(adapter="dora", module_dropout=0.1)  # module dropout works with every adapter


def test_parser_refuses_forms_it_does_not_implement():
    shapes = {"double_blocks.0.img_attn.qkv": (64, 96)}
    base = "lora_unet_double_blocks_0_img_attn_qkv"
    tucker = {f"{base}.hada_w1_a": torch.zeros(96, 2), f"{base}.hada_t1": torch.zeros(2, 2, 1, 1)}
    with pytest.raises(ValueError, match=r"hada_t1' is a form the fp32 adapters do not implement; load this file with "
                                         r"Load LoRA \(Precision\) mode 'merge'"):
        parse_adapter_file(tucker, shapes)
    per_row = {f"{base}.lora_down.weight": torch.zeros(2, 64), f"{base}.lora_up.weight": torch.zeros(96, 2),
               f"{base}.dora_scale": torch.ones(96, 1)}
    with pytest.raises(ValueError, match=r"dora_scale' is a DoRA magnitude tensor, shape \(96, 1\): the fp32 DoRA implements the per-input"):
        parse_adapter_file(per_row, shapes)
    with pytest.raises(ValueError, match=r"key 'lora_unet_other.lokr_w1' matches no whole linear layer"):
        parse_adapter_file({"lora_unet_other.lokr_w1": torch.zeros(2, 2)}, shapes)
    assert isinstance(build_adapter(base, parse_adapter_file(
        {f"{base}.lokr_w1": torch.ones(4, 4), f"{base}.lokr_w2": torch.ones(24, 16)}, shapes)[
        "double_blocks.0.img_attn.qkv"], (64, 96)), LoKrAdapter)
    assert LoHaAdapter and DoRAAdapter


@pytest.mark.parametrize("kind", KINDS)
def test_probe_measures_each_kind_against_its_own_delta(kind):
    """probe.survival takes each kind's delta (DoRA's from the layer's weight): the pack's layer realises the
    probe's ideal change (gain 1, small relative error), which a LoRA-only formula would miss for these kinds."""
    from probe.survival import adapter_delta_weight, delta_survival

    x, w, b = _data()
    a = _adapter(kind, 64, 96, w.bfloat16().float(), lokr_factor=4)
    _randomize(a, 5)
    p64 = {n: p.detach().double() for n, p in a.named_parameters()}
    ref = _ref_delta(kind, p64, a.scale, w.bfloat16().double())
    torch.testing.assert_close(adapter_delta_weight([a], w.bfloat16()).double(), ref, rtol=1e-5, atol=1e-6)
    stats = delta_survival(x, w, b, [a])
    assert stats.gains["fp32_unmerged"] == pytest.approx(1.0, abs=0.01) and stats.rel_errors["fp32_unmerged"] < 0.05


@pytest.mark.parametrize("kind", KINDS)
def test_training_state_recognises_its_adapter_file(kind):
    """resume_from checks that a state holds the saved file's values (training.checkpoint.state_lora_mismatch):
    every trainable tensor of each kind is one of the file's factors, so an unchanged file matches and a
    changed one does not (before, LoKr / LoHa files had 'no factors' and DoRA's magnitude was not counted)."""
    from types import SimpleNamespace

    from training.checkpoint import state_lora_mismatch

    shapes = {"double_blocks.0.img_attn.qkv": (64, 96)}
    weights = {p: torch.randn(o, i) for p, (i, o) in shapes.items()}
    s = LoRASet(LoRAConfig(rank=4, adapter=kind, lokr_factor=4), shapes, weights=weights)
    _randomize(s.adapters()["double_blocks.0.img_attn.qkv"], 6)
    state = SimpleNamespace(lora={n: p.detach().clone() for n, p in s.named_parameters()})
    for dtype in ("fp32", "bf16"):
        assert state_lora_mismatch(state, lora_state_dict(s, "kohya", dtype)) is None
    with torch.no_grad():
        next(iter(s.parameters())).add_(1.0)
    assert state_lora_mismatch(state, lora_state_dict(s, "kohya")) == "their LoRA values differ (1 of " + \
        f"{len(state.lora)} tensors)"
