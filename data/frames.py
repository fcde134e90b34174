"""Frame counts video VAEs encode, and the clip lengths that fit them (docs/video.md). No ComfyUI imports.

ComfyUI's causal video VAEs encode the first frame alone and every later group of ``step`` frames to one
latent frame, so a clip must have ``step * k + 1`` frames: Wan 2.1 / 2.2 and HunyuanVideo 4k+1, LTXV 8k+1,
Mochi 6k+1 (the VAE's ``downscale_index_formula[0]``). A clip of another length is not refused by ComfyUI's
VAE Encode: it encodes the frames up to the last valid count and drops the rest without a word (0.33; LTXV
on 0.3.75 raises "Invalid number of frames"). 24k+1 (1, 25, 49, 73, 97...) fits all three rules.
"""
from __future__ import annotations

from typing import Any

# frame_rule choice -> step (frames per latent frame after the first)
FRAME_RULES = {"4k+1 (Wan, HunyuanVideo)": 4, "8k+1 (LTXV)": 8, "6k+1 (Mochi)": 6,
               "24k+1 (all video families)": 24, "any count": 1}

# module of a VAE's autoencoder class -> the family users know it by
_VAE_FAMILIES = (("comfy.ldm.wan.vae2_2", "Wan 2.2"), ("comfy.ldm.wan.vae", "Wan 2.1"),
                 ("comfy.ldm.lightricks", "LTXV"), ("comfy.ldm.genmo", "Mochi"),
                 ("comfy.ldm.hunyuan_video", "HunyuanVideo 1.5"), ("comfy.ldm.cosmos", "Cosmos"),
                 ("comfy.ldm.cogvideo", "CogVideoX"), ("comfy.ldm.models.autoencoder", "HunyuanVideo"),
                 ("comfy.taesd", "TAE video"))


def fit_count(frames: int, step: int, max_frames: int) -> int:
    """The largest count <= min(frames, max_frames) of the form step*k+1 (0 when frames is 0)."""
    top = min(frames, max_frames)
    return 0 if top < 1 else top - (top - 1) % max(1, step)


def counts(step: int, n: int = 4) -> str:
    """``"1, 5, 9, 13, ..."`` for step 4."""
    return ", ".join(str(step * k + 1) for k in range(n)) + ", ..."


def vae_family(vae: Any) -> str:
    module = type(getattr(vae, "first_stage_model", None)).__module__
    for prefix, name in _VAE_FAMILIES:
        if module.startswith(prefix):
            return name
    return type(getattr(vae, "first_stage_model", None)).__name__


def vae_frame_step(vae: Any) -> int | None:
    """Frames per latent frame of a video VAE (4 Wan / HunyuanVideo, 8 LTXV, 6 Mochi), or None for a VAE that
    encodes each image on its own (image VAEs, and 3-D VAEs ComfyUI runs frame by frame)."""
    if getattr(vae, "latent_dim", 2) != 3 or getattr(vae, "not_video", False):
        return None
    formula = getattr(vae, "downscale_index_formula", None)
    try:
        step = int(formula[0])
    except (TypeError, IndexError, ValueError):
        return None
    return step if step > 1 else None


def rule_name(step: int) -> str:
    for name, s in FRAME_RULES.items():
        if s == step:
            return name
    return f"{step}k+1"


def frames_problem(vae: Any, frames: int) -> str | None:
    """Why a clip of ``frames`` frames does not fit ``vae`` (``"<what>; <fix>"``), or None."""
    step = vae_frame_step(vae)
    if step is None or (frames - 1) % step == 0:
        return None
    fits = fit_count(frames, step, frames)
    return (f"has {frames} frames, but {vae_family(vae)}'s VAE encodes {step}k+1 frames ({counts(step)}): VAE "
            f"Encode would drop the last {frames - fits}; trim the clip to {fits} frames (Precision Load Video "
            f"Dataset's frame_rule '{rule_name(step)}' does, or ImageFromBatch with length {fits})")
