"""Tiny real ComfyUI models and matching data for tests (built at test time, never committed).

Every model is a ComfyUI ModelPatcher around ComfyUI's real model class (Flux.1 dev/schnell, Flux.2,
Cosmos-Predict2, Anima on ComfyUI 0.33+), fp32 by default, with seeded random weights that are ordinary
(trainable) tensors.
"""
from __future__ import annotations

import zlib

import torch

from comfy_harness import pack_module


def _tiny():
    return pack_module("demo.tiny_models")


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """family: "cosmos", "anima", "flux1_dev", "flux1_schnell", "flux2"."""
    return _tiny().build_tiny_model(family, seed, dtype)


def tiny_flux1(variant: str = "dev", seed: int = 0, dtype: torch.dtype = torch.float32):
    return tiny_model(f"flux1_{variant}", seed, dtype)


def tiny_flux2(seed: int = 0, dtype: torch.dtype = torch.float32):
    return tiny_model("flux2", seed, dtype)


def tiny_cosmos(seed: int = 0, dtype: torch.dtype = torch.float32):
    return tiny_model("cosmos", seed, dtype)


def make_latent(model, batch: int = 1, width: int = 64, height: int = 64, seed: int = 0) -> dict:
    """LATENT dict {"samples": ...} of the model's latent shape (Cosmos: 5-D (B,16,1,H/8,W/8))."""
    return pack_module("demo.nodes").make_latent(model, width, height, batch, seed)


def tiny_anima(seed: int = 0, dtype: torch.dtype = torch.float32):
    return tiny_model("anima", seed, dtype)


def is_anima(model) -> bool:
    return hasattr(model.model.diffusion_model, "llm_adapter")


def anima_extras(text: str, seed: int = 0, tokens: int = 8) -> dict:
    """What ComfyUI's Anima text encoder adds to a CONDITIONING: T5 token ids (tokens,) int32 and their
    weights (tokens,) fp32, one row shared by the batch (as ``comfy.text_encoders.anima`` writes them)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{text}".encode()))
    ids = torch.randint(0, 32128, (tokens,), generator=gen, dtype=torch.int32)
    return {"t5xxl_ids": ids, "t5xxl_weights": torch.ones(tokens)}


# A Qwen3 of Qwen3-0.6B's width (1024, what Anima's adapter reads) with one small layer and a cut vocabulary
# (the ids of short English prompts are far below 32768), set through ComfyUI's own per-encoder config option.
TINY_QWEN3 = {"num_hidden_layers": 1, "vocab_size": 32768, "intermediate_size": 256, "num_attention_heads": 2,
              "num_key_value_heads": 1}


def tiny_anima_text_encoder(seed: int = 0):
    """A CLIP from ComfyUI's text-encoder loader for a random tiny Qwen3 state dict: ComfyUI detects it as
    Qwen3-0.6B and builds Anima's text encoder (``comfy.text_encoders.anima``) with ``TINY_QWEN3``."""
    import comfy.ops
    import comfy.sd
    import comfy.text_encoders.llama

    shapes = comfy.text_encoders.llama.Qwen3_06B(TINY_QWEN3, torch.float32, "meta", comfy.ops.manual_cast).state_dict()
    gen = torch.Generator().manual_seed(seed)
    sd = {k: (torch.randn(v.shape, generator=gen) * 0.05 if v.ndim > 1 else 1.0 + 0.1 * torch.randn(v.shape, generator=gen))
          for k, v in shapes.items()}
    return comfy.sd.load_text_encoder_state_dicts([sd], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION,
                                                  model_options={"qwen3_06b_model_config": TINY_QWEN3})


def make_conditioning(model, batch: int = 1, text: str = "a photo of sks", seed: int = 0, tokens: int = 8) -> list:
    """CONDITIONING [[context (batch, tokens, width), {"pooled_output": ..., "guidance": ...}]]; Anima
    conditioning also carries ``anima_extras`` (so its LLM adapter runs, as with the real text encoder)."""
    cond = pack_module("demo.nodes").make_conditioning(model, text, seed, tokens)
    if is_anima(model):
        cond = [[cond[0][0], {**cond[0][1], **anima_extras(text, seed, tokens)}]]
    if batch > 1:
        context, extra = cond[0]
        extra = dict(extra)
        if extra.get("pooled_output") is not None:
            extra["pooled_output"] = extra["pooled_output"].repeat(batch, 1)
        cond = [[context.repeat(batch, 1, 1), extra]]
    return cond


def write_model_file(family: str, path: str, seed: int = 0) -> str:
    """Write a tiny model file PrecisionLoadDiffusionModel loads (Cosmos also loads with stock UNETLoader)."""
    return _tiny().write_tiny_model(family, path, seed)


def denoise(model, seed: int = 0) -> torch.Tensor:
    """One euler step through ComfyUI's sampler (loads the model, applies object patches), as KSampler runs."""
    import comfy.sample

    latent = make_latent(model, batch=1, seed=seed)["samples"]
    cond = make_conditioning(model, batch=1)
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():  # as ComfyUI's executor runs KSampler
        return comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent, disable_pbar=True,
                                   seed=seed)


def randomize_lora(lora_set, seed: int, std: float = 0.2) -> None:
    """Give every adapter a seeded non-zero up factor (a fresh LoRA is the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode(False), torch.no_grad():
        for a in lora_set.adapters().values():
            a.up.copy_(torch.randn(a.up.shape, generator=g) * std)
            a.mark_modified()


def cosmos_with_lora(mods, width: int = 16, height: int = 16):
    """A tiny Cosmos with a rank-2 attention LoRA attached (``mods``: the train_mods fixture), one latent of
    ``width`` x ``height`` pixels and one conditioning: (model, latent, conditioning)."""
    model = tiny_cosmos()
    with torch.inference_mode():
        m = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=2, alpha=2, targets="attention"))
    return m, make_latent(model, 1, width=width, height=height), make_conditioning(model, 1)


def memorise(model, steps: int, lr: float, *, checkpointing: bool = False, rank: int = 8):
    """Train a rank-``rank`` LoRA (attention + MLP) on ``model`` for ``steps`` steps on one 16 px latent with the noise
    fixed to one draw (so the loss can fall on a random tiny model; see test_train_memorise.py), through the pack's
    own session and loop. Returns (losses, the model with the trained LoRA installed)."""
    glue, tglue, tdata, loop = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.train.data",
                                                          "training.loop"))
    settings = pack_module("training.settings").TrainSettings(learning_rate=lr, gradient_checkpointing=checkpointing)
    latent, cond = make_latent(model, 1, width=16, height=16), make_conditioning(model, 1)
    with torch.inference_mode():
        config = pack_module("lora.config").LoRAConfig(rank=rank, alpha=rank, targets="attention_mlp")
        out, lora_set = tglue.fork_lora(glue.attach_lora(model, config))
        with tglue.training_session(out, lora_set, settings) as device:
            samples = tdata.build_samples(out, [latent], [cond], None, device)
            base = tglue.model_fns(out, lora_set, settings, device)
            fns, _ = fixed_noise_fns(base, samples, device)
            result = loop.train(lora_set, samples, fns, settings, steps, seed=0)
    return [p["loss"] for p in result.state.history], glue.install(out, lora_set)


def fixed_noise_fns(base, samples, device, seed: int = 3):
    """The model's training functions (``nodes.train.glue.model_fns``) with the noise fixed to one seeded draw, so a
    loss can fall on a random tiny model (the memorisation tests): (functions, the noise)."""
    import dataclasses

    fixed = torch.randn((1, *samples[0].latent.shape), generator=torch.Generator().manual_seed(seed)).to(device)
    return dataclasses.replace(base, noise_latent=lambda s, n, x0: base.noise_latent(s, fixed, x0),
                               target=lambda s, n, x0: base.target(s, fixed, x0)), fixed
