"""Random-weight files of real architectures, built at test time, for running the real-training workflows.

    python tests/real_arch.py BASE_DIR      (the host's venv; writes into BASE_DIR/models and BASE_DIR/input)

What it writes (nothing is downloaded; every weight comes from a seeded generator):

- ``models/vae/real_arch_flux_ae.safetensors``: the Flux.1 16-channel VAE at its real size (~84 M
  parameters), built from ComfyUI's own Encoder/Decoder classes with the keys of the released ``ae``; the
  stock *Load VAE* detects it as it detects the released file.
- ``models/text_encoders/real_arch_clip_l.safetensors``: CLIP-L's text model at its real size (~123 M
  parameters, ComfyUI's own CLIP class and config), keys as in the released ``clip_l``.
- ``models/diffusion_models/real_arch_tiny_flux1_clip_l.safetensors``: a tiny Flux.1-dev (the demo's
  config) whose text input width is CLIP-L's 768 instead of T5-XXL's 4096, config in the file's metadata
  (loads with *Load Diffusion Model (Precision)*).
- ``input/real_arch_captioned/``: 3 images in two sizes, each with its ``.txt`` caption.

    python tests/real_arch.py BASE_DIR --t5      (also Flux.1's own text-encoder pair)

- ``models/text_encoders/real_arch_t5xxl_fp8_e4m3fn.safetensors``: T5-XXL's encoder at its real size (4.76 B
  parameters; ComfyUI has one T5-XXL config), keys and shapes from ComfyUI's own T5 class, stored in
  float8_e4m3fn as the widely used ``t5xxl_fp8_e4m3fn`` file is (4.76 GB). Written once per checkout into
  ``.cache/real_arch/`` (about a minute, 1.3 GB of memory: one tensor at a time) and linked into BASE_DIR.
  ComfyUI computes it in fp32 on a CPU: ~33 s per caption (256 tokens) on a 2-core test machine, ~10 GB
  resident while loaded.
- ``models/diffusion_models/real_arch_tiny_flux1.safetensors``: the tiny Flux.1-dev with Flux.1's own text
  widths (T5-XXL's 4096 per token, CLIP-L's pooled 768), for the shipped workflows' DualCLIPLoader unchanged.

    python tests/real_arch.py BASE_DIR --sdxl    (also an SDXL checkpoint)

- ``models/checkpoints/real_arch_tiny_sdxl.safetensors``: one file as a released SDXL checkpoint is, for
  CheckpointLoaderSimple: a tiny SDXL UNet, CLIP-L and CLIP-G at their real sizes and the SD VAE at its real
  size (tests/sdxl_standin.py, which the test server loads so that ComfyUI's detection knows the tiny UNet).
  Written once per checkout into ``.cache/real_arch/`` (~1.8 GB, under a minute) and linked into BASE_DIR.

Without ``--t5`` the tests that need speed swap DualCLIPLoader for a CLIPLoader on the same clip_l (see
swap_names) and train the tiny Flux whose text width is CLIP-L's 768.
"""
from __future__ import annotations

import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "real_arch")  # files too large to write per test server (gitignored)
VAE_NAME = "real_arch_flux_ae.safetensors"
T5_NAME = "real_arch_t5xxl_fp8_e4m3fn.safetensors"
TINY_FLUX_T5_NAME = "real_arch_tiny_flux1.safetensors"
CLIP_L_NAME = "real_arch_clip_l.safetensors"
TINY_FLUX_NAME = "real_arch_tiny_flux1_clip_l.safetensors"
SDXL_NAME = "real_arch_tiny_sdxl.safetensors"
DATASET = "real_arch_captioned"
# (file stem, width, height, caption): two sizes, so one run trains on latents of different shapes
IMAGES = (
    ("red_square", 64, 64, "a photo of sks, a red square"),
    ("green_square", 64, 64, "a photo of sks, a green square"),
    ("blue_wide", 80, 48, "a photo of sks, a wide blue band"),
)
# The Flux.1 autoencoder ("ae"): 16 latent channels, ComfyUI's default channel widths (128 x [1, 2, 4, 4]).
FLUX_VAE_CONFIG = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                   "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}


def _fill(module, seed: int) -> None:
    """ComfyUI's ops leave weights uninitialised: fill them from a seeded generator (fan-in scaled
    matrices, norm gains near 1, small biases), so activations stay finite through every layer."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def _save(sd: dict, path: str, metadata: dict | None = None) -> None:
    import safetensors.torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.partial"  # two hosts may write the cached file at once
    safetensors.torch.save_file({k: v.detach().contiguous().to(v.dtype) for k, v in sd.items()}, tmp,
                                metadata=metadata)
    os.replace(tmp, path)


def flux_vae_state_dict(seed: int = 0) -> dict:
    import torch
    from comfy.ldm.modules.diffusionmodules.model import Decoder, Encoder

    enc, dec = Encoder(**FLUX_VAE_CONFIG), Decoder(**FLUX_VAE_CONFIG)
    _fill(enc, seed)
    _fill(dec, seed + 1)
    sd = {f"encoder.{k}": v for k, v in enc.state_dict().items()}
    sd.update({f"decoder.{k}": v for k, v in dec.state_dict().items()})
    return {k: v.to(torch.float16) for k, v in sd.items()}


def clip_l_state_dict(seed: int = 0) -> dict:
    import torch
    import comfy.sd1_clip

    model = comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float32)
    _fill(model.transformer, seed)
    # the token embedding is read by index, not multiplied: keep it at the scale CLIP's own init uses
    emb = model.transformer.text_model.embeddings
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 7)
        emb.token_embedding.weight.copy_(0.02 * torch.randn(emb.token_embedding.weight.shape, generator=gen))
        emb.position_embedding.weight.copy_(0.01 * torch.randn(emb.position_embedding.weight.shape, generator=gen))
    return {k: v.to(torch.float16) for k, v in model.transformer.state_dict().items()}


def t5xxl_shapes() -> dict[str, tuple[int, ...]]:
    """Names and shapes of T5-XXL's encoder as ComfyUI builds it (its own class and config, on the meta
    device: nothing is allocated)."""
    import torch
    import comfy.ops
    import comfy.text_encoders.t5 as t5

    with open(os.path.join(os.path.dirname(t5.__file__), "t5_config_xxl.json")) as f:
        config = json.load(f)
    with torch.device("meta"):
        model = t5.T5(config, torch.float32, "meta", comfy.ops.manual_cast)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def write_t5xxl_fp8(path: str, seed: int = 0) -> None:
    """T5-XXL in float8_e4m3fn, written one tensor at a time (safetensors' layout: an 8-byte header length,
    the JSON header, then each tensor's bytes in header order), so memory stays at one tensor."""
    import struct

    import torch

    shapes = t5xxl_shapes()
    header, offset = {}, 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "F8_E4M3", "shape": list(shape), "data_offsets": [offset, offset + math.prod(shape)]}
        offset += math.prod(shape)
    header["__metadata__"] = {"precision_lora.real_arch": "T5-XXL encoder, random weights, seed %d" % seed}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.partial"  # two hosts may write the cached file at once
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in shapes.items():
            if name == "shared.weight":  # token embedding: read by index, not multiplied
                t = torch.randn(shape, generator=gen)
            elif "relative_attention_bias" in name:
                t = 0.1 * torch.randn(shape, generator=gen)
            elif len(shape) >= 2:  # fan-in scaled, as _fill: activations stay near unit scale through 24 blocks
                t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            else:  # RMS-norm gains
                t = 1.0 + 0.05 * torch.randn(shape, generator=gen)
            f.write(t.to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_tiny_flux(path: str, text_width: int, seed: int = 0) -> None:
    """The demo's tiny Flux.1-dev with ``text_width`` per text token (T5-XXL's 4096 or CLIP-L's 768) and
    CLIP-L's pooled 768; config in the file's metadata."""
    tiny = _pack_module("demo.tiny_models")
    compat = _pack_module("nodes.host.comfy_compat")
    load_model = _pack_module("nodes.model.load")
    config = compat.fit_flux_config({**tiny.TINY_UNET_CONFIGS["flux1_dev"], "context_in_dim": text_width,
                                     "vec_in_dim": 768})
    patcher = tiny.build_tiny_model("flux1_dev", seed=seed, unet_config=config)
    family = "flux1_dev_clip_l" if text_width == 768 else "flux1_dev"
    _save(tiny.tiny_state_dict(patcher), path, {load_model.UNET_CONFIG_KEY: json.dumps(config),
                                                "precision_lora.tiny_family": family})


def write_dataset(folder: str, count: int = len(IMAGES)) -> None:
    """The first ``count`` of IMAGES, each with its caption beside it."""
    import numpy as np
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, (stem, w, h, caption) in enumerate(IMAGES[:count]):
        base = np.zeros((h, w, 3), np.float32)
        base[..., i % 3] = 200.0
        pixels = np.clip(base + rng.normal(0.0, 20.0, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, stem + ".png"))
        with open(os.path.join(folder, stem + ".txt"), "w", encoding="utf-8") as f:
            f.write(caption + "\n")


def write_sdxl(base: str, seed: int = 0) -> str:
    """The tiny SDXL checkpoint, written once into the cache and linked into ``base``'s models/checkpoints."""
    import sdxl_standin

    path = os.path.join(base, "models", "checkpoints", SDXL_NAME)
    cached = os.path.join(CACHE, f"real_arch_tiny_sdxl_{sdxl_standin.fingerprint()}.safetensors")
    if not os.path.exists(cached):
        sdxl_standin.write_checkpoint(cached, seed)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(cached, path)
    return path


def write_all(base: str, seed: int = 0, t5: bool = False) -> dict[str, str]:
    """Writes every file that is missing under ``base`` (``t5``: also T5-XXL, linked from the cache, and the
    tiny Flux with T5-XXL's text width); returns {what: path}."""
    paths = {
        "vae": os.path.join(base, "models", "vae", VAE_NAME),
        "clip_l": os.path.join(base, "models", "text_encoders", CLIP_L_NAME),
        "model": os.path.join(base, "models", "diffusion_models", TINY_FLUX_NAME),
        "dataset": os.path.join(base, "input", DATASET),
    }
    if not os.path.exists(paths["vae"]):
        _save(flux_vae_state_dict(seed), paths["vae"])
    if not os.path.exists(paths["clip_l"]):
        _save(clip_l_state_dict(seed), paths["clip_l"])
    if not os.path.exists(paths["model"]):
        write_tiny_flux(paths["model"], 768, seed)
    if not os.path.isdir(paths["dataset"]):
        write_dataset(paths["dataset"])
    if t5:
        paths["t5"] = os.path.join(base, "models", "text_encoders", T5_NAME)
        paths["model_t5"] = os.path.join(base, "models", "diffusion_models", TINY_FLUX_T5_NAME)
        cached = os.path.join(CACHE, T5_NAME)
        if not os.path.exists(cached):
            write_t5xxl_fp8(cached, seed)
        if not os.path.exists(paths["t5"]):
            os.symlink(cached, paths["t5"])
        if not os.path.exists(paths["model_t5"]):
            write_tiny_flux(paths["model_t5"], 4096, seed)
    return paths


# What the real workflows ship with (workflows/build.py) and what the tests pick instead: file and folder
# names only, plus the two differences that CPU test time forces (see swap_names).
SHIPPED = {"model": "flux1-dev.safetensors", "clip_l": "clip_l.safetensors", "t5": "t5xxl_fp16.safetensors",
           "vae": "ae.safetensors", "dataset": "my_lora_dataset", "checkpoint": "sd_xl_base_1.0.safetensors"}


def swap_names(prompt: dict, lora_name: str | None = None, t5: bool = False) -> tuple[dict, list[str]]:
    """The API prompt of a shipped real workflow with this module's files picked; returns it and the list of
    edits made (what a user would do in the page). Every name edit checks the shipped value first.

    ``t5``: DualCLIPLoader keeps its type and gets this module's clip_l and T5-XXL (two name picks) and the
    model is the tiny Flux with T5-XXL's text width. Otherwise (fast) DualCLIPLoader becomes CLIPLoader (the
    same clip_l, type stable_diffusion) under the same node id and links, and the model is the tiny Flux with
    CLIP-L's text width: not a name pick. Either way an empty latent's size becomes 64 x 64 (not a name
    pick), because a real-size Flux VAE decodes 1024 x 1024 far too slowly on a CPU."""
    import copy

    out, edits = copy.deepcopy(prompt), []
    for nid, node in out.items():
        inputs, kind = node["inputs"], node["class_type"]
        if kind == "PrecisionLoadDiffusionModel":
            assert inputs["model_name"] == SHIPPED["model"] and inputs["weight_dtype"] == "default", inputs
            inputs["model_name"] = TINY_FLUX_T5_NAME if t5 else TINY_FLUX_NAME
            edits.append(f"{nid}.model_name")
        elif kind == "VAELoader":
            assert inputs["vae_name"] == SHIPPED["vae"], inputs
            inputs["vae_name"] = VAE_NAME
            edits.append(f"{nid}.vae_name")
        elif kind == "LoadImageTextDataSetFromFolder":
            assert inputs["folder"] == SHIPPED["dataset"], inputs
            inputs["folder"] = DATASET
            edits.append(f"{nid}.folder")
        elif kind == "DualCLIPLoader":
            assert (inputs["clip_name1"], inputs["clip_name2"], inputs["type"]) == (
                SHIPPED["clip_l"], SHIPPED["t5"], "flux"), inputs
            if t5:
                inputs["clip_name1"], inputs["clip_name2"] = CLIP_L_NAME, T5_NAME
                edits += [f"{nid}.clip_name1", f"{nid}.clip_name2"]
                continue
            out[nid] = {"class_type": "CLIPLoader",
                       "inputs": {"clip_name": CLIP_L_NAME, "type": "stable_diffusion", "device": inputs["device"]}}
            edits.append(f"{nid}: DualCLIPLoader -> CLIPLoader")
        elif kind == "PrecisionLoadLoRA" and lora_name is not None:
            inputs["lora_name"] = lora_name
            edits.append(f"{nid}.lora_name")
        elif kind in ("EmptySD3LatentImage", "EmptyLatentImage"):
            inputs["width"] = inputs["height"] = 64
            edits.append(f"{nid}.width/height")
        elif kind == "CheckpointLoaderSimple":
            assert inputs["ckpt_name"] == SHIPPED["checkpoint"], inputs
            inputs["ckpt_name"] = SDXL_NAME
            edits.append(f"{nid}.ckpt_name")
        elif kind == "PrecisionResolutionBuckets":  # not a name: the 64 px test images, not 1024 px photos
            inputs["resolution"] = 64
            edits.append(f"{nid}.resolution")
    return out, edits


_BASE: list[str] = []  # the base directory ComfyUI was started in-process with (main)


def _pack_module(name: str):
    """A sub-module of the pack as ComfyUI loaded it in this process (the demo's tiny Flux builder)."""
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import comfy_bootstrap

    pack = comfy_bootstrap.load_pack_in_process(_BASE[0])
    return importlib.import_module(f"{pack.__name__}.{name}")


def main(argv: list[str]) -> None:
    t5, sdxl = "--t5" in argv, "--sdxl" in argv
    argv = [a for a in argv if a not in ("--t5", "--sdxl")]
    if len(argv) != 1:
        raise SystemExit("usage: real_arch.py BASE_DIR [--t5] [--sdxl]")
    base = os.path.abspath(argv[0])
    _BASE.append(base)
    _pack_module("demo")  # imports ComfyUI (CPU) with this base directory first
    paths = write_all(base, t5=t5)
    if sdxl:
        paths["sdxl"] = write_sdxl(base)
    for what, path in paths.items():
        sys.stderr.write(f"[Precision LoRA] real-architecture {what}: {path}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
