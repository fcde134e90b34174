"""PrecisionLoadLoRA re-executes when its file changes on disk (retrained to the same name)."""
from __future__ import annotations

import os
import time

import comfy_harness


def test_fingerprint_follows_file_content(pack, tmp_path):
    import folder_paths

    node = comfy_harness.node_class("PrecisionLoadLoRA")
    folder = folder_paths.get_folder_paths("loras")[0]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "fingerprint_probe.safetensors")
    with open(path, "wb") as f:
        f.write(b"x" * 10)
    first = node.fingerprint_inputs(lora_name="fingerprint_probe.safetensors")
    assert node.fingerprint_inputs(lora_name="fingerprint_probe.safetensors") == first
    time.sleep(0.01)
    with open(path, "wb") as f:
        f.write(b"y" * 12)
    assert node.fingerprint_inputs(lora_name="fingerprint_probe.safetensors") != first
    os.remove(path)
    assert node.fingerprint_inputs(lora_name="fingerprint_probe.safetensors") == "fingerprint_probe.safetensors"
