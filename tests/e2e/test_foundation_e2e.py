"""The pack in a real ComfyUI server: registration, tooltips, the page, and a tiny Cosmos sampled end to end."""
from __future__ import annotations

import glob
import os

import pytest
import safetensors.torch
import torch

pytestmark = pytest.mark.e2e

COSMOS = "precision_tiny_cosmos.safetensors"


def test_object_info_lists_loader_with_tooltips(server):
    info = server.object_info("PrecisionLoadDiffusionModel")["PrecisionLoadDiffusionModel"]
    required = info["input"]["required"]
    assert set(required) == {"model_name", "weight_dtype"}
    assert COSMOS in required["model_name"][0] or COSMOS in str(required["model_name"])
    for name, spec in required.items():
        assert spec[1].get("tooltip"), f"input {name} has no tooltip"
    assert info["output_name"] == ["model", "info"]
    assert info["category"] == "precision_lora/loaders"


def test_page_loads_and_log_has_no_pack_import_failure(server):
    status, body = server.get("/")
    assert status == 200 and "<html" in str(body).lower()
    assert server.pack_import_errors() == []
    assert "IMPORT FAILED" not in "\n".join(
        ln for ln in server.log_text().splitlines() if "precision-lora" in ln)


def _cosmos_ksampler_prompt(prefix: str) -> dict:
    return {
        "1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": COSMOS, "weight_dtype": "fp32"}},
        "2": {"class_type": "PrecisionDemoConditioning",
              "inputs": {"model": ["1", 0], "text": "a photo of sks", "seed": 0, "tokens": 8}},
        "3": {"class_type": "PrecisionDemoLatent",
              "inputs": {"model": ["1", 0], "width": 64, "height": 48, "batch_size": 2, "seed": 1}},
        "4": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["3", 0],
            "seed": 3, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "5": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": prefix}},
    }


def test_tiny_cosmos_through_loader_and_ksampler(server):
    entry = server.run(_cosmos_ksampler_prompt("e2e_foundation/cosmos"))
    saved = entry["outputs"]["5"]["latents"][0]
    path = server.output_path(saved["subfolder"], saved["filename"])
    latent = safetensors.torch.load_file(path)["latent_tensor"]
    assert tuple(latent.shape) == (2, 16, 1, 48 // 8, 64 // 8)
    assert torch.isfinite(latent).all()
    assert latent.float().std() > 0


def test_missing_model_file_is_a_clear_validation_error(server):
    prompt = _cosmos_ksampler_prompt("e2e_foundation/missing")
    prompt["1"]["inputs"]["model_name"] = "does_not_exist.safetensors"
    with pytest.raises(AssertionError, match="does_not_exist.safetensors"):
        server.post_prompt(prompt)
    assert glob.glob(os.path.join(server.output_path("e2e_foundation"), "missing*")) == []
