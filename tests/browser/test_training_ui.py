"""The training workflow driven from the page like a user: drop it, press Run, watch the loss chart fill,
reload the page mid-run (the chart comes back), press Checkpoint now and Stop; then the LoRA the run wrote
shows its metadata on the loader of the inference workflow, whose image the LoRA and its recorded softmax scale
change (against strength 0 and attention 'ignore', set on the page's loader)."""
from __future__ import annotations

import glob
import json
import os
import re
import time

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

from precision_browser import (
    CLEAR_TOASTS, DROP_WORKFLOW, GRAPH_LOADED, PAGE_READY, fit_view,
)

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIRST_TRAIN, SECOND_TRAIN = 7, 11  # node ids in workflows/train_lora_demo.json
PATCH, SETTINGS = 2, 4  # its Patch Attention and Train Settings
VALIDATE_EVERY = 5
# Set on the page before Run, so that the inference test below can see the LoRA at work: the demo's 1e-4 for the
# ~15 steps this session trains moves no pixel of the 8-bit image, and its 1x scale would equal 'attention: ignore'
# (0.8x moved 6 % of the pixels on 0.33.0 and none by more than one level on 0.3.75: too little to be sure of).
TRAIN_LR, TRAIN_SCALE_MULTIPLIER = 1e-2, 3.0
LONG_RUN_STEPS = 2000  # far more than the test waits for: only Stop can end it early
DEMO_LORA = "precision_lora/demo_lora.safetensors"


def _drop(page, name: str) -> dict:
    with open(os.path.join(ROOT, "workflows", name)) as f:
        text = f.read()
    page.evaluate(CLEAR_TOASTS)
    page.evaluate(DROP_WORKFLOW, {"name": name, "text": text})
    want = sorted(n["id"] for n in json.loads(text)["nodes"])
    state = page.wait_for(GRAPH_LOADED, want, timeout=60)
    assert state["missingNodes"] == [] and state["dialogs"] == [] and state["toasts"] == [], state
    return state


def _chart(node_id: int) -> str:
    return f'.precision-lora-train[data-node-id="{node_id}"]'


CHART_STATE = """(id) => {
  const root = document.querySelector(`.precision-lora-train[data-node-id="${id}"]`);
  if (!root) return null;
  return {
    points: Number(root.querySelector("canvas").dataset.points || 0),
    validation: Number(root.querySelector("canvas").dataset.validationPoints || 0),
    status: root.querySelector("[data-precision-status]").textContent,
    message: root.querySelector("[data-precision-message]").textContent,
    done: root.dataset.done === "true",
    visible: root.offsetParent !== null,
  };
}"""

POINTS_AT_LEAST = """([id, n, notPrompt]) => {
  const root = document.querySelector(`.precision-lora-train[data-node-id="${id}"]`);
  const p = Number(root?.querySelector("canvas")?.dataset.points || 0);
  // notPrompt: the run the chart showed before Run was pressed (the same file dropped again keeps its graph
  // id, so its earlier run's points are on the node until the new run's first step replaces them)
  if (notPrompt !== undefined && (root?.dataset.promptId ?? "") === notPrompt) return false;
  return p >= n ? p : false;
}"""
SHOWN_PROMPT = """(id) => document.querySelector(`.precision-lora-train[data-node-id="${id}"]`)?.dataset.promptId ?? ''"""

SET_WIDGET = """([id, name, value]) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(id);
  const w = node.widgets.find((x) => x.name === name);
  w.value = value;
  return w.value;
}"""

FOCUS_NODE = """(id) => {
  const app = window.comfyAPI.app.app;
  const node = app.graph.getNodeById(id);
  const ds = app.canvas.ds;
  ds.scale = 1;
  ds.offset[0] = -node.pos[0] + 140; // clear of the side bar
  ds.offset[1] = -node.pos[1] + 120; // clear of the top bar and the node title
  app.canvas.setDirty(true, true);
  return true;
}"""


DESELECT = """() => {
  const canvas = window.comfyAPI.app.app.canvas;
  (canvas.deselectAll ?? canvas.deselectAllNodes).call(canvas);
  canvas.setDirty(true, true);
  return true;
}"""


def _run_from_page(page, server, timeout: float = 120) -> dict:
    """Presses Run; returns the history entry of the prompt it queued once the queue is idle again
    (``timeout``: seconds for that prompt to finish)."""
    _, before = server.get("/history")
    page.call("click", selector='[data-testid="queue-button"]')
    deadline = time.time() + timeout
    while time.time() < deadline:
        _, hist = server.get("/history")
        if len(hist) > len(before):
            break
        time.sleep(0.3)
    else:
        raise TimeoutError(f"Run queued nothing:\n{server.log_text()[-3000:]}")
    return _wait_idle(server)


def _wait_idle(server, timeout: float = 240) -> dict:
    """Waits until nothing is queued or running; returns the newest history entry."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        _, queue = server.get("/queue")
        if not queue["queue_running"] and not queue["queue_pending"]:
            _, hist = server.get("/history?max_items=1")
            if hist:
                return next(iter(hist.values()))
        time.sleep(0.5)
    raise TimeoutError(f"queue not idle after {timeout}s:\n{server.log_text()[-3000:]}")


@pytest.fixture(scope="module")
def training_run(comfy_page, comfy_server):
    """The user's session: everything the tests below assert on is collected here, in order."""
    try:
        return _training_run(comfy_page, comfy_server)
    except BaseException:
        # a step that failed mid-run must not leave the long training running under the rest of the suite
        comfy_server.request("/queue", {"clear": True})
        comfy_server.interrupt()
        raise


def _training_run(page, comfy_server) -> dict:
    page.console(clear=True)
    _drop(page, "train_lora_demo.json")
    assert page.evaluate(SET_WIDGET, [FIRST_TRAIN, "steps", LONG_RUN_STEPS]) == LONG_RUN_STEPS
    assert page.evaluate(SET_WIDGET, [SECOND_TRAIN, "steps", 3]) == 3
    assert page.evaluate(SET_WIDGET, [SETTINGS, "learning_rate", TRAIN_LR]) == TRAIN_LR
    # the validation loss: one of the demo's two samples held out, measured every VALIDATE_EVERY steps
    assert page.evaluate(SET_WIDGET, [SETTINGS, "validate_every_n_steps", VALIDATE_EVERY]) == VALIDATE_EVERY
    assert page.evaluate(SET_WIDGET, [SETTINGS, "validation_fraction", 0.5]) == 0.5
    assert page.evaluate(SET_WIDGET, [PATCH, "scale_value", TRAIN_SCALE_MULTIPLIER]) == TRAIN_SCALE_MULTIPLIER
    fit_view(page)
    page.screenshot("train_01_loaded")
    shown = page.evaluate(SHOWN_PROMPT, FIRST_TRAIN)
    page.call("click", selector='[data-testid="queue-button"]')
    facts = {"points_running": page.wait_for(POINTS_AT_LEAST, [FIRST_TRAIN, 10, shown], timeout=120)}
    page.evaluate(FOCUS_NODE, FIRST_TRAIN)
    page.screenshot("train_02_chart_running")
    page.screenshot("train_02_chart_widget", selector=_chart(FIRST_TRAIN))

    # A reload in the middle of the run: the chart is rebuilt from the server's history.
    before = page.evaluate(CHART_STATE, FIRST_TRAIN)["points"]
    page.call("goto", url=comfy_server.url + "/", waitFor=PAGE_READY, timeout=150)
    facts["points_before_reload"] = before
    facts["points_after_reload"] = page.wait_for(POINTS_AT_LEAST, [FIRST_TRAIN, before], timeout=60)
    page.evaluate(FOCUS_NODE, FIRST_TRAIN)
    page.screenshot("train_03_after_reload")

    # Stop on the node that is not training is refused by the server, and the node says why. The second node
    # sits below the first one's room for its report and previews: bring it into view as a user scrolls.
    page.evaluate(FOCUS_NODE, SECOND_TRAIN)
    page.call("click", selector=f'{_chart(SECOND_TRAIN)} button[data-precision-action="stop"]')
    facts["wrong_node_message"] = page.wait_for(
        f"""() => {{ const t = ({CHART_STATE})({SECOND_TRAIN}).message; return /not training now/.test(t) ? t : false; }}""",
        timeout=30)
    # Clicking on the second node selected it; its selection toolbox (drawn above it) can cover the bottom of
    # the first node, where its buttons are. A user clicks the empty canvas first; so does the test.
    page.evaluate(DESELECT)
    page.evaluate(FOCUS_NODE, FIRST_TRAIN)
    page.call("click", selector=f'{_chart(FIRST_TRAIN)} button[data-precision-action="checkpoint"]')
    facts["checkpoint_message"] = page.wait_for(
        f"""() => {{ const t = ({CHART_STATE})({FIRST_TRAIN}).message; return /checkpoint requested/.test(t) ? t : false; }}""",
        timeout=30)
    now = page.evaluate(CHART_STATE, FIRST_TRAIN)["points"]
    page.wait_for(POINTS_AT_LEAST, [FIRST_TRAIN, now + 2], timeout=60)  # the checkpoint is written between steps
    page.call("click", selector=f'{_chart(FIRST_TRAIN)} button[data-precision-action="stop"]')
    facts["stopped_state"] = page.wait_for(
        f"""() => {{ const s = ({CHART_STATE})({FIRST_TRAIN}); return s && s.done ? s : false; }}""", timeout=60)
    facts["history"] = _wait_idle(comfy_server)
    page.screenshot("train_04_stopped", selector=_chart(FIRST_TRAIN))
    fit_view(page)
    page.screenshot("train_05_finished")
    facts["checkpoints"] = sorted(glob.glob(os.path.join(comfy_server.base_dir, "models", "loras", "**", "*_step*.safetensors"),
                                            recursive=True))
    facts["pack_errors"] = page.pack_errors()
    return facts


def test_chart_fills_while_training_runs(training_run):
    assert training_run["points_running"] >= 10


def test_the_chart_draws_the_validation_loss_beside_the_training_loss(training_run):
    """Every VALIDATE_EVERY-th step's validation loss is a point of the chart's own series, live and after the
    page reload mid-run (replayed from the server's history)."""
    state = training_run["stopped_state"]
    step = int(state["status"].split("step ")[1].split("/")[0])
    assert state["validation"] == step // VALIDATE_EVERY >= 2, state


def test_chart_survives_a_page_reload_during_the_run(training_run):
    assert training_run["points_before_reload"] >= 10
    assert training_run["points_after_reload"] >= training_run["points_before_reload"]


def test_stop_ends_the_run_early_and_the_whole_graph_completes(training_run):
    state = training_run["stopped_state"]
    assert "stopped" in state["status"], state
    step = int(state["status"].split("step ")[1].split("/")[0])
    assert 10 <= step < LONG_RUN_STEPS, state
    status = training_run["history"]["status"]
    assert status["status_str"] == "success", json.dumps(status)[:3000]


def test_stop_on_a_node_that_is_not_training_is_refused(training_run):
    assert f"node {SECOND_TRAIN} is not training now (node {FIRST_TRAIN} is)" in training_run["wrong_node_message"]
    state = training_run["stopped_state"]
    assert "stopped" in state["status"]  # the first node ran on after the refused request, until its own Stop


def test_checkpoint_now_writes_a_checkpoint_file(training_run):
    message = training_run["checkpoint_message"]
    assert "checkpoint requested at step" in message, message
    requested = int(re.search(r"at step (\d+)", message).group(1))
    stopped_at = int(training_run["stopped_state"]["status"].split("step ")[1].split("/")[0])
    ckpts = training_run["checkpoints"]  # models/loras/<run name>/<run name>_step<N>.safetensors
    steps = sorted(int(m.group(1)) for p in ckpts if (m := re.search(r"_step(\d+)", os.path.basename(p))))
    assert steps, ckpts
    # one written right after the requested step, before Stop (which may write its own at the end)
    assert any(requested <= st < stopped_at for st in steps), (requested, stopped_at, steps)
    assert all(os.path.getsize(p) > 0 for p in ckpts)


def test_no_errors_from_the_pack_scripts_during_the_run(training_run):
    assert training_run["pack_errors"] == []


PANEL = """() => {
  const app = window.comfyAPI.app.app;
  const node = app.graph.nodes.find((n) => n.type === "PrecisionLoadLoRA");
  const panel = node?.precisionLoraInfo?.panel;
  if (!panel || panel.dataset.state !== "ready") return false;
  const rows = {};
  for (const td of panel.querySelectorAll("td[data-field]")) rows[td.dataset.field] = td.textContent;
  return { id: node.id, rows, text: panel.innerText };
}"""


def test_loader_shows_metadata_of_the_lora_the_run_wrote(training_run, comfy_page, comfy_server):
    path = os.path.join(comfy_server.base_dir, "models", "loras", *DEMO_LORA.split("/"))
    assert os.path.isfile(path), "the training run did not write the demo LoRA"
    comfy_page.evaluate("async () => { await window.comfyAPI.app.app.refreshComboInNodes(); return true; }")
    _drop(comfy_page, "inference_demo.json")
    panel = comfy_page.wait_for(PANEL, timeout=30)
    rows = panel["rows"]
    with safe_open(path, "pt") as f:
        md = f.metadata()
    # what the run trained with (train_lora_demo.json: rank 4, alpha 4 on tiny Flux.1, head_dim 32; the multiplier
    # set above)
    assert rows["rank"] == md["ss_network_dim"] == "4"
    assert float(rows["alpha"]) == float(md["ss_network_alpha"]) == 4.0
    assert rows["attention backend"] == md["ss_attn_mode"] == "auto"
    assert rows["base model"] == md["ss_base_model_version"] == "flux1"
    assert float(rows["softmax scale"]) == pytest.approx(TRAIN_SCALE_MULTIPLIER / 32 ** 0.5, rel=1e-3)
    assert float(md["ss_attn_softmax_scale"]) == pytest.approx(TRAIN_SCALE_MULTIPLIER / 32 ** 0.5, rel=1e-12)
    assert rows["steps"] == (md["ss_steps"] if "ss_steps" in md else "–")
    assert "recorded attention settings are applied" in panel["text"]
    comfy_page.evaluate(FOCUS_NODE, panel["id"])
    comfy_page.screenshot("loader_metadata")
    # the loader's combo lists the file, so the graph validates as it stands
    options = comfy_page.evaluate("""() => window.comfyAPI.app.app.graph.nodes
        .find((n) => n.type === "PrecisionLoadLoRA").widgets.find((w) => w.name === "lora_name").options.values""")
    assert DEMO_LORA in options
    assert comfy_page.pack_errors() == []


LOADER = 2  # Load LoRA's node id in workflows/inference_demo.json


def _image_of(server, entry: dict) -> np.ndarray:
    """The one image SaveImage wrote in a finished run, as 8-bit pixels."""
    (image,) = [img for out in entry["outputs"].values() for img in out.get("images", [])]
    return np.asarray(Image.open(server.output_path(image["subfolder"], image["filename"])).convert("RGB"))


def _changed(a: np.ndarray, b: np.ndarray) -> float:
    """The share of pixels whose value differs by more than one 8-bit level in some channel."""
    return float((np.abs(a.astype(int) - b.astype(int)).max(axis=-1) > 1).mean())


def test_inference_workflow_runs_from_the_page_on_the_trained_lora(training_run, comfy_page, comfy_server):
    """Continues from the test above: the inference graph in the page is queued with Run as it stands; then
    the same graph with the loader's strength 0 (the LoRA's weights off, its recorded scale kept) and with
    attention 'ignore' (the LoRA on, its recorded scale not applied), set on the page's loader as a user does.
    Each control changes the image: the LoRA and its recorded scale are what the first image shows."""
    entry = _run_from_page(comfy_page, comfy_server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    assert entry["prompt"][2]  # the prompt the page sent
    classes = {v["class_type"] for v in entry["prompt"][2].values()}
    assert {"PrecisionLoadLoRA", "KSampler", "SaveImage"} <= classes
    lora = entry["prompt"][2][str(LOADER)]
    assert lora["class_type"] == "PrecisionLoadLoRA" and lora["inputs"]["lora_name"] == DEMO_LORA
    assert (lora["inputs"]["strength"], lora["inputs"]["attention"]) == (1, "apply_recorded")
    with_lora = _image_of(comfy_server, entry)
    assert with_lora.shape == (64, 64, 3)
    fit_view(comfy_page)
    comfy_page.screenshot("inference_done")
    controls = {}
    for name, changes in {"strength 0": {"strength": 0}, "attention ignore": {"strength": 1, "attention": "ignore"}}.items():
        for widget, value in changes.items():
            assert comfy_page.evaluate(SET_WIDGET, [LOADER, widget, value]) == value
        control = _run_from_page(comfy_page, comfy_server)
        assert control["status"]["status_str"] == "success", json.dumps(control["status"])[:3000]
        sent = control["prompt"][2][str(LOADER)]["inputs"]
        assert all(sent[k] == v for k, v in changes.items()), sent  # the page queued the control
        controls[name] = _image_of(comfy_server, control)
    comfy_page.evaluate(SET_WIDGET, [LOADER, "attention", "apply_recorded"])
    # Pixels moved by more than a rounding step (measured shares: see the commit message). With the loader
    # ignoring strength or the recorded scale, that share is 0.
    shares = {name: _changed(with_lora, image) for name, image in controls.items()}
    assert shares["strength 0"] > 0.5, ("the LoRA's weights changed (almost) nothing", shares)
    assert shares["attention ignore"] > 0.01, ("the recorded softmax scale changed nothing", shares)
    assert comfy_page.pack_errors() == []


PROBE_TEXT = """() => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === "PreviewAny");
  // the widget is "preview" in frontend 1.32 (ComfyUI 0.3.75); 1.49 (ComfyUI 0.33) names it differently
  const w = node?.widgets?.find((x) => x.name === "preview" || (typeof x.value === "string" && x.value.length > 40));
  const text = typeof w?.value === "string" ? w.value : "";
  return text.length > 40 ? text : false;
}"""


def test_probe_workflow_runs_from_the_page_and_shows_its_report(training_run, comfy_page, comfy_server):
    _drop(comfy_page, "precision_probe.json")
    entry = _run_from_page(comfy_page, comfy_server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:3000]
    probe = next(k for k, v in entry["prompt"][2].items() if v["class_type"] == "PrecisionProbe")
    reported = "".join(entry["outputs"][probe]["text"])
    shown = comfy_page.wait_for(PROBE_TEXT, timeout=30)
    assert reported.strip()[:40] in shown
    fit_view(comfy_page)
    comfy_page.screenshot("probe_done")
    assert comfy_page.pack_errors() == []


def _cached_nodes(entry: dict) -> set[str]:
    """Node ids ComfyUI served from its cache in a finished run (its execution_cached message)."""
    return {str(n) for event, data in entry["status"]["messages"] if event == "execution_cached"
            for n in data.get("nodes", [])}


def test_three_runs_of_the_unchanged_workflow_train_once_and_a_change_retrains(training_run, comfy_page,
                                                                               comfy_server):
    """Issue 14 item 1: with the pack's seeds fixed, pressing Run again serves the training nodes from
    ComfyUI's cache (hours on a real model) instead of retraining; changing an input retrains."""
    _drop(comfy_page, "train_lora_demo.json")
    runs = [_run_from_page(comfy_page, comfy_server) for _ in range(3)]
    assert all(r["status"]["status_str"] == "success" for r in runs), [r["status"] for r in runs]
    trained = [str(FIRST_TRAIN) not in _cached_nodes(r) for r in runs]
    assert trained[1:] == [False, False] and sum(trained) <= 1, [sorted(_cached_nodes(r)) for r in runs]
    assert {str(FIRST_TRAIN), str(SECOND_TRAIN)} <= _cached_nodes(runs[2])
    steps = comfy_page.evaluate("""(id) => window.comfyAPI.app.app.graph.getNodeById(id).widgets
      .find((w) => w.name === "steps").value""", SECOND_TRAIN)
    comfy_page.evaluate(SET_WIDGET, [SECOND_TRAIN, "steps", steps + 1])
    changed = _run_from_page(comfy_page, comfy_server)
    assert changed["status"]["status_str"] == "success", changed["status"]
    cached = _cached_nodes(changed)
    assert str(SECOND_TRAIN) not in cached and str(FIRST_TRAIN) in cached, sorted(cached)
    assert comfy_page.pack_errors() == []
