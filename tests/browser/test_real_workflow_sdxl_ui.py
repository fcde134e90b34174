"""In the page: the shipped SDXL training workflow, dropped as a user would, runs with Run after picking the
checkpoint and the dataset folder; then the shipped SDXL inference workflow, with the checkpoint and the LoRA
just saved picked, samples an image that the LoRA changes. The checkpoint is tests/sdxl_standin.py's tiny SDXL
(real-size CLIP-L, CLIP-G and VAE), loaded by the stock CheckpointLoaderSimple (see that file for the one
test-only addition: ComfyUI's detection list knows the tiny UNet). What is not a name pick (time on a CPU only):
the training steps (12 of the shipped 1500), the bucket resolution and the empty latent (64 of 1024 px)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

from precision_browser import CLEAR_TOASTS, DROP_WORKFLOW, GRAPH_LOADED, NODE_OVERLAPS, PROMPT_OF_GRAPH, fit_view, \
    normalise_prompt
from test_real_workflow_ui import NUMBER, PICK, REFRESH, _api
from test_training_ui import CHART_STATE, _run_from_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402


@pytest.fixture(scope="module")
def sdxl_files(comfy_server):
    from server_harness import server_env

    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "real_arch.py"), comfy_server.base_dir, "--sdxl"],
                   check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def _drop(page, name: str) -> dict:
    """Drops a shipped workflow onto the page as a user would; waits for every node id (two CLIP Text Encode
    in the inference graph); returns {node type: node id}."""
    with open(os.path.join(ROOT, "workflows", name)) as f:
        text = f.read()
    nodes = json.loads(text)["nodes"]
    page.evaluate(REFRESH)
    page.evaluate(CLEAR_TOASTS)
    page.evaluate(DROP_WORKFLOW, {"name": name, "text": text})
    state = page.wait_for(GRAPH_LOADED, sorted(n["id"] for n in nodes), timeout=60)
    assert state["missingNodes"] == [] and state["dialogs"] == [], state
    return {n["type"]: n["id"] for n in nodes}


def _pick(page, picks: list[tuple]) -> None:
    for node_id, name, value in picks:
        assert page.evaluate(PICK, [node_id, name, value]) == {"value": value}


def _image(server, entry: dict, node_id: int) -> np.ndarray:
    (img,) = entry["outputs"][str(node_id)]["images"]
    return np.asarray(Image.open(server.output_path(img["subfolder"], img["filename"])))


def test_sdxl_workflows_run_after_picking_names(comfy_page, comfy_server, sdxl_files):
    page = comfy_page
    page.console(clear=True)
    ids = _drop(page, "train_lora_sdxl.json")
    assert page.evaluate(NODE_OVERLAPS)["overlaps"] == []
    _pick(page, [(ids["CheckpointLoaderSimple"], "ckpt_name", real_arch.SDXL_NAME),
                 (ids["LoadImageTextDataSetFromFolder"], "folder", real_arch.DATASET)])
    # Not names (time only): 12 of the shipped 1500 steps; buckets of 64 px (the test images) instead of 1024.
    assert page.evaluate(NUMBER, [ids["PrecisionTrainLoRA"], "steps", 12]) == {"value": 12}
    assert page.evaluate(NUMBER, [ids["PrecisionResolutionBuckets"], "resolution", 64]) == {"value": 64}
    want, edits = real_arch.swap_names(_api("train_lora_sdxl.json"))
    assert len(edits) == 3, edits  # checkpoint, folder; resolution
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = 12
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)

    loras = os.path.join(sdxl_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_sdxl_lora_*.safetensors")))
    entry = _run_from_page(page, comfy_server, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_sdxl_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
    assert md["ss_steps"] == "12" and md["ss_base_model_version"] == "sdxl", md
    chart = page.wait_for(f"() => {{ const s = ({CHART_STATE})({ids['PrecisionTrainLoRA']}); "
                          "return s && s.done ? s : false; }", timeout=60)
    assert chart["points"] >= 10, chart
    # Train LoRA has grown by its dataset report and loss chart: still no node over another
    overlaps = page.evaluate(NODE_OVERLAPS)
    assert overlaps["overlaps"] == [], overlaps
    fit_view(page)
    page.screenshot("real_sdxl_train_finished")

    lora_name = "precision_lora/" + os.path.basename(saved[0])
    ids = _drop(page, "inference_sdxl.json")
    assert page.evaluate(NODE_OVERLAPS)["overlaps"] == []
    _pick(page, [(ids["CheckpointLoaderSimple"], "ckpt_name", real_arch.SDXL_NAME),
                 (ids["PrecisionLoadLoRA"], "lora_name", lora_name)])
    for side in ("width", "height"):  # not a name (time only): 64 of the shipped 1024
        assert page.evaluate(NUMBER, [ids["EmptyLatentImage"], side, 64]) == {"value": 64}
    want, edits = real_arch.swap_names(_api("inference_sdxl.json"), lora_name=lora_name)
    assert len(edits) == 3, edits  # checkpoint, LoRA; latent size
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)
    entry = _run_from_page(page, comfy_server, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    with_lora = _image(comfy_server, entry, ids["SaveImage"])
    assert with_lora.shape == (64, 64, 3) and with_lora.std() > 0
    fit_view(page)
    page.screenshot("real_sdxl_infer_image")
    # the LoRA is what changes the image: strength 0 in the page gives another one
    assert page.evaluate(NUMBER, [ids["PrecisionLoadLoRA"], "strength", 0.0]) == {"value": 0.0}
    entry = _run_from_page(page, comfy_server, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert not np.array_equal(_image(comfy_server, entry, ids["SaveImage"]), with_lora)
    assert page.pack_errors() == []
