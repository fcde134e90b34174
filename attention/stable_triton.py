"""Fused stable-softmax attention in Triton: forward and backward, flash-attention-2 style.

One kernel computes the forward as an online softmax over key tiles, with the Qiu & Yao shift and the
pack's hardening exactly as ``attention.stable`` defines them (τ = 0.00196 tie tolerance, Δ = raw +
per-row jitter folded into [0.01, 60], fully masked rows → zeros), and saves the log-sum-exp. The
backward recomputes P = exp(S − LSE) tile by tile (one pass for dK/dV over key blocks, one for dQ over
query blocks; LSE is the same number with or without the shift, so the backward is the standard one).

Imports triton at import time: import this module lazily (``attention.backends`` does, only for CUDA
tensors). The PyTorch path in ``attention.stable`` stays the CPU path, the fallback and the reference.
Under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (slowly; the tests use that).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

from . import stable as _stable
from .masks import additive_mask, from_bhld, prepare_mask, to_bhld
from .stable import StableOptions
from .stable_triton_kernels import (
    _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel, _fwd_kernel, _shift_probe_kernel,
)

LOG2E = 1.4426950408889634
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch options of one kernel: BLOCK_M query rows × BLOCK_N keys per step."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class FusedConfig:
    """Configs of the three main kernels (forward, dK/dV pass, dQ pass)."""

    forward: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig


INTERPRETER_CONFIG = FusedConfig(KernelConfig(16, 16), KernelConfig(16, 16), KernelConfig(16, 16))
# Tuned on an H100 (docs/benchmarks.md, "Fused stable kernel"); head dims <= 64 and <= 256.
GPU_CONFIGS = {
    64: FusedConfig(KernelConfig(128, 64, 4, 3), KernelConfig(64, 128, 8, 3), KernelConfig(128, 32, 4, 3)),
    128: FusedConfig(KernelConfig(128, 64, 8, 3), KernelConfig(64, 128, 8, 3), KernelConfig(128, 32, 4, 3)),
    256: FusedConfig(KernelConfig(64, 32, 4, 2), KernelConfig(32, 32, 4, 2), KernelConfig(32, 32, 4, 2)),
}


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_config(head_dim: int) -> FusedConfig:
    """The tile config for ``head_dim`` (max of q's and v's feature dims)."""
    if interpreting():
        return INTERPRETER_CONFIG
    return GPU_CONFIGS[next(bound for bound in sorted(GPU_CONFIGS) if head_dim <= bound)]


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: StableOptions) -> str | None:
    """None when the fused kernel can run this call, else why not (the caller uses the PyTorch path)."""
    if q.dtype not in KERNEL_DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (the kernel takes one of fp32, fp16, bf16)"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} > {MAX_HEAD_DIM}"
    if options.softclamp > 0 or options.emulate != "none":
        return "softclamp / emulate are implemented on the PyTorch path only"
    if not (q.is_cuda or interpreting()):
        return "needs a CUDA tensor (or TRITON_INTERPRET=1)"
    return None


def _rows_last(x: torch.Tensor) -> torch.Tensor:
    """x with a unit stride on the feature dim (the kernels address rows by stride, features densely)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _empty_like_layout(q: torch.Tensor, last: int, dtype: torch.dtype) -> torch.Tensor:
    """(B,H,L,last) tensor whose memory order follows q's (bhld or blhd), as a bhld view."""
    b, h, length = q.shape[:3]
    if q.stride(1) < q.stride(2):  # heads inside rows: blhd memory
        return torch.empty((b, length, h, last), dtype=dtype, device=q.device).transpose(1, 2)
    return torch.empty((b, h, length, last), dtype=dtype, device=q.device)


def _mask_args(mask: torch.Tensor | None, shape: tuple[int, int, int, int]) -> tuple[torch.Tensor | None, list[int]]:
    """The additive fp32 mask expanded to (B,H,Lq,Lk) (a view) and its four strides (0: broadcast)."""
    if mask is None:
        return None, [0, 0, 0, 0]
    expanded = mask.expand(shape)
    return expanded, list(expanded.stride())


def _bhl_strides(x: torch.Tensor) -> list[int]:
    return [x.stride(0), x.stride(1), x.stride(2)]


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
             shift: bool, beta: float, tau: float, cfg: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B,H,Lq,D), k (B,H,Lk,D), v (B,H,Lk,Dv) bhld views of one dtype; mask additive fp32 or None.
    Returns out (B,H,Lq,Dv) in q's dtype and memory order, lse (B·H, Lq) fp32 in base 2."""
    b, h, lq, d = q.shape
    lk, dv = k.shape[2], v.shape[3]
    out = _empty_like_layout(q, dv, q.dtype)
    lse = torch.empty((b * h, lq), dtype=torch.float32, device=q.device)
    mask_t, mask_strides = _mask_args(mask, (b, h, lq, lk))
    grid = (triton.cdiv(lq, cfg.block_m), b * h)
    _fwd_kernel[grid](
        q, k, v, mask_t, out, lse, *_bhl_strides(q), *_bhl_strides(k), *_bhl_strides(v), *mask_strides,
        *_bhl_strides(out), h, lq, lk, d, dv, scale * LOG2E, beta, tau * LOG2E, float(_stable.ROW_JITTER),
        _stable.shift_max(q.dtype),
        HAS_MASK=mask_t is not None, SHIFT=shift, IEEE=q.dtype == torch.float32, EVEN_N=lk % cfg.block_n == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse


def kernel_row_shift(r: torch.Tensor, beta: float, rows: torch.Tensor, high: float = _stable.SHIFT_MAX) -> torch.Tensor:
    """Δ the kernels use on tied rows with maxima ``r`` (1-D fp32), global row indices ``rows`` (1-D
    int) and upper bound ``high``, fp32 in natural units: for comparing with ``stable.row_shift``."""
    r, rows = r.float().contiguous(), rows.to(torch.int32).contiguous()
    out = torch.empty_like(r)
    _shift_probe_kernel[(triton.cdiv(r.numel(), 256),)](r, rows, out, r.numel(), beta,
                                                         float(_stable.ROW_JITTER), high, BLOCK=256)
    return out / LOG2E


def _block_dim(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, mask: torch.Tensor | None, scale: float,
              cfg: FusedConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, each in its input's dtype and (B,H,·,·) shape."""
    b, h, lq, d = q.shape
    lk, dv_dim = k.shape[2], v.shape[3]
    delta = torch.empty_like(lse)
    _bwd_delta_kernel[(triton.cdiv(lq, 64), b * h)](
        out, grad_out, delta, *_bhl_strides(out), *_bhl_strides(grad_out), h, lq, dv_dim,
        BLOCK_M=64, BLOCK_DV=_block_dim(dv_dim))
    dq = _empty_like_layout(q, d, q.dtype)
    dk = torch.empty((b, h, lk, d), dtype=k.dtype, device=k.device)
    dvv = torch.empty((b, h, lk, dv_dim), dtype=v.dtype, device=v.device)
    mask_t, mask_strides = _mask_args(mask, (b, h, lq, lk))
    common = dict(HAS_MASK=mask_t is not None, IEEE=q.dtype == torch.float32,
                  BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv_dim))
    strides = [*_bhl_strides(q), *_bhl_strides(k), *_bhl_strides(v), *mask_strides, *_bhl_strides(grad_out)]
    sizes = (h, lq, lk, d, dv_dim, scale * LOG2E, scale)
    c = cfg.dkdv
    _bwd_dkdv_kernel[(triton.cdiv(lk, c.block_n), b * h)](
        q, k, v, mask_t, grad_out, lse, delta, dk, dvv, *strides, *_bhl_strides(dk), *_bhl_strides(dvv), *sizes,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages, **common)
    c = cfg.dq
    _bwd_dq_kernel[(triton.cdiv(lq, c.block_m), b * h)](
        q, k, v, mask_t, grad_out, lse, delta, dq, *strides, *_bhl_strides(dq), *sizes,
        EVEN_N=lk % c.block_n == 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps,
        num_stages=c.num_stages, **common)
    return dq, dk, dvv


class _FusedStableFn(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, the output and the base-2 LSE; the backward recomputes P."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, opts, cfg):  # type: ignore[override]
        shift = opts.shift_on(q.dtype if q.dtype in _stable.LOW_PRECISION else None)
        out, lse = _forward(q, k, v, mask, scale, shift, opts.beta, opts.tau, cfg.forward)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.scale, ctx.cfg = scale, cfg
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = _backward(_rows_last(grad_out), q, k, v, out, lse, mask, ctx.scale, ctx.cfg)
        return dq, dk, dv, None, None, None, None  # k, v broadcast by expand: autograd reduces dk, dv


def fused_stable_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
    layout: str = "bhld", options: StableOptions | None = None, config: FusedConfig | None = None,
) -> torch.Tensor:
    """The ``stable`` backend as one fused Triton kernel (forward and backward).

    q (B,H,Lq,D), k (B|1,H|1,Lk,D), v (B|1,H|1,Lk,Dv) in ``layout`` ("bhld" or "blhd"), one dtype of
    fp32 / fp16 / bf16, CUDA (or CPU under TRITON_INTERPRET=1); mask as ``attention.masks`` (bool or
    additive, 2-D to 4-D). Output (B,H,Lq,Dv) in q's dtype and layout. Logits, softmax statistics and
    accumulators in fp32; P̄ is cast to the input dtype for P̄·V (fp32 inputs: exact fp32 products, no
    tf32). The shift is on for fp16/bf16 inputs by default (``StableOptions.shift``). Fully masked rows
    give zeros and zero gradients. ``config``: tile shapes (default: ``default_config``).
    """
    opts = options or StableOptions()
    opts.validate()
    qb, kb, vb = (_rows_last(to_bhld(t, layout)) for t in (q, k, v))
    reason = unsupported_reason(qb, kb, vb, opts)
    if reason is not None:
        raise ValueError(f"fused stable attention cannot run this call: {reason}")
    if not math.isfinite(scale):
        raise ValueError(f"fused stable attention: scale={scale!r} is not finite")
    b, h = qb.shape[:2]
    kb, vb = kb.expand(b, h, -1, -1), vb.expand(b, h, -1, -1)
    m4 = prepare_mask(mask, qb, kb)
    add = None if m4 is None else additive_mask(m4, torch.float32)
    cfg = config or default_config(max(qb.shape[-1], vb.shape[-1]))
    out = _FusedStableFn.apply(qb, kb, vb, add, float(scale), opts, cfg)
    return from_bhld(out, layout)
