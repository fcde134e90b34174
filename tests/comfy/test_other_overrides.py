"""Another pack's attention override beside the pack's (ComfyUI-KJNodes' real functions, loaded in-process from
../shared/custom_nodes by tests/other_packs.py): never a RecursionError, never a silent drop.

KJNodes' GGUF loader sets its ``sdpa`` override (``GGUFLoaderKJ.ATTENTION_OVERRIDES["sdpa"]``: it calls ComfyUI's
``attention_pytorch.__wrapped__``, which calls ``torch.nn.functional.scaled_dot_product_attention``) on the model it
loads; NABLA_AttentionKJ sets one that calls ``optimized_attention`` (ComfyUI's choice at import: sub-quadratic on
a CPU by default, PyTorch's SDPA with ``--use-pytorch-cross-attention``, which the tests give it by replacing that
name in KJNodes' module). Each is set before Patch Attention, after it, before Load LoRA (Precision), or alone;
sampled as KSampler samples and trained by Train LoRA.

What must hold (docs/attention.md, "Other packs' attention overrides"):
- the other override alone runs as ComfyUI runs it, with Train LoRA too (no shim of the pack engages);
- before or after Patch Attention (backend auto): both run on every call (counted: the pack's override and the
  other's, through a counting wrapper around it), the scale applies (the output equals a model patched with the
  pack's reference backend at that scale, within float32 kernel differences), the saved LoRA records it;
- an explicit backend replaces the kernel: the other override runs 0 calls, and the node says so by name;
- an override whose output carries no gradient is refused by name at its first training call, before any update.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import sys

import pytest
import torch

from models import denoise, make_conditioning, make_latent, tiny_flux1

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import other_packs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
HEAD_DIM = 32  # tiny Flux.1: hidden 64, 2 heads
HALF = dict(scale_mode="multiplier", scale_value=0.5)


@pytest.fixture(scope="module")
def kj(pack):
    """KJNodes' model_optimization_nodes module (the pack itself loaded in-process first)."""
    other_packs.load_in_process(other_packs.KJNODES)
    name = next(k for k in sys.modules if k.endswith("ComfyUI-KJNodes.nodes.model_optimization_nodes"))
    return sys.modules[name]


@pytest.fixture(scope="module")
def m(pack_module, train_mods):
    class M:
        glue = pack_module("nodes.attention.glue")
        reach = pack_module("nodes.attention.reach")
        Config = pack_module("attention.config").AttentionConfig
        lglue = train_mods.glue
        train = train_mods.train
        lora = train_mods.lora
        Settings = train_mods.Settings
        info = pack_module("nodes.model.info")
    return M


class Counted:
    """The other pack's override function with a call count (its name and module kept: reports name it)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):  # a clone's options hold this very function, as they hold KJNodes' own
        return self


def with_override(model, fn):
    """What KJNodes' nodes do: a clone whose override slot holds ``fn``, replacing whatever was there."""
    clone = model.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = fn
    return clone


def kj_sdpa(kj) -> Counted:
    return Counted(kj.GGUFLoaderKJ.ATTENTION_OVERRIDES["sdpa"])


def nabla(kj, model, monkeypatch=None) -> tuple:
    """NABLA_AttentionKJ's own patch (torch_compile off: runs on a CPU) and the override it set, counted.
    ``monkeypatch``: KJNodes' module-level ``optimized_attention`` becomes ComfyUI's PyTorch attention, as it is
    under ``--use-pytorch-cross-attention`` (every attention call then goes through SDPA)."""
    import comfy.ldm.modules.attention as attn

    if monkeypatch is not None:
        monkeypatch.setattr(kj, "optimized_attention", attn.attention_pytorch)
    latent = {"samples": torch.zeros(1, 16, 1, 32, 32)}  # only its shape is read (B, C, T, H, W)
    (patched,) = kj.NABLA_AttentionKJ().patch(model, latent, 11, 3, 3, 0.9, False)
    options = patched.model_options["transformer_options"]
    options["optimized_attention_override"] = counted = Counted(options["optimized_attention_override"])
    return patched, counted


def patch(m, model, **cfg):
    return m.glue.patch_attention(model, m.Config(**cfg))


def reference(m, model):
    """The same model with the pack's float64 reference backend at half the default scale."""
    return denoise(patch(m, model, backend="math", **HALF))


def train(m, model, steps: int = 2, **settings):
    """Attach LoRA + Train LoRA (the node, as ComfyUI calls it); returns the trained model and its LoRA set."""
    with torch.inference_mode():
        attached = m.lglue.attach_lora(model, m.lora.LoRAConfig(rank=4, alpha=4, targets="attention"))
        out = m.train.PrecisionTrainLoRA.execute(
            [attached], [make_latent(model, 1, width=32, height=32)], [make_conditioning(model, 1)], [steps], [0],
            ["other_overrides"], settings=[m.Settings(learning_rate=1e-3, **settings)])
    trained = out.result[0]
    return trained, m.lglue.get_lora_set(trained)


def saved_metadata(m, trained, lora_set) -> dict:
    return m.lglue.build_lora_metadata(trained, m.info.describe_model(trained), lora_set)


def test_the_shim_keeps_comfyuis_undecorated_function_as_wrapped(m, pack):
    """KJNodes' sdpa override calls ``attention_pytorch.__wrapped__``: while the pack's shims are in place that must
    still be the kernel, not ComfyUI's decorated function (which hands the call to the override again)."""
    import comfy.ldm.modules.attention as attn

    undecorated = attn.attention_pytorch.__wrapped__
    options = {"optimized_attention_override": m.glue.PrecisionAttentionOverride(m.Config(**HALF))}
    with m.reach.reach_options(options):
        assert attn.attention_pytorch is not undecorated and attn.attention_pytorch.__wrapped__ is undecorated
    assert attn.attention_pytorch.__wrapped__ is undecorated


@pytest.mark.parametrize("kind", ["sdpa", "nabla_pytorch"])
def test_another_override_alone_runs_as_comfyui_runs_it(m, kj, kind, monkeypatch):
    """No pack attention node: sampling and Train LoRA (plain and checkpointed) run the other override on every
    call, no shim of the pack engages, and the LoRA records ComfyUI's default attention and the other override."""
    base = tiny_flux1()
    if kind == "sdpa":
        model, counted = with_override(base, kj_sdpa(kj)), None
        counted = model.model_options["transformer_options"]["optimized_attention_override"]
    else:
        model, counted = nabla(kj, base, monkeypatch)
    stock = denoise(base)
    out = denoise(model)
    assert counted.calls > 0 and not m.reach.installed()
    torch.testing.assert_close(out, stock, rtol=1e-4, atol=1e-5)  # SDPA vs ComfyUI's sub-quadratic kernel
    for checkpointing in (False, True):
        before = counted.calls
        trained, lora_set = train(m, model, gradient_checkpointing=checkpointing)
        assert counted.calls > before
        md = saved_metadata(m, trained, lora_set)
        assert "ComfyUI-KJNodes" in md["precision_lora_attention_other_override"], md
        assert float(md["ss_attn_softmax_scale"]) == pytest.approx(1 / math.sqrt(HEAD_DIM))
        assert "precision_lora_attention_calls" not in md


def _assert_both_ran(m, out, expected, counted, override):
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    calls = override.calls()
    assert counted.calls > 0 and calls["calls"] == calls["previous"] == counted.calls, (calls, counted.calls)


@pytest.mark.parametrize("order", ["before", "after"])
def test_other_sdpa_override_and_patch_attention_compose_when_sampling(m, kj, order, caplog):
    """KSampler: both overrides run on every call and the half scale applies, whichever was set first."""
    base = tiny_flux1()
    expected, stock = reference(m, base), denoise(base)
    counted = kj_sdpa(kj)
    if order == "before":
        model = patch(m, with_override(base, counted), **HALF)
    else:
        with caplog.at_level(logging.WARNING):
            model = with_override(patch(m, base, **HALF), counted)
            denoise(model)
        assert "GGUFLoaderKJ.attention_override_pytorch (ComfyUI-KJNodes, nodes/model_optimization_nodes.py) was set " \
               "on the model after Patch Attention" in caplog.text
    counted.calls = 0
    override = m.glue.get_attention_override(model)
    before = override.calls()["calls"]
    out = denoise(model)
    assert override.calls()["calls"] > before
    assert (out - stock).abs().max() > 1e-3  # the scale changes the output: it is not stock attention
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert counted.calls == override.calls()["calls"] - before
    assert m.glue.get_attention_config(model) == m.Config(**HALF)


@pytest.mark.parametrize("order", ["before", "after"])
def test_nabla_under_pytorch_attention_composes_with_patch_attention(m, kj, order, monkeypatch):
    """NABLA_AttentionKJ calls ComfyUI's attention function from its override; under PyTorch attention that is SDPA,
    which the pack's shim must pass through (it recursed before)."""
    base = tiny_flux1()
    expected = reference(m, base)
    if order == "before":
        nabla_model, counted = nabla(kj, base, monkeypatch)
        model = patch(m, nabla_model, **HALF)
    else:
        model, counted = nabla(kj, patch(m, base, **HALF), monkeypatch)
    override = m.glue.get_attention_override(model)
    before = override.calls()["calls"]
    out = denoise(model)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert counted.calls == override.calls()["calls"] - before > 0


def test_patch_attention_node_names_the_override_it_keeps(m, kj, pack):
    import comfy_harness

    node = comfy_harness.node_class("PrecisionPatchAttention")
    base = with_override(tiny_flux1(), kj_sdpa(kj))
    args = dict(scale_mode="multiplier", scale_value=0.5, stable_beta=2.0, softclamp=0.0, fp32_softmax=False)
    _, info = node.execute(base, backend="auto", **args).result
    assert "another override was on the model: GGUFLoaderKJ.attention_override_pytorch (ComfyUI-KJNodes, " \
           "nodes/model_optimization_nodes.py) runs each attention call as the kernel" in info
    replaced, info = node.execute(base, backend="sdpa", **args).result
    assert "is NOT called: backend 'sdpa' was chosen and replaces it; choose backend auto to keep it" in info
    counted = replaced.model_options["transformer_options"]["precision_lora_attention"].previous
    counted.calls = 0
    torch.testing.assert_close(denoise(replaced), reference(m, tiny_flux1()), rtol=1e-4, atol=1e-5)
    assert counted.calls == 0  # not called, as the info says


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_train_lora_runs_both_and_records_what_ran(m, kj, order, checkpointing):
    base = tiny_flux1()
    counted = kj_sdpa(kj)
    model = patch(m, with_override(base, counted), **HALF) if order == "before" else \
        with_override(patch(m, base, **HALF), counted)
    trained, lora_set = train(m, model, gradient_checkpointing=checkpointing)
    assert any(float(a.up.detach().abs().max()) > 0 for a in lora_set.adapters().values())  # it trained
    md = saved_metadata(m, trained, lora_set)
    ours, total = map(int, md["precision_lora_attention_calls"].split("/"))
    assert ours == total > 0, md  # every attention call of the run went through the pack's override
    assert md["precision_lora_attention_kept_override"] == (
        f"GGUFLoaderKJ.attention_override_pytorch (ComfyUI-KJNodes, nodes/model_optimization_nodes.py): kernel, {counted.calls} calls")
    assert counted.calls == ours
    assert float(md["ss_attn_softmax_scale"]) == pytest.approx(0.5 / math.sqrt(HEAD_DIM))


def _no_gradient_override(func, q, k, v, heads, *rest, **kwargs):
    """What SageAttention does to gradients: a result computed outside autograd."""
    with torch.no_grad():
        return func(q, k, v, heads, *rest, **kwargs)


def test_an_override_without_gradients_is_refused_by_name_before_any_update(m):
    model = patch(m, with_override(tiny_flux1(), _no_gradient_override), **HALF)
    with pytest.raises(ValueError, match=r"PrecisionTrainLoRA.*the attention override _no_gradient_override "
                                         r"\(test_other_overrides.py\).*returns no gradient"):
        train(m, model)
    with torch.inference_mode():  # sampling through it stays allowed
        assert torch.isfinite(denoise(model)).all()


def test_a_second_patch_keeps_the_other_override(m, kj):
    """Load LoRA (Precision) applying a file's settings patches again: the new patch replaces the pack's own
    settings and keeps the other pack's override under them."""
    counted = kj_sdpa(kj)
    first = patch(m, with_override(tiny_flux1(), counted), backend="auto")
    second = patch(m, first, **HALF)
    override = m.glue.get_attention_override(second)
    assert override.previous is counted and override.cfg == m.Config(**HALF)
    counted.calls = 0
    torch.testing.assert_close(denoise(second), reference(m, tiny_flux1()), rtol=1e-4, atol=1e-5)
    assert counted.calls > 0
