"""Checks of LATENT and CONDITIONING inputs against the model they are used with (train and probe).

A latent or a conditioning made for another model used to reach the forward and fail there with torch's
own words ("mat1 and mat2 shapes cannot be multiplied", "too many values to unpack": issue 13, D7). These
return a phrase ``"<what is wrong>; <fix>"`` (or None) that the node prefixes with its name and input.
"""
from __future__ import annotations

from typing import Any

import torch

from .model_info import describe_model

# Families whose text-conditioning width the unet config states (others are not checked here).
_CONTEXT_KEYS = {"flux": "context_in_dim", "flux2": "context_in_dim", "chroma": "context_in_dim",
                 "cosmos_predict2": "crossattn_emb_channels"}
_POOLED_KEYS = {"flux": "vec_in_dim", "chroma": "vec_in_dim"}


def latent_problem(model: Any, samples: Any) -> str | None:
    """Why ``samples`` (a LATENT's tensor) does not fit ``model``'s latent space, or None."""
    fmt = model.model.latent_format
    want_ndim = 2 + getattr(fmt, "latent_dimensions", 2)
    channels = fmt.latent_channels
    if not isinstance(samples, torch.Tensor):
        return "is not a LATENT with a 'samples' tensor; connect a LATENT (VAE Encode or PrecisionDemoLatent)"
    if samples.ndim != want_ndim or samples.shape[1] != channels:
        layout = "(B, C, T, H, W)" if want_ndim == 5 else "(B, C, H, W)"
        return (f"has shape {tuple(samples.shape)} but this model ({describe_model(model).family}) expects {layout} "
                f"with C={channels}; encode the images with this model's VAE")
    if samples.is_floating_point() and not bool(torch.isfinite(samples).all()):
        return "holds NaN/inf; encode the images again (check the VAE and its dtype)"
    return None


def _width(model: Any, keys: dict[str, str]) -> int | None:
    cfg = model.model.model_config.unet_config
    key = keys.get(cfg.get("image_model"))
    value = cfg.get(key) if key else None
    return int(value) if value else None


def conditioning_problem(model: Any, cond: Any) -> str | None:
    """Why ``cond`` (one CONDITIONING) cannot condition ``model``, or None."""
    if not isinstance(cond, list) or not cond or not isinstance(cond[0], (list, tuple)) or len(cond[0]) < 2 \
            or not isinstance(cond[0][0], torch.Tensor) or not isinstance(cond[0][1], dict):
        return "is not a CONDITIONING; connect a text encoder's output (or PrecisionDemoConditioning)"
    ctx, extra = cond[0][0], cond[0][1]
    family = describe_model(model).family
    width = _width(model, _CONTEXT_KEYS)
    if ctx.ndim != 3 or (width is not None and ctx.shape[-1] != width):
        expected = f"(B, tokens, {width})" if width else "(B, tokens, width)"
        return (f"has context shape {tuple(ctx.shape)} but this model ({family}) expects {expected}: it was "
                "encoded for another model; connect conditioning from this model's text encoder")
    pooled, want = extra.get("pooled_output"), _width(model, _POOLED_KEYS)
    if want is not None and isinstance(pooled, torch.Tensor) and pooled.shape[-1] != want:
        return (f"has pooled_output shape {tuple(pooled.shape)} but this model ({family}) expects width {want}: "
                "it was encoded for another model; connect conditioning from this model's text encoder")
    if ctx.is_floating_point() and not bool(torch.isfinite(ctx).all()):
        return "holds NaN/inf; encode the prompt again (check the text encoder and its dtype)"
    return None
