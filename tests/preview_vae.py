"""A tiny real-architecture VAE for preview tests, built at test time (nothing downloaded).

ComfyUI's TAESD (the architecture of the released taef1 previewer) with 16 latent channels and seeded random
weights. The weights are scaled so that the decoded images sit inside [0, 1] instead of saturating (torch's
default init does), so a trained LoRA visibly changes them. ``tiny_vae_state_dict`` is what a file holds
(the stock Load VAE detects TAESD by its ``taesd_decoder.*`` keys); ``tiny_vae`` loads it as Load VAE does.
"""
from __future__ import annotations

import torch


def tiny_vae_state_dict(channels: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    import comfy.taesd.taesd as taesd

    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, value in taesd.TAESD(latent_channels=channels).state_dict().items():
        if value.ndim == 4:  # conv weights: unit gain, so activations neither die nor saturate
            sd[key] = torch.randn(value.shape, generator=gen) * 1.2 / value[0].numel() ** 0.5
        else:
            sd[key] = torch.zeros_like(value) if key.endswith("bias") else value.clone()
    sd["taesd_decoder.19.bias"] += 0.5  # mid-grey images
    return sd


def tiny_vae(channels: int = 16, seed: int = 0):
    import comfy.sd

    return comfy.sd.VAE(sd=tiny_vae_state_dict(channels, seed))


def write_tiny_vae(path: str, channels: int = 16, seed: int = 0) -> str:
    """Saves the VAE as a .safetensors file (e.g. into a server's models/vae for Load VAE)."""
    import safetensors.torch

    sd = {k: v.contiguous() for k, v in tiny_vae_state_dict(channels, seed).items()}
    safetensors.torch.save_file(sd, path)
    return path


def main(argv: list[str]) -> None:
    """``python tests/preview_vae.py FILE`` (the host's venv): writes the VAE to FILE, e.g. a server's
    models/vae, from a process that has not imported ComfyUI (the browser tests)."""
    import os
    import sys

    if len(argv) != 1:
        raise SystemExit("usage: preview_vae.py FILE.safetensors")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import comfy_bootstrap

    comfy_bootstrap.prepare([])  # ComfyUI importable (CPU); only its TAESD class is used
    write_tiny_vae(os.path.abspath(argv[0]))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
