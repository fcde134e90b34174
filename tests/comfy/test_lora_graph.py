"""The LoRA nodes in ComfyUI's executor (inference_mode, validation, caching): Load → Attach → Save, then
Load → Load LoRA, as API-format graphs."""
from __future__ import annotations

import os

import pytest
import torch

import comfy_harness
from models import write_model_file

ATTACH = dict(rank=4, alpha=4.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=3,
              init_lora="none", dry_run=False)


@pytest.fixture(scope="module")
def model_name(pack):
    import folder_paths

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    write_model_file("flux1_dev", os.path.join(folder, "lora_graph_flux1.safetensors"))
    return "lora_graph_flux1.safetensors"


def test_attach_save_then_load_graph(model_name, pack_module):
    import folder_paths

    glue = pack_module("nodes.lora.glue")
    prompt = {
        "1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": model_name, "weight_dtype": "fp32"}},
        "2": {"class_type": "PrecisionAttachLoRA", "inputs": {"model": ["1", 0], **ATTACH}},
        "3": {"class_type": "PrecisionSaveLoRA", "inputs": {"model": ["2", 0], "filename_prefix": "graph/lora",
                                                            "folder": "loras", "save_dtype": "bf16", "key_style": "auto",
                                                            "use_counter": True, "overwrite": False}},
    }
    run = comfy_harness.run_graph(prompt, outputs=["2", "3"])
    assert run["success"], run["messages"]
    patched, listing = run["outputs"]["2"][0][0], run["outputs"]["2"][1][0]
    lora_set = glue.get_lora_set(patched)
    assert listing.startswith("6 layers") and len(lora_set.adapters()) == 6
    assert not any(p.is_inference() for p in lora_set.parameters()), "params created in a node must be trainable"
    path = run["outputs"]["3"][0][0]
    assert os.path.basename(path) == "lora_00001_.safetensors"
    assert os.path.dirname(path) == os.path.join(folder_paths.get_folder_paths("loras")[0], "graph")
    from lora.file import read_lora_file

    tensors, md = read_lora_file(path)
    assert tensors["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].dtype == torch.bfloat16
    assert md["ss_save_dtype"] == "bf16" and md["ss_seed"] == "3"
    load = {
        "1": prompt["1"],
        "4": {"class_type": "PrecisionLoadLoRA", "inputs": {
            "model": ["1", 0], "lora_name": "graph/lora_00001_.safetensors", "strength": 0.5, "mode": "fp32",
            "attention": "apply_recorded", "override_backend": "auto", "override_scale_mode": "default",
            "override_scale_value": 1.0}},
    }
    run = comfy_harness.run_graph(load, outputs=["4"])
    assert run["success"], run["messages"]
    loaded, info = run["outputs"]["4"][0][0], run["outputs"]["4"][1][0]
    (frozen,) = loaded.get_attachment(glue.LOADED_KEY)
    assert {a.multiplier for a in frozen.adapters().values()} == {0.5}
    assert info.startswith("graph/lora_00001_.safetensors: fp32, strength 0.5")


def test_save_node_refuses_escaping_prefix_in_validation(model_name):
    prompt = {
        "1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": model_name, "weight_dtype": "fp32"}},
        "2": {"class_type": "PrecisionAttachLoRA", "inputs": {"model": ["1", 0], **ATTACH}},
        "3": {"class_type": "PrecisionSaveLoRA", "inputs": {"model": ["2", 0], "filename_prefix": "../../evil",
                                                            "folder": "output", "save_dtype": "fp32", "key_style": "auto",
                                                            "use_counter": True, "overwrite": False}},
    }
    with pytest.raises(AssertionError, match=r"PrecisionSaveLoRA: input 'filename_prefix'='\.\./\.\./evil' contains '\.\.'"):
        comfy_harness.run_graph(prompt)


def test_combo_values_are_checked_with_node_and_input_names(pack):
    save, load = comfy_harness.node_class("PrecisionSaveLoRA"), comfy_harness.node_class("PrecisionLoadLoRA")
    assert save.validate_inputs(filename_prefix="ok", folder="models", save_dtype="fp32", key_style="auto") == (
        "[Precision LoRA] PrecisionSaveLoRA: input 'folder'='models' is not an option; choose one of ['loras', 'output']")
    assert save.validate_inputs(filename_prefix="ok", folder="loras", save_dtype="fp32", key_style="kohya") is True
    assert load.validate_inputs(mode="bf16").startswith("[Precision LoRA] PrecisionLoadLoRA: input 'mode'='bf16' is not an option")
    assert load.validate_inputs(lora_name="missing.safetensors", mode="fp32", attention="ignore").startswith(
        "[Precision LoRA] PrecisionLoadLoRA: input 'lora_name'='missing.safetensors' is not in models/loras; put the "
        "file there and refresh the node list")
