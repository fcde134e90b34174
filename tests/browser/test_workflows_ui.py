"""Each example workflow dropped into the real page: every node known, no missing-node dialog, no errors
from the pack's scripts, and the graph the page would queue is the committed API twin."""
from __future__ import annotations

import glob
import json
import os

import pytest

from precision_browser import CLEAR_TOASTS, DROP_WORKFLOW, GRAPH_LOADED, PROMPT_OF_GRAPH, fit_view, normalise_prompt

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UI_FILES = sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json")))


def test_there_are_workflows_to_check():
    names = {os.path.basename(p) for p in UI_FILES}
    assert {"train_lora.json", "inference_matching_scale.json", "train_lora_demo.json", "inference_demo.json"} <= names, names


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: os.path.basename(p))
def test_dropped_workflow_loads_cleanly_and_queues_its_twin(comfy_page, path):
    name = os.path.basename(path)
    with open(path) as f:
        text = f.read()
    workflow = json.loads(text)
    with open(os.path.join(ROOT, "workflows", "api", name)) as f:
        twin = json.load(f)
    comfy_page.console(clear=True)
    comfy_page.evaluate(CLEAR_TOASTS)
    comfy_page.evaluate(DROP_WORKFLOW, {"name": name, "text": text})
    want_ids = sorted(n["id"] for n in workflow["nodes"])
    state = comfy_page.wait_for(GRAPH_LOADED, want_ids, timeout=60)
    assert state["missingNodes"] == [], f"missing-node dialog for {state['missingNodes']}"
    assert state["dialogs"] == [], f"dialogs open after loading {name}: {state['dialogs']}"
    assert state["unregistered"] == [], state["unregistered"]
    assert state["toasts"] == [], f"alerts after loading {name}: {state['toasts']}"
    fit_view(comfy_page)
    comfy_page.screenshot(f"workflow_{name[:-5]}")
    queued = comfy_page.evaluate(PROMPT_OF_GRAPH)
    assert normalise_prompt(queued) == normalise_prompt(twin)
    assert comfy_page.pack_errors() == []


SCALE_TEXT = """(id) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(id);
  const el = node?.precisionScale?.el;
  return el && el.dataset.headDim ? { text: el.textContent, headDim: el.dataset.headDim } : false;
}"""

SET_BY_USER = """([id, name, value]) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(id);
  const w = node.widgets.find((x) => x.name === name);
  w.value = value;
  w.callback?.(value); // what the widget does when the user edits it
  return w.value;
}"""


def test_patch_attention_shows_the_resolved_scale_for_the_connected_model(comfy_page):
    with open(os.path.join(ROOT, "workflows", "train_lora_demo.json")) as f:
        text = f.read()
    workflow = json.loads(text)
    att = next(n["id"] for n in workflow["nodes"] if n["type"] == "PrecisionPatchAttention")
    comfy_page.evaluate(DROP_WORKFLOW, {"name": "train_lora_demo.json", "text": text})
    comfy_page.wait_for(GRAPH_LOADED, sorted(n["id"] for n in workflow["nodes"]), timeout=60)
    first = comfy_page.wait_for(SCALE_TEXT, att, timeout=30)
    assert first["headDim"] == "32"  # tiny Flux.1 upstream: hidden 64 / 2 heads
    assert "scale = 0.1768 for head_dim 32" in first["text"], first
    comfy_page.evaluate(SET_BY_USER, [att, "scale_value", 2.0])
    doubled = comfy_page.wait_for(
        f"() => {{ const s = ({SCALE_TEXT})({att}); return s && s.text.includes('0.3536') ? s : false; }}", timeout=10)
    assert "(2 × 1/sqrt(d))" in doubled["text"]
    comfy_page.evaluate(SET_BY_USER, [att, "scale_mode", "absolute"])
    comfy_page.evaluate(SET_BY_USER, [att, "scale_value", 0.25])
    absolute = comfy_page.wait_for(
        f"() => {{ const s = ({SCALE_TEXT})({att}); return s && s.text.startsWith('scale = 0.25 for') ? s : false; }}",
        timeout=10)
    assert "head_dim 32" in absolute["text"]
    assert comfy_page.pack_errors() == []


SEED_CONTROLS = """async (apiPrompt) => {
  const app = window.comfyAPI.app.app;
  const controls = (n) => (n.widgets || []).filter((w) => w.name === "control_after_generate").map((w) => w.value);
  const fromMenu = {};
  for (const t of ["PrecisionTrainLoRA", "PrecisionAttachLoRA", "PrecisionProbe", "KSampler"]) {
    const n = window.LiteGraph.createNode(t); // what the node menu and search box do
    app.graph.add(n);
    fromMenu[t] = controls(n);
    app.graph.remove(n);
  }
  await app.loadApiJson(apiPrompt, "train_lora_api.json");
  const fromApi = {};
  for (const n of app.graph.nodes) if (controls(n).length) fromApi[n.type] = controls(n);
  return { fromMenu, fromApi };
}"""


def test_pack_seeds_start_fixed_from_the_menu_and_from_api_json_and_saved_choices_win(comfy_page):
    """Issue 14 item 1: the frontend gives every seed "control after generate: randomize", so each Run
    changed a training node's seed and retrained from scratch. Pack nodes now start at "fixed" when added
    from the menu or loaded from an API prompt; ComfyUI's own nodes are left alone; a saved workflow's
    explicit "randomize" stays."""
    with open(os.path.join(ROOT, "workflows", "api", "train_lora.json")) as f:
        api_prompt = json.load(f)
    got = comfy_page.evaluate(SEED_CONTROLS, api_prompt)
    for node in ("PrecisionTrainLoRA", "PrecisionAttachLoRA", "PrecisionProbe"):
        assert got["fromMenu"][node] == ["fixed"], got
    assert got["fromMenu"]["KSampler"] == ["randomize"], got  # not ours to change
    pack = {t: v for t, v in got["fromApi"].items() if t.startswith("Precision")}
    assert pack and all(v == ["fixed"] for v in pack.values()), got
    with open(os.path.join(ROOT, "workflows", "train_lora.json")) as f:
        workflow = json.load(f)
    train = next(n for n in workflow["nodes"] if n["type"] == "PrecisionTrainLoRA")
    slot = train["widgets_values"].index("fixed")
    train["widgets_values"][slot] = "randomize"  # the user chose it and saved the workflow
    comfy_page.evaluate(DROP_WORKFLOW, {"name": "train_lora.json", "text": json.dumps(workflow)})
    comfy_page.wait_for(GRAPH_LOADED, sorted(n["id"] for n in workflow["nodes"]), timeout=60)
    saved = comfy_page.evaluate("""(id) => window.comfyAPI.app.app.graph.getNodeById(id).widgets
      .find((w) => w.name === "control_after_generate").value""", train["id"])
    assert saved == "randomize"
    assert comfy_page.pack_errors() == []
