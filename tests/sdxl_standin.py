"""A tiny SDXL checkpoint that ComfyUI's stock CheckpointLoaderSimple loads, for the SDXL real-workflow tests.

ComfyUI detects SDXL (``comfy/model_detection.py`` against ``comfy.supported_models.models``) only at its full
size: 320 channels, transformer depths [0, 0, 2, 2, 10, 10], 2.6 B parameters. No smaller SDXL file loads
through CheckpointLoaderSimple, and a full-size one trains far too slowly on a test machine's CPU.

So the test servers load this file as a custom node (tests/conftest.py links it into the session server's
``custom_nodes``; it is no part of the pack). Importing it appends one entry to ComfyUI's list of model
configs: a subclass of ComfyUI's own ``SDXL`` (same name) that changes nothing but the UNet size it matches
(below). Everything else is stock: CheckpointLoaderSimple, the file's layout and key conversions (written with
ComfyUI's own ``process_*_for_saving``, as its CheckpointSave writes SDXL files), the SDXL model class, latent
format and sampling, and the text encoders (``SDXLClipModel``: CLIP-L and CLIP-G at their real sizes, random
weights) and the SD VAE at its real size.

    write_checkpoint(path)   # ~1.8 GB in fp16 (CLIP-G's 695 M parameters are most of it)
"""
from __future__ import annotations

import math

import comfy.supported_models

# The tiny UNet: SDXL's layout (linear transformers, CLIP-L + CLIP-G's 2048-wide context, the 2816-wide label
# embedding, ResBlocks, down/upsamplers) with 64 and 128 channels (1 and 2 heads of SDXL's 64 channels).
TINY_UNET = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
    "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4, "model_channels": 64,
    "num_res_blocks": [1, 1], "transformer_depth": [0, 1], "channel_mult": [1, 2], "transformer_depth_middle": 1,
    "use_linear_in_transformer": True, "context_dim": 2048, "transformer_depth_output": [0, 0, 1, 1],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
# The SD / SDXL autoencoder: 4 latent channels, 128 x [1, 2, 4, 4] (~84 M parameters).
SD_VAE_CONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                 "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}

FORMAT = 1  # raise when the file's contents change in a way the configs above do not show (fill, keys)


def fingerprint() -> str:
    """A short hash of what the file holds: a changed stand-in gets a new file in the cache, not the old one."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps([TINY_UNET, SD_VAE_CONFIG, FORMAT], sort_keys=True).encode()).hexdigest()[:10]


class SDXL(comfy.supported_models.SDXL):
    """ComfyUI's SDXL config, matching the tiny UNet above instead of the full-size one. Same class name: the
    pack (and ComfyUI's logs) name a model's family by it, so the stand-in is SDXL to them as a real file is."""
    precision_standin = True
    unet_config = {k: TINY_UNET[k] for k in ("model_channels", "use_linear_in_transformer", "transformer_depth",
                                             "context_dim", "adm_in_channels", "use_temporal_attention")}


def register() -> None:
    """Append the stand-in's config to ComfyUI's detection list (once)."""
    if not any(getattr(m, "precision_standin", False) for m in comfy.supported_models.models):
        comfy.supported_models.models.append(SDXL)


register()
NODE_CLASS_MAPPINGS: dict = {}  # a custom node with no nodes: ComfyUI imports it for the registration above


def _fill(module, seed: int) -> None:
    """Seeded weights (ComfyUI's ops leave them uninitialised): fan-in scaled matrices, norm gains near 1
    (GroupNorm / LayerNorm modules, whatever their names), small biases; token and position embeddings at
    CLIP's own init scale (they are read by index, not multiplied)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    norms = {id(m.weight) for m in module.modules()
             if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and getattr(m, "weight", None) is not None}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if id(p) in norms:
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("token_embedding.weight", "position_embedding.weight")):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def _vae_state_dict(seed: int) -> dict:
    import torch
    from comfy.ldm.modules.diffusionmodules.model import Decoder, Encoder

    enc, dec = Encoder(**SD_VAE_CONFIG), Decoder(**SD_VAE_CONFIG)
    quant, post_quant = torch.nn.Conv2d(8, 8, 1), torch.nn.Conv2d(4, 4, 1)
    for i, m in enumerate((enc, dec, quant, post_quant)):
        _fill(m, seed + i)
    sd = {f"encoder.{k}": v for k, v in enc.state_dict().items()}
    sd.update({f"decoder.{k}": v for k, v in dec.state_dict().items()})
    sd.update({f"quant_conv.{k}": v for k, v in quant.state_dict().items()})
    sd.update({f"post_quant_conv.{k}": v for k, v in post_quant.state_dict().items()})
    return sd


def _clip_state_dict(seed: int) -> dict:
    """SDXLClipModel's keys (clip_l.transformer.*, clip_g.transformer.*), both encoders at their real sizes."""
    import torch
    import comfy.sd1_clip
    import comfy.sdxl_clip

    sd = {}
    for prefix, make in (("clip_l", lambda: comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float32)),
                         ("clip_g", lambda: comfy.sdxl_clip.SDXLClipG(device="cpu", dtype=torch.float32))):
        model = make()
        _fill(model.transformer, seed)
        sd.update({f"{prefix}.transformer.{k}": v.to(torch.float16) for k, v in model.transformer.state_dict().items()})
        del model
        seed += 1
    return sd


def write_checkpoint(path: str, seed: int = 0) -> None:
    """One .safetensors holding the tiny UNet, CLIP-L, CLIP-G and the VAE under the keys of a released SDXL
    checkpoint (model.diffusion_model.*, conditioner.embedders.{0,1}.*, first_stage_model.*), in fp16."""
    import os

    import torch
    import safetensors.torch

    config = SDXL(dict(TINY_UNET))
    with torch.inference_mode(False):
        unet = config.get_model({}, "").diffusion_model
        _fill(unet, seed)
        sd = config.process_unet_state_dict_for_saving({k: v.to(torch.float16) for k, v in unet.state_dict().items()})
        sd.update(config.process_vae_state_dict_for_saving(
            {k: v.to(torch.float16) for k, v in _vae_state_dict(seed + 10).items()}))
        sd.update(config.process_clip_state_dict_for_saving(_clip_state_dict(seed + 20)))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.partial"  # two hosts may write the cached file at once
    note = {"precision_lora.real_arch": f"tiny SDXL stand-in, random weights, seed {seed}"}
    safetensors.torch.save_file({k: v.detach().contiguous() for k, v in sd.items()}, tmp, metadata=note)
    os.replace(tmp, path)
