"""Stable-softmax attention (Qiu & Yao, arXiv 2510.04212), hardened as in PRECISION.md §3.

Tiled online softmax over key tiles: memory O(B·H·Lq × tile). In each tile the running row max r is
updated; when two or more logits of the row lie within ``tau`` of r (a tie or near-tie, which would
make bf16(P̄) == 1 twice), the offset becomes m = r + Δ with a row-dependent
Δ ≈ (β−1)·r if r > 0 else −r, kept in [0.01, 60] (see ``row_shift``), so no P̄ = exp(S − m) reaches 1. Softmax is
shift-invariant, so in exact arithmetic the output is unchanged; the clamp keeps ℓ > 0 (no NaN for
row maxima up to hundreds) and handles r == 0 and tiny r.

Backward recomputes P = exp(S − LSE) per tile (LSE = m + log ℓ), so it needs no stored probabilities.
``emulate`` rounds P̄ (and optionally the tile product P̄V) to bf16 like a low-precision kernel would,
for the bias tests: "kernel" = bf16 P̄, fp32 Ō accumulator; "paper" = bf16 P̄ and bf16 tile products.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .masks import additive_mask, from_bhld, prepare_mask, to_bhld

TIE_TOLERANCE = 0.00196  # > -ln(1 - 2**-9): any logit this close to the max gives bf16(P̄) == 1
SHIFT_MIN = 0.01
SHIFT_MAX = 60.0
EMULATIONS = ("none", "kernel", "paper")
TILE_BUDGET_ELEMENTS = 1 << 25  # B·H·Lq·tile fp32 elements per logits tile (128 MiB)


@dataclass(frozen=True)
class StableOptions:
    """beta in [1.5, 8]; tau: tie tolerance; softclamp: 0 = off; tile: keys per tile (0 = by memory
    budget); shift: False gives plain online softmax (for comparisons); emulate: see module doc."""

    beta: float = 2.0
    tau: float = TIE_TOLERANCE
    softclamp: float = 0.0
    tile: int = 0
    shift: bool = True
    emulate: str = "none"

    def validate(self) -> None:
        if not (math.isfinite(self.beta) and 1.5 <= self.beta <= 8.0):
            raise ValueError(f"stable beta={self.beta!r} is out of range; use a value in [1.5, 8]")
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"stable tau={self.tau!r} is invalid; use a finite value >= 0 (default {TIE_TOLERANCE})")
        if self.emulate not in EMULATIONS:
            raise ValueError(f"stable emulate={self.emulate!r} is unknown; use one of {', '.join(EMULATIONS)}")
        if self.tile < 0:
            raise ValueError(f"stable tile={self.tile!r} is invalid; use 0 (automatic) or a positive key count")


def _tile_size(rows: int, keys: int, tile: int) -> int:
    if tile > 0:
        return min(tile, keys)
    return max(64, min(keys, TILE_BUDGET_ELEMENTS // max(rows, 1)))


def row_shift(r: torch.Tensor, beta: float) -> torch.Tensor:
    """Δ for row maxima ``r``: (β−1)·r for r > 0, −r for r <= 0 (the paper's m = β·r or m = 0), kept in
    [0.01, 60] by a *folded* clamp: below 0.01 it becomes 0.01 + raw, above 60 it becomes
    60 − frac(raw). A hard clamp would give many rows the same Δ, hence the same relative bf16 rounding
    of their tied P̄ = exp(−Δ), which brings the bias back (PRECISION.md §3); folding keeps Δ
    row-dependent while bounding it (so ℓ >= e^-60 > 0 in fp32: no NaN)."""
    raw = torch.where(r > 0, (beta - 1.0) * r, -r)
    low = raw + SHIFT_MIN
    high = SHIFT_MAX - torch.frac(raw)
    return torch.where(raw < SHIFT_MIN, low, torch.where(raw > SHIFT_MAX, high, raw))


def _row_offset(r: torch.Tensor, tied: torch.Tensor, beta: float) -> torch.Tensor:
    """m for each row: r, or r + Δ on tied rows."""
    return torch.where(tied, r + row_shift(r, beta), r)


def _logits(q: torch.Tensor, k_tile: torch.Tensor, softclamp: float, mask_tile: torch.Tensor | None) -> torch.Tensor:
    """q already scaled (fp32); returns (B,H,Lq,T) fp32 logits with softclamp and mask applied."""
    s = torch.matmul(q, k_tile.transpose(-1, -2))
    if softclamp > 0:
        s = torch.tanh(s.div_(softclamp)).mul_(softclamp)
    if mask_tile is not None:
        s = s + mask_tile
    return s


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def stable_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None, opts: StableOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B,H,Lq,D), k (B,H,Lk,D), v (B,H,Lk,Dv) fp32; mask additive fp32 4-D or None.

    Returns (out (B,H,Lq,Dv) fp32, lse (B,H,Lq,1) fp32 with -inf on fully masked rows,
    triggered (B,H,Lq,1) bool: rows where the shift fired in some tile).
    """
    qs = q * scale
    lk = k.shape[2]
    tile = _tile_size(q.shape[0] * q.shape[1] * q.shape[2], lk, opts.tile)
    r = m = l = acc = count = None
    triggered = torch.zeros(q.shape[:-1] + (1,), dtype=torch.bool, device=q.device)
    for start in range(0, lk, tile):
        end = min(start + tile, lk)
        s = _logits(qs, k[:, :, start:end], opts.softclamp, None if mask is None else mask[..., start:end])
        tile_max = s.amax(dim=-1, keepdim=True)
        r_new = tile_max if r is None else torch.maximum(r, tile_max)
        live = torch.isfinite(r_new)
        r_safe = torch.where(live, r_new, torch.zeros_like(r_new))
        if opts.shift:
            near = (s >= r_new - opts.tau).sum(dim=-1, keepdim=True)
            count = near if count is None else torch.where(r >= r_new - opts.tau, count, 0) + near
            tied = (count > 1) & live
            triggered |= tied
            m_new = _row_offset(r_safe, tied, opts.beta)
        else:
            m_new = r_safe
        p = torch.exp(s.sub_(m_new))
        row_sum = p.sum(dim=-1, keepdim=True)
        pv = _tile_product(p, v[:, :, start:end], opts.emulate)
        if acc is None:
            l, acc = row_sum, pv
        else:
            # m_new >= r_new >= r and m <= r + 60, so the factor is at most e^60: no overflow.
            alpha = torch.where(l > 0, torch.exp(m - m_new), torch.zeros_like(l))
            l = l * alpha + row_sum
            acc = acc * alpha + pv
        r, m = r_new, m_new
    alive = l > 0
    out = acc / torch.where(alive, l, torch.ones_like(l))
    lse = torch.where(alive, m + torch.log(torch.where(alive, l, torch.ones_like(l))), torch.full_like(l, float("-inf")))
    return out, lse, triggered


def _tile_product(p: torch.Tensor, v_tile: torch.Tensor, emulate: str) -> torch.Tensor:
    if emulate == "none":
        return torch.matmul(p, v_tile)
    product = torch.matmul(_bf16(p), _bf16(v_tile))
    return _bf16(product) if emulate == "paper" else product


def stable_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, scale: float, mask: torch.Tensor | None, opts: StableOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) in fp32 by recomputing P = exp(S − LSE) tile by tile."""
    qs = q * scale
    delta = (grad_out * out).sum(dim=-1, keepdim=True)
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    lk = k.shape[2]
    tile = _tile_size(q.shape[0] * q.shape[1] * q.shape[2], lk, opts.tile)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for start in range(0, lk, tile):
        end = min(start + tile, lk)
        k_t, v_t = k[:, :, start:end], v[:, :, start:end]
        raw = torch.matmul(qs, k_t.transpose(-1, -2))
        s = raw
        if opts.softclamp > 0:
            t = torch.tanh(raw / opts.softclamp)
            s = t * opts.softclamp
        if mask is not None:
            s = s + mask[..., start:end]
        p = torch.exp(s - lse_safe)
        dvs.append(torch.matmul(p.transpose(-1, -2), grad_out))
        ds = p * (torch.matmul(grad_out, v_t.transpose(-1, -2)) - delta)
        if opts.softclamp > 0:
            ds = ds * (1.0 - t * t)
        dq += torch.matmul(ds, k_t) * scale
        dks.append(torch.matmul(ds.transpose(-1, -2), q) * scale)
    return dq, torch.cat(dks, dim=2), torch.cat(dvs, dim=2)


class _StableAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, opts):  # type: ignore[override]
        qf, kf, vf = q.float(), k.float(), v.float()
        out, lse, triggered = stable_forward(qf, kf, vf, scale, mask, opts)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.scale, ctx.opts = scale, opts
        ctx.mark_non_differentiable(triggered)
        return out.to(q.dtype), triggered

    @staticmethod
    def backward(ctx, grad_out, _grad_triggered):  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = stable_backward(
            grad_out.float(), q.float(), k.float(), v.float(), out, lse, ctx.scale, mask, ctx.opts
        )
        dk = _sum_to(dk, k.shape)
        dv = _sum_to(dv, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _sum_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a gradient over dims that were broadcast (size 1 in ``shape``)."""
    dims = [i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def stable_attention_with_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
    layout: str = "bhld", options: StableOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``stable_attention``, also returning the (B,H,Lq,1) bool map of rows where the shift fired."""
    opts = options or StableOptions()
    opts.validate()
    qb, kb, vb = to_bhld(q, layout), to_bhld(k, layout), to_bhld(v, layout)
    m4 = prepare_mask(mask, qb, kb)
    add = None if m4 is None else additive_mask(m4, torch.float32)
    out, triggered = _StableAttentionFn.apply(qb, kb, vb, add, float(scale), opts)
    return from_bhld(out, layout), triggered


def stable_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None,
    layout: str = "bhld", options: StableOptions | None = None,
) -> torch.Tensor:
    """The ``stable`` backend. q/k/v in ``layout`` (any float dtype; computed in fp32), output in q's
    dtype and layout. Differentiable (custom backward). Fully masked rows give zeros."""
    return stable_attention_with_stats(q, k, v, scale=scale, mask=mask, layout=layout, options=options)[0]
