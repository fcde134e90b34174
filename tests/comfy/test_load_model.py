"""PrecisionLoadDiffusionModel in-process: training-safe weights, dtype choice, info, clear errors."""
from __future__ import annotations

import math
import os

import pytest
import torch

import comfy_harness
from models import write_model_file


@pytest.fixture(scope="module")
def model_dir(pack):
    import folder_paths

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    os.makedirs(folder, exist_ok=True)
    for family in ("cosmos", "flux1_dev", "flux2"):
        write_model_file(family, os.path.join(folder, f"loader_{family}.safetensors"))
    return folder


def _load(name: str, dtype: str = "default"):
    node = comfy_harness.node_class("PrecisionLoadDiffusionModel")
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        out = node.execute(model_name=name, weight_dtype=dtype)
    return out.args if hasattr(out, "args") else out.result


@pytest.mark.parametrize("family,heads,head_dim,config", [
    ("cosmos", 16, 12, "CosmosT2IPredict2"), ("flux1_dev", 2, 32, "Flux"), ("flux2", 2, 32, "Flux2")])
def test_loads_trainable_weights_and_reports_heads(model_dir, family, heads, head_dim, config):
    model, info = _load(f"loader_{family}.safetensors", "fp32")
    params = list(model.model.diffusion_model.parameters())
    assert params and not any(p.is_inference() for p in params)
    assert all(p.dtype == torch.float32 for p in params)
    assert f"attention heads: {heads}" in info and f"head_dim: {head_dim}" in info
    assert f"{1 / math.sqrt(head_dim):.6g}" in info and config in info
    # autograd can save the weights for backward (an inference tensor raises here). The base stays frozen
    # or not as ComfyUI builds it (0.30+ freezes it at construction); training freezes it either way.
    w = params[0]
    x = torch.ones_like(w, requires_grad=True)
    (w * x).sum().backward()
    assert torch.equal(x.grad, w)


def test_bf16_weight_dtype(model_dir):
    model, info = _load("loader_flux1_dev.safetensors", "bf16")
    assert model.model.diffusion_model.img_in.weight.dtype == torch.bfloat16
    assert "weight dtype: bfloat16" in info


def test_cosmos_file_also_loads_with_stock_unet_loader(model_dir):
    import nodes as comfy_nodes

    (stock,) = comfy_nodes.UNETLoader().load_unet("loader_cosmos.safetensors", "default")
    assert type(stock.model.model_config).__name__ == "CosmosT2IPredict2"


def test_missing_and_non_model_files_name_the_file(model_dir):
    node = comfy_harness.node_class("PrecisionLoadDiffusionModel")
    msg = node.validate_inputs(model_name="nope.safetensors", weight_dtype="default")
    assert "nope.safetensors" in msg and "models/diffusion_models" in msg
    assert node.validate_inputs(model_name="loader_flux2.safetensors", weight_dtype="fp7") != True  # noqa: E712
    import safetensors.torch

    safetensors.torch.save_file({"foo": torch.zeros(3)}, os.path.join(model_dir, "not_a_model.safetensors"))
    with pytest.raises(ValueError, match="not_a_model.safetensors"):
        _load("not_a_model.safetensors")
    with open(os.path.join(model_dir, "truncated.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(ValueError, match="cannot read .truncated.safetensors"):
        _load("truncated.safetensors")
