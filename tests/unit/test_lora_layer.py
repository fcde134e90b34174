"""LoRA layer numerics: fp32 path under autocast, identity at init, delta survival, dropouts, LoRA+, config errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.lora import PATHS, gain_table
from lora.config import LoRAConfig, lora_scale
from lora.layer import LoRASet
from lora.lowrank import LoRAAdapter, lora_linear
from lora.linear import base_linear_fp32


def _layer(n_in=64, n_out=96, rank=4, seed=0, **cfg):
    g = torch.Generator().manual_seed(seed)
    a = LoRAAdapter(n_in, n_out, LoRAConfig(rank=rank, alpha=float(rank), **cfg), init_generator=g)
    with torch.no_grad():
        a.up.copy_(torch.randn(n_out, rank, generator=g) * 0.05)
    w = torch.randn(n_out, n_in, generator=g) / n_in**0.5
    b = torch.randn(n_out, generator=g) * 0.1
    x = torch.randn(3, 5, n_in, generator=g)
    return a, x, w, b


def _reference(a: LoRAAdapter, x, w, b):
    dw = (a.up.double() @ a.down.double()) * a.scale
    return F.linear(x.double(), w.double() + dw, b.double())


def test_fp32_path_under_autocast_differs_from_bf16_and_is_closer_to_fp64():
    a, x, w, b = _layer(n_in=256, n_out=256, rank=8)
    # bf16-representable inputs: autocast's own rounding of x and W is then exact, so the reference is the truth
    x, w, b = x.bfloat16().float(), w.bfloat16().float(), b.bfloat16().float()
    ref = _reference(a, x, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32 = lora_linear(x, w, b, (a,))
        a.fp32_accumulation = False
        plain = lora_linear(x, w, b, (a,))
    assert fp32.dtype == plain.dtype == torch.bfloat16
    assert not torch.equal(fp32, plain), "fp32 accumulation is a no-op under autocast"
    err_fp32 = (fp32.double() - ref).abs().mean().item()
    err_plain = (plain.double() - ref).abs().mean().item()
    assert err_fp32 < 0.8 * err_plain, (err_fp32, err_plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp32_accumulation", [True, False])
def test_identity_at_init_is_bit_equal(dtype, fp32_accumulation):
    g = torch.Generator().manual_seed(1)
    a = LoRAAdapter(1000, 500, LoRAConfig(rank=8, fp32_accumulation=fp32_accumulation), init_generator=g)
    assert torch.count_nonzero(a.up) == 0 and torch.count_nonzero(a.down) > 0
    x = torch.randn(33, 1000, generator=g).to(dtype)
    w = torch.randn(500, 1000, generator=g).to(dtype)
    b = torch.randn(500, generator=g).to(dtype)
    with torch.inference_mode():  # how ComfyUI runs a model
        assert torch.equal(a.forward_with_base(x, w, b), F.linear(x, w, b))
    if dtype == torch.bfloat16 and fp32_accumulation:
        # an fp32-output base GEMM rounds differently from the bf16 GEMM here: the zero-init shortcut is what
        # makes the output bit-equal, so this test would fail without it
        assert not torch.equal(base_linear_fp32(x, w, b).bfloat16(), F.linear(x, w, b))


def test_modified_up_is_used_and_grad_forward_leaves_identity_shortcut():
    a, x, w, b = _layer()
    assert not a.delta_is_zero()  # up was written in place by _layer
    fresh = LoRAAdapter(64, 96, LoRAConfig(rank=4))
    with torch.enable_grad():
        out = fresh.forward_with_base(x.requires_grad_(True), w, b)
        out.sum().backward()
    assert fresh.up.grad is not None and fresh.up.grad.abs().sum() > 0, "training must reach the up factor at init"
    assert not fresh.delta_is_zero()


def test_fp32_path_gradients_match_fp64_reference():
    a, x, w, b = _layer()
    a.train()
    x = x.requires_grad_(True)
    lora_linear(x, w, b, (a,)).pow(2).sum().backward()
    a64 = LoRAAdapter(64, 96, LoRAConfig(rank=4)).double()
    with torch.no_grad():
        a64.down.copy_(a.down)
        a64.up.copy_(a.up)
    x64 = x.detach().double().requires_grad_(True)
    (F.linear(x64, w.double(), b.double()) + a.scale * F.linear(F.linear(x64, a64.down), a64.up)).pow(2).sum().backward()
    torch.testing.assert_close(a.up.grad.double(), a64.up.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.down.grad.double(), a64.down.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def gains():
    return gain_table(width=3072, tokens=256, rank=16)


@pytest.mark.parametrize("rho", [1e-3, 3e-3, 1e-2])
def test_delta_survival_gain_of_fp32_path(gains, rho):
    assert gains[rho]["fp32_accumulation"] == pytest.approx(1.0, abs=0.05)


def test_delta_survival_other_paths_lose_half_at_1e_3(gains):
    for path in PATHS[:3]:
        assert 0.4 < gains[1e-3][path] < 0.65, (path, gains[1e-3])
        assert 0.85 < gains[3e-3][path] < 0.97, (path, gains[3e-3])
        assert gains[1e-2][path] > 0.97, (path, gains[1e-2])


def test_dropouts_only_in_train_mode_and_seeded():
    cfg = dict(dropout=0.5, rank_dropout=0.3)
    a, x, w, b = _layer(seed=3, **cfg)
    plain, *_ = _layer(seed=3)
    with torch.no_grad():
        assert torch.equal(a.forward_with_base(x, w, b), plain.forward_with_base(x, w, b))  # eval: no dropout
        a.train()
        y1 = a.forward_with_base(x, w, b)
        y2 = a.forward_with_base(x, w, b)
        assert not torch.equal(y1, y2)
        a2, *_ = _layer(seed=3, **cfg)
        a2.train()
        assert torch.equal(a2.forward_with_base(x, w, b), y1), "dropout masks must come from the config seed"


def test_module_dropout_skips_whole_delta_sometimes():
    a, x, w, b = _layer(module_dropout=0.5)
    base = lora_linear(x, w, b, ())
    a.train()
    with torch.no_grad():
        outs = [a.forward_with_base(x, w, b) for _ in range(16)]
    skipped = sum(torch.equal(o, base) for o in outs)
    assert 0 < skipped < 16


def test_scale_rslora_and_multiplier():
    assert lora_scale(16, 4) == 4.0 and lora_scale(16, 4, rslora=True) == 8.0
    a, x, w, b = _layer()
    full = a.forward_with_base(x, w, b).double() - F.linear(x, w, b).double()
    a.multiplier = 0.5
    half = a.forward_with_base(x, w, b).double() - F.linear(x, w, b).double()
    torch.testing.assert_close(half, full * 0.5, rtol=1e-4, atol=1e-6)


def test_param_groups_loraplus_and_bf16_storage():
    s = LoRASet(LoRAConfig(rank=2, param_dtype="bf16"), {"a.q": (8, 8), "b.k": (8, 16)})
    groups = s.param_groups(lr=1e-4, loraplus_ratio=16)
    assert [g["name"] for g in groups] == ["lora_down", "lora_up"]
    assert groups[0]["lr"] == 1e-4 and groups[1]["lr"] == pytest.approx(1.6e-3)
    assert {id(p) for g in groups for p in g["params"]} == {id(p) for p in s.parameters()}
    assert all(p.dtype == torch.bfloat16 for p in s.parameters())
    assert LoRASet(LoRAConfig(rank=2), {"a.q": (8, 8)}).adapters()["a.q"].down.dtype == torch.float32


def test_init_is_deterministic_in_seed():
    shapes = {"x.a": (16, 16), "x.b": (16, 32)}
    s1, s2 = LoRASet(LoRAConfig(rank=2, seed=7), shapes), LoRASet(LoRAConfig(rank=2, seed=7), shapes)
    s3 = LoRASet(LoRAConfig(rank=2, seed=8), shapes)
    assert torch.equal(s1.adapters()["x.b"].down, s2.adapters()["x.b"].down)
    assert not torch.equal(s1.adapters()["x.b"].down, s3.adapters()["x.b"].down)


def test_copy_is_independent_with_the_same_values_dropout_state_and_info():
    s = LoRASet(LoRAConfig(rank=2, dropout=0.5, param_dtype="bf16"), {"x.a": (8, 8), "x.b": (8, 16)})
    s.info["ss_steps"] = "5"
    with torch.no_grad():
        s.adapters()["x.a"].up.normal_()  # a non-zero delta, so the dropout masks show in it
    x = torch.randn(3, 8)
    s.train(True)
    s.adapters()["x.a"].delta_fp32(x)  # advance the dropout generator past its seed
    c = s.copy()
    assert c.info == {"ss_steps": "5"} and c.config == s.config
    for (name, p), (name_c, q) in zip(s.named_parameters(), c.named_parameters()):
        assert name == name_c and q.dtype == p.dtype and torch.equal(p, q) and q.data_ptr() != p.data_ptr()
    c.train(True)
    torch.testing.assert_close(s.adapters()["x.a"].delta_fp32(x), c.adapters()["x.a"].delta_fp32(x))  # same masks
    with torch.no_grad():
        c.adapters()["x.b"].up.add_(1.0)
    assert not torch.equal(s.adapters()["x.b"].up, c.adapters()["x.b"].up) and not s.adapters()["x.b"].up.any()


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 0}, r"rank=0 is invalid: use an integer in \[1, 1024\]"),
    ({"rank": -3}, r"rank=-3 is invalid"),
    ({"alpha": 0.0}, r"alpha=0.0 is invalid: use a positive number"),
    ({"alpha": -1.0}, r"alpha=-1.0 is invalid"),
    ({"dropout": 1.0}, r"dropout=1.0 is invalid: use a probability in \[0, 1\)"),
    ({"param_dtype": "fp8"}, r"param_dtype='fp8' is unknown: use one of \['bf16', 'fp32'\]"),
    ({"targets": "everything"}, r"targets='everything' is unknown"),
    ({"include": "("}, r"include regex '\(' is invalid"),
    ({"blocks": "3-1"}, r"range '3-1' is empty"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs).validate()


def test_rank_larger_than_layer_width_is_rejected():
    with pytest.raises(ValueError, match=r"rank=32 exceeds the width of 'blocks.0.q' \(16x64\): use rank <= 16"):
        LoRASet(LoRAConfig(rank=32), {"blocks.0.q": (64, 16)})


def test_empty_target_set_is_rejected():
    with pytest.raises(ValueError, match="no target modules"):
        LoRASet(LoRAConfig(), {})


def _bf16_case(device="cpu"):
    a, x, w, b = _layer(n_in=64, n_out=48, rank=4, seed=9)
    return a.to(device), x.bfloat16().to(device), w.bfloat16().to(device), b.bfloat16().to(device)


def _grads(a, x, w, b):
    a.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    out = lora_linear(x, w, b, (a,))
    out.float().pow(2).sum().backward()
    return out, x.grad, w.grad, a.up.grad.clone()


def _grads_fp64(a, x, w, b):
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    up = a.up.detach().double().requires_grad_(True)
    out = F.linear(x64, w64, b.double()) + a.scale * F.linear(F.linear(x64, a.down.double()), up)
    out.pow(2).sum().backward()
    return out, x64.grad, w64.grad, up.grad


def test_bf16_operands_fp32_path_backward_through_own_gemm_function():
    a, x, w, b = _bf16_case()
    out, gx, gw, gup = _grads(a, x, w, b)
    ref = _grads_fp64(a, x, w, b)
    assert out.dtype == gx.dtype == gw.dtype == torch.bfloat16
    for got, want in zip((out, gx, gw, gup), ref):
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 1e-2, rel  # bf16-level agreement: the backward is the plain layer's, in bf16


@pytest.mark.gpu
def test_cuda_fp32_path_uses_fp32_output_gemm_and_trains():
    a, x, w, b = _bf16_case("cuda")
    out, gx, gw, gup = _grads(a, x, w, b)
    ref = _grads_fp64(a.cpu(), x.cpu(), w.cpu(), b.cpu())
    for got, want in zip((out, gx, gw, gup), ref):
        assert ((got.double().cpu() - want).norm() / want.norm()) < 1e-2
    a.cuda()
    base = F.linear(x.float(), w.float(), b.float())
    from lora.linear import base_linear_fp32

    torch.testing.assert_close(base_linear_fp32(x, w, b), base, rtol=1e-5, atol=1e-4)


def test_replaced_or_loaded_up_factor_is_never_treated_as_zero():
    src, x, w, b = _layer(seed=11)
    for assign in (False, True):
        fresh = LoRAAdapter(64, 96, LoRAConfig(rank=4, alpha=4.0))
        with torch.no_grad():
            assert fresh.delta_is_zero()
        fresh.load_state_dict(src.state_dict(), assign=assign)
        assert not fresh.delta_is_zero()
        torch.testing.assert_close(fresh.forward_with_base(x, w, b), src.forward_with_base(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_fp32_path_equals_the_composition_it_replaces(dtype):
    """``linear_fp32`` (delta added into the base output in place) gives the values and gradients of
    base_linear_fp32 + add_delta_fp32; with bf16 operands both agree with fp64 at bf16 level."""
    a, x, w, b = _layer(n_in=64, n_out=96, rank=4, seed=5)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    a.train()

    def run(in_place: bool):
        a.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(True)
        if in_place:
            out = a.linear_fp32(xx, w, b, None)
            assert out is not None and out._version == 1  # the delta went into the base output in place
            out = out.to(dtype)
        else:
            out = a.add_delta_fp32(base_linear_fp32(xx, w, b), xx).to(dtype)
        out.float().pow(2).sum().backward()
        return out, xx.grad, a.down.grad.clone(), a.up.grad.clone()

    fused, plain = run(True), run(False)
    assert fused[0].dtype == fused[1].dtype == dtype
    for got, want in zip(fused, plain):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, want)  # the same operations in the same order
    if dtype == torch.bfloat16:
        _, gx64, _, gup64 = _grads_fp64(a, x, w, b)
        for got, want in ((fused[1], gx64), (fused[3], gup64)):
            assert ((got.double() - want).norm() / want.norm()) < 1e-2


def test_in_place_path_is_not_used_for_dropout_or_a_trainable_base():
    a, x, w, b = _layer(seed=6, dropout=0.5)
    a.train()
    assert a.linear_fp32(x, w, b, None) is None  # the dropout mask needs its own path
    a.eval()
    assert a.linear_fp32(x, w, b, None) is not None  # dropout is off outside train()
    trainable = w.detach().requires_grad_(True)
    assert a.linear_fp32(x, trainable, b, None) is None  # its backward needs the unmodified output
    out = lora_linear(x, trainable, b, (a,))
    out.sum().backward()
    torch.testing.assert_close(trainable.grad, torch.ones(15, 96).t() @ x.reshape(-1, 64))


@pytest.mark.gpu
def test_cuda_in_place_path_with_fp32_output_gemm_matches_the_cpu_reference():
    """On CUDA the bf16 base GEMM writes fp32 (aten::mm.dtype) and the delta is added into it in place."""
    a, x, w, b = _bf16_case()
    a.train()
    ref = _grads_fp64(a, x, w, b)
    a.cuda()
    xx = x.cuda().requires_grad_(True)
    out = a.linear_fp32(xx, w.cuda(), b.cuda(), None)
    assert out is not None and out.dtype == torch.float32 and out._version == 1
    out.pow(2).sum().backward()
    for got, want in ((out, ref[0]), (xx.grad, ref[1]), (a.up.grad, ref[3])):
        assert ((got.double().cpu() - want).norm() / want.norm()) < 1e-2
