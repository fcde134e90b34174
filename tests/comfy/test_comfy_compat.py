"""Version differences (nodes/host/comfy_compat.py) on the host this run uses: ComfyUI 0.3.75 or 0.33.

Each test names the 0.33 change it guards (flux config keys, kitchen rotary ops, new backends, deep copies);
each fails on 0.33 without the fix.
Where a cause does not exist on a host (comfy-kitchen and ``in_training`` are 0.30+), the test checks what
the host has instead, or says in its skip reason why it cannot apply.
"""
from __future__ import annotations

import math

import pytest
import torch

from models import make_conditioning, make_latent, tiny_cosmos, tiny_flux1

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(pack_module):
    class M:
        compat = pack_module("nodes.host.comfy_compat")
        glue = pack_module("nodes.lora.glue")
        aglue = pack_module("nodes.attention.glue")
        train = pack_module("nodes.train.node")
        jobs = pack_module("nodes.train.jobs")
        lora = pack_module("lora.config")
        AttentionConfig = pack_module("attention.config").AttentionConfig
        Settings = pack_module("training.settings").TrainSettings
    return M


def _kitchen():
    """comfy.quant_ops where this ComfyUI routes ops through comfy-kitchen (0.30+), else None."""
    try:
        import comfy.quant_ops as quant_ops
    except ImportError:
        return None
    return quant_ops if hasattr(quant_ops, "ck") else None


def test_version_gate_names_the_supported_versions(mods):
    with pytest.raises(RuntimeError, match=r"supports ComfyUI 0\.3\.75 up to 0\.33\.x.*this ComfyUI is 0\.3\.40"):
        mods.compat.check_supported((0, 3, 40))
    assert mods.compat.check_supported() >= (0, 3, 75)  # the running host is supported
    assert mods.compat.parse_version("0.33.0") == (0, 33, 0) and mods.compat.parse_version("0.3.75rc1") == (0, 3, 75)


def test_flux_config_fits_this_version(mods):
    """Cause 1: FluxParams gained a required txt_ids_dims (0.4+) that 0.3.75 rejects."""
    import dataclasses

    from comfy.ldm.flux.model import FluxParams

    fields = {f.name for f in dataclasses.fields(FluxParams)}
    legacy = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 64,
              "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
              "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True}
    for config in (legacy, {**legacy, "txt_ids_dims": []}):  # a file written on either version
        fitted = mods.compat.fit_flux_config(config)
        FluxParams(**{k: v for k, v in fitted.items() if k != "image_model"})  # raises on a missing/extra key
        assert ("txt_ids_dims" in fitted) == ("txt_ids_dims" in fields)
    flux2 = mods.compat.fit_flux_config({**legacy, "image_model": "flux2"})
    assert flux2.get("txt_ids_dims", [3]) == [3]


def test_tiny_cosmos_has_ten_blocks():
    """Cause 5: 0.33 counts the blocks in the state dict (a probe with one key detected one block)."""
    assert len(tiny_cosmos().model.diffusion_model.blocks) == 10


def test_kitchen_rope_is_differentiable_only_while_the_pack_needs_gradients(mods, monkeypatch):
    """Causes 2-3: comfy-kitchen's fused rotary ops have no autograd formula and reject float64."""
    quant_ops = _kitchen()
    if quant_ops is None:
        pytest.skip("ComfyUI 0.3.75 has no comfy-kitchen ops (they arrived in 0.30): nothing to route")
    q = torch.randn(1, 8, 2, 16)
    k = torch.randn(1, 8, 2, 16)
    freqs = torch.randn(1, 8, 1, 8, 2, 2)
    scale = torch.ones(16)
    with torch.enable_grad():
        qg = q.clone().requires_grad_(True)
        with pytest.raises(RuntimeError, match="autograd"):
            quant_ops.ck.rms_rope_split_half(qg, k, freqs, scale, scale, 1e-6)[0].sum().backward()
        with mods.compat.model_gradients():
            out = quant_ops.ck.rms_rope_split_half(qg, k, freqs, scale, scale, 1e-6)[0]
            out.sum().backward()
            fused = {"n": 0}
            assert qg.grad is not None and torch.isfinite(qg.grad).all()
            # without gradients (inference inside a training graph) the fused kernel still runs
            kitchen = quant_ops.ck._kitchen
            real = kitchen.rms_rope_split_half

            def counting(*a, **kw):
                fused["n"] += 1
                return real(*a, **kw)

            monkeypatch.setattr(kitchen, "rms_rope_split_half", counting)
            with torch.no_grad():
                plain_out = quant_ops.ck.rms_rope_split_half(q, k, freqs, scale, scale, 1e-6)[0]
            assert fused["n"] == 1
            torch.testing.assert_close(plain_out, out.detach(), rtol=1e-5, atol=1e-5)
            double = quant_ops.ck.rms_rope_split_half(q.double(), k.double(), freqs.double(), scale.double(),
                                                      scale.double(), 1e-6)[0]
            assert double.dtype == torch.float64 and fused["n"] == 1  # float64 takes the plain path


# The autograd state a node runs under: ComfyUI's executor (inference mode), or plain grad mode (a script or
# another pack calling the node): in plain grad mode a leaked no_grad or inference mode shows.
CONTEXTS = {"inference": torch.inference_mode, "grad": torch.enable_grad}


def _autograd_modes() -> tuple[bool, bool]:
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _hooked_run(mods, family: str, steps: int, on_step=None, error_at: int | None = None,
                context: str = "inference", modes: dict | None = None):
    """Train ``steps`` steps; a forward hook records the globals seen inside and may raise at a step.
    ``modes`` gets the (grad, inference mode) pair right before and right after the node, inside ``context``
    (whose exit would otherwise reset what the node leaked)."""
    model = {"cosmos": tiny_cosmos, "flux1": tiny_flux1}[family]()
    with torch.inference_mode():
        m = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=2, alpha=2, targets="attention"))
    seen: list[dict] = []
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        seen.append(mods.compat.globals_snapshot())
        if error_at is not None and calls["n"] == error_at:
            raise RuntimeError("injected failure")

    handle = m.model.diffusion_model.register_forward_hook(hook)
    modes = {} if modes is None else modes
    latent, cond = make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)
    try:
        with CONTEXTS[context]():
            modes["before"] = _autograd_modes()
            try:
                mods.train.PrecisionTrainLoRA.execute([m], [latent], [cond], [steps], [0], ["compat"],
                                                      settings=[mods.Settings(learning_rate=1e-3)])
            finally:
                modes["after"] = _autograd_modes()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("ending, context", [("done", "inference"), ("stop", "inference"), ("cancel", "inference"),
                                             ("error", "inference"), ("done", "grad"), ("error", "grad")])
def test_every_global_is_restored_after_training(mods, ending, context):
    """After done, stop, cancel or error: in_training, the kitchen module, grad and inference mode are back."""
    import comfy.model_management as mm
    import comfy_harness

    before = mods.compat.globals_snapshot()
    server = comfy_harness.server()
    original = server.send_sync

    def control(event, data, sid=None):
        original(event, data, sid)
        if event == "precision_lora.train_step" and data["step"] == 1:
            if ending == "stop":
                mods.jobs.current_job().request("stop")
            elif ending == "cancel":
                mm.interrupt_current_processing(True)

    server.send_sync = control
    seen: list[dict] = []
    modes: dict = {}
    outside = _autograd_modes()
    try:
        if ending == "error":
            with pytest.raises(Exception, match="injected failure"):
                _hooked_run(mods, "cosmos", 3, error_at=2, context=context, modes=modes)
        elif ending == "cancel":
            with pytest.raises(mm.InterruptProcessingException):
                seen = _hooked_run(mods, "cosmos", 3, context=context, modes=modes)
        else:
            seen = _hooked_run(mods, "cosmos", 3, context=context, modes=modes)
    finally:
        server.send_sync = original
        mm.interrupt_current_processing(False)
    after = mods.compat.globals_snapshot()
    assert after["in_training"] == before["in_training"] and after["ck"] is before["ck"]
    expected = (False, True) if context == "inference" else (True, False)
    assert modes["before"] == expected
    assert modes["after"] == modes["before"], "the node leaked (grad enabled, inference mode) to its caller"
    assert _autograd_modes() == outside
    if ending == "done" and before["in_training"] is not None:  # 0.30+: in_training was set while training
        assert seen and all(s["in_training"] is True for s in seen)
        assert all(s["ck"] is not before["ck"] for s in seen)


def test_model_scale_kwarg_is_the_base_of_relative_scales(mods):
    """0.33 passes a model's own base scale as ``scale``: a multiplier multiplies it, absolute replaces it."""
    multiplier = mods.AttentionConfig(scale_mode="multiplier", scale_value=2.0)
    assert multiplier.resolve_scale(64, None) == pytest.approx(2 / 8)
    assert multiplier.resolve_scale(64, 1.0) == pytest.approx(2.0)
    absolute = mods.AttentionConfig(scale_mode="absolute", scale_value=0.3)
    assert absolute.resolve_scale(64, 1.0) == pytest.approx(0.3)

    def stock(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kw):
        s = kw.get("scale", q.shape[-1] ** -0.5)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=s, enable_gqa=kw.get("enable_gqa", False))

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 16, generator=gen) for _ in range(3))
    for backend in ("auto", "sdpa"):
        ov = mods.aglue.PrecisionAttentionOverride(
            mods.AttentionConfig(backend=backend, scale_mode="multiplier", scale_value=2.0))
        out = ov(stock, q, k, v, 4, skip_reshape=True, skip_output_reshape=True, scale=0.5)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_grouped_query_kwargs_reach_our_backends(mods):
    """``enable_gqa``: k/v with fewer heads than q give the same output as the heads repeated."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, generator=gen)
    k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=3 / math.sqrt(8))
    for backend in ("sdpa", "math", "stable"):
        ov = mods.aglue.PrecisionAttentionOverride(
            mods.AttentionConfig(backend=backend, scale_mode="multiplier", scale_value=3.0))
        out = ov(None, q, k, v, 4, skip_reshape=True, skip_output_reshape=True, enable_gqa=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        flat = ov(None, *(t.transpose(1, 2).reshape(1, 6, -1) for t in (q, k, v)), 4, enable_gqa=True)
        torch.testing.assert_close(flat, ref.transpose(1, 2).reshape(1, 6, -1), rtol=1e-5, atol=1e-6)


def test_new_backends_without_backward_are_classified(mods):
    """Cause 10: 0.33's attention3_sage and attention_comfy_kitchen_int8 have no backward, like sage."""
    for name in ("attention_sage", "attention3_sage", "attention_flash", "attention_comfy_kitchen_int8"):
        func = type("F", (), {"__name__": name})()
        assert not mods.compat.has_backward(func)
        ov = mods.aglue.PrecisionAttentionOverride(mods.AttentionConfig(scale_mode="multiplier", scale_value=2.0))
        q = torch.randn(1, 2, 4, 8, requires_grad=True)
        host = mods.aglue._host(func, 2, (), {}, {}, "bhld")
        assert not host.trainable
        with torch.enable_grad():
            assert ov.dispatcher.kernel_for(q, q, q, None, host).name == "sdpa"
    import comfy.ldm.modules.attention as attention

    assert mods.compat.has_backward(attention.attention_pytorch)
