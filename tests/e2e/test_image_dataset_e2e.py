"""PrecisionLoadImageDataset through a real server's /prompt (ComfyUI's validation included): the report names
every decision and missing caption, the trigger-word recipe of docs/datasets.md runs, Resolution Buckets
names the empty text, and folders outside input/ or refused images are errors naming node, input and file
(issues 23 items 4, 5, 9 and 22 item 8)."""
from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.e2e

FOLDER = "image_dataset_e2e"


@pytest.fixture(scope="module")
def dataset(comfy_server) -> str:
    path = os.path.join(comfy_server.base_dir, "input", FOLDER)
    os.makedirs(path, exist_ok=True)
    Image.fromarray(np.full((64, 64), 40000, dtype=np.uint16)).save(os.path.join(path, "a_gray16.png"))
    clear = np.zeros((64, 64, 4), dtype=np.uint8)
    clear[:, 32:] = (255, 0, 0, 255)
    Image.fromarray(clear, "RGBA").save(os.path.join(path, "b_alpha.png"))
    Image.new("RGB", (64, 64), (0, 0, 255)).save(os.path.join(path, "c_nocap.png"))
    for stem in ("a_gray16", "b_alpha"):
        with open(os.path.join(path, stem + ".txt"), "w", encoding="utf-8") as f:
            f.write(f"a photo of {stem}")
    return FOLDER


def _loader(folder: str, **inputs) -> dict:
    return {"class_type": "PrecisionLoadImageDataset", "inputs": {
        "folder": folder, "alpha": "white", "animated": "first_frame", "missing_caption": "train_empty", **inputs}}


def test_report_trigger_recipe_and_buckets_through_the_server(server, dataset):
    prompt = {
        "1": _loader(dataset),
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 2]}},
        "3": {"class_type": "StringConcatenate", "inputs": {"string_a": "sks", "string_b": ["1", 1],
                                                            "delimiter": ", "}},
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}},
        "5": {"class_type": "PrecisionResolutionBuckets", "inputs": {
            "images": ["1", 0], "texts": ["1", 1], "resolution": 64, "multiple": 16, "max_upscale": 2.0}},
        "6": {"class_type": "PreviewAny", "inputs": {"source": ["5", 2]}},
    }
    entry = server.run(prompt)
    (report,) = entry["outputs"]["2"]["text"]
    lines = report.splitlines()
    assert lines[0] == f"3 images from input/{dataset} (3 files, name order): 2 with a caption, 1 without", lines
    assert "a_gray16.png: 16-bit grayscale (I;16): scaled from 0..65535" in lines
    assert "b_alpha.png: transparent pixels (50 % of the pixels) composited on white" in lines
    assert "c_nocap.png: no caption (c_nocap.txt not found): trains on the empty caption" in lines
    assert entry["outputs"]["4"]["text"] == ["sks, a photo of a_gray16", "sks, a photo of b_alpha", "sks, "]
    (buckets,) = entry["outputs"]["6"]["text"]
    assert buckets.endswith("; texts 2 (0-based, the images' order) are empty while the others are not: those "
                            "images train on the empty caption (a missing .txt?)"), buckets


@pytest.mark.parametrize("folder", ["../..", "/etc", "../input/" + FOLDER])
def test_folders_outside_input_are_refused_at_validation(server, dataset, folder):
    status, body = server.request("/prompt", {"prompt": {
        "1": _loader(folder), "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 2]}}},
        "client_id": str(uuid.uuid4())})
    assert status == 400, json.dumps(body)[:2000]
    details = " | ".join(e["details"] for e in body["node_errors"]["1"]["errors"])
    assert f"PrecisionLoadImageDataset: input 'folder'={folder!r} is not an option; choose one of [" in details, details


def test_a_refused_image_is_an_execution_error_naming_the_file(server, dataset):
    prompt = {"1": _loader(dataset, alpha="refuse"), "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 2]}}}
    entry = server.wait(server.post_prompt(prompt))
    assert entry["status"]["status_str"] == "error"
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert errors and errors[0]["node_id"] == "1", errors
    assert (f"PrecisionLoadImageDataset: input 'folder'={dataset!r}: b_alpha.png has transparent pixels (50 % of the "
            "pixels) and alpha='refuse'") in errors[0]["exception_message"]
