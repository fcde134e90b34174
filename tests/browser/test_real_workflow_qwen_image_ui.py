"""In the page: the shipped Qwen-Image training workflow, dropped as a user would, runs with Run after picking the
diffusion model, the text encoder, the VAE and the dataset folder; then the shipped Qwen-Image inference workflow,
with the same files and the LoRA just saved picked, samples an image that the LoRA changes.

The files are tests/qwen_image_standin.py's: a tiny Qwen-Image transformer (ComfyUI's own class, 2 blocks), the
Qwen-Image VAE (Wan 2.1) at its real size, and ComfyUI's own Qwen2.5-VL-7B text model class at a tiny config
(width 64, 2 layers; the real tokenizer): the 7 B encoder is unaffordable on a test machine. Stock detection knows
neither tiny model, so the session server loads that file as a test-only custom node adding their configs; the
loaders (UNETLoader, CLIPLoader type qwen_image, VAELoader) and everything after them are stock. What is not a
name pick (time on a CPU only): the training steps (12 of the shipped 1000), the bucket resolution and the empty
latent (64 of 1024 and 1328 px), the sampling steps (4 of 20)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from precision_browser import NODE_OVERLAPS, PROMPT_OF_GRAPH, fit_view, normalise_prompt
from test_real_workflow_sdxl_ui import _drop, _image, _pick
from test_real_workflow_ui import NUMBER, _api
from test_training_ui import CHART_STATE, _run_from_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "workflows"))
import qwen_image_standin as standin  # noqa: E402
import spec_qwen_image as spec  # noqa: E402

SHIPPED = {("UNETLoader", "unet_name"): spec.MODEL, ("CLIPLoader", "clip_name"): spec.TEXT_ENCODER,
           ("VAELoader", "vae_name"): spec.VAE, ("LoadImageTextDataSetFromFolder", "folder"): spec.DATASET}


@pytest.fixture(scope="module")
def qwen_files(comfy_server):
    from server_harness import server_env

    if not standin.link_cached(comfy_server.base_dir):
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "qwen_image_standin.py"),
                        comfy_server.base_dir], check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def _name_picks(ids: dict) -> list[tuple]:
    return [(ids[kind], name, value) for (kind, name), value in standin.PICKS.items() if kind in ids]


def test_qwen_image_workflows_run_after_picking_names(comfy_page, comfy_server, qwen_files):
    page = comfy_page
    page.console(clear=True)
    ids = _drop(page, "train_lora_qwen_image.json")
    assert page.evaluate(NODE_OVERLAPS)["overlaps"] == []
    picks = _name_picks(ids)
    assert len(picks) == 4, picks  # diffusion model, text encoder, VAE, dataset folder
    _pick(page, picks)
    # Not names (time only): 12 of the shipped 1000 steps; buckets of 64 px (the test images) instead of 1024.
    assert page.evaluate(NUMBER, [ids["PrecisionTrainLoRA"], "steps", 12]) == {"value": 12}
    assert page.evaluate(NUMBER, [ids["PrecisionResolutionBuckets"], "resolution", 64]) == {"value": 64}
    want, edits = standin.swap_names(_api("train_lora_qwen_image.json"), SHIPPED)
    assert len(edits) == 5, edits  # 4 names; resolution
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = 12
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)

    loras = os.path.join(qwen_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_qwen_image_lora_*.safetensors")))
    entry = _run_from_page(page, comfy_server, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_qwen_image_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
    assert md["ss_steps"] == "12" and md["ss_base_model_version"] == "qwen_image", md
    chart = page.wait_for(f"() => {{ const s = ({CHART_STATE})({ids['PrecisionTrainLoRA']}); "
                          "return s && s.done ? s : false; }", timeout=60)
    assert chart["points"] >= 10, chart
    # Train LoRA has grown by its dataset report and loss chart: still no node over another
    overlaps = page.evaluate(NODE_OVERLAPS)
    assert overlaps["overlaps"] == [], overlaps
    fit_view(page)
    page.screenshot("real_qwen_image_train_finished")

    lora_name = "precision_lora/" + os.path.basename(saved[0])
    ids = _drop(page, "inference_qwen_image.json")
    assert page.evaluate(NODE_OVERLAPS)["overlaps"] == []
    picks = _name_picks(ids) + [(ids["PrecisionLoadLoRA"], "lora_name", lora_name)]
    assert len(picks) == 4, picks  # diffusion model, text encoder, VAE, LoRA
    _pick(page, picks)
    for side in ("width", "height"):  # not names (time only): 64 of the shipped 1328 px, 4 of the 20 steps
        assert page.evaluate(NUMBER, [ids["EmptySD3LatentImage"], side, 64]) == {"value": 64}
    assert page.evaluate(NUMBER, [ids["KSampler"], "steps", 4]) == {"value": 4}
    want, edits = standin.swap_names(_api("inference_qwen_image.json"), SHIPPED, lora_name=lora_name)
    assert len(edits) == 5, edits  # 4 names; latent size
    want[str(ids["KSampler"])]["inputs"]["steps"] = 4
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)
    entry = _run_from_page(page, comfy_server, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    with_lora = _image(comfy_server, entry, ids["SaveImage"])
    assert with_lora.shape == (64, 64, 3) and with_lora.std() > 0
    fit_view(page)
    page.screenshot("real_qwen_image_infer_image")
    # the LoRA is what changes the image: strength 0 in the page gives another one
    assert page.evaluate(NUMBER, [ids["PrecisionLoadLoRA"], "strength", 0.0]) == {"value": 0.0}
    entry = _run_from_page(page, comfy_server, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert not np.array_equal(_image(comfy_server, entry, ids["SaveImage"]), with_lora)
    assert page.pack_errors() == []
