"""Checks of LATENT and CONDITIONING inputs against the model they are used with (train and probe).

A latent or a conditioning made for another model used to reach the forward and fail there with torch's
own words ("mat1 and mat2 shapes cannot be multiplied (154x768 and 64x64)", "too many values to unpack").
These return a phrase ``"<what is wrong>; <fix>"`` (or None) that the node prefixes with its name and input.
Widths are read from the loaded model (its unet config, or the module that takes the text), so a resized
or pruned model is checked against what it really takes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .info import describe_model

# Text width the unet config states, per family (others are read from modules or not checked).
_CONTEXT_KEYS = {"flux": "context_in_dim", "flux2": "context_in_dim", "chroma": "context_in_dim",
                 "cosmos_predict2": "crossattn_emb_channels", "minimax_h3": "text_dim"}
_POOLED_KEYS = {"flux": "vec_in_dim", "chroma": "vec_in_dim"}

# The text encoder each family was trained with, as the user loads it in ComfyUI.
ENCODERS = {
    "flux1": "Flux.1 needs CLIP-L + T5-XXL (DualCLIPLoader, type flux)",
    "flux2": ("Flux.2 needs its own text encoder (CLIPLoader, type flux2: Mistral-Small-3 for Flux.2 dev, Qwen3-4B "
              "for Flux.2 klein 4B, Qwen3-8B for klein 9B)"),
    "chroma": "Chroma needs T5-XXL (CLIPLoader, type chroma)",
    "cosmos_predict2": "Cosmos-Predict2 needs the old T5-XXL (CLIPLoader, type cosmos)",
    "anima": "Anima needs Qwen3 0.6B (CLIPLoader with the Qwen3-0.6B file)",
    "MiniMaxH3": "MiniMax H3 needs its Qwen3-VL-32B text encoder (CLIPLoader, type minimax)",
}


def _packs_to(fmt: Any, samples: torch.Tensor, channels: int) -> bool:
    """Whether the format's ``process_in`` maps a latent of these channels to the model's (HunyuanImage 2.1's
    refiner: its VAE gives 32 channels, packed two frames into 64), tried on a 1x1 zero latent."""
    probe = torch.zeros((1, samples.shape[1], *([1] * (samples.ndim - 2))))
    try:
        return fmt.process_in(probe).shape[1] == channels
    except Exception:  # a format whose process_in needs other shapes: not a packing format
        return False


@dataclass(frozen=True)
class AudioVideoParts:
    """What an audio-video model's packed LATENT holds: the video part's channels, the audio part's fixed axes
    (axis -> size; the others are time), its layout as the error names it, and how to make such a LATENT."""

    video_channels: int
    audio_axes: dict[int, int]
    audio_layout: str
    concat: str
    audio_fix: str
    video_fix: str = "encode the images with this model's VAE"


_CONCAT = ("connect LTXVConcatAVLatent (video_latent from this model's video VAE, audio_latent from its audio VAE "
           "encode or LTXVEmptyLatentAudio)")
# MiniMax H3 (ComfyUI 0.33+): video (B, 24, T, H, W), audio (B, 32, 2, T) with time last (stereo, 40 latent frames a
# second); EmptyMiniMaxH3LatentAV makes an empty one, LTXVConcatAVLatent joins encoded parts for any AV model.
_MINIMAX_CONCAT = ("connect LTXVConcatAVLatent (video_latent from MiniMax H3's video VAE, 24 channels; audio_latent "
                   "from its audio VAE, (B, 32, 2, frames)); EmptyMiniMaxH3LatentAV shows the layout")


def audio_video_parts(model: Any) -> AudioVideoParts | None:
    """The packed LATENT ``model`` samples when it is an audio-video model (LTX-2's LTXAV: a video latent and an
    audio latent (B, 8, frames, 16) in one LATENT, as LTXVConcatAVLatent makes it; MiniMax H3: video 24 channels
    and audio (B, 32, 2, frames)), else None."""
    import comfy.model_base

    dm = model.model.diffusion_model
    ltxav = getattr(comfy.model_base, "LTXAV", None)
    if ltxav is not None and isinstance(model.model, ltxav):
        channels, bins = int(dm.num_audio_channels), int(dm.audio_frequency_bins)
        return AudioVideoParts(
            int(model.model.latent_format.latent_channels), {1: channels, 3: bins}, f"(B, {channels}, frames, {bins})",
            _CONCAT, "encode the audio with this model's audio VAE (LTXVAudioVAEEncode) or use LTXVEmptyLatentAudio")
    if is_minimax_h3(model):
        return AudioVideoParts(
            int(dm.latents_dim), {1: int(dm.audio_latents_dim), 2: 2}, f"(B, {int(dm.audio_latents_dim)}, 2, frames)",
            _MINIMAX_CONCAT, "encode the audio with MiniMax H3's audio VAE (stereo: 2 channels, time last)",
            "encode the video with MiniMax H3's video VAE (24 channels)")
    return None


def is_minimax_h3(model: Any) -> bool:
    """Whether ``model`` is MiniMax H3 (ComfyUI 0.33+; 0.3.75 has no such class)."""
    import comfy.model_base

    cls = getattr(comfy.model_base, "MiniMaxH3", None)
    return cls is not None and isinstance(getattr(model, "model", None), cls)


def is_packed(samples: Any) -> bool:
    """Whether a LATENT's 'samples' is ComfyUI's NestedTensor (several latents packed: video + audio)."""
    return not isinstance(samples, torch.Tensor) and bool(getattr(samples, "is_nested", False))


def _packed_problem(model: Any, samples: Any, av: AudioVideoParts | None) -> str | None:
    parts = list(samples.unbind())
    shapes = ", ".join(str(tuple(t.shape)) for t in parts)
    family = describe_model(model).family
    if av is None:
        return (f"is an audio-video LATENT (parts {shapes}) but this model ({family}) takes one latent tensor; "
                "connect the video part (LTXVSeparateAVLatent's video_latent); the audio-video models the pack trains "
                "on such a LATENT are LTX-2 (LTXAV) and MiniMax H3")
    if len(parts) != 2 or not all(isinstance(t, torch.Tensor) for t in parts):
        return f"is a packed LATENT of {len(parts)} parts ({shapes}) but this model ({family}) takes video + audio; {av.concat}"
    video, audio = parts
    problem = latent_problem(model, video, _plain=True, _channels=av.video_channels, _fix=av.video_fix)
    if problem is not None:
        return f"has a video part that {problem}"
    if audio.ndim != 4 or any(audio.shape[axis] != size for axis, size in av.audio_axes.items()) \
            or audio.shape[0] != video.shape[0]:
        return (f"has an audio part of shape {tuple(audio.shape)} but this model ({family}) expects "
                f"{av.audio_layout} with the video's batch {video.shape[0]}; {av.audio_fix}")
    if audio.is_floating_point() and not bool(torch.isfinite(audio).all()):
        return "has an audio part that holds NaN/inf; encode the audio again (check the audio VAE and its dtype)"
    return None


def latent_problem(model: Any, samples: Any, _plain: bool = False, _channels: int | None = None,
                   _fix: str = "encode the images with this model's VAE") -> str | None:
    """Why ``samples`` (a LATENT's tensor, or a packed audio-video NestedTensor) does not fit ``model``'s latent
    space, or None. ``_channels`` / ``_fix``: a packed latent's video part (its channels, what to encode it with)."""
    av = None if _plain else audio_video_parts(model)
    if is_packed(samples):
        return _packed_problem(model, samples, av)
    if av is not None and isinstance(samples, torch.Tensor):
        return (f"is a plain latent of shape {tuple(samples.shape)} but this model ({describe_model(model).family}) "
                f"is an audio-video model that trains on its video and audio latents packed together; {av.concat}")
    fmt = model.model.latent_format
    want_ndim = 2 + getattr(fmt, "latent_dimensions", 2)
    channels = fmt.latent_channels if _channels is None else _channels
    if not isinstance(samples, torch.Tensor):
        return "is not a LATENT with a 'samples' tensor; connect a LATENT (VAE Encode or PrecisionDemoLatent)"
    if samples.ndim != want_ndim or (samples.shape[1] != channels and not _packs_to(fmt, samples, channels)):
        layout = "(B, C, T, H, W)" if want_ndim == 5 else "(B, C, H, W)"
        return (f"has shape {tuple(samples.shape)} but this model ({describe_model(model).family}) expects {layout} "
                f"with C={channels}; {_fix}")
    if samples.is_floating_point() and not bool(torch.isfinite(samples).all()):
        return "holds NaN/inf; encode the images again (check the VAE and its dtype)"
    return None


def _config_width(model: Any, keys: dict[str, str]) -> int | None:
    cfg = model.model.model_config.unet_config
    key = keys.get(cfg.get("image_model"))
    value = cfg.get(key) if key else None
    return int(value) if value else None


def context_width(model: Any) -> int | None:
    """Width of the text conditioning ``model`` takes, or None where it is not known."""
    width = _config_width(model, _CONTEXT_KEYS)
    if width is not None:
        return width
    adapter = getattr(model.model.diffusion_model, "llm_adapter", None)  # Anima: its adapter reads the text
    try:
        return int(adapter.blocks[0].cross_attn.k_proj.weight.shape[1])
    except (AttributeError, IndexError, TypeError):
        return None


def _needs(family: str) -> str:
    encoder = ENCODERS.get(family)
    return f"; {encoder}" if encoder else ""


def conditioning_problem(model: Any, cond: Any) -> str | None:
    """Why ``cond`` (one CONDITIONING, every entry) cannot condition ``model``, or None."""
    if not isinstance(cond, list) or not cond:
        return "is not a CONDITIONING; connect a text encoder's output (or PrecisionDemoConditioning)"
    for entry in cond:
        if not isinstance(entry, (list, tuple)) or len(entry) < 2 or not isinstance(entry[0], torch.Tensor) \
                or not isinstance(entry[1], dict):
            return "is not a CONDITIONING; connect a text encoder's output (or PrecisionDemoConditioning)"
    for ctx, extra in (entry[:2] for entry in cond):
        problem = _entry_problem(model, ctx, extra)
        if problem is not None:
            return problem
    return None


def _entry_problem(model: Any, ctx: torch.Tensor, extra: dict) -> str | None:
    family = describe_model(model).family
    width = context_width(model)
    if ctx.ndim != 3 or (width is not None and ctx.shape[-1] != width):
        expected = f"(B, tokens, {width})" if width else "(B, tokens, width)"
        got = f"got width {ctx.shape[-1]}" if ctx.ndim == 3 else f"got {ctx.ndim} dimensions"
        return (f"has context shape {tuple(ctx.shape)} but this model ({family}) expects {expected}: it was encoded "
                f"for another model; connect conditioning from this model's text encoder (expected width "
                f"{width if width else 'of this model'}, {got}){_needs(family)}")
    pooled, want = extra.get("pooled_output"), _config_width(model, _POOLED_KEYS)
    if want is not None and family == "flux1" and not isinstance(pooled, torch.Tensor):
        return (f"has no pooled_output, which this model ({family}) reads (width {want}, from CLIP-L): it was "
                f"encoded for another model; connect conditioning from this model's text encoder{_needs(family)}")
    if want is not None and isinstance(pooled, torch.Tensor) and pooled.shape[-1] != want:
        return (f"has pooled_output shape {tuple(pooled.shape)} but this model ({family}) expects width {want}: "
                f"it was encoded for another model; connect conditioning from this model's text encoder "
                f"(expected width {want}, got width {pooled.shape[-1]}){_needs(family)}")
    if ctx.is_floating_point() and not bool(torch.isfinite(ctx).all()):
        return "holds NaN/inf; encode the prompt again (check the text encoder and its dtype)"
    return None
