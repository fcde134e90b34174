"""Layouts, masks and the logits formula shared by every backend and by the statistics.

Layouts: ``"bhld"`` = (B, H, L, D), ``"blhd"`` = (B, L, H, D). Masks follow ComfyUI's pytorch backend
(and SDPA): a 2-D mask is (Lq, Lk), a 3-D mask (B, Lq, Lk), a 4-D mask (B, H, Lq, Lk); any size-1 dim
broadcasts. Boolean masks: True = the key takes part. Float masks are added to the logits.
"""
from __future__ import annotations

import torch

LAYOUTS = ("bhld", "blhd")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {', '.join(LAYOUTS)}")


def to_bhld(x: torch.Tensor, layout: str) -> torch.Tensor:
    """View ``x`` (4-D, in ``layout``) as (B, H, L, D); no copy."""
    check_layout(layout)
    if x.ndim != 4:
        raise ValueError(f"attention inputs must be 4-D ({layout}), got shape {tuple(x.shape)}")
    return x if layout == "bhld" else x.transpose(1, 2)


def from_bhld(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of ``to_bhld``: (B, H, L, D) viewed in ``layout``."""
    check_layout(layout)
    return x if layout == "bhld" else x.transpose(1, 2)


def expand_heads(kv: torch.Tensor, q: torch.Tensor, layout: str) -> torch.Tensor:
    """k or v (4-D, ``layout``) with its heads repeated to q's head count: grouped-query attention, where
    each k/v head serves several query heads. A no-op without it."""
    axis = 1 if layout == "bhld" else 2
    groups = q.shape[axis] // kv.shape[axis]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=axis)


def prepare_mask(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """A 4-D mask broadcastable to (B, H, Lq, Lk) for q (B, H, Lq, D) and k (B, H, Lk, D).

    Keeps the mask's kind (bool or float). Raises ValueError when it cannot broadcast.
    """
    if mask is None:
        return None
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    m = mask
    if m.ndim == 2:
        m = m[None, None]
    elif m.ndim == 3:
        m = m[:, None]
    elif m.ndim != 4:
        raise ValueError(f"attention mask must be 2-D, 3-D or 4-D, got shape {tuple(mask.shape)}")
    target = (b, h, lq, lk)
    for have, want in zip(m.shape, target):
        if have not in (1, want):
            raise ValueError(
                f"attention mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Lq, Lk) = {target}"
            )
    return m


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float mask in ``dtype`` to add to logits (bool False -> -inf)."""
    if mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, torch.tensor(float("-inf"), dtype=dtype, device=mask.device))
    return mask.to(dtype)


def dead_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """(…, Lq, 1) bool: rows in which every key is masked out (None when no row is, or no mask)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        dead = ~mask.any(dim=-1, keepdim=True)
    else:
        dead = torch.isneginf(mask).all(dim=-1, keepdim=True)
    return dead if bool(dead.any()) else None


def unmask_dead_rows(mask: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """The mask with fully-masked rows opened (so kernels stay finite); their output is zeroed after."""
    if mask.dtype == torch.bool:
        return mask | dead
    return torch.where(dead, torch.zeros((), dtype=mask.dtype, device=mask.device), mask)


def finish_logits(s: torch.Tensor, softclamp: float, mask: torch.Tensor | None) -> torch.Tensor:
    """The logits from the scaled products s = q·kᵀ·scale: softclamp c·tanh(s/c) when c > 0, then the
    additive ``mask`` (broadcastable to s). Works in place on s unless autograd records s (the math
    backend), so the tiled loops allocate no second block."""
    if s.requires_grad:
        if softclamp > 0:
            s = softclamp * torch.tanh(s / softclamp)
        return s if mask is None else s + mask
    if softclamp > 0:
        s = torch.tanh(s.div_(softclamp)).mul_(softclamp)
    return s if mask is None else s.add_(mask)
