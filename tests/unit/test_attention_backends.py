"""Every available backend against an fp64 oracle written out here: scales, masks, layouts, softclamp,
gradients; registry. The oracle shares no helper with the pack (not ``attention.masks``, not
``attention.reference``), so a wrong mask, softclamp or softmax in those helpers cannot agree with itself;
``reference_attention`` (the oracle other tests use) is checked against it too."""
from __future__ import annotations

import math

import pytest
import torch

from attention.backends import BACKENDS, available, get_backend
from attention.reference import reference_attention

B, H, LQ, LK, D = 2, 3, 7, 9, 16
SCALES = {"default": 1.0, "half": 0.5, "double": 2.0}
CPU_BACKENDS = [name for name, reason in available().items() if reason is None]
GPU_BACKENDS = ["flash", "sage", "xformers"]


def _inputs(layout: str, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, LQ, D), (B, H, LK, D), (B, H, LK, D)]
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)
    if layout == "blhd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v


def _mask(kind: str):
    gen = torch.Generator().manual_seed(1)
    if kind == "none":
        return None
    if kind == "bool2d":
        m = torch.rand(LQ, LK, generator=gen) > 0.3
        m[:, 0] = True
        return m
    if kind == "additive3d":
        return torch.randn(B, LQ, LK, generator=gen) * 2.0
    if kind == "bool4d_dead_row":  # row 2 of every batch/head has no key left
        m = torch.rand(B, H, LQ, LK, generator=gen) > 0.4
        m[..., 0] = True
        m[:, :, 2, :] = False
        return m
    if kind == "additive4d_neginf_row":
        m = torch.zeros(B, 1, LQ, LK)
        m[:, :, 3, :] = float("-inf")
        m[:, :, :, 5] = float("-inf")
        return m
    raise AssertionError(kind)


MASKS = ["none", "bool2d", "additive3d", "bool4d_dead_row", "additive4d_neginf_row"]


def oracle(q, k, v, *, scale, mask=None, layout="bhld", softclamp=0.0):
    """softmax(c·tanh(q·kᵀ·scale / c) + mask) · v in fp64, written out: (B, H, L, D) by permuting, masks
    broadcast by hand (2-D (Lq, Lk), 3-D (B, Lq, Lk), 4-D), bool False = -inf, rows with no key left = 0."""
    q, k, v = (t.double() if layout == "bhld" else t.double().permute(0, 2, 1, 3) for t in (q, k, v))
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softclamp:
        s = softclamp * torch.tanh(s / softclamp)
    live = torch.ones_like(s, dtype=torch.bool)
    if mask is not None:
        m = {2: lambda x: x.reshape(1, 1, *x.shape), 3: lambda x: x.unsqueeze(1), 4: lambda x: x}[mask.ndim](mask)
        m = m.expand_as(s)
        live = m if m.dtype == torch.bool else ~torch.isneginf(m)
        s = s + (0.0 if m.dtype == torch.bool else torch.where(live, m.double(), 0.0))
    dead = ~live.any(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(live, s, -1e300), dim=-1) * live
    out = torch.where(dead, 0.0, p) @ v
    return out if layout == "bhld" else out.permute(0, 2, 1, 3)


def _check(name, layout, scale_key, mask_kind, device="cpu", dtype=torch.float32, tol=2e-6):
    q, k, v = (t.to(device) for t in _inputs(layout, dtype))
    mask = _mask(mask_kind)
    mask = None if mask is None else mask.to(device)
    scale = SCALES[scale_key] / math.sqrt(D)
    out = get_backend(name)(q, k, v, scale=scale, mask=mask, layout=layout)
    ref = oracle(q.cpu(), k.cpu(), v.cpu(), scale=scale, mask=None if mask is None else mask.cpu(), layout=layout)
    out = out.cpu()
    assert out.shape == q.shape[:-1] + (v.shape[-1],)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err < tol, f"{name} {layout} {scale_key} {mask_kind}: max error {err:.2e}"
    return out


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("scale_key", sorted(SCALES))
@pytest.mark.parametrize("mask_kind", MASKS)
def test_available_backend_matches_fp64_reference(name, layout, scale_key, mask_kind):
    out = _check(name, layout, scale_key, mask_kind)
    if mask_kind == "bool4d_dead_row":  # masked-row protection: zeros, not NaN
        dead = out[:, :, 2] if layout == "bhld" else out[:, 2]
        assert torch.equal(dead, torch.zeros_like(dead))


def test_the_cpu_suite_covers_the_three_cpu_backends():
    assert set(CPU_BACKENDS) >= {"sdpa", "math", "stable"}


@pytest.mark.parametrize("name", [n for n in CPU_BACKENDS if BACKENDS[n].trainable])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("mask_kind", ["none", "additive3d", "bool4d_dead_row"])
def test_trainable_backend_gradients_match_fp64_reference(name, layout, mask_kind):
    q, k, v = _inputs(layout)
    mask = _mask(mask_kind)
    scale = 1.7 / math.sqrt(D)
    grad_out = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(3))
    ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
    get_backend(name)(*ours, scale=scale, mask=mask, layout=layout).backward(grad_out)
    refs = [t.double().requires_grad_(True) for t in (q, k, v)]
    oracle(*refs, scale=scale, mask=mask, layout=layout).backward(grad_out.double())
    for which, mine, ref in zip("qkv", ours, refs):
        assert torch.isfinite(mine.grad).all(), f"{name} d{which} has NaN/inf"
        err = (mine.grad.double() - ref.grad).abs().max().item()
        assert err < 5e-6, f"{name} d{which}: max error {err:.2e}"


@pytest.mark.parametrize("name", ["math", "stable"])
@pytest.mark.parametrize("mask_kind", ["none", "additive3d", "bool4d_dead_row"])
def test_softclamp_matches_oracle(name, mask_kind):
    q, k, v = _inputs("bhld")
    q = q * 4  # logits of a few units so the clamp at 3 bites
    mask = _mask(mask_kind)
    out = get_backend(name)(q, k, v, scale=0.5, mask=mask, softclamp=3.0)
    ref = oracle(q, k, v, scale=0.5, mask=mask, softclamp=3.0)
    plain = oracle(q, k, v, scale=0.5, mask=mask)
    assert (out.double() - ref).abs().max().item() < 2e-6
    assert (plain - ref).abs().max().item() > 1e-2


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("softclamp", [0.0, 3.0])
def test_reference_attention_matches_oracle(layout, mask_kind, softclamp):
    """``reference_attention`` is the fp64 oracle of other test files: it must agree with this one."""
    q, k, v = _inputs(layout, torch.float64)
    q = q * 4
    mask = _mask(mask_kind)
    ref = reference_attention(q, k, v, scale=0.5, mask=mask, layout=layout, softclamp=softclamp)
    assert ref.dtype == torch.float64
    assert (ref - oracle(q, k, v, scale=0.5, mask=mask, layout=layout, softclamp=softclamp)).abs().max() < 1e-12


def test_oracle_is_the_formula():
    """The oracle itself on a case small enough to write down: one query, two keys, logits 1 and 3 clamped at
    c=2: weights softmax(2·tanh(1/2), 2·tanh(3/2)); a masked key gets no weight; a dead row gives 0."""
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[1.0, 0.0], [3.0, 0.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[10.0], [20.0]]]], dtype=torch.float64)
    a, b = math.exp(2 * math.tanh(0.5)), math.exp(2 * math.tanh(1.5))
    got = oracle(q, k, v, scale=1.0, softclamp=2.0).item()
    assert got == pytest.approx((10 * a + 20 * b) / (a + b), rel=1e-12)
    assert oracle(q, k, v, scale=1.0, mask=torch.tensor([[True, False]])).item() == pytest.approx(10.0, rel=1e-12)
    assert oracle(q, k, v, scale=1.0, mask=torch.tensor([[False, False]])).item() == 0.0


def test_backends_without_logits_reject_softclamp():
    q, k, v = _inputs("bhld")
    with pytest.raises(ValueError, match="backend 'sdpa' cannot apply softclamp=3.0; use backend math or stable"):
        get_backend("sdpa")(q, k, v, scale=0.5, softclamp=3.0)


def test_available_reports_a_reason_naming_the_package():
    reasons = available()
    assert set(reasons) == set(BACKENDS)
    for name, package in (("flash", "flash-attn"), ("sage", "sageattention"), ("xformers", "xformers")):
        reason = reasons[name]
        if reason is not None:
            assert package in reason or "CUDA" in reason


def test_get_backend_unknown_lists_known_names():
    with pytest.raises(ValueError) as info:
        get_backend("warp")
    assert "attention backend 'warp' is unknown; known backends: sdpa, math, stable, flash, sage, xformers" in str(info.value)


@pytest.mark.skipif(available()["flash"] is None, reason="flash-attn is installed here")
def test_unavailable_backend_error_names_the_missing_package():
    with pytest.raises(RuntimeError) as info:
        get_backend("flash", require_available=True)
    assert "attention backend 'flash' is unavailable:" in str(info.value)
    assert "flash-attn" in str(info.value) or "CUDA" in str(info.value)


def _require_on_gpu_host(name: str) -> None:
    """The gpu-marked tests run only on a CUDA host (conftest skips them elsewhere); there a backend of the
    node's menu that is not installed is a failure, not a skip: otherwise it is tested nowhere."""
    reason = available()[name]
    if reason is not None:
        pytest.fail(f"backend {name!r} is in the node's menu but unavailable on this CUDA host: {reason}; "
                    "install it on the GPU host (scripts/gpu) so the backend is tested")


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("scale_key", sorted(SCALES))
def test_gpu_backend_matches_fp64_reference(name, layout, scale_key):
    _require_on_gpu_host(name)
    masks = ["none", "additive3d"] if BACKENDS[name].supports_mask else ["none"]
    for mask_kind in masks:  # bf16 kernels: tolerance of bf16 inputs/outputs
        _check(name, layout, scale_key, mask_kind, device="cuda", dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash", "xformers"])
def test_gpu_trainable_backend_gradients(name):
    _require_on_gpu_host(name)
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _inputs("bhld"))
    ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
    get_backend(name)(*ours, scale=0.3, layout="bhld").float().sum().backward()
    refs = [t.double().cpu().requires_grad_(True) for t in (q, k, v)]
    oracle(*refs, scale=0.3).sum().backward()
    for mine, ref in zip(ours, refs):
        assert (mine.grad.double().cpu() - ref.grad).abs().max().item() < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sdpa", "math", "stable"])
@pytest.mark.parametrize("mask_kind", ["none", "bool4d_dead_row"])
def test_pytorch_backends_on_cuda_bf16(name, mask_kind):
    _check(name, "bhld", "double", mask_kind, device="cuda", dtype=torch.bfloat16, tol=3e-2)


def test_availability_is_looked_up_once_not_on_every_call(monkeypatch):
    """The dispatcher asks for a chosen backend's availability on every attention call: find_spec and
    torch.cuda.is_available() run once per process, not per call."""
    import importlib.util

    from attention import backends as b

    b._module_present.cache_clear()
    b._cuda_present.cache_clear()
    calls = {"find_spec": 0, "cuda": 0}
    real_find, real_cuda = importlib.util.find_spec, torch.cuda.is_available

    def find_spec(name, *a, **k):
        calls["find_spec"] += 1
        return real_find(name, *a, **k)

    def cuda():
        calls["cuda"] += 1
        return real_cuda()

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(torch.cuda, "is_available", cuda)
    first = b.available()
    for _ in range(100):
        assert b.available() == first
    needs = {m for backend in b.BACKENDS.values() for m, _ in backend.requires}
    assert calls["find_spec"] == len(needs) and calls["cuda"] <= 1, calls
