"""Flux gradients through the training path equal a float64 reference that in-place adds cannot corrupt.

Flux blocks add residuals in place (``img += ...``). The reference is forward-mode AD in float64: tangents
flow op by op, in-place adds included, and nothing is saved for a backward pass. It is cross-checked by a
central finite difference. The gradients under test are reverse-mode gradients under the trainer's fix
(``clone_saved_tensors``), with and without the trainer's block checkpointing (``checkpoint_blocks``).
Plain autograd on the same model raises, which shows the comparison has teeth.

The loss is taken on the diffusion model's float64 output: ``BaseModel.apply_model`` casts the model
output to fp32 (ComfyUI's own ``.float()``), which would limit any reference to fp32 precision; the
trainer wraps ``apply_model`` in the same ``clone_saved_tensors`` context (tested below).
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.utils.checkpoint import checkpoint

from models import make_conditioning, make_latent, tiny_flux1, tiny_flux2

BUILDERS = {"flux1": tiny_flux1, "flux2": tiny_flux2}
# Flux.2's global modulation feeds every block through dataclasses nested in tuples: train it too, so
# checkpointing must carry gradients through nested block arguments.
TRAINED = ("double_blocks", "single_blocks", "double_stream_modulation", "single_stream_modulation")


@pytest.fixture(scope="module")
def mods(pack_module):
    class M:
        tglue = pack_module("nodes.train.glue")
        tdata = pack_module("nodes.train.data")
        grad = pack_module("training.grad")
        compat = pack_module("nodes.host.comfy_compat")
        Settings = pack_module("training.settings").TrainSettings

        @staticmethod
        @contextlib.contextmanager
        def autograd():
            """As the training session does: autograd on, ComfyUI's model code differentiable."""
            with M.grad.autograd_enabled(), M.compat.model_gradients():
                yield
    return M


def exact_attention(func, q, k, v, heads, mask=None, *args, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """Attention in the inputs' dtype (float64 here); ComfyUI's CPU backend upcasts to fp32 only."""
    if not skip_reshape:
        b, n, _ = q.shape
        q, k, v = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    out = scores.softmax(dim=-1) @ v  # explicit math: forward-mode AD supports every op here
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def _problem(mods, family: str):
    model = BUILDERS[family](dtype=torch.float64)
    dm = model.model.diffusion_model
    assert all(p.dtype == torch.float64 for p in dm.parameters())
    for p in dm.parameters():  # as in a training session: only the parameters under test require grad
        p.requires_grad_(False)
    params = [p for n, p in dm.named_parameters() if n.startswith(TRAINED)]
    width = 32 if family == "flux1" else 64
    with mods.autograd():
        latent = make_latent(model, 1, width=width, height=width)
        sample = mods.tdata.build_samples(model, [latent], [make_conditioning(model, 1)], None, torch.device("cpu"))[0]
        fns = mods.tglue.model_fns(model, None, mods.Settings(), torch.device("cpu"))
        ms = model.model.model_sampling
        gen = torch.Generator().manual_seed(0)
        x0 = sample.latent[None].double()
        sigma = torch.tensor([0.6], dtype=torch.float64)
        x_t = fns.noise_latent(sigma, torch.randn(x0.shape, generator=gen, dtype=torch.float64), x0)
        weight = torch.randn(x0.shape, generator=gen, dtype=torch.float64)
    cond = fns.collate([sample.cond])
    kwargs = {k: (v.double() if isinstance(v, torch.Tensor) else v)
              for k, v in {"context": cond["c_crossattn"], "y": cond.get("y"), "guidance": cond.get("guidance")}.items()}
    x_in, t = ms.calculate_input(sigma, x_t), ms.timestep(sigma)

    def loss(fix: bool = True) -> torch.Tensor:
        with mods.grad.clone_saved_tensors() if fix else contextlib.nullcontext():
            out = dm(x_in, t, transformer_options={"optimized_attention_override": exact_attention}, **kwargs)
        assert out.dtype == torch.float64
        return (out * weight).sum()

    return model, params, loss


def _fd_directional(params, loss, direction, h=1e-6) -> float:
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.add_(d, alpha=h)
        plus = float(loss())
        for p, d in zip(params, direction):
            p.add_(d, alpha=-2 * h)
        minus = float(loss())
        for p, d in zip(params, direction):
            p.add_(d, alpha=h)
    return (plus - minus) / (2 * h)


def _autograd(params, loss, wrap=contextlib.nullcontext):
    for p in params:
        p.grad = None
        p.requires_grad_(True)
    try:
        with wrap():
            value = loss()
        value.backward()
        return [p.grad.clone() for p in params]
    finally:
        for p in params:
            p.requires_grad_(False)
            p.grad = None


def _forward_ad(dm, names, params, loss, direction) -> float:
    """Directional derivative by forward-mode AD: tangents flow op by op (in-place adds included) and
    nothing is saved for a backward pass, so in-place residual adds cannot corrupt it."""
    owners = [(dm.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1]) for n in names]
    with torch.no_grad(), fwAD.dual_level():
        for (mod, attr), p, d in zip(owners, params, direction):
            delattr(mod, attr)
            setattr(mod, attr, fwAD.make_dual(p.detach(), d))
        try:
            return float(fwAD.unpack_dual(loss(fix=False)).tangent)
        finally:
            for (mod, attr), p in zip(owners, params):
                delattr(mod, attr)
                mod.register_parameter(attr, p)


@contextlib.contextmanager
def _builtin_style_checkpointing(dm):
    """What ComfyUI's TrainLoraNode does: non-reentrant checkpointing per block, no saved-tensor clones."""
    blocks = list(dm.double_blocks) + list(dm.single_blocks)
    for b in blocks:
        b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False)
    try:
        yield
    finally:
        for b in blocks:
            del b.forward


def _dot(grads, direction) -> float:
    return sum(float((g * d).sum()) for g, d in zip(grads, direction))


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_flux_gradients_match_float64_reference(mods, family):
    model, params, loss = _problem(mods, family)
    dm = model.model.diffusion_model
    names = [n for n, p in dm.named_parameters() if n.startswith(TRAINED)]
    with mods.autograd():
        gen = torch.Generator().manual_seed(1)
        directions = [[torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params] for _ in range(3)]
        reference = [_forward_ad(dm, names, params, loss, d) for d in directions]
        # the reference agrees with a finite difference (fp32 islands such as RoPE make the FD noisy)
        assert _fd_directional(params, loss, directions[0], h=1e-5) == pytest.approx(reference[0], rel=1e-3)
        ours = _autograd(params, loss)
        ours_ckpt = _autograd(params, loss, lambda: mods.grad.checkpoint_blocks(mods.grad.find_block_lists(dm)))
        for grads in (ours, ours_ckpt):
            assert [_dot(grads, d) for d in directions] == pytest.approx(reference, rel=1e-6)
        with pytest.raises(RuntimeError, match="inplace operation"):
            _autograd(params, lambda: loss(fix=False))


def test_builtin_style_checkpointing_does_not_give_the_reference(mods):
    """The trap the fix avoids: ComfyUI's built-in checkpointing on the same model either raises an
    in-place error or returns a gradient that differs from the reference."""
    model, params, loss = _problem(mods, "flux1")
    dm = model.model.diffusion_model
    names = [n for n, p in dm.named_parameters() if n.startswith(TRAINED)]
    with mods.autograd():
        direction = [torch.randn(p.shape, generator=torch.Generator().manual_seed(2), dtype=p.dtype) for p in params]
        reference = _forward_ad(dm, names, params, loss, direction)
        try:
            wrong = _autograd(params, lambda: loss(fix=False), lambda: _builtin_style_checkpointing(dm))
        except RuntimeError as exc:
            assert "inplace operation" in str(exc)
            return
    assert _dot(wrong, direction) != pytest.approx(reference, rel=1e-3)


def test_trainer_predict_gradients_match_forward_mode_derivatives(mods):
    """model_fns(...).predict on Flux (the trainer's own forward, under clone_saved_tensors, else backward
    raises): its reverse-mode gradients, projected on two random directions, equal forward-mode derivatives of
    the same predict in float64."""
    model, params, _ = _problem(mods, "flux1")
    dm = model.model.diffusion_model
    names = [n for n, p in dm.named_parameters() if n.startswith(TRAINED)]
    fns = mods.tglue.model_fns(model, None, mods.Settings(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    with mods.autograd():
        x = torch.randn(1, 16, 4, 4, dtype=torch.float64, generator=gen)
        weight = torch.randn(x.shape, dtype=torch.float64, generator=gen)
        sigma = torch.tensor([0.5], dtype=torch.float64)
        from models import make_conditioning as mc
        sample = mods.tdata.build_samples(model, [{"samples": x}], [mc(model, 1)], None, torch.device("cpu"))[0]
        cond = fns.collate([sample.cond])

        def loss(fix: bool = True) -> torch.Tensor:
            return (fns.predict(x, sigma, cond).double() * weight).sum()

        grads = _autograd(params, loss)
        assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
        for _ in range(2):
            direction = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
            assert _dot(grads, direction) == pytest.approx(_forward_ad(dm, names, params, loss, direction), rel=1e-6)


def test_cosmos_checkpointing_without_copies_gives_the_same_gradients(mods):
    """Cosmos blocks have no in-place adds: the copy-free checkpointing path must not change gradients."""
    from models import tiny_cosmos

    model = tiny_cosmos(dtype=torch.float64)
    dm = model.model.diffusion_model
    for p in dm.parameters():
        p.requires_grad_(False)
    params = [p for n, p in dm.named_parameters() if n.startswith("blocks.") and n.endswith("weight")]
    fns = mods.tglue.model_fns(model, None, mods.Settings(), torch.device("cpu"))
    with mods.autograd():
        latent = make_latent(model, 1, width=32, height=32)
        sample = mods.tdata.build_samples(model, [latent], [make_conditioning(model, 1)], None, torch.device("cpu"))[0]
        x = sample.latent[None].double()
        sigma = torch.tensor([0.7], dtype=torch.float64)
        cond = fns.collate([sample.cond])

        def loss():
            return fns.predict(x, sigma, cond).pow(2).sum()

        plain = _autograd(params, loss)
        ckpt = _autograd(params, loss, lambda: mods.grad.checkpoint_blocks(dm.blocks, in_place_adds=False))
    assert mods.tglue.needs_in_place_fix(model) is False
    assert len(plain) == len(ckpt) > 0
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_cosmos_gradients_match_float64_reference(mods):
    """Cosmos-Predict2 through the training path (``model_fns(...).predict``) equals forward-mode AD in
    float64. On ComfyUI 0.30+ its rotary embedding is comfy-kitchen's fused op, which has no backward and
    rejects float64: the training path reroutes it (``comfy_compat.model_gradients``), and this checks
    the rerouted gradients are the right ones, not only that they exist."""
    from models import tiny_cosmos

    model = tiny_cosmos(dtype=torch.float64)
    model.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = exact_attention
    dm = model.model.diffusion_model
    for p in dm.parameters():
        p.requires_grad_(False)
    names = [n for n, p in dm.named_parameters() if n.startswith("blocks.") and n.endswith("weight")]
    params = [dm.get_parameter(n) for n in names]
    fns = mods.tglue.model_fns(model, None, mods.Settings(), torch.device("cpu"))
    with mods.autograd():
        latent = make_latent(model, 1, width=32, height=32)
        sample = mods.tdata.build_samples(model, [latent], [make_conditioning(model, 1)], None, torch.device("cpu"))[0]
        x = sample.latent[None].double()
        sigma = torch.tensor([0.7], dtype=torch.float64)
        cond = fns.collate([sample.cond])
        weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

        def loss(fix: bool = True) -> torch.Tensor:
            return (fns.predict(x, sigma, cond) * weight).sum()

        gen = torch.Generator().manual_seed(5)
        directions = [[torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params] for _ in range(2)]
        reference = [_forward_ad(dm, names, params, loss, d) for d in directions]
        ours = _autograd(params, loss)
    assert all(r != 0 for r in reference)
    assert [_dot(ours, d) for d in directions] == pytest.approx(reference, rel=1e-6)
