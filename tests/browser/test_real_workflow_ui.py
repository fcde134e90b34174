"""In the page: the shipped real-training workflow, dropped as a user would, runs with Run after picking file
and folder names in its widgets, on Flux.1's own text-encoder pair: DualCLIPLoader (type flux) unchanged, with
CLIP-L and T5-XXL at their real sizes (random weights, tests/real_arch.py --t5). Then the shipped inference
workflow, names picked the same way plus the LoRA just saved, samples an image with it. What is not a name pick
(time on a CPU only): the training steps (12 of the shipped 1000) and the empty latent's size (64 of 1024)."""
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

from precision_browser import CLEAR_TOASTS, DROP_WORKFLOW, GRAPH_LOADED, PROMPT_OF_GRAPH, fit_view, normalise_prompt
from test_training_ui import CHART_STATE, _cached_nodes, _run_from_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402

# Each call is one thing a user does in the page: pick a value in a widget's list. Returns what the widget holds
# afterwards (a pick of a value the list lacks is refused).
PICK = """([id, name, value]) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(id);
  const w = node.widgets.find((x) => x.name === name);
  const values = typeof w.options.values === "function" ? w.options.values() : w.options.values;
  if (!values.includes(value)) return { refused: values };
  w.value = value;
  w.callback?.(value);
  return { value: w.value };
}"""

NUMBER = PICK.replace("if (!values", "if (values && !values")  # a number widget has no list of values
REFRESH = "async () => { await window.comfyAPI.app.app.refreshComboInNodes(); return true; }"


@pytest.fixture(scope="module")
def real_files(comfy_server):
    from server_harness import server_env

    # --t5: T5-XXL at its real size, written once per checkout (~1 min) into .cache/real_arch
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "real_arch.py"), comfy_server.base_dir, "--t5"],
                   check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def _drop(page, name: str) -> dict:
    """Drops a shipped workflow onto the page as a user would; returns {node type: node id}."""
    with open(os.path.join(ROOT, "workflows", name)) as f:
        text = f.read()
    ids = {n["type"]: n["id"] for n in json.loads(text)["nodes"]}
    page.evaluate(REFRESH)
    page.evaluate(CLEAR_TOASTS)
    page.evaluate(DROP_WORKFLOW, {"name": name, "text": text})
    state = page.wait_for(GRAPH_LOADED, sorted(ids.values()), timeout=60)
    assert state["missingNodes"] == [] and state["dialogs"] == [], state
    return ids


def _pick_names(page, ids: dict, lora_name: str | None = None) -> None:
    picks = [
        (ids["PrecisionLoadDiffusionModel"], "model_name", real_arch.TINY_FLUX_T5_NAME),
        (ids["DualCLIPLoader"], "clip_name1", real_arch.CLIP_L_NAME),
        (ids["DualCLIPLoader"], "clip_name2", real_arch.T5_NAME),
        (ids["VAELoader"], "vae_name", real_arch.VAE_NAME),
    ]
    if "LoadImageTextDataSetFromFolder" in ids:
        picks.append((ids["LoadImageTextDataSetFromFolder"], "folder", real_arch.DATASET))
    if lora_name is not None:
        picks.append((ids["PrecisionLoadLoRA"], "lora_name", lora_name))
    for node_id, name, value in picks:
        assert page.evaluate(PICK, [node_id, name, value]) == {"value": value}


def _api(name: str) -> dict:
    with open(os.path.join(ROOT, "workflows", "api", name)) as f:
        return json.load(f)


def test_real_workflows_run_after_picking_names(comfy_page, comfy_server, real_files):
    page = comfy_page
    page.console(clear=True)
    ids = _drop(page, "train_lora.json")
    _pick_names(page, ids)
    # Not a name (time only, as in tests/e2e/test_real_workflow.py): 12 of the shipped 1000 steps.
    assert page.evaluate(NUMBER, [ids["PrecisionTrainLoRA"], "steps", 12]) == {"value": 12}
    # the page queues exactly the shipped API twin with those names picked (nothing else changed)
    want, edits = real_arch.swap_names(_api("train_lora.json"), t5=True)
    assert len(edits) == 5 and not any("->" in e for e in edits), edits  # model, clip_l, t5xxl, VAE, folder
    assert want[str(ids["DualCLIPLoader"])]["inputs"]["type"] == "flux"
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = 12
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)
    fit_view(page)
    page.screenshot("real_train_01_names_picked")

    loras = os.path.join(real_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_lora_*.safetensors")))
    # T5-XXL encodes each of the 3 captions in ~33 s on a 2-core CPU (256 tokens, 4.76 B parameters)
    entry = _run_from_page(page, comfy_server, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    steps = want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"]
    with safe_open(saved[0], "pt") as f:
        assert f.metadata()["ss_steps"] == str(steps)
    chart = page.wait_for(f"() => {{ const s = ({CHART_STATE})({ids['PrecisionTrainLoRA']}); "
                          "return s && s.done ? s : false; }", timeout=60)
    assert chart["points"] >= 10, chart
    fit_view(page)
    page.screenshot("real_train_02_finished")

    # Issue 14: two more Runs of the unchanged graph train nothing (ComfyUI serves Train LoRA from its cache).
    again = [_run_from_page(page, comfy_server) for _ in range(2)]
    assert all(r["status"]["status_str"] == "success" for r in again), [r["status"] for r in again]
    train_id = str(ids["PrecisionTrainLoRA"])
    assert all(train_id in _cached_nodes(r) for r in again), [sorted(_cached_nodes(r)) for r in again]

    # The inference workflow with the LoRA just saved, picked from Load LoRA (Precision)'s refreshed list.
    lora_name = "precision_lora/" + os.path.basename(saved[0])
    ids = _drop(page, "inference_matching_scale.json")
    _pick_names(page, ids, lora_name=lora_name)
    for side in ("width", "height"):  # not a name (time only): 64 of the shipped 1024
        assert page.evaluate(NUMBER, [ids["EmptySD3LatentImage"], side, 64]) == {"value": 64}
    want, edits = real_arch.swap_names(_api("inference_matching_scale.json"), lora_name=lora_name, t5=True)
    assert len(edits) == 6, edits  # model, clip_l, t5xxl, VAE, LoRA; latent size
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)
    entry = _run_from_page(page, comfy_server, timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    (img,) = entry["outputs"][str(ids["SaveImage"])]["images"]
    pixels = np.asarray(Image.open(comfy_server.output_path(img["subfolder"], img["filename"])))
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    fit_view(page)
    page.screenshot("real_infer_01_image")
    assert page.pack_errors() == []
