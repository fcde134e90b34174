"""Every available backend against the fp64 reference: scales, masks, layouts, gradients; registry."""
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


def _check(name, layout, scale_key, mask_kind, device="cpu", dtype=torch.float32, tol=2e-6):
    q, k, v = (t.to(device) for t in _inputs(layout, dtype))
    mask = _mask(mask_kind)
    mask = None if mask is None else mask.to(device)
    scale = SCALES[scale_key] / math.sqrt(D)
    out = get_backend(name)(q, k, v, scale=scale, mask=mask, layout=layout)
    ref = reference_attention(q.double(), k.double(), v.double(), scale=scale, mask=mask, layout=layout)
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
    reference_attention(*refs, scale=scale, mask=mask, layout=layout).backward(grad_out.double())
    for which, mine, ref in zip("qkv", ours, refs):
        assert torch.isfinite(mine.grad).all(), f"{name} d{which} has NaN/inf"
        err = (mine.grad.double() - ref.grad).abs().max().item()
        assert err < 5e-6, f"{name} d{which}: max error {err:.2e}"


@pytest.mark.parametrize("name", ["math", "stable"])
def test_softclamp_matches_reference(name):
    q, k, v = _inputs("bhld")
    q = q * 4  # logits of a few units so the clamp at 3 bites
    out = get_backend(name)(q, k, v, scale=0.5, softclamp=3.0)
    ref = reference_attention(q.double(), k.double(), v.double(), scale=0.5, softclamp=3.0)
    plain = reference_attention(q.double(), k.double(), v.double(), scale=0.5)
    assert (out.double() - ref).abs().max().item() < 2e-6
    assert (plain - ref).abs().max().item() > 1e-2


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


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("scale_key", sorted(SCALES))
def test_gpu_backend_matches_fp64_reference(name, layout, scale_key):
    reason = available()[name]
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    masks = ["none", "additive3d"] if BACKENDS[name].supports_mask else ["none"]
    for mask_kind in masks:  # bf16 kernels: tolerance of bf16 inputs/outputs
        _check(name, layout, scale_key, mask_kind, device="cuda", dtype=torch.bfloat16, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash", "xformers"])
def test_gpu_trainable_backend_gradients(name):
    reason = available()[name]
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _inputs("bhld"))
    ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
    get_backend(name)(*ours, scale=0.3, layout="bhld").float().sum().backward()
    refs = [t.double().requires_grad_(True) for t in (q, k, v)]
    reference_attention(*refs, scale=0.3).sum().backward()
    for mine, ref in zip(ours, refs):
        assert (mine.grad.double() - ref.grad).abs().max().item() < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sdpa", "math", "stable"])
@pytest.mark.parametrize("mask_kind", ["none", "bool4d_dead_row"])
def test_pytorch_backends_on_cuda_bf16(name, mask_kind):
    _check(name, "bhld", "double", mask_kind, device="cuda", dtype=torch.bfloat16, tol=3e-2)
