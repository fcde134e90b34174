"""Precision Load Image Dataset from the page (issue 23 items 4, 5): a graph dropped as a user drops a file,
Run pressed, and the dataset report (every decision and missing caption, by file) reaches the page's
Preview Any node exactly as the server computed it."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from test_chart_binding_ui import _drop_api_text
from test_training_ui import _run_from_page

pytestmark = pytest.mark.browser

FOLDER = "image_dataset_ui"

PREVIEW_TEXT = """() => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === "PreviewAny");
  const w = node?.widgets?.find((x) => typeof x.value === "string" && x.value.includes("images from input/"));
  return w ? w.value : false;
}"""


def _folder(base_dir: str) -> None:
    path = os.path.join(base_dir, "input", FOLDER)
    os.makedirs(path, exist_ok=True)
    Image.fromarray(np.full((32, 32), 40000, dtype=np.uint16)).save(os.path.join(path, "a_gray16.png"))
    clear = np.zeros((32, 32, 4), dtype=np.uint8)
    clear[:, 16:] = (255, 0, 0, 255)
    Image.fromarray(clear, "RGBA").save(os.path.join(path, "b_alpha.png"))
    Image.new("RGB", (32, 32), (0, 0, 255)).save(os.path.join(path, "c_nocap.png"))
    for stem in ("a_gray16", "b_alpha"):
        with open(os.path.join(path, stem + ".txt"), "w", encoding="utf-8") as f:
            f.write(f"a photo of {stem}")


def test_load_image_dataset_report_shows_on_the_page(comfy_page, comfy_server):
    _folder(comfy_server.base_dir)
    prompt = {
        "1": {"class_type": "PrecisionLoadImageDataset", "inputs": {
            "folder": FOLDER, "alpha": "white", "animated": "first_frame", "missing_caption": "train_empty"}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 2]}},
    }
    _drop_api_text(comfy_page, "image_dataset_api.json", json.dumps(prompt))
    entry = _run_from_page(comfy_page, comfy_server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:2000]
    sent = entry["prompt"][2]["1"]["inputs"]
    assert sent["folder"] == FOLDER and sent["alpha"] == "white", sent  # the page queued the dropped values
    (report,) = entry["outputs"]["2"]["text"]
    lines = report.splitlines()
    assert lines[0] == f"3 images from input/{FOLDER} (3 files, name order): 2 with a caption, 1 without", lines
    assert "b_alpha.png: transparent pixels (50 % of the pixels) composited on white" in lines
    assert "c_nocap.png: no caption (c_nocap.txt not found): trains on the empty caption" in lines
    assert comfy_page.wait_for(PREVIEW_TEXT, timeout=30) == report
    assert comfy_page.pack_errors() == []
