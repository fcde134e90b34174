"""Qwen-Image files that ComfyUI's stock loaders load, for the Qwen-Image real-workflow tests.

    python tests/qwen_image_standin.py BASE_DIR   (the host's venv; links the files into BASE_DIR/models and
                                                   writes the captioned dataset into BASE_DIR/input)

- ``models/diffusion_models/standin_tiny_qwen_image.safetensors`` (stock *Load Diffusion Model*, UNETLoader): a
  tiny Qwen-Image transformer built with ComfyUI's own ``QwenImageTransformer2DModel`` (2 blocks, 2 heads of 32,
  text width 64), bf16, keys as ComfyUI's class names them (the diffusers-format names of the released file).
- ``models/text_encoders/standin_tiny_qwen_2.5_vl.safetensors`` (stock *Load CLIP*, type qwen_image): ComfyUI's
  own Qwen2.5-VL-7B text model class (``Qwen25_7BVLI``) at a tiny config: width 64, 2 layers; the real
  tokenizer, vocabulary and head layout (4 key/value heads of 128, what ComfyUI's detection reads).
  Qwen2.5-VL-7B itself (7 B parameters) is far too large for a test machine's CPU.
- ``models/vae/standin_qwen_image_vae.safetensors`` (stock *Load VAE*): the Qwen-Image VAE (ComfyUI's Wan 2.1
  ``WanVAE``, 96 channels, ~127 M parameters) at its real size, random weights, keys as the released file.

Neither tiny model is something ComfyUI's detection can know: it reads only the block count from a Qwen-Image
transformer (the widths are the class defaults: the released sizes) and builds ``Qwen25_7BVLI`` from its
fixed config. So the test server loads this file as a test-only custom node
(tests/conftest.py links every ``tests/*_standin.py`` into its ``custom_nodes``; it is no part of the pack).
Importing it (``register``) adds two things, each only for these files:

- a subclass of ComfyUI's ``QwenImage`` model config (same name) that matches a 2-block transformer only, put
  ahead of the stock one in ComfyUI's detection list, with the tiny widths;
- around ``comfy.sd.load_text_encoder_state_dicts``: when the one state dict is the tiny encoder (width 64),
  ``Qwen25_7BVLI`` is built with the tiny config. Any other file loads as before.

Everything else is stock: the loaders, the Qwen-Image model class, latent format and sampling, the tokenizer and
its chat template, ``QwenImageTEModel`` and the VAE.

The files are written once per checkout into ``.cache/real_arch`` (name with a hash of the configs below) and
linked into BASE_DIR.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "real_arch")

# The tiny transformer (tests/families.py's QwenImage config): released 60 blocks, 24 heads of 128, text 3584.
TINY_DIT = {"num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 64,
            "axes_dims_rope": [8, 12, 12]}
# The tiny Qwen2.5-VL-7B text model: released hidden 3584, 28 layers, 28 heads, MLP 18944. Kept: the vocabulary
# (the tokenizer's ids), 4 key/value heads of 128 (k_proj's bias is 512 wide: how ComfyUI tells the 7B),
# rope sections. The width is the transformer's text width.
TINY_TE = {"hidden_size": TINY_DIT["joint_attention_dim"], "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4}
# The Wan 2.1 VAE as Qwen-Image ships it: ComfyUI reads dim from the file; the rest is its fixed config.
WAN21_VAE = {"dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
             "temperal_downsample": [False, True, True], "dropout": 0.0}
FORMAT = 1  # raise when the files' contents change in a way the configs above do not show (fill, keys)

# What the tests pick in the shipped workflows (file names in BASE_DIR/models)
DIT_NAME = "standin_tiny_qwen_image.safetensors"
TE_NAME = "standin_tiny_qwen_2.5_vl.safetensors"
VAE_NAME = "standin_qwen_image_vae.safetensors"


def fingerprint() -> str:
    """A short hash of what the files hold: a changed stand-in gets new files in the cache, not the old ones."""
    return hashlib.sha256(json.dumps([TINY_DIT, TINY_TE, WAN21_VAE, FORMAT], sort_keys=True).encode()).hexdigest()[:10]


def _is_tiny_te(sd: dict) -> bool:
    emb, bias = sd.get("model.embed_tokens.weight"), sd.get("model.layers.0.self_attn.k_proj.bias")
    return (emb is not None and bias is not None and emb.shape[-1] == TINY_TE["hidden_size"]
            and bias.shape[0] == 512)


def register() -> None:
    """Adds the tiny transformer's config to ComfyUI's detection list and the tiny text encoder's config around
    the text-encoder loader (once per process)."""
    import dataclasses

    import comfy.sd
    import comfy.supported_models as sm
    import comfy.text_encoders.llama as llama

    if any(getattr(m, "precision_standin_qwen_image", False) for m in sm.models):
        return

    class QwenImage(sm.QwenImage):
        """ComfyUI's QwenImage config, for the tiny transformer only (2 blocks; the released one has 60). Same
        class name: the pack and ComfyUI's logs name a model's family by it."""
        precision_standin_qwen_image = True
        unet_config = {**sm.QwenImage.unet_config, "num_layers": TINY_DIT["num_layers"]}
        unet_extra_config = {k: (tuple(v) if isinstance(v, list) else v) for k, v in TINY_DIT.items()
                             if k != "num_layers"}

    sm.models.insert(sm.models.index(sm.QwenImage), QwenImage)

    stock_config = llama.Qwen25_7BVLI_Config
    tiny_config = dataclasses.make_dataclass(
        "Qwen25_7BVLI_Config", [(k, type(v), dataclasses.field(default=v)) for k, v in TINY_TE.items()],
        bases=(stock_config,))
    stock_load = comfy.sd.load_text_encoder_state_dicts

    def load_text_encoder_state_dicts(state_dicts=[], *args, **kwargs):
        if len(state_dicts) != 1 or not _is_tiny_te(state_dicts[0]):
            return stock_load(state_dicts, *args, **kwargs)
        llama.Qwen25_7BVLI_Config = tiny_config  # read by Qwen25_7BVLI.__init__, inside this call only
        try:
            return stock_load(state_dicts, *args, **kwargs)
        finally:
            llama.Qwen25_7BVLI_Config = stock_config

    comfy.sd.load_text_encoder_state_dicts = load_text_encoder_state_dicts


if "comfy.supported_models" in sys.modules:  # loaded by ComfyUI as a custom node (not by a test reading names)
    register()
NODE_CLASS_MAPPINGS: dict = {}  # a custom node with no nodes: ComfyUI imports it for the registration above


def _fill(module, seed: int) -> None:
    """Seeded weights (ComfyUI's ops leave them uninitialised): fan-in scaled matrices and convolutions, norm
    gains near 1 (by class, and the VAE's RMS_norm 'gamma'), small biases; the token embedding at unit scale
    (read by index, not multiplied)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    gains = {f"{owner}.{p}" if owner else p for owner, sub in module.named_modules() if "Norm" in type(sub).__name__
             for p, _ in sub.named_parameters(recurse=False) if p in ("weight", "scale")}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in gains or name.endswith("gamma"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def _save(sd: dict, path: str, what: str) -> None:
    import safetensors.torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.partial"  # two hosts may write the cached file at once
    safetensors.torch.save_file({k: v.detach().contiguous() for k, v in sd.items()}, tmp,
                                metadata={"precision_lora.standin": what + ", random weights"})
    os.replace(tmp, path)


def dit_state_dict(seed: int = 0) -> dict:
    import torch
    import comfy.supported_models as sm

    register()
    (config_cls,) = [m for m in sm.models if getattr(m, "precision_standin_qwen_image", False)]
    config = config_cls({**config_cls.unet_config, "in_channels": 64})
    config.set_inference_dtype(torch.float32, None)
    with torch.inference_mode(False):
        model = config.get_model({}, "").diffusion_model
        _fill(model, seed)
        return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


def te_state_dict(seed: int = 0) -> dict:
    """The text model's weights only (``model.*``): Qwen-Image encodes text without the vision tower."""
    import torch
    import comfy.ops
    import comfy.text_encoders.llama as llama

    register()
    with torch.inference_mode(False):
        llm = llama.Llama2_(llama.Qwen25_7BVLI_Config(**TINY_TE), device="cpu", dtype=torch.float32,
                            ops=comfy.ops.manual_cast)
        _fill(llm, seed)
        return {f"model.{k}": v.to(torch.bfloat16) for k, v in llm.state_dict().items()}


def vae_state_dict(seed: int = 0) -> dict:
    import inspect

    import torch
    from comfy.ldm.wan.vae import WanVAE

    accepted = inspect.signature(WanVAE.__init__).parameters
    with torch.inference_mode(False):
        vae = WanVAE(**{k: v for k, v in WAN21_VAE.items() if k in accepted})
        _fill(vae, seed)
        return {k: v.to(torch.bfloat16) for k, v in vae.state_dict().items()}


FILES = (("diffusion model", "diffusion_models", DIT_NAME), ("text encoder", "text_encoders", TE_NAME),
         ("vae", "vae", VAE_NAME))


def _cached(name: str) -> str:
    return os.path.join(CACHE, f"{name[: -len('.safetensors')]}_{fingerprint()}.safetensors")


def link_cached(base: str) -> bool:
    """When the cache holds all three files of this fingerprint: link them and write the dataset (no ComfyUI
    needed); returns whether it did."""
    if not all(os.path.exists(_cached(name)) for _, _, name in FILES):
        return False
    write_files(base)
    return True


def write_files(base: str, seed: int = 0) -> dict[str, str]:
    """The three files, written once into the cache (ComfyUI imported) and linked into ``base``'s model folders;
    the dataset."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import real_arch

    makers = {DIT_NAME: lambda: dit_state_dict(seed), TE_NAME: lambda: te_state_dict(seed + 10),
              VAE_NAME: lambda: vae_state_dict(seed + 20)}
    paths = {}
    for what, folder, name in FILES:
        cached = _cached(name)
        if not os.path.exists(cached):
            _save(makers[name](), cached, f"tiny Qwen-Image stand-in {what}")
        path = paths[what] = os.path.join(base, "models", folder, name)
        if not os.path.lexists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.symlink(cached, path)
    paths["dataset"] = os.path.join(base, "input", real_arch.DATASET)
    if not os.path.isdir(paths["dataset"]):
        real_arch.write_dataset(paths["dataset"])
    return paths


# What the shipped Qwen-Image workflows name (workflows/spec_qwen_image.py) -> what the tests pick instead.
PICKS = {("UNETLoader", "unet_name"): DIT_NAME, ("CLIPLoader", "clip_name"): TE_NAME,
         ("VAELoader", "vae_name"): VAE_NAME, ("LoadImageTextDataSetFromFolder", "folder"): "real_arch_captioned"}


def swap_names(prompt: dict, shipped: dict, lora_name: str | None = None) -> tuple[dict, list[str]]:
    """The API prompt of a shipped Qwen-Image workflow with the stand-ins picked; returns it and the edits made
    (what a user would do in the page). ``shipped``: {(class_type, input): the name the workflow ships with},
    checked before each edit. Not names (CPU time only): Resolution Buckets' resolution and an empty latent's
    size become 64 px."""
    from real_workflow_lib import pick_names

    return pick_names(prompt, {key: (shipped[key], value) for key, value in PICKS.items()}, lora_name=lora_name,
                      sizes={"EmptySD3LatentImage": {"width": 64, "height": 64},
                             "PrecisionResolutionBuckets": {"resolution": 64}})


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: qwen_image_standin.py BASE_DIR")
    base = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import comfy_bootstrap

    comfy_bootstrap.init_in_process(base)
    register()
    for what, path in write_files(base).items():
        sys.stderr.write(f"[Precision LoRA] Qwen-Image stand-in {what}: {path}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
