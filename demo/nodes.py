"""Demo data nodes: latents and conditioning of the right shapes without a VAE or text encoder.

They let the example workflows and the tests run on tiny models on any machine. Conditioning is a seeded
function of the prompt text, so different prompts (e.g. a trigger word vs a class word for DOP) give
different, repeatable conditioning. Replace them with real encoders for real training.
"""
from __future__ import annotations

import hashlib

import torch

from ..nodes.checks.gate import PrecisionNode
from ..nodes.host.comfy_io import io


def _seed_for(text: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def conditioning_shape(model) -> tuple[int, int | None]:
    """(context width, pooled width or None) the model's cross-attention expects."""
    cfg = model.model.model_config.unet_config
    if cfg.get("image_model") in ("flux", "flux2", "chroma"):
        return int(cfg.get("context_in_dim", 4096)), cfg.get("vec_in_dim")
    if cfg.get("image_model") == "cosmos_predict2":
        return int(cfg.get("crossattn_emb_channels", 1024)), None
    if type(model.model).__name__ == "SDXL":  # its label input (adm) is built from CLIP-G's pooled output
        return int(cfg["context_dim"]), 1280
    width = cfg.get("context_dim") or cfg.get("text_emb_dim") or cfg.get("crossattn_emb_channels")
    if not width:
        raise ValueError(f"PrecisionDemoConditioning: no known context width for "
                         f"{type(model.model.model_config).__name__}; use a real text encoder")
    return int(width), cfg.get("adm_in_channels")


def make_conditioning(model, text: str, seed: int = 0, tokens: int = 8) -> list:
    """ComfyUI CONDITIONING ``[[context (1, tokens, width), {pooled_output, guidance}]]``."""
    width, pooled = conditioning_shape(model)
    gen = torch.Generator().manual_seed(_seed_for(text, seed))
    context = torch.randn((1, tokens, width), generator=gen)
    extra: dict = {"pooled_output": torch.randn((1, pooled), generator=gen) if pooled else None}
    if model.model.model_config.unet_config.get("guidance_embed"):
        extra["guidance"] = 3.5
    return [[context, extra]]


def latent_shape(model, width: int, height: int, batch: int) -> tuple[int, ...]:
    fmt = model.model.latent_format
    channels = fmt.latent_channels
    down = 16 if channels == 128 else 8  # Flux.2 latents are 2x2-patchified 32-channel VAE latents
    if width % down or height % down:
        raise ValueError(f"PrecisionDemoLatent: width/height {width}x{height} must be "
                         f"multiples of {down} for this model")
    spatial = (height // down, width // down)
    if fmt.latent_dimensions == 3:
        return (batch, channels, 1, *spatial)
    return (batch, channels, *spatial)


def make_latent(model, width: int = 64, height: int = 64, batch: int = 1, seed: int = 0) -> dict:
    """A LATENT dict with a seeded random 'image' latent of the model's shape (5-D for video-latent models)."""
    gen = torch.Generator().manual_seed(seed)
    samples = torch.randn(latent_shape(model, width, height, batch), generator=gen)
    return {"samples": samples}


class PrecisionDemoConditioning(PrecisionNode):
    NODE = "PrecisionDemoConditioning"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PrecisionDemoConditioning",
            display_name="Demo Conditioning (no text encoder)",
            category="precision_lora/demo",
            description="Seeded random conditioning with the shapes the model expects (context width, "
                        "pooled output). For tiny demo models and tests; use a real text encoder for real work.",
            inputs=[
                io.Model.Input("model", tooltip="Model whose conditioning shape to produce."),
                io.String.Input("text", default="a photo of sks", tooltip="Text; different texts give "
                                "different (repeatable) conditioning."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, step=1, tooltip="Seed."),
                io.Int.Input("tokens", default=8, min=1, max=512, step=1, tooltip="Sequence length."),
            ],
            outputs=[io.Conditioning.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, model, text: str, seed: int, tokens: int) -> io.NodeOutput:
        return io.NodeOutput(make_conditioning(model, text, seed, tokens))


class PrecisionDemoLatent(PrecisionNode):
    NODE = "PrecisionDemoLatent"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PrecisionDemoLatent",
            display_name="Demo Latent (no VAE)",
            category="precision_lora/demo",
            description="A seeded random image latent with the model's latent shape (channels, 5-D for "
                        "Cosmos/Anima). Stands in for VAE-encoded training images in demos and tests.",
            inputs=[
                io.Model.Input("model", tooltip="Model whose latent shape to produce."),
                io.Int.Input("width", default=64, min=16, max=4096, step=16, tooltip="Image width in pixels."),
                io.Int.Input("height", default=64, min=16, max=4096, step=16, tooltip="Image height in pixels."),
                io.Int.Input("batch_size", default=1, min=1, max=64, step=1, tooltip="Number of latents."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, step=1, tooltip="Seed."),
            ],
            outputs=[io.Latent.Output(display_name="latent")],
        )

    @classmethod
    def execute(cls, model, width: int, height: int, batch_size: int, seed: int) -> io.NodeOutput:
        return io.NodeOutput(make_latent(model, width, height, batch_size, seed))


def latent_to_preview(samples: torch.Tensor, upscale: int = 8) -> torch.Tensor:
    """IMAGE (B, H*upscale, W*upscale, 3) in [0, 1] from the first 3 latent channels (first frame if 5-D).

    Each image is min-max normalised on its own: a look at the latent's structure, not a decode.
    """
    x = samples.detach().float()
    if x.ndim == 5:
        x = x[:, :, 0]
    if x.ndim != 4:
        raise ValueError(f"PrecisionDemoPreview: expected a 4-D or 5-D latent, got shape {tuple(x.shape)}")
    if x.shape[1] < 3:
        x = x[:, :1].expand(-1, 3, -1, -1)
    x = x[:, :3]
    lo = x.amin(dim=(1, 2, 3), keepdim=True)
    hi = x.amax(dim=(1, 2, 3), keepdim=True)
    x = (x - lo) / (hi - lo).clamp_min(1e-12)
    x = torch.nn.functional.interpolate(x, scale_factor=upscale, mode="nearest")
    return x.movedim(1, -1).contiguous()


class PrecisionDemoPreview(PrecisionNode):
    NODE = "PrecisionDemoPreview"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PrecisionDemoPreview",
            display_name="Demo Latent Preview (no VAE)",
            category="precision_lora/demo",
            description="Shows a latent as an image without a VAE: its first 3 channels, normalised, upscaled "
                        "8x. Stands in for VAE Decode with tiny demo models; use VAE Decode for real models.",
            inputs=[io.Latent.Input("samples", tooltip="Latent to show (e.g. KSampler's output).")],
            outputs=[io.Image.Output(display_name="image")],
        )

    @classmethod
    def execute(cls, samples) -> io.NodeOutput:
        return io.NodeOutput(latent_to_preview(samples["samples"]))


NODES = [PrecisionDemoConditioning, PrecisionDemoLatent, PrecisionDemoPreview]
