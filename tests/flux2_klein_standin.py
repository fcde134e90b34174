"""Tiny Flux.2 klein files that ComfyUI's stock loaders load, for the Flux.2 klein real-workflow tests.

The released klein 4B is too large for a test machine's CPU (a 4 B-parameter DiT, the 4 B Qwen3-4B text
encoder). What stands in, file by file, each loaded by the stock loader the shipped workflows use:

- ``models/diffusion_models/real_arch_tiny_flux2_klein.safetensors`` (UNETLoader): ComfyUI's own Flux.2 model
  (``supported_models.Flux2`` -> ``model_base.Flux2``) at width 256 with 2 double and 2 single blocks, no
  guidance embedding and a text input 3 x 2560 wide (klein takes Qwen3-4B's layers 9, 18 and 27), under the
  released ``flux-2-klein-base-4b.safetensors``' keys (BFL's, with ``*_norm.scale``). ComfyUI 0.33's
  detection (``model_detection.py``) derives Flux.2 from the keys and the head count from the width (heads of
  128 channels), so this file needs no registration: it loads as the released one does.
- ``models/text_encoders/real_arch_qwen3_4b_tiny.safetensors`` (CLIPLoader, type flux2): the tiny Qwen3-4B of
  tests/z_image_standin.py (shared with the Z-Image tests; its registration, loaded as a test-only custom node,
  makes ComfyUI build it at its tiny size). With type flux2 ComfyUI 0.33 wraps it in klein's encoder
  (``text_encoders.flux.klein_te``: hidden layers 9, 18, 27 stacked -> 7680 per token).
- ``models/vae/real_arch_flux2_vae.safetensors`` (VAELoader): the Flux.2 VAE at its real size (~84 M
  parameters; 32 latent channels, the 2 x 2 patch batch norm -> 128 channels at 1/16), ComfyUI's own
  ``AutoencoderKL`` classes.

    python tests/flux2_klein_standin.py BASE_DIR    # writes the cached files once, links them into BASE_DIR

ComfyUI 0.3.75 has no Flux.2 klein (see ``klein_unavailable``). Importing this module does nothing else: the
session server links every tests/*_standin.py as a custom node, and this one registers nothing.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "real_arch")

QWEN3_4B_WIDTH = 2560
# What ComfyUI 0.33's detection derives from a klein file, at this size (klein 4B: hidden 3072 = 24 heads,
# 5 double and 20 single blocks, 7680-wide text input, no guidance embedding).
KLEIN_TINY = {
    "image_model": "flux2", "axes_dim": [32, 32, 32, 32], "num_heads": 2, "mlp_ratio": 3.0, "theta": 2000,
    "out_channels": 128, "global_modulation": True, "mlp_silu_act": True, "qkv_bias": False, "ops_bias": False,
    "default_ref_method": "index", "ref_index_scale": 10.0, "txt_ids_dims": [3], "patch_size": 1,
    "in_channels": 128, "hidden_size": 256, "context_in_dim": 3 * QWEN3_4B_WIDTH, "vec_in_dim": None,
    "depth": 2, "depth_single_blocks": 2, "guidance_embed": False, "yak_mlp": False, "txt_norm": False,
}
# The Flux.2 autoencoder: Flux.1's encoder / decoder layout with 32 latent channels and the latent batch norm.
FLUX2_VAE_CONFIG = {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                    "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                    "batch_norm_latent": True}
FORMAT = 1  # raise when the files' contents change in a way the configs above do not show (fill, keys)

KLEIN_NAME = "real_arch_tiny_flux2_klein.safetensors"
VAE_NAME = "real_arch_flux2_vae.safetensors"
TEXT_ENCODER_NAME = "real_arch_qwen3_4b_tiny.safetensors"  # tests/z_image_standin.py's QWEN3_4B_NAME
DATASET = "real_arch_captioned"  # tests/real_arch.py's 3 captioned images
# Attention targets of the default preset on the tiny model: img_attn / txt_attn qkv + proj of each double
# block, linear1 + linear2 of each single block.
ATTENTION_TARGETS = 4 * KLEIN_TINY["depth"] + 2 * KLEIN_TINY["depth_single_blocks"]
# What the shipped workflows name (workflows/spec_flux2_klein.py)
SHIPPED = {"model": "flux-2-klein-base-4b.safetensors", "text_encoder": "qwen_3_4b.safetensors",
           "vae": "flux2-vae.safetensors", "dataset": "my_lora_dataset"}


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps([*parts, FORMAT], sort_keys=True).encode()).hexdigest()[:10]


def klein_unavailable(comfy_dir: str) -> str | None:
    """Why the ComfyUI in ``comfy_dir`` cannot run Flux.2 klein, read from its source, or None.

    ComfyUI 0.3.75 has Flux.2 dev only: its text-encoder loader has no klein encoder (a Qwen3-4B file loads as
    Z-Image's, 2560 wide per token, whatever the CLIPLoader type) and its detection fixes every Flux.2 file at
    48 heads (Flux.2 dev's; 0.33 derives the head count from the width)."""
    with open(os.path.join(comfy_dir, "comfy", "text_encoders", "flux.py"), encoding="utf-8") as f:
        has_klein_te = "def klein_te(" in f.read()
    with open(os.path.join(comfy_dir, "comfy", "model_detection.py"), encoding="utf-8") as f:
        fixed_heads = 'dit_config["num_heads"] = dit_config["hidden_size"] // sum(' not in f.read()
    if has_klein_te and not fixed_heads:
        return None
    why = [w for w, bad in (("its comfy/text_encoders/flux.py has no klein_te (Qwen3-4B loads as Z-Image's encoder)",
                             not has_klein_te),
                            ("its detection fixes Flux.2 at 48 heads", fixed_heads)) if bad]
    return "this ComfyUI has no Flux.2 klein: " + "; ".join(why)


# -- the files (a process that imported ComfyUI: scripts/comfy_bootstrap.init_in_process) --------------------

def _fill(module, seed: int) -> None:
    """Seeded weights (ComfyUI's ops leave them uninitialised): fan-in scaled matrices, norm gains near 1
    (RMSNorm / GroupNorm modules, whatever their names), small biases."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    norms = tuple(c for c in (torch.nn.GroupNorm, torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", None)) if c)
    gains = {id(p) for m in module.modules() if isinstance(m, norms) for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if id(p) in gains or name.endswith(("_norm.weight", "_norm.scale")):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def _save(sd: dict, path: str, note: str) -> None:
    import safetensors.torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.partial"  # two hosts may write the cached file at once
    safetensors.torch.save_file({k: v.detach().contiguous() for k, v in sd.items()}, tmp,
                                metadata={"precision_lora.real_arch": note})
    os.replace(tmp, path)


def klein_state_dict(seed: int = 0) -> dict:
    """The tiny klein DiT (ComfyUI's Flux.2 classes) under BFL's keys (``*_norm.scale``, no prefix), bf16."""
    import torch
    import comfy.supported_models

    with torch.inference_mode(False):
        model = comfy.supported_models.Flux2(copy.deepcopy(KLEIN_TINY)).get_model({}).diffusion_model
        _fill(model, seed)
        sd = {}
        for k, v in model.state_dict().items():
            if k.endswith("_norm.weight"):  # ComfyUI renames these on load (Flux.process_unet_state_dict)
                k = k[: -len(".weight")] + ".scale"
            sd[k] = v.to(torch.bfloat16)
    return sd


def flux2_vae_state_dict(seed: int = 0) -> dict:
    """The Flux.2 VAE at its real size (ComfyUI's AutoencoderKL with the latent batch norm), fp16; the batch
    norm's running statistics are a plausible latent's (mean near 0, variance near 1)."""
    import torch
    from comfy.ldm.models.autoencoder import AutoencoderKL

    with torch.inference_mode(False):
        vae = AutoencoderKL(ddconfig=dict(FLUX2_VAE_CONFIG), embed_dim=FLUX2_VAE_CONFIG["z_channels"])
        _fill(vae, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.running_mean.shape, generator=gen))
            vae.bn.running_var.copy_(1.0 + 0.2 * torch.rand(vae.bn.running_var.shape, generator=gen))
        return {k: (v.to(torch.float16) if v.is_floating_point() else v) for k, v in vae.state_dict().items()}


def _cached(make, name: str, fingerprint: str, link: str, seed: int) -> str:
    stem, ext = os.path.splitext(name)
    cached = os.path.join(CACHE, f"{stem}_{fingerprint}{ext}")
    if not os.path.exists(cached):
        _save(make(seed), cached, f"{stem}: tiny stand-in, random weights, seed {seed}")
    if not os.path.lexists(link):
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(cached, link)
    return link


def link_all(base: str, seed: int = 0) -> dict[str, str]:
    """Every file of the klein tests under ``base`` (cached in .cache/real_arch, linked): {what: path}."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import real_arch
    import z_image_standin

    assert z_image_standin.QWEN3_4B_NAME == TEXT_ENCODER_NAME and real_arch.DATASET == DATASET
    assert z_image_standin.QWEN3_4B_WIDTH == QWEN3_4B_WIDTH
    paths = {
        "model": _cached(klein_state_dict, KLEIN_NAME, _fingerprint(KLEIN_TINY),
                         os.path.join(base, "models", "diffusion_models", KLEIN_NAME), seed),
        "vae": _cached(flux2_vae_state_dict, VAE_NAME, _fingerprint(FLUX2_VAE_CONFIG),
                       os.path.join(base, "models", "vae", VAE_NAME), seed + 10),
        "text_encoder": z_image_standin.link_qwen3_4b_standin(base, seed),
        "dataset": os.path.join(base, "input", DATASET),
    }
    if not os.path.isdir(paths["dataset"]):
        real_arch.write_dataset(paths["dataset"])
    return paths


# -- the tests' name picks ----------------------------------------------------------------------------------

def swap_names(prompt: dict, lora_name: str | None = None, size: int = 64) -> tuple[dict, list[str]]:
    """The API prompt of a shipped klein workflow with this module's files picked; returns it and the edits
    made (what a user does in the page). Every name edit checks the shipped value first. Not names (CPU time
    only): the bucket resolution and the empty latent / scheduler size become ``size`` (the test images)."""
    from real_workflow_lib import pick_names

    picks = {("UNETLoader", "unet_name"): (SHIPPED["model"], KLEIN_NAME), ("UNETLoader", "weight_dtype"): ("default",) * 2,
             ("CLIPLoader", "clip_name"): (SHIPPED["text_encoder"], TEXT_ENCODER_NAME),
             ("CLIPLoader", "type"): ("flux2",) * 2, ("VAELoader", "vae_name"): (SHIPPED["vae"], VAE_NAME),
             ("LoadImageTextDataSetFromFolder", "folder"): (SHIPPED["dataset"], DATASET),
             ("PrecisionResolutionBuckets", "resolution"): (1024,) * 2}
    square = ("EmptyFlux2LatentImage", "Flux2Scheduler")
    picks.update({(kind, side): (1024,) * 2 for kind in square for side in ("width", "height")})
    sizes = {"PrecisionResolutionBuckets": {"resolution": size}, **{k: {"width": size, "height": size} for k in square}}
    return pick_names(prompt, picks, lora_name=lora_name, sizes=sizes)


def files_for(comfy_server) -> str:
    """For a test on the session server: skips (with the reason read from this ComfyUI's source) where it has
    no klein, else writes / links the files into its base directory (a subprocess: the host's ComfyUI)."""
    import subprocess

    import pytest
    from server_harness import server_env

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import comfy_bootstrap

    reason = klein_unavailable(comfy_bootstrap.COMFY_DIR)
    if reason is not None:
        status, stats = comfy_server.get("/system_stats")
        version = stats["system"]["comfyui_version"]
        assert status == 200 and version.startswith("0.3."), (version, reason)  # 0.33 has klein
        pytest.skip(f"ComfyUI {version}: {reason}")
    subprocess.run([sys.executable, os.path.abspath(__file__), comfy_server.base_dir], check=True, env=server_env(),
                   timeout=900)
    return comfy_server.base_dir


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: flux2_klein_standin.py BASE_DIR")
    base = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import comfy_bootstrap

    comfy_bootstrap.init_in_process(base)
    reason = klein_unavailable(comfy_bootstrap.COMFY_DIR)
    if reason:
        raise SystemExit(f"[Precision LoRA] {reason}")
    for what, path in link_all(base).items():
        sys.stderr.write(f"[Precision LoRA] real-architecture {what}: {path}\n")


if __name__ == "__main__":
    main(sys.argv[1:])

NODE_CLASS_MAPPINGS: dict = {}  # linked into the test server's custom_nodes with the other stand-ins: no nodes
