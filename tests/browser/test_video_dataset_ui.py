"""Precision Load Video Dataset from the page (issue 25 item 4): a graph dropped as a user drops a file, Run
pressed, and the dataset report (each clip's frame count and cut, the still image read as a one-frame clip)
reaches the page's Preview Any node exactly as the server computed it. The clips are real mp4 files written with
PyAV, as tests/e2e/test_video_e2e.py writes them."""
from __future__ import annotations

import json
import os
import sys

import pytest
from PIL import Image

from test_chart_binding_ui import _drop_api_text
from test_training_ui import _run_from_page

pytestmark = pytest.mark.browser

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e"))
from test_video_e2e import frames, write_video  # noqa: E402

FOLDER = "video_dataset_ui"

PREVIEW_TEXT = """() => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === "PreviewAny");
  const w = node?.widgets?.find((x) => typeof x.value === "string" && x.value.includes("clips from input/"));
  return w ? w.value : false;
}"""


def _folder(base_dir: str) -> None:
    path = os.path.join(base_dir, "input", FOLDER)
    os.makedirs(path, exist_ok=True)
    write_video(os.path.join(path, "a_walk.mp4"), frames(7, seed=1))
    with open(os.path.join(path, "a_walk.txt"), "w", encoding="utf-8") as f:
        f.write("a red square moves right")
    Image.fromarray(frames(1, seed=2)[0]).save(os.path.join(path, "b_still.png"))


def test_load_video_dataset_report_shows_on_the_page(comfy_page, comfy_server):
    _folder(comfy_server.base_dir)
    prompt = {
        "1": {"class_type": "PrecisionLoadVideoDataset", "inputs": {
            "folder": FOLDER, "frame_rule": "4k+1 (Wan, HunyuanVideo)", "max_frames": 33, "frame_stride": 1,
            "missing_caption": "train_empty"}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 2]}},
    }
    _drop_api_text(comfy_page, "video_dataset_api.json", json.dumps(prompt))
    entry = _run_from_page(comfy_page, comfy_server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:2000]
    sent = entry["prompt"][2]["1"]["inputs"]
    assert sent["folder"] == FOLDER and sent["frame_rule"] == "4k+1 (Wan, HunyuanVideo)", sent  # the dropped values
    (report,) = entry["outputs"]["2"]["text"]
    assert f"2 clips from input/{FOLDER}" in report, report
    assert "a_walk.mp4: 7 frames at 8 fps -> kept the first 5 (the frame rule)" in report, report
    assert "b_still.png: still image, trains as a one-frame clip" in report, report
    assert "b_still.png: no caption" in report, report
    assert comfy_page.wait_for(PREVIEW_TEXT, timeout=30) == report
    assert comfy_page.pack_errors() == []
