"""Training on a scaled-fp8 base through a real server's /prompt (issue 29 item 4), as a user's graph runs it:
ComfyUI's own Load Diffusion Model on a file in ComfyUI's scaled-fp8 format (``scaled_fp8`` marker, per-layer
``scale_weight``), Attach LoRA, Train LoRA, Save LoRA; then stock LoraLoaderModelOnly loads the saved LoRA onto
that scaled-fp8 model with no missing key and changes its sample. The numerics are tested in process
(tests/comfy/test_quantized_base.py)."""
from __future__ import annotations

import json
import math
import os

import pytest
import safetensors.torch
import torch

from training.settings import TrainSettings

pytestmark = pytest.mark.e2e

SOURCE = "precision_tiny_cosmos.safetensors"
SCALED = "e2e_cosmos_scaled_fp8.safetensors"
ATTACH = dict(rank=4, alpha=4.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
              dry_run=False, init_lora="none")


def write_scaled_fp8(folder: str) -> None:
    """The demo Cosmos with every 2-D weight (all Linear in this model) in ComfyUI's scaled-fp8 format."""
    sd = safetensors.torch.load_file(os.path.join(folder, SOURCE))
    with safetensors.safe_open(os.path.join(folder, SOURCE), "pt") as f:
        metadata = f.metadata()
    out = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, t in sd.items():
        if key.endswith(".weight") and t.ndim == 2:
            scale = t.float().abs().amax() / 448.0
            layer = key[: -len(".weight")]
            out.update({key: (t.float() / scale).to(torch.float8_e4m3fn), f"{layer}.scale_weight": scale.reshape(()),
                        f"{layer}.scale_input": torch.ones(())})
        else:
            out[key] = t
    safetensors.torch.save_file(out, os.path.join(folder, SCALED), metadata=metadata)


def _nodes(model: list, prefix: str, first: int) -> dict:
    a, b, c, d = (str(first + i) for i in range(4))
    return {
        a: {"class_type": "PrecisionDemoConditioning", "inputs": {"model": model, "text": "sks", "seed": 0, "tokens": 8}},
        b: {"class_type": "PrecisionDemoLatent", "inputs": {"model": model, "width": 16, "height": 16, "batch_size": 1,
                                                              "seed": 1}},
        c: {"class_type": "KSampler", "inputs": {
            "model": model, "positive": [a, 0], "negative": [a, 0], "latent_image": [b, 0], "seed": 3, "steps": 1,
            "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        d: {"class_type": "SaveLatent", "inputs": {"samples": [c, 0], "filename_prefix": prefix}},
    }


def _latent(server, entry: dict, node: str) -> torch.Tensor:
    saved = entry["outputs"][node]["latents"][0]
    return safetensors.torch.load_file(server.output_path(saved["subfolder"], saved["filename"]))["latent_tensor"]


def test_train_on_scaled_fp8_through_stock_loader_and_stock_load_the_lora(server):
    write_scaled_fp8(os.path.join(server.base_dir, "models", "diffusion_models"))
    settings = TrainSettings(learning_rate=1e-2).to_dict()
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": SCALED, "weight_dtype": "default"}},
        "2": {"class_type": "PrecisionAttachLoRA", "inputs": {"model": ["1", 0], **ATTACH}},
        "3": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["1", 0], "text": "sks", "seed": 0, "tokens": 8}},
        "4": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["1", 0], "width": 16, "height": 16, "batch_size": 1, "seed": 1}},
        "5": {"class_type": "PrecisionTrainSettings", "inputs": settings},
        "6": {"class_type": "PrecisionTrainLoRA", "inputs": {
            "model": ["2", 0], "latents": ["4", 0], "conditioning": ["3", 0], "settings": ["5", 0],
            "steps": 2, "seed": 0, "name": "e2e_scaled_fp8"}},
        "7": {"class_type": "PrecisionSaveLoRA", "inputs": {
            "model": ["6", 0], "filename_prefix": "e2e_scaled_fp8/lora", "folder": "loras", "save_dtype": "fp32",
            "key_style": "auto", "use_counter": True, "overwrite": False}},
    }
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[:3000]
    (path,) = entry["outputs"]["7"]["text"]
    name = os.path.relpath(path, os.path.join(server.base_dir, "models", "loras"))
    before = server.log_text().count("lora key not loaded")
    stock = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": SCALED, "weight_dtype": "default"}},
        "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": name, "strength_model": 1.0}},
        **_nodes(["2", 0], "e2e_scaled_fp8/with_lora", 3),
        **_nodes(["1", 0], "e2e_scaled_fp8/base", 7),
    }
    stock_entry = server.run(stock)
    assert server.log_text().count("lora key not loaded") == before == 0
    with_lora, base = _latent(server, stock_entry, "6"), _latent(server, stock_entry, "10")
    assert math.isfinite(float(with_lora.abs().max()))
    assert (with_lora - base).abs().max() > 1e-3, "the stock-loaded LoRA must change the scaled-fp8 model's sample"
