"""The override through ComfyUI's real ``wrap_attn`` seam: layouts, reshape flags, masks by keyword or
position, ``auto`` delegation, the training policies, and deep-copy safety."""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from attention.reference import reference_attention

B, H, L, D = 2, 2, 6, 8


@pytest.fixture(scope="module")
def glue(pack_module):
    return pack_module("nodes.attention.glue")


@pytest.fixture(scope="module")
def backends(pack_module):
    return pack_module("attention.backends")


@pytest.fixture(scope="module")
def AttentionConfig(pack_module):
    """The pack's own class (ComfyUI loads the pack under its folder name, a separate module tree)."""
    return pack_module("attention.config").AttentionConfig


@pytest.fixture(scope="module")
def comfy_attn(pack):
    import comfy.ldm.modules.attention as attn

    return attn


def _qkv(seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


def _mask(kind):
    if kind == "none":
        return None
    if kind == "bool2d":
        return torch.ones(L, L, dtype=torch.bool).tril()
    return torch.randn(B, L, L, generator=torch.Generator().manual_seed(9))  # additive 3-D


def _expected(q, k, v, scale, mask, skip_output_reshape):
    out = reference_attention(q.double(), k.double(), v.double(), scale=scale, mask=mask).float()
    return out if skip_output_reshape else out.transpose(1, 2).reshape(B, L, H * D)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "math", "stable"])
@pytest.mark.parametrize("skip_reshape", [True, False])
@pytest.mark.parametrize("skip_output_reshape", [True, False])
@pytest.mark.parametrize("mask_kind, positional", [("none", False), ("bool2d", False), ("bool2d", True),
                                                   ("additive3d", True)])
def test_override_through_comfy_wrapper(glue, comfy_attn, AttentionConfig, backend, skip_reshape, skip_output_reshape,
                                        mask_kind, positional):
    q, k, v = _qkv()
    mask = _mask(mask_kind)
    override = glue.PrecisionAttentionOverride(AttentionConfig(backend=backend, scale_mode="multiplier", scale_value=2.0))
    args = (q, k, v) if skip_reshape else tuple(t.transpose(1, 2).reshape(B, L, H * D) for t in (q, k, v))
    kwargs = dict(skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                  transformer_options={"optimized_attention_override": override})
    # With auto the result is ComfyUI's own backend's: attention_basic reads bool masks per key only, so
    # masked cases use the pytorch backend (SDPA semantics, like ours).
    fn = comfy_attn.attention_basic if mask_kind == "none" else comfy_attn.attention_pytorch
    if positional:
        out = fn(*args, H, mask, None, **kwargs)
    else:
        out = fn(*args, H, mask=mask, **kwargs)
    expected = _expected(q, k, v, 2.0 / math.sqrt(D), mask, skip_output_reshape)
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() < 5e-6


def test_auto_delegates_to_comfys_function_with_the_wrapper_flag(glue, AttentionConfig):
    seen = {}

    def func(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
        seen.update(kwargs, q=q)
        return torch.zeros(B, L, H * D)

    override = glue.PrecisionAttentionOverride(AttentionConfig(scale_mode="multiplier", scale_value=3.0))
    q, k, v = _qkv()
    override(func, q, k, v, H, skip_reshape=True, _inside_attn_wrapper=True, transformer_options={})
    assert seen["_inside_attn_wrapper"] is True
    torch.testing.assert_close(seen["q"], q * 3.0)  # scale·sqrt(d) / sqrt(d) folded into q
    default = glue.PrecisionAttentionOverride(AttentionConfig())
    seen.clear()
    default(func, q, k, v, H, skip_reshape=True, _inside_attn_wrapper=True)
    assert seen["q"] is q  # default settings: handed through untouched


def test_auto_falls_back_to_sdpa_when_comfys_backend_has_no_backward(glue, caplog, AttentionConfig):
    def attention_sage(*args, **kwargs):
        raise AssertionError("must not be called while gradients are needed")

    override = glue.PrecisionAttentionOverride(AttentionConfig(scale_mode="multiplier", scale_value=2.0))
    q, k, v = _qkv(requires_grad=True)
    with caplog.at_level(logging.WARNING):
        out = override(attention_sage, q, k, v, H, skip_reshape=True, skip_output_reshape=True)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    assert "attention_sage has no usable backward" in caplog.text
    torch.testing.assert_close(out, _expected(q.detach(), k.detach(), v.detach(), 2.0 / math.sqrt(D), None, True))


def test_explicit_sage_while_training_is_a_clear_error(glue, comfy_attn, monkeypatch, AttentionConfig, backends):
    def fake_sage(q, k, v, *, scale, mask=None, layout="bhld", softclamp=0.0, beta=2.0):
        return backends.BACKENDS["math"](q, k, v, scale=scale, layout=layout).detach()

    monkeypatch.setitem(backends.BACKENDS, "sage", backends.Backend("sage", fake_sage, False, False, False, (), "test double"))
    override = glue.PrecisionAttentionOverride(AttentionConfig(backend="sage"))
    opts = {"optimized_attention_override": override}
    q, k, v = _qkv()
    out = comfy_attn.attention_pytorch(q, k, v, H, skip_reshape=True, transformer_options=opts)
    assert out.shape == (B, L, H * D)  # inference works
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="attention backend 'sage' has no backward pass"):
        comfy_attn.attention_pytorch(q, k, v, H, skip_reshape=True, transformer_options=opts)


def test_patch_attention_is_a_clone_and_deepcopy_safe(glue, pack_module, AttentionConfig):
    from models import tiny_flux1

    model = tiny_flux1()
    cfg = AttentionConfig(backend="stable", scale_mode="absolute", scale_value=0.2, collect_stats=True)
    patched = glue.patch_attention(model, cfg)
    assert glue.get_attention_config(patched) == cfg
    assert glue.get_attention_config(model) is None
    override = patched.model_options["transformer_options"][glue.OVERRIDE_KEY]
    again = patched.clone()
    assert again.model_options["transformer_options"][glue.OVERRIDE_KEY] is override
    assert copy.deepcopy(patched.model_options)["transformer_options"][glue.OVERRIDE_KEY] is override
    assert glue.get_attention_stats(again) is glue.get_attention_stats(patched)
    with pytest.raises(ValueError, match="scale_value=-1"):
        glue.patch_attention(model, AttentionConfig(scale_mode="absolute", scale_value=-1.0))

