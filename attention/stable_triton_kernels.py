"""Triton kernels of the fused stable-softmax attention (flash-attention-2 style). Imported only by
``attention.stable_triton``, which is itself imported lazily (this module imports triton).

Conventions, shared with the launcher: one program per (query block, batch·head) in the forward and
the dQ pass, per (key block, batch·head) in the dK/dV pass. Tensors are addressed through (batch,
head, row) strides with the feature dim contiguous; the additive fp32 mask through four strides (0
where it broadcasts). Logits are kept in base 2 (s₂ = s·log2 e): exp2 is the fast instruction, and
the tie test s ≥ r − τ reads the same in either unit (τ is passed as τ·log2 e). The row max, Δ and τ
are as in ``attention.stable`` (natural units there); Lse holds the base-2 log-sum-exp m₂ + log2 ℓ,
-inf on rows whose keys are all masked.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
SHIFT_MIN = tl.constexpr(0.01)  # attention.stable.SHIFT_MIN / GOLDEN_16 (a test checks they agree)
GOLDEN_16 = tl.constexpr(40503)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with an fp32 accumulator; IEEE: exact fp32 products for fp32 inputs (no tf32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tile(ptr, rows, cols, row_stride, n_rows, n_cols):
    """(len(rows), len(cols)) tile of a matrix with unit column stride; zeros outside n_rows × n_cols."""
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def _tile_t(ptr, rows, cols, row_stride, n_rows, n_cols):
    """The same tile transposed, (len(cols), len(rows)), read straight from memory."""
    return tl.load(ptr + rows[None, :] * row_stride + cols[:, None],
                   mask=(rows[None, :] < n_rows) & (cols[:, None] < n_cols), other=0.0)


@triton.jit
def _program(H):
    """(program index along axis 0, b·H + h, b and h as int64 for the base offsets)."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    return pid, pid_bh, (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)


@triton.jit
def _row_jitter(rows, jitter):
    """``attention.stable.row_jitter`` of global row indices: jitter · frac(rows / φ) in 16-bit fixed point."""
    return ((rows.to(tl.int64) * GOLDEN_16) & 0xFFFF).to(tl.float32) * (jitter / 65536.0)


@triton.jit
def _shifted_offset(r2, tied, row_jit, beta, shift_max):
    """m₂ for running row maxima r₂ (base 2): r₂, or r₂ + Δ·log2 e on tied rows, with Δ as
    ``attention.stable.row_shift`` (raw + the rows' jitter ``row_jit``, folded into [0.01, shift_max])."""
    r = r2 * LN2
    raw = tl.where(r > 0, (beta - 1.0) * r, -r) + row_jit
    folded = shift_max - (raw - tl.floor(raw))
    delta = tl.where(raw < SHIFT_MIN, raw + SHIFT_MIN, tl.where(raw > shift_max, folded, raw))
    return tl.where(tied, r2 + delta * LOG2E, r2)


@triton.jit
def _logits(q, kt, Mask, mask_base, offs_m, offs_n, smm, smn, LQ, LK, qk_scale,
            HAS_MASK: tl.constexpr, IEEE: tl.constexpr, EVEN_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) base-2 logits q·kᵀ·scale·log2 e (+ mask·log2 e); -inf beyond LK.
    EVEN_N: LK is a multiple of BLOCK_N (no key beyond LK: the per-element select is skipped)."""
    s = _dot(q, kt, IEEE) * qk_scale
    if HAS_MASK:
        inside = (offs_m[:, None] < LQ) & (offs_n[None, :] < LK)
        add = tl.load(Mask + mask_base + offs_m[:, None] * smm + offs_n[None, :] * smn, mask=inside, other=0.0)
        s += add * LOG2E
    if not EVEN_N:
        s = tl.where(offs_n[None, :] < LK, s, float("-inf"))
    return s


@triton.jit
def _fwd_kernel(Q, K, V, Mask, Out, Lse,
                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, smh, smm, smn, sob, soh, som,
                H, LQ, LK, D, DV, qk_scale, beta, tau2, jitter, shift_max,
                HAS_MASK: tl.constexpr, SHIFT: tl.constexpr, IEEE: tl.constexpr, EVEN_N: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Online softmax over key tiles with the stable shift; writes Out (input dtype) and Lse."""
    pid_m, pid_bh, b, h = _program(H)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, offs_dv, offs_j = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    q = _tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqm, LQ, D)
    k_ptr, v_ptr, mask_base = K + b * skb + h * skh, V + b * svb + h * svh, b * smb + h * smh
    row_jit = _row_jitter(pid_bh * LQ + offs_m, jitter)  # rows (b·H + h)·LQ + i, as in attention.stable
    r = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m = tl.zeros([BLOCK_M], tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    count = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(0, LK, BLOCK_N):
        offs_n = start + offs_j
        kt = _tile_t(k_ptr, offs_n, offs_d, skn, LK, D)
        s = _logits(q, kt, Mask, mask_base, offs_m, offs_n, smm, smn, LQ, LK, qk_scale, HAS_MASK, IEEE, EVEN_N)
        r_new = tl.maximum(r, tl.max(s, 1))
        live = r_new > float("-inf")
        r_safe = tl.where(live, r_new, 0.0)
        if SHIFT:  # count of logits within tau of the running max (ties and near-ties)
            near = tl.sum((s >= (r_new - tau2)[:, None]).to(tl.int32), 1)
            count = tl.where(r >= r_new - tau2, count, 0) + near
            m_new = _shifted_offset(r_safe, live & (count > 1), row_jit, beta, shift_max)
        else:
            m_new = r_safe
        p = tl.exp2(s - m_new[:, None])
        # m_new >= r_new >= r and m <= r + 60·log2 e: the factor is at most 2^87, no overflow.
        alpha = tl.where(l > 0, tl.exp2(m - m_new), 0.0)
        l = l * alpha + tl.sum(p, 1)
        v = _tile(v_ptr, offs_n, offs_dv, svn, LK, DV)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        r, m = r_new, m_new
    alive = l > 0
    l_safe = tl.where(alive, l, 1.0)
    out = acc / l_safe[:, None]
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < LQ) & (offs_dv[None, :] < DV))
    tl.store(Lse + pid_bh * LQ + offs_m, tl.where(alive, m + tl.log2(l_safe), float("-inf")), mask=offs_m < LQ)


@triton.jit
def _bwd_delta_kernel(Out, dOut, Delta, sob, soh, som, sdb, sdh, sdm, H, LQ, DV,
                      BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Delta = rowsum(dO ∘ O) in fp32, (B·H, LQ)."""
    pid_m, pid_bh, b, h = _program(H)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o = _tile(Out + b * sob + h * soh, offs_m, offs_dv, som, LQ, DV)
    do = _tile(dOut + b * sdb + h * sdh, offs_m, offs_dv, sdm, LQ, DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh * LQ + offs_m, delta, mask=offs_m < LQ)


@triton.jit
def _row_stats(Lse, Delta, pid_bh, offs_m, LQ):
    """Base-2 LSE (0 where -inf: those rows' logits are all -inf, so P stays 0) and Delta of rows."""
    lse = tl.load(Lse + pid_bh * LQ + offs_m, mask=offs_m < LQ, other=0.0)
    delta = tl.load(Delta + pid_bh * LQ + offs_m, mask=offs_m < LQ, other=0.0)
    return tl.where(lse == float("-inf"), 0.0, lse), delta


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, Mask, dOut, Lse, Delta, dK, dV,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, smh, smm, smn, sdb, sdh, sdm,
                     sgkb, sgkh, sgkn, sgvb, sgvh, sgvn,
                     H, LQ, LK, D, DV, qk_scale, sm_scale,
                     HAS_MASK: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """dK, dV of one key block, looping over query blocks; P = exp2(s₂ − Lse) recomputed (transposed)."""
    pid_n, pid_bh, b, h = _program(H)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d, offs_dv, offs_i = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_M)
    k = _tile(K + b * skb + h * skh, offs_n, offs_d, skn, LK, D)
    v = _tile(V + b * svb + h * svh, offs_n, offs_dv, svn, LK, DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    q_ptr, do_ptr, mask_base = Q + b * sqb + h * sqh, dOut + b * sdb + h * sdh, b * smb + h * smh
    for start in range(0, LQ, BLOCK_M):
        offs_m = start + offs_i
        qt = _tile_t(q_ptr, offs_m, offs_d, sqm, LQ, D)
        st = _dot(k, qt, IEEE) * qk_scale
        inside = (offs_n[:, None] < LK) & (offs_m[None, :] < LQ)
        if HAS_MASK:
            st += tl.load(Mask + mask_base + offs_m[None, :] * smm + offs_n[:, None] * smn,
                          mask=inside, other=0.0) * LOG2E
        lse, delta = _row_stats(Lse, Delta, pid_bh, offs_m, LQ)
        pt = tl.where(inside, tl.exp2(st - lse[None, :]), 0.0)
        do = _tile(do_ptr, offs_m, offs_dv, sdm, LQ, DV)
        dv += _dot(pt.to(do.dtype), do, IEEE)
        dst = pt * (_dot(v, tl.trans(do), IEEE) - delta[None, :])
        dk += _dot(dst.to(qt.dtype), tl.trans(qt), IEEE)
    tl.store(dK + b * sgkb + h * sgkh + offs_n[:, None] * sgkn + offs_d[None, :],
             (dk * sm_scale).to(dK.dtype.element_ty),
             mask=(offs_n[:, None] < LK) & (offs_d[None, :] < D))
    tl.store(dV + b * sgvb + h * sgvh + offs_n[:, None] * sgvn + offs_dv[None, :], dv.to(dV.dtype.element_ty),
             mask=(offs_n[:, None] < LK) & (offs_dv[None, :] < DV))


@triton.jit
def _bwd_dq_kernel(Q, K, V, Mask, dOut, Lse, Delta, dQ,
                   sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, smh, smm, smn, sdb, sdh, sdm,
                   sgqb, sgqh, sgqm,
                   H, LQ, LK, D, DV, qk_scale, sm_scale,
                   HAS_MASK: tl.constexpr, IEEE: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """dQ of one query block, looping over key blocks."""
    pid_m, pid_bh, b, h = _program(H)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, offs_dv, offs_j = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    q = _tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqm, LQ, D)
    do = _tile(dOut + b * sdb + h * sdh, offs_m, offs_dv, sdm, LQ, DV)
    lse, delta = _row_stats(Lse, Delta, pid_bh, offs_m, LQ)
    k_ptr, v_ptr, mask_base = K + b * skb + h * skh, V + b * svb + h * svh, b * smb + h * smh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, LK, BLOCK_N):
        offs_n = start + offs_j
        kt = _tile_t(k_ptr, offs_n, offs_d, skn, LK, D)
        vt = _tile_t(v_ptr, offs_n, offs_dv, svn, LK, DV)
        s = _logits(q, kt, Mask, mask_base, offs_m, offs_n, smm, smn, LQ, LK, qk_scale, HAS_MASK, IEEE, EVEN_N)
        p = tl.where(offs_m[:, None] < LQ, tl.exp2(s - lse[:, None]), 0.0)
        ds = p * (_dot(do, vt, IEEE) - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), IEEE)
    tl.store(dQ + b * sgqb + h * sgqh + offs_m[:, None] * sgqm + offs_d[None, :],
             (dq * sm_scale).to(dQ.dtype.element_ty),
             mask=(offs_m[:, None] < LQ) & (offs_d[None, :] < D))


@triton.jit
def _shift_probe_kernel(R, Rows, Out, N, beta, jitter, shift_max, BLOCK: tl.constexpr):
    """Out = m₂ − r₂ (base 2) for tied rows with maxima R (natural units): the kernel's Δ·log2 e,
    so tests can compare it with ``attention.stable.row_shift``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r2 = tl.load(R + offs, mask=offs < N, other=0.0) * LOG2E
    rows = tl.load(Rows + offs, mask=offs < N, other=0)
    tied = tl.full([BLOCK], 1, tl.int1)
    tl.store(Out + offs, _shifted_offset(r2, tied, _row_jitter(rows, jitter), beta, shift_max) - r2, mask=offs < N)
