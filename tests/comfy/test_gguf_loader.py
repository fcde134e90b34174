"""Load Diffusion Model (Precision) given a GGUF file (issue 36 item 4): it names ComfyUI-GGUF's *Unet Loader (GGUF)*,
whose MODEL trains, instead of calling a file that is in models/diffusion_models missing (ComfyUI's list of that
folder leaves ``.gguf`` files out, so the name never matches an option).
"""
from __future__ import annotations

import os
import re

import pytest

import gguf_models

ADVICE = (r"PrecisionLoadDiffusionModel: input 'model_name'='{name}' is a GGUF file, which this loader does not read; "
          r"{install}load it with ComfyUI-GGUF's \"Unet Loader \(GGUF\)\" node \(UnetLoaderGGUF\) and connect its "
          r"MODEL to Attach LoRA \(Precision\): a LoRA trains on a GGUF base")
INSTALL = r"ComfyUI-GGUF is not loaded in this ComfyUI: install city96's ComfyUI-GGUF .*restart, then "


@pytest.fixture(scope="module")
def gguf_name(pack_module) -> str:
    """A real GGUF file (the tiny Cosmos in Q8_0) in models/diffusion_models."""
    import folder_paths

    tiny = pack_module("demo.tiny_models")
    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    os.makedirs(folder, exist_ok=True)
    gguf_models.write_gguf(tiny.tiny_state_dict(gguf_models.tiny_cosmos(tiny)), os.path.join(folder, "loader.gguf"),
                           "Q8_0")
    return "loader.gguf"


@pytest.fixture(params=[True, False], ids=["gguf_installed", "gguf_absent"])
def installed(request, monkeypatch) -> bool:
    """ComfyUI-GGUF's loader registered in ComfyUI's node registry, or not (a ComfyUI without the pack)."""
    import nodes as comfy_nodes

    if request.param:
        monkeypatch.setitem(comfy_nodes.NODE_CLASS_MAPPINGS, "UnetLoaderGGUF", object)
    else:
        monkeypatch.delitem(comfy_nodes.NODE_CLASS_MAPPINGS, "UnetLoaderGGUF", raising=False)
    return request.param


def _advice(name: str, installed: bool) -> str:
    return ADVICE.format(name=name, install="" if installed else INSTALL)


def test_the_node_names_comfyui_ggufs_loader_for_a_gguf_file_it_finds(gguf_name, installed):
    """Through ComfyUI's validation (what /prompt runs): the GGUF advice, not "is not in models/diffusion_models";
    when ComfyUI-GGUF is not loaded, the advice starts with installing it."""
    import comfy_harness
    import folder_paths

    assert gguf_name not in folder_paths.get_filename_list("diffusion_models")  # why the old message appeared
    prompt = {"1": {"class_type": "PrecisionLoadDiffusionModel",
                    "inputs": {"model_name": gguf_name, "weight_dtype": "default"}}}
    with pytest.raises(AssertionError) as info:
        comfy_harness.run_graph(prompt, outputs=["1"])
    message = str(info.value).replace("\\'", "'")  # ComfyUI's errors, printed as a list of dicts
    assert "is not in models/diffusion_models" not in message
    assert re.search(_advice(gguf_name, installed), message), message


def test_the_loader_refuses_a_gguf_file_by_its_path_with_the_same_advice(pack_module, gguf_name, installed):
    """``load_model_file`` (the node's loading, and ComfyUI's deep-copy reloads) on a GGUF path, found by its magic
    bytes even when renamed: the same advice, before any tensor is read."""
    import shutil

    import folder_paths

    load = pack_module("nodes.model.load")
    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    renamed = os.path.join(folder, "renamed_gguf.safetensors")
    shutil.copyfile(os.path.join(folder, gguf_name), renamed)
    for path in (os.path.join(folder, gguf_name), renamed):
        with pytest.raises(ValueError, match=_advice(os.path.basename(path), installed)):
            load.load_model_file(path)
