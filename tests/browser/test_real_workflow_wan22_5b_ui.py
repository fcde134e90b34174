"""In the page: the shipped Wan 2.2 5B training workflow, dropped as a user would, runs with Run after picking the
model, text encoder, VAE and dataset folder; then the shipped Wan 2.2 5B inference workflow, with those and the LoRA
just saved picked, samples a video that the LoRA changes. The files are tests/wan22_5b_standin.py's (a tiny Wan 2.2
5B diffusion model that stock detection loads, the Wan 2.2 VAE at its real size, a tiny umt5-xxl that stock
CLIPLoader type wan loads through the stand-in's test-only registration; see that file). What is not a name pick
(time on a CPU only): the training steps (6 of the shipped 1500), the bucket resolution (64 of 960 px), the video
latent (64 x 64, 1 frame of the shipped 1280 x 704, 121) and the sampling steps (4 of 20)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from precision_browser import CLEAR_TOASTS, DROP_WORKFLOW, GRAPH_LOADED, NODE_OVERLAPS, PROMPT_OF_GRAPH, fit_view, \
    normalise_prompt
from test_real_workflow_ui import NUMBER, PICK, REFRESH, _api
from test_training_ui import CHART_STATE, _run_from_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import wan22_5b_standin as standin  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def wan_files(comfy_server):
    from server_harness import server_env

    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "wan22_5b_standin.py"), comfy_server.base_dir],
                   check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def _drop(page, name: str) -> dict:
    """Drops a shipped workflow onto the page as a user would; waits for every node id; returns {node type: id}
    (the two CLIP Text Encode nodes of the inference graph: the last one's id)."""
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


def _number(page, picks: list[tuple]) -> None:
    for node_id, name, value in picks:
        assert page.evaluate(NUMBER, [node_id, name, value]) == {"value": value}


def _frames(server, entry: dict, node_id: int) -> np.ndarray:
    from PIL import Image, ImageSequence

    (item,) = entry["outputs"][str(node_id)]["images"]
    with Image.open(server.output_path(item["subfolder"], item["filename"])) as img:
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(img)])


def test_wan22_5b_workflows_run_after_picking_names(comfy_page, comfy_server, wan_files):
    page = comfy_page
    page.console(clear=True)
    ids = _drop(page, "train_lora_wan22_5b.json")
    assert page.evaluate(NODE_OVERLAPS)["overlaps"] == []
    names = [(ids["UNETLoader"], "unet_name", standin.MODEL_NAME), (ids["CLIPLoader"], "clip_name", standin.CLIP_NAME),
             (ids["VAELoader"], "vae_name", standin.VAE_NAME)]
    _pick(page, [*names, (ids["LoadImageTextDataSetFromFolder"], "folder", standin.DATASET)])
    _number(page, [(ids["PrecisionTrainLoRA"], "steps", STEPS), (ids["PrecisionResolutionBuckets"], "resolution", 64)])
    want, edits = standin.swap_names(_api("train_lora_wan22_5b.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, folder; resolution
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = STEPS
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)

    loras = os.path.join(wan_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_wan22_5b_lora_*.safetensors")))
    entry = _run_from_page(page, comfy_server, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_wan22_5b_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
    assert md["ss_steps"] == str(STEPS) and md["ss_base_model_version"] == "WAN22_T2V", md
    chart = page.wait_for(f"() => {{ const s = ({CHART_STATE})({ids['PrecisionTrainLoRA']}); "
                          "return s && s.done ? s : false; }", timeout=60)
    assert chart["points"] >= STEPS - 1, chart
    # Train LoRA has grown by its dataset report and loss chart: still no node over another
    overlaps = page.evaluate(NODE_OVERLAPS)
    assert overlaps["overlaps"] == [], overlaps
    fit_view(page)
    page.screenshot("real_wan22_5b_train_finished")

    lora_name = "precision_lora/" + os.path.basename(saved[0])
    ids = _drop(page, "inference_wan22_5b.json")
    assert page.evaluate(NODE_OVERLAPS)["overlaps"] == []
    _pick(page, [(ids["UNETLoader"], "unet_name", standin.MODEL_NAME),
                 (ids["CLIPLoader"], "clip_name", standin.CLIP_NAME), (ids["VAELoader"], "vae_name", standin.VAE_NAME),
                 (ids["PrecisionLoadLoRA"], "lora_name", lora_name)])
    latent = ids["Wan22ImageToVideoLatent"]
    _number(page, [(latent, "width", 64), (latent, "height", 64), (latent, "length", 1), (ids["KSampler"], "steps", 4)])
    want, edits = standin.swap_names(_api("inference_wan22_5b.json"), lora_name=lora_name)
    assert len(edits) == 5, edits  # model, text encoder, VAE, LoRA; latent size and frames
    want[str(ids["KSampler"])]["inputs"]["steps"] = 4
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)
    entry = _run_from_page(page, comfy_server, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    with_lora = _frames(comfy_server, entry, ids["SaveAnimatedWEBP"])
    assert with_lora.shape == (1, 64, 64, 3) and with_lora.std() > 0, with_lora.shape
    fit_view(page)
    page.screenshot("real_wan22_5b_infer_video")
    # the LoRA is what changes the video: strength 0 in the page gives another one
    _number(page, [(ids["PrecisionLoadLoRA"], "strength", 0.0)])
    entry = _run_from_page(page, comfy_server, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert not np.array_equal(_frames(comfy_server, entry, ids["SaveAnimatedWEBP"]), with_lora)
    assert page.pack_errors() == []
