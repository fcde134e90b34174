"""Stand-ins for the Wan 2.2 5B (TI2V) files of the shipped Wan workflows, and the one test-only addition that lets
ComfyUI's stock CLIPLoader (type wan) load a tiny umt5-xxl.

    python tests/wan22_5b_standin.py BASE_DIR     (the host's venv; links the files into BASE_DIR)

What it writes, once per checkout into ``.cache/real_arch/`` (the names carry a fingerprint of the configs below),
linked into BASE_DIR (nothing is downloaded; every weight comes from a seeded generator):

- ``models/diffusion_models/real_arch_tiny_wan22_5b.safetensors``: a tiny Wan 2.2 5B diffusion model built with
  ComfyUI's own class (``supported_models.WAN22_T2V`` -> ``model_base.WAN22``: 48 latent channels in and out,
  per-token timesteps) under the released file's keys (``patch_embedding.weight``, ``blocks.0.self_attn.q.weight``
  ...): 2 blocks of width 128 (one head of 128: ComfyUI's detection derives the head count as width / 128) and
  umt5-xxl's 4096-wide text input. Stock UNETLoader detects it as it detects ``wan2.2_ti2v_5B_fp16`` (nothing
  registered for it).
- ``models/vae/real_arch_wan22_vae.safetensors``: the Wan 2.2 VAE (48 latent channels, 16x16 spatial and 4x
  temporal compression) at its real size, 705 M parameters in fp16 (1.4 GB), ComfyUI's own ``WanVAE`` class with
  the released file's keys; stock VAELoader detects it as it detects ``wan2.2_vae``. On a CPU it encodes a 64 px
  image in ~1 s and decodes one in ~4 s.
- ``models/text_encoders/real_arch_tiny_umt5.safetensors``: umt5-xxl is 5.7 B parameters (11 GB in fp16, minutes per
  caption on a CPU): unaffordable here. This is ComfyUI's own class for it (``comfy.text_encoders.t5.T5`` as
  ``wan.UMT5XXlModel`` builds it) at a tiny config (``TINY_UMT5``: 2 blocks, a 512-piece vocabulary) that keeps
  umt5-xxl's 4096-wide output, so the diffusion model's text input is the released one. Its ``spiece_model`` is a
  sentencepiece model trained here on a few captions (the released file carries umt5's own the same way).

ComfyUI has one umt5-xxl config and recognises a T5-XXL file by its 24th block, so the test servers load this file
as a custom node (tests/conftest.py links every tests/*_standin.py into the session server's ``custom_nodes``; it is
no part of the pack). Importing it wraps two functions of ``comfy.sd``: ``detect_te_model`` answers T5_XXL for the
tiny umt5 (recognised by its shapes, below) and ``load_text_encoder_state_dicts`` passes ComfyUI's own per-model
config override (``model_options["umt5xxl_model_config"]``) for it. Any other file goes through unchanged; the
loader, the tokenizer, the ``wan`` text-encoder classes and everything after them are stock.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CACHE = os.path.join(ROOT, ".cache", "real_arch")

# What ComfyUI's detection derives from the file (comfy/model_detection.py) for a Wan 2.2 5B: the released sizes are
# dim 3072, ffn_dim 14336, 30 blocks; the rest (48 channels, patch (1, 2, 2), freq_dim 256, qk/cross norms) is theirs.
TINY_WAN = {"image_model": "wan2.1", "model_type": "t2v", "dim": 128, "out_dim": 48, "num_heads": 1, "ffn_dim": 256,
            "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
            "cross_attn_norm": True, "eps": 1e-6, "in_dim": 48}
# ComfyUI's VAELoader builds every Wan 2.2 VAE at this config (comfy/sd.py); the file has to match it.
WAN22_VAE = {"dim": 160, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
             "temperal_downsample": [False, True, True], "dropout": 0.0}
# Over comfy/text_encoders/umt5_config_xxl.json (d_model 4096 kept: the diffusion model's text input width).
TINY_UMT5 = {"num_layers": 2, "num_decoder_layers": 2, "num_heads": 2, "d_kv": 16, "d_ff": 64, "vocab_size": 512}
TOKENIZER_TEXT = (
    "a photo of sks, a red square", "a photo of sks, a green square", "a photo of sks, a wide blue band",
    "a photo of sks", "blurry, low quality, static, worst quality, deformed", "the quick brown fox jumps over the lazy dog",
    "a street musician plays guitar in a retro subway station, the camera slowly moves right",
)

# What the shipped workflows name (ComfyUI's own Wan 2.2 5B template's file names) and what the tests pick instead.
SHIPPED = {"model": "wan2.2_ti2v_5B_fp16.safetensors", "clip": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
           "vae": "wan2.2_vae.safetensors", "dataset": "my_lora_dataset"}
MODEL_NAME = "real_arch_tiny_wan22_5b.safetensors"
CLIP_NAME = "real_arch_tiny_umt5.safetensors"
VAE_NAME = "real_arch_wan22_vae.safetensors"
DATASET = "real_arch_captioned"  # tests/real_arch.py's 3 captioned images (64 x 64, 64 x 64, 80 x 48)

FORMAT = 1  # raise when what the files hold changes in a way the configs above do not show (fill, keys)


def fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps([*parts, FORMAT], sort_keys=True).encode()).hexdigest()[:10]


# ---- the test-only registration (runs when the test server imports this file as a custom node) ----

def is_tiny_umt5(sd) -> bool:
    """The tiny umt5 by its shapes: umt5-xxl's 4096-wide model with TINY_UMT5's feed-forward, its tokenizer, and
    no block past TINY_UMT5's last. A released T5 / umt5 file never has a 64-wide feed-forward."""
    wi = sd.get("encoder.block.0.layer.1.DenseReluDense.wi_1.weight")
    return (wi is not None and tuple(wi.shape) == (TINY_UMT5["d_ff"], 4096) and "spiece_model" in sd
            and f"encoder.block.{TINY_UMT5['num_layers']}.layer.0.SelfAttention.q.weight" not in sd)


def register() -> None:
    import comfy.sd

    if getattr(comfy.sd.detect_te_model, "precision_standin", False):
        return
    detect, load = comfy.sd.detect_te_model, comfy.sd.load_text_encoder_state_dicts

    def detect_te_model(sd):
        return comfy.sd.TEModel.T5_XXL if is_tiny_umt5(sd) else detect(sd)

    def load_text_encoder_state_dicts(state_dicts=[], *args, **kwargs):
        if len(state_dicts) == 1 and is_tiny_umt5(state_dicts[0]):
            kwargs["model_options"] = {**kwargs.get("model_options", {}), "umt5xxl_model_config": dict(TINY_UMT5)}
        return load(state_dicts, *args, **kwargs)

    detect_te_model.precision_standin = True
    comfy.sd.detect_te_model = detect_te_model
    comfy.sd.load_text_encoder_state_dicts = load_text_encoder_state_dicts


# Registered when ComfyUI imports the file as a custom node (under its own module name); not when a test imports it
# by name for SHIPPED / swap_names (no ComfyUI there) or when it runs as the script that writes the files.
if __name__ not in ("__main__", "wan22_5b_standin"):
    register()
NODE_CLASS_MAPPINGS: dict = {}  # a custom node with no nodes: ComfyUI imports it for the registration above


# ---- the files (need ComfyUI imported: run as a script, or from a process that imported it) ----

def _fill(module, seed: int) -> None:
    """Seeded weights (ComfyUI's ops leave them uninitialised): fan-in scaled matrices and convolutions, gains of
    norm layers (found by class: LayerNorm, RMSNorm, Wan's RMS_norm) near 1, small biases; the token embedding at
    unit scale (read by index, not multiplied)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    gains = {f"{owner}.{p}" if owner else p for owner, sub in module.named_modules() if "norm" in type(sub).__name__.lower()
             for p, _ in sub.named_parameters(recurse=False) if p in ("weight", "gamma", "scale")}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in gains:
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith("shared.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "relative_attention_bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
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


def write_model(path: str, seed: int = 0) -> None:
    import torch
    import comfy.model_detection
    import comfy.supported_models

    config = comfy.supported_models.WAN22_T2V(dict(TINY_WAN))
    config.set_inference_dtype(torch.float32, None)
    with torch.inference_mode(False):
        model = config.get_model({}, "").diffusion_model
        _fill(model, seed)
        sd = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
    found = comfy.model_detection.model_config_from_unet(sd, "")
    if type(found).__name__ != "WAN22_T2V" or found.unet_config["dim"] != TINY_WAN["dim"]:
        raise RuntimeError(f"ComfyUI detects the tiny Wan 2.2 5B as {type(found).__name__} {found.unet_config}")
    _save(sd, path, f"tiny Wan 2.2 5B (TI2V) stand-in, random weights, seed {seed}")


def write_vae(path: str, seed: int = 0) -> None:
    import torch
    import comfy.ldm.wan.vae2_2

    with torch.inference_mode(False):
        vae = comfy.ldm.wan.vae2_2.WanVAE(**WAN22_VAE)
        _fill(vae, seed)
        sd = {k: v.to(torch.float16) for k, v in vae.state_dict().items()}
    del vae
    _save(sd, path, f"Wan 2.2 VAE at its real size, random weights, seed {seed}")


def spiece_model(vocab_size: int) -> bytes:
    """A sentencepiece model in umt5's layout (pad 0, eos 1, unk 2, no bos; bytes for what it never saw)."""
    import io

    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT * 4), model_writer=out, vocab_size=vocab_size, model_type="bpe",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True, hard_vocab_limit=False, num_threads=1,
        minloglevel=2)
    return out.getvalue()


def write_umt5(path: str, seed: int = 0) -> None:
    import torch
    import comfy.ops
    import comfy.text_encoders.t5 as t5

    with open(os.path.join(os.path.dirname(t5.__file__), "umt5_config_xxl.json")) as f:
        config = {**json.load(f), **TINY_UMT5}
    with torch.inference_mode(False):
        model = t5.T5(config, torch.float32, "cpu", comfy.ops.manual_cast)
        _fill(model, seed)
        sd = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
    proto = spiece_model(TINY_UMT5["vocab_size"])
    sd["spiece_model"] = torch.frombuffer(bytearray(proto), dtype=torch.uint8)
    if not is_tiny_umt5(sd):
        raise RuntimeError("the tiny umt5 does not have the shapes is_tiny_umt5 recognises")
    _save(sd, path, f"tiny umt5-xxl stand-in (4096 wide, {TINY_UMT5}), random weights, seed {seed}")


def write_all(base: str, seed: int = 0) -> dict[str, str]:
    """Writes what is missing in the cache and links it into ``base``; also tests/real_arch.py's captioned images."""
    import real_arch

    files = {
        "model": ("diffusion_models", MODEL_NAME, fingerprint(TINY_WAN), write_model),
        "vae": ("vae", VAE_NAME, fingerprint(WAN22_VAE), write_vae),
        "clip": ("text_encoders", CLIP_NAME, fingerprint(TINY_UMT5, TOKENIZER_TEXT), write_umt5),
    }
    paths = {}
    for what, (folder, name, fp, write) in files.items():
        stem, ext = os.path.splitext(name)
        cached = os.path.join(CACHE, f"{stem}_{fp}{ext}")
        if not os.path.exists(cached):
            write(cached, seed)
        path = paths[what] = os.path.join(base, "models", folder, name)
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.symlink(cached, path)
    paths["dataset"] = os.path.join(base, "input", DATASET)
    if not os.path.isdir(paths["dataset"]):
        real_arch.write_dataset(paths["dataset"])
    return paths


def swap_names(prompt: dict, lora_name: str | None = None) -> tuple[dict, list[str]]:
    """The API prompt of a shipped Wan 2.2 5B workflow with this module's files picked; returns it and the edits
    made (what a user does in the page). Every name edit checks the shipped value first. Not names (CPU time):
    the bucket resolution (64 px test images) and the video latent (64 x 64, 1 frame)."""
    from real_workflow_lib import pick_names

    picks = {("UNETLoader", "unet_name"): (SHIPPED["model"], MODEL_NAME),
             ("CLIPLoader", "clip_name"): (SHIPPED["clip"], CLIP_NAME), ("CLIPLoader", "type"): ("wan",) * 2,
             ("VAELoader", "vae_name"): (SHIPPED["vae"], VAE_NAME),
             ("LoadImageTextDataSetFromFolder", "folder"): (SHIPPED["dataset"], DATASET)}
    sizes = {"PrecisionResolutionBuckets": {"resolution": 64},
             "Wan22ImageToVideoLatent": {"width": 64, "height": 64, "length": 1}}
    return pick_names(prompt, picks, lora_name=lora_name, sizes=sizes)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: wan22_5b_standin.py BASE_DIR")
    sys.path.insert(0, HERE)
    import real_arch

    base = os.path.abspath(argv[0])
    real_arch._BASE.append(base)
    real_arch._pack_module("demo")  # imports ComfyUI (CPU) with this base directory first
    for what, path in write_all(base).items():
        sys.stderr.write(f"[Precision LoRA] Wan 2.2 5B stand-in {what}: {path}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
