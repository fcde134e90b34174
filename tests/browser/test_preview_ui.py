"""Sample images during training, seen in the page (issue 14 item 4): the demo training workflow plus a
Precision Preview Settings node (Load VAE with a tiny real-architecture VAE written at test time, the demo
conditioning as prompt, every 2 steps) wired to the first Train LoRA. While the run goes on the node shows the
live preview (ComfyUI's progress preview, as KSampler's) and the dataset report (ComfyUI's progress text); the
preview PNGs land on disk with the step in their names.

Where the frontends keep a node's live preview: both 1.32 (ComfyUI 0.3.75) and 1.49 (0.33) store the blob URLs
of the latest ``b_preview_with_metadata`` in ``app.nodePreviewImages[<node locator id>]`` (the node id for a
node of the root graph) and draw them on the node; progress text becomes the node's read-only
``$$node-text-preview`` widget.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from precision_browser import CLEAR_TOASTS, DROP_WORKFLOW, GRAPH_LOADED, NODE_OVERLAPS, PAGE_READY, fit_view
from test_training_ui import DESELECT, FIRST_TRAIN, FOCUS_NODE, LONG_RUN_STEPS, SECOND_TRAIN, SET_WIDGET, _wait_idle

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONDITIONING = 6  # node id in workflows/train_lora_demo.json (the train nodes: test_training_ui)
VAE_FILE = "precision_preview_taesd.safetensors"
RUN_NAME = "preview_ui"


@pytest.fixture(scope="module")
def vae_file(comfy_server):
    from server_harness import server_env

    path = os.path.join(comfy_server.base_dir, "models", "vae", VAE_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "preview_vae.py"), path], check=True,
                   env=server_env(), timeout=300)
    return path


# Adds Load VAE + Precision Preview Settings and wires them as a user would (LiteGraph calls).
ADD_PREVIEW = """([trainId, condId, vaeName]) => {
  const app = window.comfyAPI.app.app;
  const train = app.graph.getNodeById(trainId);
  const cond = app.graph.getNodeById(condId);
  // Below every node of the demo (the run's overlap check covers these two as well).
  const bottom = Math.max(...app.graph.nodes.map((n) => n.pos[1] + n.size[1])) + 80;
  const vae = window.LiteGraph.createNode("VAELoader");
  app.graph.add(vae);
  vae.pos = [0, bottom];
  vae.widgets.find((w) => w.name === "vae_name").value = vaeName;
  const pv = window.LiteGraph.createNode("PrecisionPreviewSettings");
  app.graph.add(pv);
  pv.pos = [380, bottom];
  const set = { steps: 2, width: 64, height: 64, batch_size: 1, seed: 7, every_n_steps: 2, at_start: false,
                at_end: true };
  for (const [name, value] of Object.entries(set)) pv.widgets.find((w) => w.name === name).value = value;
  cond.connect(0, pv, pv.findInputSlot("positive"));
  vae.connect(0, pv, pv.findInputSlot("vae"));
  pv.connect(0, train, train.findInputSlot("preview"));
  app.graph.setDirtyCanvas(true, true);
  return { vae: vae.id, preview: pv.id, linked: train.inputs[train.findInputSlot("preview")].link != null };
}"""

# Truthy once the running Train LoRA node holds a live preview (and its chart says it is still training).
LIVE_PREVIEW = """(id) => {
  const app = window.comfyAPI.app.app;
  const urls = app.nodePreviewImages?.[String(id)];
  const root = document.querySelector(`.precision-lora-train[data-node-id="${id}"]`);
  if (!urls?.length || !root || root.dataset.done === "true") return false;
  const node = app.graph.getNodeById(id);
  const text = node.widgets?.find((w) => w.name === "$$node-text-preview")?.value ?? null;
  return { urls: [...urls], status: root.querySelector("[data-precision-status]").textContent, text };
}"""

# Loads the node's current live preview as an image (a URL may be revoked when the next preview replaces it).
PREVIEW_IMAGE = """async (id) => {
  const urls = window.comfyAPI.app.app.nodePreviewImages?.[String(id)];
  if (!urls?.length) return null;
  const img = new Image();
  const ok = await new Promise((r) => { img.onload = () => r(true); img.onerror = () => r(false); img.src = urls[0]; });
  return ok ? { url: urls[0], width: img.naturalWidth, height: img.naturalHeight } : null;
}"""

CHART_DONE = """(id) => {
  const root = document.querySelector(`.precision-lora-train[data-node-id="${id}"]`);
  return root && root.dataset.done === "true" ? root.querySelector("[data-precision-status]").textContent : false;
}"""


# What the node draws: the loaded preview images (node.imgs) and the widgets that hold them and the text.
NODE_DRAWING = """(id) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(id);
  return { imgs: (node.imgs || []).map((i) => [i.naturalWidth, i.naturalHeight]), size: [...node.size],
           widgets: (node.widgets || []).map((w) => [w.name, w.y ?? null, w.computedHeight ?? null]) };
}"""


# The frontend's report widget as drawn: the text's rendered height, the height the widget gives it and
# whether any of it is hidden (scrolled or clipped by the widget's box).
# The dataset report as the node shows it after the run: in the frontend's progress-text widget (frontends up to
# 1.49 keep it), else in the pack's own report widget (1.58 removes the frontend's when the job ends; the pack then
# shows the same text, web/train_report.js).
REPORT_FIT = """(id) => {
  const app = window.comfyAPI.app.app;
  const node = app.graph.getNodeById(id);
  const own = node.widgets?.find((w) => w.name === "$$node-text-preview");
  const pack = node.widgets?.find((w) => w.name === "precision_dataset_report");
  const el = own ? [...document.querySelectorAll(".dom-widget span")].find((e) => e.textContent.startsWith("dataset:"))
    : pack?.precisionEl;
  const widget = own ?? pack;
  if (!widget || !el) return { widget: Boolean(widget), span: Boolean(el) };
  const value = own ? String(own.value) : el.textContent;
  const range = document.createRange();
  range.selectNodeContents(el);
  const scroller = own ? el.closest(".overflow-y-auto") : el;
  const box = el.closest(".dom-widget").getBoundingClientRect();
  const text = range.getBoundingClientRect();
  const scale = app.canvas.ds.scale;
  return { shownBy: own ? "frontend" : "pack", lines: value.split("\\n").length,
           textLines: Math.round(text.height / scale / 16), textHeight: text.height / scale,
           widgetHeight: widget.computedHeight ?? widget.computeSize?.(node.size[0])?.[1],
           scrolled: scroller.scrollHeight > scroller.clientHeight + 1,
           clipped: text.bottom > box.bottom + 1 || text.top < box.top - 1 };
}"""


# What the node keeps of its run (saved with the workflow).
KEPT = """(id) => {
  const p = window.comfyAPI.app.app.graph.getNodeById(id).properties;
  return { report: p.precision_dataset_report ?? null, previews: p.precision_preview_images ?? [] };
}"""

# Truthy once the reloaded page shows the kept report and has loaded the kept preview images on the node.
RESTORED = """(id) => {
  const app = window.comfyAPI.app.app;
  const node = app.graph.getNodeById(id);
  const el = document.querySelector(".precision-lora-report");
  const imgs = node?.imgs ?? [];
  if (!node || !el || !imgs.length || imgs.some((i) => !i.complete)) return false;
  return { text: el.textContent, properties: node.properties.precision_preview_images ?? [],
           outputs: app.nodeOutputs[String(id)]?.images ?? [],
           imgs: imgs.map((i) => ({ src: i.src, width: i.naturalWidth })) };
}"""


def _previews_dir(server) -> str:
    return server.output_path("precision_lora", "previews", RUN_NAME)


def _preview_steps(server) -> list[int]:
    folder = _previews_dir(server)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted({int(m.group(1)) for n in names if (m := re.fullmatch(rf"{RUN_NAME}_step(\d+)_0\.png", n))})


@pytest.fixture(scope="module")
def preview_run(comfy_page, comfy_server, vae_file):
    page, server = comfy_page, comfy_server
    page.console(clear=True)
    with open(os.path.join(ROOT, "workflows", "train_lora_demo.json")) as f:
        text = f.read()
    page.evaluate("async () => { await window.comfyAPI.app.app.refreshComboInNodes(); return true; }")
    page.evaluate(CLEAR_TOASTS)
    page.evaluate(DROP_WORKFLOW, {"name": "train_lora_demo.json", "text": text})
    state = page.wait_for(GRAPH_LOADED, sorted(n["id"] for n in json.loads(text)["nodes"]), timeout=60)
    assert state["missingNodes"] == [] and state["dialogs"] == [] and state["toasts"] == [], state
    facts = {"added": page.evaluate(ADD_PREVIEW, [FIRST_TRAIN, CONDITIONING, VAE_FILE])}
    assert page.evaluate(SET_WIDGET, [FIRST_TRAIN, "steps", LONG_RUN_STEPS]) == LONG_RUN_STEPS
    assert page.evaluate(SET_WIDGET, [FIRST_TRAIN, "name", RUN_NAME]) == RUN_NAME
    assert page.evaluate(SET_WIDGET, [SECOND_TRAIN, "steps", 3]) == 3
    fit_view(page)
    page.screenshot("preview_01_wired")

    page.call("click", selector='[data-testid="queue-button"]')
    facts["live"] = page.wait_for(LIVE_PREVIEW, FIRST_TRAIN, timeout=180)
    _, queue = server.get("/queue")
    facts["running_when_seen"] = len(queue["queue_running"])
    facts["image"] = None
    for _ in range(20):  # the URL seen may be replaced (and revoked) by the next preview before it loads
        facts["image"] = page.evaluate(PREVIEW_IMAGE, FIRST_TRAIN)
        if facts["image"]:
            break
        time.sleep(0.2)
    facts["text"] = page.wait_for(
        f"""() => {{ const n = window.comfyAPI.app.app.graph.getNodeById({FIRST_TRAIN});
            const v = n.widgets?.find((w) => w.name === "$$node-text-preview")?.value;
            return v && /dataset:/.test(v) ? v : false; }}""", timeout=30)
    deadline = time.time() + 120  # two previews written (steps 2 and 4) while the run goes on
    while len(_preview_steps(server)) < 2 and time.time() < deadline:
        time.sleep(0.3)
    facts["steps_while_running"] = _preview_steps(server)
    page.evaluate(FOCUS_NODE, FIRST_TRAIN)
    page.evaluate("() => new Promise((r) => setTimeout(() => requestAnimationFrame(() => r(true)), 300))")
    page.screenshot("preview_02_live_on_node")
    facts["drawn"] = page.evaluate(NODE_DRAWING, FIRST_TRAIN)

    page.evaluate(DESELECT)
    page.call("click", selector=f'.precision-lora-train[data-node-id="{FIRST_TRAIN}"] button[data-precision-action="stop"]')
    facts["stopped"] = page.wait_for(CHART_DONE, FIRST_TRAIN, timeout=60)
    facts["history"] = _wait_idle(server)
    fit_view(page)
    page.screenshot("preview_03_finished")
    facts["steps_after"] = _preview_steps(server)
    facts["overlaps"] = page.evaluate(NODE_OVERLAPS)
    facts["report_fit"] = page.evaluate(REPORT_FIT, FIRST_TRAIN)
    facts["kept"] = page.evaluate(KEPT, FIRST_TRAIN)

    # A reload: the report and the preview images come back from the node's properties (saved with the
    # workflow); an image deleted on the server meanwhile is dropped without a broken image.
    gone = facts["kept"]["previews"][0]["filename"]
    os.remove(os.path.join(_previews_dir(server), gone))
    facts["gone"] = gone
    page.console(clear=True)
    page.call("goto", url=server.url + "/", waitFor=PAGE_READY, timeout=150)
    facts["restored"] = page.wait_for(RESTORED, FIRST_TRAIN, timeout=60)
    fit_view(page)
    page.evaluate(FOCUS_NODE, FIRST_TRAIN)
    page.evaluate("() => new Promise((r) => setTimeout(() => requestAnimationFrame(() => r(true)), 300))")
    page.screenshot("preview_04_after_reload")
    facts["pack_errors"] = page.pack_errors()
    return facts


def test_the_preview_settings_node_is_wired_to_train_lora(preview_run):
    """What the page sent and the server ran (not the test's own wiring): Train LoRA's preview input linked to
    the Precision Preview Settings node, which carries the values set on its widgets and its linked inputs."""
    added = preview_run["added"]
    prompt = preview_run["history"]["prompt"][2]
    pv = str(added["preview"])
    assert prompt[pv]["class_type"] == "PrecisionPreviewSettings", prompt.get(pv)
    assert prompt[str(FIRST_TRAIN)]["inputs"]["preview"] == [pv, 0]
    inputs = prompt[pv]["inputs"]
    expected = {"steps": 2, "width": 64, "height": 64, "batch_size": 1, "seed": 7, "every_n_steps": 2,
                "at_start": False, "at_end": True}
    assert {k: inputs.get(k) for k in expected} == expected, inputs
    assert inputs["vae"] == [str(added["vae"]), 0] and inputs["positive"] == [str(CONDITIONING), 0], inputs
    assert prompt[str(added["vae"])]["inputs"]["vae_name"] == VAE_FILE


def test_a_preview_image_appears_on_the_node_while_it_trains(preview_run):
    live = preview_run["live"]
    assert live["urls"] and all(u.startswith("blob:") for u in live["urls"]), live
    assert preview_run["running_when_seen"] == 1  # seen before the queue was idle: the run was still going
    assert "step" in live["status"] and "stopped" not in live["status"], live
    image = preview_run["image"]
    # one 64 x 64 image per preview, sent at its own size (ComfyUI's server would enlarge it to the max size the
    # node asks for, so the node asks for at most the image's own size)
    assert image and image["width"] == image["height"] == 64, image
    # and the node draws it: loaded into node.imgs, in the image widget below the report text
    drawn = preview_run["drawn"]
    names = [w[0] for w in drawn["widgets"]]
    assert drawn["imgs"] and "$$canvas-image-preview" in names, drawn
    assert names.index("$$node-text-preview") < names.index("$$canvas-image-preview"), drawn


def test_the_dataset_report_is_shown_on_the_node(preview_run):
    text = preview_run["text"]
    assert text.startswith("dataset: 2 samples from 1 LATENT input; sizes "), text
    assert "captions: 1 conditioning for all 2 samples" in text, text


def test_preview_pngs_are_saved_with_the_step_in_their_names(preview_run):
    while_running = preview_run["steps_while_running"]
    assert while_running[:2] == [2, 4], while_running  # every 2 steps
    after = preview_run["steps_after"]
    assert all(s % 2 == 0 for s in after[:-1]) and after[:len(while_running)] == while_running, after
    stopped_at = int(re.search(r"step (\d+)", preview_run["stopped"]).group(1))
    assert after[-1] <= stopped_at, (after, preview_run["stopped"])


def test_the_run_completes_and_no_pack_script_errors(preview_run):
    status = preview_run["history"]["status"]
    assert status["status_str"] == "success", json.dumps(status)[:3000]
    assert preview_run["pack_errors"] == []


def test_the_demo_nodes_do_not_overlap_once_the_node_shows_report_and_previews(preview_run):
    overlaps = preview_run["overlaps"]
    grown = next(b for b in overlaps["boxes"] if b[0] == FIRST_TRAIN)
    assert grown[2][3] > 700, grown  # the first Train LoRA did grow by its report and preview image
    assert overlaps["overlaps"] == [], overlaps


def test_the_whole_dataset_report_is_visible(preview_run):
    fit = preview_run["report_fit"]
    assert fit.get("lines", 0) >= 2, fit  # the report has a dataset and a captions line
    assert fit["textLines"] >= fit["lines"], fit  # lines wrap at the node's width, never fewer than the text's
    assert fit["widgetHeight"] >= fit["textHeight"], fit
    assert not fit["scrolled"] and not fit["clipped"], fit


def test_report_and_preview_images_come_back_after_a_reload(preview_run):
    kept, restored, gone = preview_run["kept"], preview_run["restored"], preview_run["gone"]
    assert kept["report"] == preview_run["text"], kept
    names = [p["filename"] for p in kept["previews"]]
    assert names == [f"{RUN_NAME}_step{s:06d}_0.png" for s in preview_run["steps_after"]][-16:], names  # the last 16
    assert all(p["subfolder"] == f"precision_lora/previews/{RUN_NAME}" and p["type"] == "output"
               for p in kept["previews"]), kept
    assert restored["text"] == kept["report"]
    left = [p for p in kept["previews"] if p["filename"] != gone]
    assert restored["properties"] == left and restored["outputs"] == left, restored
    assert len(restored["imgs"]) >= 1 and all(i["width"] == 64 for i in restored["imgs"]), restored
    assert not any(gone in i["src"] for i in restored["imgs"]), restored
    assert preview_run["pack_errors"] == []
