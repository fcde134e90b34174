"""Stable-softmax attention (Qiu & Yao, arXiv 2510.04212), hardened (row-dependent shift, bounds, jitter).

Blocked online softmax: (batch, head group, query chunk) blocks, keys in tiles, so the live logits
block is about 2 MiB whatever the sequence length: memory O(rows × tile).
In each tile the running row max r is updated; when two or more logits of the row lie within ``tau``
of r (a tie or near-tie, which would make bf16(P̄) == 1 twice), the offset becomes m = r + Δ with a
row-dependent Δ ≈ (β−1)·r if r > 0 else −r, plus a deterministic per-row jitter, kept in [0.01, 60]
([0.01, 4] for fp16 P̄; see ``row_shift``), so no P̄ = exp(S − m) reaches 1. Softmax is
shift-invariant, so in exact arithmetic the output is unchanged; the bounds keep ℓ > 0 (no NaN for row maxima in the hundreds) and handle r == 0.

Where P̄ is rounded: for bf16/fp16 inputs P̄ is cast to the input dtype for the P̄·V product (as flash
kernels do; ℓ is summed from the fp32 P̄), which is where the bias arises and the shift acts. For
fp32/fp64 inputs nothing rounds P̄, the shift could only change fp32 rounding noise, and by default
(``shift=None``) the tie scan is skipped there. ``emulate`` imitates a bf16 kernel on fp32 inputs for
the bias tests: "kernel" = bf16 P̄ and V, fp32 Ō accumulator; "paper" = also bf16 tile products.

Backward recomputes P = exp(S − LSE) block by block (LSE = m + log ℓ): no stored probabilities.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .masks import additive_mask, finish_logits, from_bhld, prepare_mask, to_bhld

TIE_TOLERANCE = 0.00196  # > -ln(1 - 2**-9): any logit this close to the max gives bf16(P̄) == 1
SHIFT_MIN = 0.01
SHIFT_MAX = 60.0
SHIFT_MAX_FP16 = 4.0  # fp16 P̄ would underflow at Δ > ~9.7 (2^-14): keep the tied e^-Δ >= e^-4 normal
EMULATIONS = ("none", "kernel", "paper")
BLOCK_ELEMENTS = 1 << 19  # fp32 logits per block (2 MiB): stays in cache / out of mmap territory
DEFAULT_TILE = 1024  # keys per tile
QUERY_CHUNK = 256  # query rows per block (more heads per block instead)
LOW_PRECISION = (torch.bfloat16, torch.float16)
ROW_JITTER = 0.5  # spread of Δ's per-row component: ~90 bf16 rounding steps of exp(-Δ) (see row_jitter)
GOLDEN_16 = 40503  # round(2**16 / φ): the golden-ratio (Kronecker) sequence in 16-bit fixed point


@dataclass(frozen=True)
class StableOptions:
    """beta in [1.5, 8]; tau: tie tolerance; softclamp: 0 = off; tile: keys per tile (0 = automatic);
    shift: True / False (plain online softmax, for comparisons) / None = on where P̄ is rounded
    (low-precision inputs or ``emulate``); emulate: see module doc."""

    beta: float = 2.0
    tau: float = TIE_TOLERANCE
    softclamp: float = 0.0
    tile: int = 0
    shift: bool | None = None
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

    def shift_on(self, pv_dtype: torch.dtype | None) -> bool:
        if self.shift is not None:
            return self.shift
        return self.emulate != "none" or pv_dtype is not None


Block = tuple[slice, slice, slice]  # batch, heads, query rows


def _blocks(q: torch.Tensor, lk: int, tile: int) -> tuple[list[Block], int]:
    """Blocks of (batch, head group, query chunk) whose logits (× keys per tile) hold about
    BLOCK_ELEMENTS, and the keys per tile. Head groups keep each GEMM big enough to be efficient."""
    b, h, lq = q.shape[0], q.shape[1], q.shape[2]
    tile = min(tile if tile > 0 else DEFAULT_TILE, lk)
    chunk = max(1, min(lq, QUERY_CHUNK, BLOCK_ELEMENTS // tile))
    group = max(1, min(h, BLOCK_ELEMENTS // (chunk * tile)))
    blocks = [(slice(bi, bi + 1), slice(hi, min(hi + group, h)), slice(qi, min(qi + chunk, lq)))
              for bi in range(b) for hi in range(0, h, group) for qi in range(0, lq, chunk)]
    return blocks, tile


def _mask_block(mask: torch.Tensor | None, block: Block) -> torch.Tensor | None:
    """The mask's part for ``block`` (broadcast dims of size 1 stay as they are)."""
    if mask is None:
        return None
    index = tuple(sl if mask.shape[d] != 1 else slice(None) for d, sl in enumerate(block))
    return mask[index]


def row_jitter(rows: torch.Tensor) -> torch.Tensor:
    """Δ's deterministic per-row component for global row indices ``rows`` (any int shape, flat
    (b·H + h)·Lq + i over bhld): ROW_JITTER · frac(rows / φ), exact in 16-bit fixed point, fp32 in
    [0, ROW_JITTER). The golden-ratio sequence spreads any run of consecutive rows evenly, so the
    relative bf16 rounding of the tied P̄ = exp(−Δ) averages out even when every row has the same max."""
    fixed = (rows.to(torch.int64) * GOLDEN_16) & 0xFFFF
    return fixed.to(torch.float32) * (ROW_JITTER / 65536.0)


def shift_max(pv_dtype: torch.dtype | None) -> float:
    """Upper bound of Δ when P̄ is rounded to ``pv_dtype``: 60 (bf16 has fp32's exponent range), 4 for
    fp16, whose P̄ = e^-Δ would leave the normal range at Δ > 9.7 and vanish at Δ > 16.6."""
    return SHIFT_MAX_FP16 if pv_dtype == torch.float16 else SHIFT_MAX


def row_shift(
    r: torch.Tensor, beta: float, jitter: torch.Tensor | float = 0.0, high: float = SHIFT_MAX,
) -> torch.Tensor:
    """Δ for row maxima ``r`` and per-row ``jitter`` (``row_jitter``): d = raw + jitter with
    raw = (β−1)·r for r > 0, −r for r <= 0 (the paper's m = β·r or m = 0), kept in [0.01, 60] by a
    *folded* clamp: below 0.01 it becomes 0.01 + d, above ``high`` (60; ``shift_max``) high − frac(d).
    Δ must differ between rows: rows sharing a Δ share the relative bf16 rounding of
    their tied P̄ = exp(−Δ), and over few distinct Δ that rounding has a nonzero mean, which is the bias
    again. A hard clamp would give every row above the bound one Δ (hence the fold); row maxima on a
    coarse grid give few distinct raw values (hence the jitter). Both keep ℓ >= e^-60 > 0 in fp32."""
    raw = torch.where(r > 0, (beta - 1.0) * r, -r) + jitter
    low = raw + SHIFT_MIN
    folded = high - torch.frac(raw)
    return torch.where(raw < SHIFT_MIN, low, torch.where(raw > high, folded, raw))


def _row_offset(r: torch.Tensor, tied: torch.Tensor, beta: float, jitter: torch.Tensor, high: float) -> torch.Tensor:
    """m for each row: r, or r + Δ on tied rows."""
    return torch.where(tied, r + row_shift(r, beta, jitter, high), r)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def _tile_product(p: torch.Tensor, v_tile: torch.Tensor, emulate: str, pv_dtype: torch.dtype | None) -> torch.Tensor:
    """P̄·V for one tile, fp32 result. pv_dtype: round P̄ to it for the product (low-precision inputs)."""
    if pv_dtype is not None:
        return torch.matmul(p.to(pv_dtype), v_tile.to(pv_dtype)).float()
    if emulate == "none":
        return torch.matmul(p, v_tile)
    product = torch.matmul(_bf16(p), _bf16(v_tile))
    return _bf16(product) if emulate == "paper" else product


def _forward_rows(
    qs: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, opts: StableOptions, tile: int,
    pv_dtype: torch.dtype | None, jitter: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Online softmax of one chunk of query rows over all key tiles (kt = kᵀ, (B,H,D,Lk)).
    ``jitter``: the rows' ``row_jitter`` (B,H,rows,1), or None for the plain (unshifted) softmax."""
    lk = kt.shape[3]
    shift = jitter is not None
    r = m = l = acc = count = None
    triggered = torch.zeros(qs.shape[:-1] + (1,), dtype=torch.bool, device=qs.device) if shift else None
    for start in range(0, lk, tile):
        end = min(start + tile, lk)
        s = finish_logits(torch.matmul(qs, kt[..., start:end]), opts.softclamp,
                          None if mask is None else mask[..., start:end])
        tile_max = s.amax(dim=-1, keepdim=True)
        r_new = tile_max if r is None else torch.maximum(r, tile_max)
        live = torch.isfinite(r_new)
        r_safe = torch.where(live, r_new, torch.zeros_like(r_new))
        if shift:
            near = (s >= r_new - opts.tau).sum(dim=-1, keepdim=True)
            count = near if count is None else torch.where(r >= r_new - opts.tau, count, 0) + near
            tied = (count > 1) & live
            triggered |= tied
            m_new = _row_offset(r_safe, tied, opts.beta, jitter, shift_max(pv_dtype))
        else:
            m_new = r_safe
        p = s.sub_(m_new).exp_()
        row_sum = p.sum(dim=-1, keepdim=True)
        pv = _tile_product(p, v[:, :, start:end], opts.emulate, pv_dtype)
        if acc is None:
            l, acc = row_sum, pv
        else:
            # m_new >= r_new >= r and m <= r + 60, so the factor is at most e^60: no overflow.
            alpha = torch.where(l > 0, torch.exp(m - m_new), torch.zeros_like(l))
            l = l.mul_(alpha).add_(row_sum)
            acc = acc.mul_(alpha).add_(pv)
        r, m = r_new, m_new
    alive = l > 0
    safe_l = torch.where(alive, l, torch.ones_like(l))
    lse = torch.where(alive, m + torch.log(safe_l), torch.full_like(l, float("-inf")))
    return acc.div_(safe_l), lse, triggered


def stable_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
    opts: StableOptions, pv_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B,H,Lq,D), k (B,H,Lk,D) fp32; v (B,H,Lk,Dv) fp32 (or ``pv_dtype``); mask additive fp32 4-D
    or None. ``pv_dtype`` (bf16/fp16): P̄ is rounded to it for the P̄·V product, like a flash kernel.

    Returns (out (B,H,Lq,Dv) fp32, lse (B,H,Lq,1) fp32 with -inf on fully masked rows,
    triggered (B,H,Lq,1) bool: rows where the shift fired in some tile).
    """
    shift = opts.shift_on(pv_dtype)
    blocks, tile = _blocks(q, k.shape[2], opts.tile)
    kt = k.transpose(-1, -2).contiguous()  # one copy; plain GEMM layout for every block
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:-1] + (1,), dtype=torch.float32, device=q.device)
    triggered = torch.zeros(q.shape[:-1] + (1,), dtype=torch.bool, device=q.device)
    b, h, lq = q.shape[:3]
    jitter = row_jitter(torch.arange(b * h * lq, device=q.device).view(b, h, lq, 1)) if shift else None
    for bs, hs, rows in blocks:
        o, l, trig = _forward_rows(q[bs, hs, rows] * scale, kt[bs, hs], v[bs, hs],
                                   _mask_block(mask, (bs, hs, rows)), opts, tile, pv_dtype,
                                   None if jitter is None else jitter[bs, hs, rows])
        out[bs, hs, rows] = o
        lse[bs, hs, rows] = l
        if shift:
            triggered[bs, hs, rows] = trig
    return out, lse, triggered


def stable_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, scale: float, mask: torch.Tensor | None, opts: StableOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) in fp32 by recomputing P = exp(S − LSE) block by block."""
    delta = (grad_out * out).sum(dim=-1, keepdim=True)
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    lk = k.shape[2]
    blocks, tile = _blocks(q, lk, opts.tile)
    kt = k.transpose(-1, -2).contiguous()
    dq = torch.zeros_like(q)
    dk = torch.zeros(q.shape[:2] + k.shape[2:], dtype=q.dtype, device=q.device)
    dv = torch.zeros(q.shape[:2] + v.shape[2:], dtype=q.dtype, device=q.device)
    for bs, hs, rows in blocks:
        q_c, g_c, mask_c = q[bs, hs, rows], grad_out[bs, hs, rows], _mask_block(mask, (bs, hs, rows))
        qs, lse_c, delta_c = q_c * scale, lse_safe[bs, hs, rows], delta[bs, hs, rows]
        for ka in range(0, lk, tile):
            kb = min(ka + tile, lk)
            k_t, v_t = k[bs, hs, ka:kb], v[bs, hs, ka:kb]
            s = torch.matmul(qs, kt[bs, hs, :, ka:kb])
            if opts.softclamp > 0:  # not finish_logits: the clamp's derivative 1 - t² needs t itself
                t = torch.tanh(s / opts.softclamp)
                s = t * opts.softclamp
            if mask_c is not None:
                s = s + mask_c[..., ka:kb]
            p = s.sub_(lse_c).exp_()
            dv[bs, hs, ka:kb] += torch.matmul(p.transpose(-1, -2), g_c)
            ds = p.mul_(torch.matmul(g_c, v_t.transpose(-1, -2)).sub_(delta_c))
            if opts.softclamp > 0:
                ds = ds * (1.0 - t * t)
            dq[bs, hs, rows] += torch.matmul(ds, k_t) * scale
            dk[bs, hs, ka:kb] += torch.matmul(ds.transpose(-1, -2), q_c) * scale
    return dq, dk, dv


class _StableAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, opts):  # type: ignore[override]
        low = q.dtype in LOW_PRECISION and opts.emulate == "none"
        pv_dtype = q.dtype if low else None
        out, lse, triggered = stable_forward(q.float(), k.float(), v if low else v.float(), scale, mask, opts,
                                             pv_dtype)
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
    """The ``stable`` backend. q/k/v in ``layout`` (any float dtype; logits and softmax in fp32; P̄·V in
    the input dtype for bf16/fp16 inputs), output in q's dtype and layout. Differentiable (custom backward). Fully masked rows give zeros."""
    return stable_attention_with_stats(q, k, v, scale=scale, mask=mask, layout=layout, options=options)[0]
