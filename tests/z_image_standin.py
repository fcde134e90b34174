"""Tiny Z-Image and Qwen3-4B files that ComfyUI's stock loaders load, for the Z-Image real-workflow tests
(and the Flux.2 klein ones, which share the Qwen3-4B text encoder).

The released files are too large for a test machine's CPU: Z-Image Turbo's diffusion model is 6 B parameters
(width 3840) and its text encoder, Qwen3-4B, 4 B. ComfyUI detects both from their shapes:

- the diffusion model (``comfy/model_detection.py``): a Lumina2-style NextDiT is Z-Image only at width 3840;
  at any other width it is plain Lumina 2 with no head count, so no smaller Z-Image loads through UNETLoader.
- the text encoder (``comfy/sd.py`` ``detect_te_model``): a Qwen3 of width 2560 is Qwen3-4B (0.3.75: any
  Qwen3), and ComfyUI builds it with ``Qwen3_4BConfig``'s 36 layers and 9728-wide MLPs whatever the file holds.

So the test servers load this file as a test-only custom node (tests/conftest.py links every
``tests/*_standin.py`` into the session server's ``custom_nodes``; it is no part of the pack). Importing it
registers two things, and nothing else changes:

- ``ZImage``: a subclass of ComfyUI's own ``ZImage`` config (same name; the pack and ComfyUI's logs name a
  family by it), put ahead of ``Lumina2`` in ComfyUI's detection list, that matches the tiny width below and
  supplies what detection gives a 3840-wide file (heads, RoPE axes and theta, modulation, time scale, pad
  tokens) at that size. UNETLoader, the model class (``model_base.Lumina2`` / ``NextDiT``), latent format
  (Flux's 16 channels) and sampling (shift 3) are stock.
- the tiny Qwen3-4B config: when ComfyUI's text-encoder loader gets a state dict of this module's tiny
  Qwen3-4B (width 2560 as the real one, so stock detection calls it Qwen3-4B on both hosts; 28 layers, so
  Flux.2 klein's hidden layers 9, 18, 27 exist; 2 heads; 64-wide MLPs), it passes ComfyUI's own
  ``qwen3_4b_model_config`` model option with that config, as a caller of ``comfy.sd.load_clip`` may. The
  CLIPLoader, tokenizer (Qwen2.5's real vocabulary of 151936), chat template, ``Qwen3_4B`` class and the
  Z-Image / klein text-encoder wrappers are stock. Any other Qwen3 file loads as before.

    write_qwen3_4b_standin(path)   # ~0.9 GB in bf16 (the 151936 x 2560 token embedding is most of it)
    write_z_image_standin(path)    # ~14 MB: 2 layers and 2 refiner layers of each kind, width 256
    python tests/z_image_standin.py BASE_DIR    # both, cached in .cache/real_arch, linked into BASE_DIR/models

A process that imports this module must have ComfyUI importable (a custom node, or after
``scripts/comfy_bootstrap.init_in_process``); registration runs on import except in script mode.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "real_arch")

# The tiny Qwen3-4B: Qwen3_4BConfig's fields that differ from the real model (head_dim stays 128).
QWEN3_4B_TINY = {"num_hidden_layers": 28, "intermediate_size": 64, "num_attention_heads": 2,
                 "num_key_value_heads": 1}
QWEN3_4B_WIDTH, QWEN3_VOCAB = 2560, 151936  # what detection and the tokenizer need, as released
# The tiny Z-Image: what ComfyUI's detection reads from a file (model_detection.py's Lumina 2 branch) ...
Z_IMAGE_DETECTED = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256,
                    "cap_feat_dim": QWEN3_4B_WIDTH, "n_layers": 2, "qk_norm": True}
# ... and what it adds for a 3840-wide Z-Image, at this width: 2 heads of Z-Image's 128 channels (RoPE axes
# 32 + 48 + 48 as released), Z-Image's theta, FFN multiplier, modulation, time scale and pad tokens.
Z_IMAGE_EXTRA = {"n_heads": 2, "n_kv_heads": 2, "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512],
                 "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True,
                 "time_scale": 1000.0, "pad_tokens_multiple": 32}
FORMAT = 1  # raise when the files' contents change in a way the configs above do not show (fill, keys)

QWEN3_4B_NAME = "real_arch_qwen3_4b_tiny.safetensors"
Z_IMAGE_NAME = "real_arch_tiny_z_image.safetensors"


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps([*parts, FORMAT], sort_keys=True).encode()).hexdigest()[:10]


def qwen3_4b_fingerprint() -> str:
    """A short hash of what the text-encoder file holds (a changed stand-in gets a new cached file)."""
    return _fingerprint(QWEN3_4B_TINY, QWEN3_4B_WIDTH, QWEN3_VOCAB)


def z_image_fingerprint() -> str:
    return _fingerprint(Z_IMAGE_DETECTED, Z_IMAGE_EXTRA)


# -- registration (in the ComfyUI process) ------------------------------------------------------------------

def is_qwen3_4b_standin(sd: dict) -> bool:
    """Whether a text-encoder state dict is this module's tiny Qwen3-4B (the real one's MLPs are 9728 wide)."""
    gate = sd.get("model.layers.0.mlp.gate_proj.weight")
    return (gate is not None and "model.layers.0.self_attn.q_norm.weight" in sd
            and tuple(gate.shape) == (QWEN3_4B_TINY["intermediate_size"], QWEN3_4B_WIDTH)
            and f"model.layers.{QWEN3_4B_TINY['num_hidden_layers'] - 1}.mlp.gate_proj.weight" in sd)


def register_qwen3_4b() -> None:
    """ComfyUI's text-encoder loader builds the tiny Qwen3-4B with ``QWEN3_4B_TINY`` (once per process)."""
    import comfy.sd

    stock = comfy.sd.load_text_encoder_state_dicts
    if getattr(stock, "precision_standin", False):
        return

    def load_text_encoder_state_dicts(*args, **kwargs):
        state_dicts = args[0] if args else kwargs.get("state_dicts", [])
        if any(is_qwen3_4b_standin(sd) for sd in state_dicts):
            if len(args) > 3:
                args = (*args[:3], {**args[3], "qwen3_4b_model_config": dict(QWEN3_4B_TINY)}, *args[4:])
            else:
                kwargs["model_options"] = {**kwargs.get("model_options", {}),
                                           "qwen3_4b_model_config": dict(QWEN3_4B_TINY)}
        return stock(*args, **kwargs)

    load_text_encoder_state_dicts.precision_standin = True
    comfy.sd.load_text_encoder_state_dicts = load_text_encoder_state_dicts


def z_image_config_class():
    """ComfyUI's ``ZImage`` config, matching the tiny width instead of 3840 (same class name)."""
    import comfy.supported_models

    for m in comfy.supported_models.models:
        if getattr(m, "precision_standin", None) == "z_image":
            return m

    class ZImage(comfy.supported_models.ZImage):
        precision_standin = "z_image"
        unet_config = {k: Z_IMAGE_DETECTED[k] for k in ("image_model", "dim", "cap_feat_dim")}
        unet_extra_config = dict(Z_IMAGE_EXTRA)

    return ZImage


def register_z_image() -> None:
    """Put the tiny Z-Image's config ahead of Lumina 2 (which matches any width) in ComfyUI's detection list."""
    import comfy.supported_models as sm

    cls = z_image_config_class()
    if cls not in sm.models:
        sm.models.insert(sm.models.index(sm.Lumina2), cls)


def register() -> None:
    register_qwen3_4b()
    register_z_image()


# -- the files (any process with ComfyUI importable) --------------------------------------------------------

def _fill(module, seed: int) -> None:
    """Seeded weights (ComfyUI's ops leave them uninitialised): fan-in scaled matrices, norm gains near 1,
    small biases and vectors; the token embedding at 0.02 (read by index, not multiplied)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def _save(sd: dict, path: str, note: str) -> None:
    import safetensors.torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.partial"  # two hosts may write the cached file at once
    safetensors.torch.save_file({k: v.detach().contiguous() for k, v in sd.items()}, tmp,
                                metadata={"precision_lora.real_arch": note})
    os.replace(tmp, path)


def write_qwen3_4b_standin(path: str, seed: int = 0) -> None:
    """The tiny Qwen3-4B under the released ``qwen_3_4b.safetensors``' keys (``model.embed_tokens``,
    ``model.layers.N.*``, ``model.norm``) and shapes, from ComfyUI's own ``Qwen3_4B`` class (built on the meta
    device: only the bf16 tensors written are allocated, the embedding a slice at a time), in bf16."""
    import torch
    import comfy.ops
    import comfy.text_encoders.llama as llama

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in
                  llama.Qwen3_4B(dict(QWEN3_4B_TINY), torch.float32, "meta", comfy.ops.manual_cast).state_dict().items()}
    assert shapes["model.embed_tokens.weight"] == (QWEN3_VOCAB, QWEN3_4B_WIDTH), shapes["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        if name.endswith("embed_tokens.weight"):  # read by index, not multiplied
            t = torch.empty(shape, dtype=torch.bfloat16)
            for i in range(0, shape[0], 8192):
                t[i:i + 8192] = 0.02 * torch.randn((min(8192, shape[0] - i), shape[1]), generator=gen)
        elif len(shape) >= 2:  # fan-in scaled: activations stay near unit scale through the layers
            t = (torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))).to(torch.bfloat16)
        elif "norm" in name:
            t = (1.0 + 0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        else:
            t = (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        sd[name] = t
    _save(sd, path, f"tiny Qwen3-4B stand-in {QWEN3_4B_TINY}, random weights, seed {seed}")


def write_z_image_standin(path: str, seed: int = 0) -> None:
    """The tiny Z-Image (ComfyUI's own ``model_base.Lumina2`` / ``NextDiT`` through the config above) under
    the keys of the released ``z_image_turbo_bf16.safetensors`` (the NextDiT's own, no prefix), in bf16."""
    import torch

    config = z_image_config_class()(dict(Z_IMAGE_DETECTED))
    with torch.inference_mode(False):
        model = config.get_model({}, "").diffusion_model
        _fill(model, seed)
        sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    # 0.3.75's NextDiT has an unused final RMSNorm that 0.33.0's dropped; the released file has none either
    # (0.3.75 logs it as missing and never reads it), so the cached file is the same whichever host wrote it.
    sd.pop("norm_final.weight", None)
    _save(sd, path, f"tiny Z-Image stand-in {Z_IMAGE_DETECTED} {Z_IMAGE_EXTRA}, random weights, seed {seed}")


def _cached(write, name: str, fingerprint: str, link: str, seed: int) -> str:
    stem, ext = os.path.splitext(name)
    cached = os.path.join(CACHE, f"{stem}_{fingerprint}{ext}")
    if not os.path.exists(cached):
        write(cached, seed)
    if not os.path.lexists(link):
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(cached, link)
    return link


def link_qwen3_4b_standin(base: str, seed: int = 0) -> str:
    """The tiny Qwen3-4B, written once per checkout into .cache/real_arch and linked into
    ``base``/models/text_encoders as ``QWEN3_4B_NAME``; returns the link's path."""
    return _cached(write_qwen3_4b_standin, QWEN3_4B_NAME, qwen3_4b_fingerprint(),
                   os.path.join(base, "models", "text_encoders", QWEN3_4B_NAME), seed)


def link_z_image_standin(base: str, seed: int = 0) -> str:
    """The tiny Z-Image, cached and linked into ``base``/models/diffusion_models as ``Z_IMAGE_NAME``."""
    return _cached(write_z_image_standin, Z_IMAGE_NAME, z_image_fingerprint(),
                   os.path.join(base, "models", "diffusion_models", Z_IMAGE_NAME), seed)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: z_image_standin.py BASE_DIR")
    base = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import comfy_bootstrap

    comfy_bootstrap.init_in_process(base)
    for what, path in (("qwen3_4b", link_qwen3_4b_standin(base)), ("z_image", link_z_image_standin(base))):
        sys.stderr.write(f"[Precision LoRA] real-architecture {what}: {path}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
else:  # imported by ComfyUI as a (test-only) custom node, or by a test process that imported ComfyUI
    register()

NODE_CLASS_MAPPINGS: dict = {}  # a custom node with no nodes: ComfyUI imports it for the registration above
