"""Tiny video VAEs of ComfyUI's video families, built at test time through ComfyUI's own VAE loader.

``tiny_video_vae(family)`` returns a ``comfy.sd.VAE`` made from a state dict, as Load VAE makes it: ComfyUI
detects the family from the keys and sets its latent layout, channels and frame rule (Wan 2.1 / 2.2 and
HunyuanVideo 4k+1, LTXV 8k+1, Mochi 6k+1). The autoencoder is ComfyUI's own class for that family at a few
MB instead of hundreds: Wan 2.1's width comes from its state dict as in a real file, LTXV's blocks from the
file's ``config`` metadata as LTXV files carry it, and for the classes ComfyUI builds at a fixed size (Wan 2.2,
HunyuanVideo, Mochi) the width is lowered while the VAE is built. Weights are seeded random.
"""
from __future__ import annotations

import contextlib
import json

import torch

# family -> (temporal, spatial) compression ComfyUI states for that VAE
RULES = {"wan21": (4, 8), "wan22": (4, 16), "hunyuan_video": (4, 8), "ltxv": (8, 32), "mochi": (6, 8)}
LATENT_CHANNELS = {"wan21": 16, "wan22": 48, "hunyuan_video": 16, "ltxv": 128, "mochi": 12}
# supported_models class of the tiny diffusion model (tests/families.py) trained on each VAE's latents
MODEL_OF = {"wan21": "WAN21_T2V", "wan22": "WAN22_T2V", "hunyuan_video": "HunyuanVideo", "ltxv": "LTXV",
            "mochi": "GenmoMochi"}

LTXV_CONFIG = {"_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
               "latent_channels": 128, "encoder_base_channels": 32, "decoder_base_channels": 32,
               "blocks": [["res_x", 1], ["compress_all", 1], ["compress_all", 1], ["compress_all", 1], ["res_x", 1]],
               "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
               "use_quant_conv": False, "causal_decoder": False}


@contextlib.contextmanager
def _patched(owner, name, make):
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _small_wan22(cls):
    return lambda **kw: cls(**{**kw, "dim": 16, "dec_dim": 16})


def _small_kl(cls):
    def make(ddconfig, embed_dim, **kw):
        return cls(ddconfig={**ddconfig, "ch": 32, "ch_mult": [1, 1, 1, 1], "num_res_blocks": 1},
                   embed_dim=embed_dim, **kw)
    return make


def _small_mochi(cls):
    import comfy.ldm.genmo.vae.model as genmo

    class TinyMochiVAE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            small = dict(base_channels=32, channel_multipliers=[1, 2, 3, 4], num_res_blocks=[1, 1, 1, 1, 1],
                         latent_dim=12, padding_mode="replicate")
            self.encoder = genmo.Encoder(in_channels=15, temporal_reductions=[1, 2, 3], spatial_reductions=[2, 2, 2],
                                         prune_bottlenecks=[False] * 5, has_attentions=[False, True, True, True, True],
                                         affine=True, bias=True, input_is_conv_1x1=True, **small)
            self.decoder = genmo.Decoder(out_channels=3, temporal_expansions=[1, 2, 3], spatial_expansions=[2, 2, 2],
                                         has_attention=[False] * 5, output_norm=False, nonlinearity="silu",
                                         output_nonlinearity="silu", causal=True, **small)

        encode = cls.encode
        decode = cls.decode

    return lambda: TinyMochiVAE()


def _module(family: str) -> tuple[torch.nn.Module, dict | None]:
    """The tiny autoencoder (ComfyUI's class) and the file metadata it is saved with."""
    import comfy.ldm.genmo.vae.model as genmo
    import comfy.ldm.lightricks.vae.causal_video_autoencoder as ltxv
    import comfy.ldm.wan.vae as wan
    import comfy.ldm.wan.vae2_2 as wan22
    from comfy.ldm.models.autoencoder import AutoencoderKL

    if family == "wan21":
        return wan.WanVAE(dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                          temperal_downsample=[False, True, True]), None
    if family == "wan22":
        return _small_wan22(wan22.WanVAE)(dim=160, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                          attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0), None
    if family == "hunyuan_video":
        ddconfig = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                    "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                    "conv3d": True, "time_compress": 4}
        return _small_kl(AutoencoderKL)(ddconfig=ddconfig, embed_dim=16), None
    if family == "ltxv":
        return ltxv.VideoVAE(config=LTXV_CONFIG), {"config": json.dumps({"vae": LTXV_CONFIG})}
    if family == "mochi":
        return _small_mochi(genmo.VideoVAE)(), None
    raise KeyError(family)


def tiny_video_vae_state_dict(family: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict | None]:
    """What a file of the tiny VAE holds (keys as ComfyUI's class names them) and its metadata."""
    module, metadata = _module(family)
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, value in module.state_dict().items():
        if key.endswith("std-of-means"):
            sd[key] = torch.ones_like(value)
        elif key.endswith("mean-of-means") or key.endswith("bias"):
            sd[key] = torch.zeros_like(value)
        elif value.ndim >= 2:
            fan_in = max(1, value[0].numel())
            sd[key] = torch.randn(value.shape, generator=gen) / fan_in ** 0.5
        else:
            sd[key] = torch.ones_like(value) if value.is_floating_point() else value.clone()
    return sd, metadata


@contextlib.contextmanager
def small_classes():
    """While ComfyUI builds a VAE: its fixed-size classes (Wan 2.2, HunyuanVideo, Mochi) at the tiny width."""
    import comfy.ldm.genmo.vae.model as genmo
    import comfy.ldm.wan.vae2_2 as wan22
    import comfy.sd

    with _patched(wan22, "WanVAE", _small_wan22), _patched(comfy.sd, "AutoencoderKL", _small_kl), \
            _patched(genmo, "VideoVAE", _small_mochi):
        yield


def tiny_video_vae(family: str, seed: int = 0):
    """``comfy.sd.VAE`` of the tiny family VAE, detected from its state dict as Load VAE does."""
    import comfy.sd

    sd, metadata = tiny_video_vae_state_dict(family, seed)
    with small_classes():
        return comfy.sd.VAE(sd=sd, metadata=metadata)


def write_tiny_video_vae(path: str, family: str, seed: int = 0) -> str:
    """The tiny VAE as a .safetensors file (with LTXV's config metadata) for a server's models/vae. Only
    Wan 2.1 and LTXV load at the tiny size in a stock Load VAE (the others need ``small_classes``)."""
    import safetensors.torch

    sd, metadata = tiny_video_vae_state_dict(family, seed)
    safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, path, metadata=metadata)
    return path
