"""Masked loss: what of each sample trains (Train Settings' ``unmasked_weight``, a mask per sample).

A sample's mask is a pixel mask (ComfyUI's MASK: 1 = train here, 0 = not) brought to the latent grid by
``to_grid``: the share of masked pixels under each latent cell (area average), so a cell half covered weighs half.
The loss of a masked sample weighs each latent cell by ``unmasked_weight + (1 - unmasked_weight) * mask``
(``cell_weights``) and is normalised by the sum of those weights (``training.sampling.weighted_mse``): the loss stays
on the scale of the unmasked loss, and at ``unmasked_weight`` 0 the prediction outside the mask has no gradient at
all. The model still sees the whole latent (attention mixes the cells), so the LoRA can still depend on what is
outside the mask through what the model reads there; what it is trained to reproduce is the masked region only.
Pure torch, no ComfyUI.

``OUTSIDE_KEY``: the LATENT key under which Cached Training Dataset says which colour it gave the pixels where the
mask is 0 before encoding (its ``outside_mask``); Train LoRA reports it and refuses it with ``unmasked_weight`` above
0, which would train that flat colour.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

OUTSIDE_KEY = "precision_outside_mask"


def to_grid(mask: torch.Tensor, latent_shape: Sequence[int]) -> torch.Tensor:
    """``mask`` (H, W) in [0, 1] as weights on the grid of a latent of ``latent_shape`` (C, h, w) or (C, T, h, w):
    a (1, h, w) or (1, 1, h, w) tensor, the share of masked pixels under each cell. ValueError when the mask's
    aspect is not the latent's (one latent cell of slack: a mask for another image)."""
    if mask.ndim != 2:
        raise ValueError(f"a mask is one (H, W) image per sample; got shape {tuple(mask.shape)}")
    if len(latent_shape) not in (3, 4):
        raise ValueError(f"a latent of shape {tuple(latent_shape)} has no image grid (C, H, W) or (C, T, H, W) "
                         "to put a mask on")
    (big_h, big_w), (h, w) = mask.shape, latent_shape[-2:]
    scale = big_w / w
    if abs(big_h - scale * h) > max(scale, 1.0):
        raise ValueError(f"a {big_w}x{big_h} mask does not match a {w}x{h} latent (an image of about "
                         f"{round(scale * w)}x{round(scale * h)} px): give each sample the mask of its own image, "
                         "at the image's size")
    m = mask.detach().float().clamp(0, 1)[None, None]
    grid = F.interpolate(m, size=(h, w), mode="area")[0]
    return grid if len(latent_shape) == 3 else grid[:, None]


def cell_weights(masks: Sequence[torch.Tensor | None], unmasked_weight: float,
                 like: torch.Tensor) -> torch.Tensor | None:
    """The loss weight of each latent cell of a batch ``like`` (b, C, ...) whose samples have ``masks`` (grid
    masks from ``to_grid`` or None: every cell weighs 1); None when no sample has a mask (the plain loss)."""
    if all(m is None for m in masks):
        return None
    ones = torch.ones((1, *like.shape[2:]), dtype=torch.float32, device=like.device)
    return torch.stack([ones if m is None else
                        unmasked_weight + (1.0 - unmasked_weight) * m.to(like.device, torch.float32)
                        for m in masks])


def coverage(mask: torch.Tensor) -> float:
    """The share of the latent a grid mask trains on (its mean)."""
    return float(mask.float().mean())
