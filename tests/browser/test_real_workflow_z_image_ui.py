"""In the page: the shipped Z-Image training workflow, dropped as a user would, runs with Run after picking the
diffusion model, the text encoder, the VAE and the dataset folder; then the shipped Z-Image inference workflow,
with the same files and the LoRA just saved picked, samples an image that the LoRA changes.

Stand-ins (see tests/e2e/test_real_workflow_z_image.py and tests/z_image_standin.py): a tiny Z-Image and a tiny
Qwen3-4B built with ComfyUI's own classes (the real 6 B and 4 B are unaffordable on a test machine; the
session server registers their tiny configs with ComfyUI's detection as a test-only custom node) and the
Flux.1 VAE at its real size, each loaded by the stock UNETLoader / CLIPLoader / VAELoader. What is not a name
pick (time on a CPU only): the training steps (12 of the shipped 2000), the bucket resolution and the empty
latent (64 of 1024 px)."""
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
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from test_real_workflow_z_image import STANDIN, swap_names  # noqa: E402


@pytest.fixture(scope="module")
def z_image_files(comfy_server):
    from server_harness import server_env

    for script in ("real_arch.py", "z_image_standin.py"):
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", script), comfy_server.base_dir],
                       check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def _pick_files(page, ids: dict) -> None:
    _pick(page, [(ids["UNETLoader"], "unet_name", STANDIN["unet_name"]),
                 (ids["CLIPLoader"], "clip_name", STANDIN["clip_name"]),
                 (ids["VAELoader"], "vae_name", STANDIN["vae_name"])])


def test_z_image_workflows_run_after_picking_names(comfy_page, comfy_server, z_image_files):
    page = comfy_page
    page.console(clear=True)
    ids = _drop(page, "train_lora_z_image.json")
    assert page.evaluate(NODE_OVERLAPS)["overlaps"] == []
    _pick_files(page, ids)
    _pick(page, [(ids["LoadImageTextDataSetFromFolder"], "folder", STANDIN["folder"])])
    # Not names (time only): 12 of the shipped 2000 steps; buckets of 64 px (the test images) instead of 1024.
    assert page.evaluate(NUMBER, [ids["PrecisionTrainLoRA"], "steps", 12]) == {"value": 12}
    assert page.evaluate(NUMBER, [ids["PrecisionResolutionBuckets"], "resolution", 64]) == {"value": 64}
    want, edits = swap_names(_api("train_lora_z_image.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, folder; resolution
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = 12
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)

    loras = os.path.join(z_image_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_z_image_lora_*.safetensors")))
    entry = _run_from_page(page, comfy_server, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_z_image_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
    assert md["ss_steps"] == "12" and md["ss_base_model_version"] == "lumina2", md
    chart = page.wait_for(f"() => {{ const s = ({CHART_STATE})({ids['PrecisionTrainLoRA']}); "
                          "return s && s.done ? s : false; }", timeout=60)
    assert chart["points"] >= 10, chart
    # Train LoRA has grown by its dataset report and loss chart: still no node over another
    overlaps = page.evaluate(NODE_OVERLAPS)
    assert overlaps["overlaps"] == [], overlaps
    fit_view(page)
    page.screenshot("real_z_image_train_finished")

    lora_name = "precision_lora/" + os.path.basename(saved[0])
    ids = _drop(page, "inference_z_image.json")
    assert page.evaluate(NODE_OVERLAPS)["overlaps"] == []
    _pick_files(page, ids)
    _pick(page, [(ids["PrecisionLoadLoRA"], "lora_name", lora_name)])
    for side in ("width", "height"):  # not a name (time only): 64 of the shipped 1024
        assert page.evaluate(NUMBER, [ids["EmptySD3LatentImage"], side, 64]) == {"value": 64}
    want, edits = swap_names(_api("inference_z_image.json"), lora_name=lora_name)
    assert len(edits) == 5, edits  # model, text encoder, VAE, LoRA; latent size
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)
    entry = _run_from_page(page, comfy_server, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    with_lora = _image(comfy_server, entry, ids["SaveImage"])
    assert with_lora.shape == (64, 64, 3) and with_lora.std() > 0
    fit_view(page)
    page.screenshot("real_z_image_infer_image")
    # the LoRA is what changes the image: strength 0 in the page gives another one
    assert page.evaluate(NUMBER, [ids["PrecisionLoadLoRA"], "strength", 0.0]) == {"value": 0.0}
    entry = _run_from_page(page, comfy_server, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert not np.array_equal(_image(comfy_server, entry, ids["SaveImage"]), with_lora)
    assert page.pack_errors() == []
