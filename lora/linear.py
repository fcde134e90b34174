"""The base linear with an fp32, unrounded output: the first half of the LoRA layer's fp32 path.

With bf16/fp16 operands the GEMM takes them in that dtype and writes fp32 (on CUDA ``torch.mm`` with
``out_dtype``, with its own backward; on CPU an fp32 product of the same operands), so the LoRA delta can
be added before anything is rounded to the model dtype. Shapes: ``x`` (..., in_features); ``weight``
(out_features, in_features); ``bias`` (out_features,) or None; output (..., out_features).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

_RECAST = "_precision_lora_recast"


def recomputable(weight: torch.Tensor, recast: Callable[[], tuple[torch.Tensor, Callable[[], None]]]) -> torch.Tensor:
    """Mark ``weight``, a fresh cast of a frozen layer's stored weight (ComfyUI's cast of an fp8 / scaled-fp8 /
    quantized / offloaded layer), as one the base GEMM need not keep for backward: the backward calls
    ``recast()`` for the same values again ((weight, release); release after the GEMM) instead. Saves one
    model-dtype copy of every such layer's weight from the forward to its backward (Flux.1-dev fp8: the
    last block's and the recomputed block's copies). Returns ``weight``."""
    setattr(weight, _RECAST, recast)
    return weight


def _gemm_fp32_out(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a (m, k) @ b_t (k, n) of low-precision operands with an fp32, unrounded result."""
    if a.is_cuda:
        return torch.mm(a, b_t, out_dtype=torch.float32)
    return torch.mm(a.float(), b_t.float())  # CPU: aten::mm.dtype is not implemented in torch 2.13


class _LowPrecisionGemmFp32Out(torch.autograd.Function):
    """x2 (m, in) @ w (out, in)^T → (m, out) fp32. ``aten::mm.dtype`` has no derivative, so the backward is
    written here: input and weight gradients in the operands' dtype, as the plain layer would produce."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # the base weight is frozen in training: x2 is then not needed, and not kept, for backward; a weight
        # marked ``recomputable`` is cast again in backward instead of kept
        ctx.recast = getattr(w, _RECAST, None) if not ctx.needs_input_grad[1] else None
        keep_w = ctx.needs_input_grad[0] and ctx.recast is None
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, w if keep_w else None)
        ctx.x_dtype, ctx.w_dtype = x2.dtype, w.dtype
        return _gemm_fp32_out(x2, w.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        x2, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0] and ctx.recast is not None:
            w, release = ctx.recast()
            gx = _gemm_fp32_out(grad.to(ctx.w_dtype), w.to(ctx.w_dtype)).to(ctx.x_dtype)
            release()
        elif ctx.needs_input_grad[0]:
            gx = _gemm_fp32_out(grad.to(w.dtype), w).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gw = _gemm_fp32_out(grad.to(x2.dtype).t(), x2).to(ctx.w_dtype)
        return gx, gw


class _UpcastMm(torch.autograd.Function):
    """x2 (m, k) bf16/fp16 @ w (n, k)^T fp32 -> (m, n) fp32, computed as ``x2.float() @ w.t()`` but saving
    x2 in its own dtype: the backward upcasts it again (exact), so the fp32 LoRA path keeps no fp32 copy of
    a layer's input alive until backward. Gradients are the ones autograd gives ``x2.float() @ w.t()``
    (same formulas, same operand layouts), so values are bit-identical to the plain composition."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(x2 if need_w else None, w if need_x else None)
        ctx.x_dtype = x2.dtype
        return torch.mm(x2.float(), w.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        x2, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = grad.mm(w).to(ctx.x_dtype)  # autograd's mm_mat1_backward for a row-major mat1
        if ctx.needs_input_grad[1]:
            gw = grad.t().mm(x2.float())  # mm_mat2_backward for the column-major w.t(), transposed back
        return gx, gw


def upcast_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x.float(), w)`` for an fp32 ``w`` (a LoRA factor) without keeping ``x.float()`` for backward:
    a bf16/fp16 ``x`` is saved as it is and upcast again in backward. x (..., k) -> (..., n) fp32."""
    if x.dtype == torch.float32:
        return F.linear(x, w)
    out = _UpcastMm.apply(x.reshape(-1, x.shape[-1]), w)
    return out.view(*x.shape[:-1], w.shape[0])


def base_linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     low: torch.dtype | None = None) -> torch.Tensor:
    """Base linear with an fp32 output that has not been rounded to the model dtype.

    With bf16/fp16 operands (or under a bf16/fp16 autocast) the operands are taken in that dtype and the
    GEMM writes fp32: on CUDA ``torch.mm(..., out_dtype=torch.float32)`` (with our own backward), on CPU
    an fp32 product of the same operands. fp32 operands: an fp32 linear. Call with autocast disabled.
    ``low``: the operand dtype to use (the caller's autocast dtype); None = from the operands.
    x (..., in) → (..., out) fp32.
    """
    if low is None and x.dtype == weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32):
        return F.linear(x, weight, bias)  # fp32 model: nothing to cast (saves three calls per layer)
    low = low or low_precision_dtype(x, weight)
    if low is not None:
        x2 = x.reshape(-1, x.shape[-1]).to(low)
        w = weight.to(low)
        if w is not weight and hasattr(weight, _RECAST):
            setattr(w, _RECAST, getattr(weight, _RECAST))  # the backward casts the recast weight to low again
        y = _LowPrecisionGemmFp32Out.apply(x2, w).reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias.float()
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def low_precision_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The bf16/fp16 dtype the GEMM takes its operands in (the autocast dtype, else the operands' common
    dtype), or None for fp32 operands."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) in (torch.bfloat16, torch.float16):
        return torch.get_autocast_dtype(dev)
    if x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return x.dtype
    return None


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """What a plain linear would return for x: the autocast dtype when autocast is on, else x.dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype
