"""LoRA nodes in a real ComfyUI server over HTTP: Attach (init from a file) → Save; the saved file through
stock LoraLoaderModelOnly and through PrecisionLoadLoRA gives the same sampled latent as the attached LoRA."""
from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

from lora.file import save_lora_file

pytestmark = pytest.mark.e2e

COSMOS = "precision_tiny_cosmos.safetensors"
ATTACH = dict(rank=4, alpha=4.0, targets="self_attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0, dry_run=False)


def _write_init_lora(server) -> str:
    """A non-zero rank-4 LoRA for the demo Cosmos model's self-attention, written into the server's loras folder."""
    model = safetensors.torch.load_file(os.path.join(server.base_dir, "models", "diffusion_models", COSMOS))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for key, w in model.items():
        if ".self_attn." in key and key.endswith("_proj.weight"):
            prefix = "diffusion_model." + key[: -len(".weight")]
            tensors[prefix + ".lora_down.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.1
            tensors[prefix + ".lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.1
            tensors[prefix + ".alpha"] = torch.tensor(4.0)
    assert tensors
    return save_lora_file(os.path.join(server.base_dir, "models", "loras", "e2e_init.safetensors"), tensors, {},
                          overwrite=True)


def _sample(model_node: dict, prefix: str) -> dict:
    return {
        "1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": COSMOS, "weight_dtype": "fp32"}},
        "2": model_node,
        "3": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["1", 0], "text": "sks", "seed": 0, "tokens": 8}},
        "4": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["1", 0], "width": 64, "height": 48, "batch_size": 1, "seed": 1}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["2", 0], "positive": ["3", 0], "negative": ["3", 0], "latent_image": ["4", 0],
            "seed": 3, "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": prefix}},
    }


def _latent(server, entry: dict) -> torch.Tensor:
    saved = entry["outputs"]["6"]["latents"][0]
    return safetensors.torch.load_file(server.output_path(saved["subfolder"], saved["filename"]))["latent_tensor"]


def test_attach_save_then_stock_and_precision_loaders_match(server):
    _write_init_lora(server)
    attach = {"class_type": "PrecisionAttachLoRA", "inputs": {"model": ["1", 0], **ATTACH, "init_lora": "e2e_init.safetensors"}}
    prompt = _sample(attach, "e2e_lora/attached")
    prompt["7"] = {"class_type": "PrecisionSaveLoRA", "inputs": {
        "model": ["2", 0], "filename_prefix": "e2e/lora", "folder": "loras", "save_dtype": "fp32", "key_style": "auto",
        "use_counter": True, "overwrite": False}}
    entry = server.run(prompt)
    attached = _latent(server, entry)
    (path,) = entry["outputs"]["7"]["text"]
    assert path == os.path.join(server.base_dir, "models", "loras", "e2e", "lora_00001_.safetensors")
    name = "e2e/lora_00001_.safetensors"
    log_before = server.log_text().count("lora key not loaded")
    stock = _latent(server, server.run(_sample(
        {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": name, "strength_model": 1.0}},
        "e2e_lora/stock")))
    ours = _latent(server, server.run(_sample(
        {"class_type": "PrecisionLoadLoRA", "inputs": {
            "model": ["1", 0], "lora_name": name, "strength": 1.0, "mode": "fp32", "attention": "apply_recorded",
            "override_backend": "auto", "override_scale_mode": "default", "override_scale_value": 1.0}},
        "e2e_lora/ours")))
    base = _latent(server, server.run(_sample(
        {"class_type": "PrecisionLoadLoRA", "inputs": {
            "model": ["1", 0], "lora_name": name, "strength": 0.0, "mode": "merge", "attention": "ignore",
            "override_backend": "auto", "override_scale_mode": "default", "override_scale_value": 1.0}},
        "e2e_lora/base")))
    assert server.log_text().count("lora key not loaded") == log_before == 0
    torch.testing.assert_close(ours, attached, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stock, attached, rtol=1e-4, atol=1e-4)
    assert (base - attached).abs().max() > 1e-3, "the LoRA must change the sample for this test to mean anything"
