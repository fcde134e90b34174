"""A tiny MiniMax H3 (ComfyUI 0.33+), built at test time from ComfyUI's own class, with its packed latent and
conditioning (for tests/comfy/test_minimax_h3_training.py, and for tests/families.py to import).

MiniMax H3 denoises a video latent (B, 24, T, H, W) and a stereo audio latent (B, 32, 2, frames) (time last) in
one packed sequence [text | audio | video]; ComfyUI samples them as one LATENT (a NestedTensor, made by
EmptyMiniMaxH3LatentAV or LTXVConcatAVLatent). Its text is Qwen3-VL's hidden states (text_dim wide), which a
projection and a small token refiner turn into the model's width, and the per-token modality tags the text
encoder gives (``minimax_token_tags``: 1 for text tokens).

``build(seed)`` returns a ModelPatcher with seeded fp32 weights (64 wide, 2 blocks, 1 refiner block, head_dim 32 of
which 24 are rotated); ``latent(model, seed)`` a packed latent of 2 video frames of 4 x 4 (64 px) and the 8 audio
frames EmptyMiniMaxH3LatentAV gives 5 video frames; ``conditioning(seed)`` a text-only prompt of 8 tokens.
Its tiny config, text width and latent shapes are tests/families.py's MiniMaxH3 entries (TINY, CONTEXT, EXTRAS,
PACKED), where it is a row of the family table; ``families.build`` fills its rotary buffer with ``fill_buffers``.
"""
from __future__ import annotations

import torch

import families

NAME = "MiniMaxH3"
TEXT_DIM, TOKENS = families.CONTEXT[NAME][0], 8
TINY = families.TINY[NAME]  # 64 wide, 2 blocks, 1 refiner block, 2 heads of 32
# video (1, 24, latent frames, h, w) and audio (1, 32, 2, frames), as EmptyMiniMaxH3LatentAV(64, 64, 5) shapes them
VIDEO, AUDIO = families.PACKED[NAME]
N_VIDEO = 24 * 2 * 4 * 4  # the video part's elements in a packed row (then the audio part's 32 * 2 * 8)


def available() -> str | None:
    """Why this ComfyUI cannot build MiniMax H3 (0.3.75 has no such class), or None."""
    import comfy.supported_models as sm
    import comfyui_version

    return None if hasattr(sm, NAME) else f"ComfyUI {comfyui_version.__version__} has no MiniMaxH3 model class"


def built_or_skip():
    """The tiny model for a test module's fixture; the test is skipped, with the reason, where ComfyUI lacks it."""
    import pytest

    reason = available()
    if reason is not None:
        pytest.skip(reason)
    return build()


def av(seed: int = 0) -> dict:
    """A LATENT dict around the packed latent."""
    return {"samples": latent(seed=seed)}


def build(seed: int = 0, dtype: torch.dtype = torch.float32):
    """ComfyUI's MiniMaxH3 at the tiny config, fp32 (or ``dtype``: the released bf16, whose patch projections and
    output heads ComfyUI keeps in fp32), CPU, its rotary frequencies filled (``fill_buffers``)."""
    import comfy.model_patcher
    import comfy.supported_models as sm

    config = sm.MiniMaxH3({**sm.MiniMaxH3.unet_config, **TINY})
    config.unet_config.update(TINY)
    config.set_inference_dtype(dtype, None)
    with torch.inference_mode(False):
        model = config.get_model({}, "")
        families._fill(model.diffusion_model, seed)
        fill_buffers(model.diffusion_model)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def fill_buffers(diffusion_model: torch.nn.Module) -> None:
    """The rotary frequencies, a buffer ComfyUI loads from the file (``torch.empty`` until then): 1 / 10000^(i/n)."""
    with torch.no_grad():
        inv = diffusion_model.rope.inv_freq
        inv.copy_(1.0 / 10000.0 ** (torch.arange(inv.shape[0], dtype=torch.float32) / inv.shape[0]))


def parts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VIDEO, generator=gen), torch.randn(AUDIO, generator=gen)


def latent(model=None, seed: int = 0):
    """The packed audio-video latent (a NestedTensor: video, audio), joined by ComfyUI's own LTXVConcatAVLatent
    (which ComfyUI documents for any AV model, MiniMax H3 included). ``model``: unused (families' signature)."""
    from comfy_extras.nodes_lt import LTXVConcatAVLatent

    video, audio = parts(seed)
    return LTXVConcatAVLatent.execute({"samples": video}, {"samples": audio}).args[0]["samples"]


def conditioning(seed: int = 0, training: bool = False, tokens: int = TOKENS) -> list:
    """What ComfyUI's MiniMax H3 text encoder gives for a text-only prompt: hidden states (1, tokens, text_dim) and
    the modality tags (1 = text) in the conditioning's extras. ``training``: the same (families' signature)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [[torch.randn((1, tokens, TEXT_DIM), generator=gen),
             {"minimax_token_tags": torch.ones(tokens, dtype=torch.long)}]]


def denoise(model, seed: int = 0):
    """One euler step (cfg 1: one forward) through ComfyUI's sampler on the packed latent (a NestedTensor back)."""
    import comfy.sample

    x, cond = latent(model, seed), conditioning(seed)
    noise = comfy.sample.prepare_noise(x, seed)
    return comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, x, disable_pbar=True, seed=seed)
