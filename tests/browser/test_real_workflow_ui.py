"""In the page: the shipped real-training workflow, dropped as a user would, runs with Run after picking file
and folder names in its widgets. The one structural edit (and why) is in tests/real_arch.py's swap_names:
this CPU cannot build Flux.1's T5-XXL, so the DualCLIPLoader is replaced by a CLIPLoader on the same clip_l."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from precision_browser import CLEAR_TOASTS, DROP_WORKFLOW, GRAPH_LOADED, PROMPT_OF_GRAPH, fit_view, normalise_prompt
from test_training_ui import CHART_STATE, _cached_nodes, _run_from_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402

# Each call is one thing a user does in the page: pick a value in a widget's list, or add / remove a node, or
# drag a link. Returns what the widget holds afterwards (a pick of a value the list lacks is refused).
PICK = """([id, name, value]) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(id);
  const w = node.widgets.find((x) => x.name === name);
  const values = typeof w.options.values === "function" ? w.options.values() : w.options.values;
  if (!values.includes(value)) return { refused: values };
  w.value = value;
  w.callback?.(value);
  return { value: w.value };
}"""

SWAP_TEXT_ENCODER = """([dualId, clipName]) => {
  const app = window.comfyAPI.app.app;
  const dual = app.graph.getNodeById(dualId);
  const targets = (dual.outputs[0].links || []).map((l) => app.graph.links[l]).map((l) => [l.target_id, l.target_slot]);
  const node = window.LiteGraph.createNode("CLIPLoader");
  app.graph.add(node);                                           // add
  node.pos = [dual.pos[0], dual.pos[1]];
  node.widgets.find((w) => w.name === "clip_name").value = clipName;  // pick (type keeps its default)
  for (const [id, slot] of targets) node.connect(0, app.graph.getNodeById(id), slot);  // links
  app.graph.remove(dual);                                        // remove
  return { id: node.id, links: targets.length, type: node.widgets.find((w) => w.name === "type").value };
}"""


@pytest.fixture(scope="module")
def real_files(comfy_server):
    from server_harness import server_env

    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "real_arch.py"), comfy_server.base_dir], check=True,
                   env=server_env(), timeout=600)
    return comfy_server.base_dir


def test_real_training_workflow_runs_after_picking_names(comfy_page, comfy_server, real_files):
    page = comfy_page
    with open(os.path.join(ROOT, "workflows", "train_lora.json")) as f:
        text = f.read()
    workflow = json.loads(text)
    ids = {n["type"]: n["id"] for n in workflow["nodes"]}
    page.console(clear=True)
    page.evaluate("async () => { await window.comfyAPI.app.app.refreshComboInNodes(); return true; }")
    page.evaluate(CLEAR_TOASTS)
    page.evaluate(DROP_WORKFLOW, {"name": "train_lora.json", "text": text})
    state = page.wait_for(GRAPH_LOADED, sorted(ids.values()), timeout=60)
    assert state["missingNodes"] == [] and state["dialogs"] == [], state

    picks = [
        (ids["PrecisionLoadDiffusionModel"], "model_name", real_arch.TINY_FLUX_NAME),
        (ids["VAELoader"], "vae_name", real_arch.VAE_NAME),
        (ids["LoadImageTextDataSetFromFolder"], "folder", real_arch.DATASET),
    ]
    for node_id, name, value in picks:
        assert page.evaluate(PICK, [node_id, name, value]) == {"value": value}
    # Not a name (time only, as in tests/e2e/test_real_workflow.py): 12 of the shipped 1000 steps.
    assert page.evaluate(PICK.replace("if (!values", "if (values && !values"), [ids["PrecisionTrainLoRA"], "steps", 12]) == {"value": 12}
    swapped = page.evaluate(SWAP_TEXT_ENCODER, [ids["DualCLIPLoader"], real_arch.CLIP_L_NAME])
    assert swapped["links"] == 1 and swapped["type"] == "stable_diffusion", swapped
    # the page queues exactly the shipped API twin with those names picked (nothing else changed)
    want, _ = real_arch.swap_names(json.load(open(os.path.join(ROOT, "workflows", "api", "train_lora.json"))))
    want[str(swapped["id"])] = want.pop(str(ids["DualCLIPLoader"]))
    want[str(ids["MakeTrainingDataset"])]["inputs"]["clip"] = [str(swapped["id"]), 0]
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = 12
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)
    fit_view(page)
    page.screenshot("real_train_01_names_picked")

    loras = os.path.join(real_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_lora_*.safetensors")))
    entry = _run_from_page(page, comfy_server)
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
    assert page.pack_errors() == []
