"""What every shipped real workflow's page test does the same way (tests/browser/test_real_workflow*_ui.py): drop
the workflow as a user would, pick names in its widgets, check the page queues exactly the shipped API twin with
those picks, Run, and read what the run saved; then the inference twin with the LoRA just saved, and strength 0
in the page to show the LoRA is what changes the output."""
from __future__ import annotations

import glob
import json
import os

import numpy as np
from PIL import Image, ImageSequence
from safetensors import safe_open

from precision_browser import CLEAR_TOASTS, DROP_WORKFLOW, GRAPH_LOADED, NODE_OVERLAPS, PROMPT_OF_GRAPH, fit_view, \
    normalise_prompt
from test_training_ui import CHART_STATE, _run_from_page

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def api(name: str) -> dict:
    """A shipped workflow's API twin (workflows/api/<name>)."""
    with open(os.path.join(ROOT, "workflows", "api", name)) as f:
        return json.load(f)


def drop(page, name: str, no_overlaps: bool = True) -> dict:
    """Drops a shipped workflow onto the page as a user would; waits for every node id; returns {node type: id}
    (of two nodes of one type, e.g. the inference graph's CLIP Text Encode pair: the last one's id). With
    `no_overlaps`, checks that no node lies over another as the graph loads."""
    with open(os.path.join(ROOT, "workflows", name)) as f:
        text = f.read()
    nodes = json.loads(text)["nodes"]
    page.evaluate(REFRESH)
    page.evaluate(CLEAR_TOASTS)
    page.evaluate(DROP_WORKFLOW, {"name": name, "text": text})
    state = page.wait_for(GRAPH_LOADED, sorted(n["id"] for n in nodes), timeout=60)
    assert state["missingNodes"] == [] and state["dialogs"] == [], state
    if no_overlaps:
        assert page.evaluate(NODE_OVERLAPS)["overlaps"] == []
    return {n["type"]: n["id"] for n in nodes}


def pick(page, picks: list[tuple]) -> None:
    """(node id, widget, value) picks from the widgets' lists."""
    for node_id, name, value in picks:
        assert page.evaluate(PICK, [node_id, name, value]) == {"value": value}


def number(page, picks: list[tuple]) -> None:
    """(node id, widget, value) numbers typed into widgets."""
    for node_id, name, value in picks:
        assert page.evaluate(NUMBER, [node_id, name, value]) == {"value": value}


def assert_queues(page, want: dict) -> None:
    """The page's graph converts to exactly this API prompt (what Run would queue)."""
    assert normalise_prompt(page.evaluate(PROMPT_OF_GRAPH)) == normalise_prompt(want)


def run(page, server, timeout: int = 600) -> dict:
    """Run in the page; the history entry of the run, which succeeded."""
    entry = _run_from_page(page, server, timeout=timeout)
    assert entry["status"]["status_str"] == "success", entry["status"]
    return entry


def image(server, entry: dict, node_id: int) -> np.ndarray:
    """The image a SaveImage node of the run saved (h, w, 3)."""
    (img,) = entry["outputs"][str(node_id)]["images"]
    return np.asarray(Image.open(server.output_path(img["subfolder"], img["filename"])))


def frames(server, entry: dict, node_id: int) -> np.ndarray:
    """The frames a Save Animated WEBP node of the run saved (n, h, w, 3)."""
    (item,) = entry["outputs"][str(node_id)]["images"]
    with Image.open(server.output_path(item["subfolder"], item["filename"])) as img:
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(img)])


def train_in_page(page, server, ids: dict, *, files: str, lora_prefix: str, steps: int, base_model_version: str,
                  shot: str, no_overlaps: bool = True, timeout: float = 900) -> tuple[str, set[str]]:
    """Run the dropped training graph from the page: it saves one new LoRA (`<lora_prefix>_*.safetensors`) that
    records `steps` and the family, Train LoRA's loss chart shows the finished run, and (`no_overlaps`) no node lies
    over another after Train LoRA grew by its report and chart. Returns the LoRA's name for Load LoRA's list and its modules."""
    pattern = os.path.join(files, "models", "loras", "precision_lora", f"{lora_prefix}_*.safetensors")
    before = set(glob.glob(pattern))
    run(page, server, timeout=timeout)
    saved = sorted(set(glob.glob(pattern)) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
        modules = {k[: -len(".lora_up.weight")] for k in f.keys() if k.endswith(".lora_up.weight")}
    assert md["ss_steps"] == str(steps) and md["ss_base_model_version"] == base_model_version, md
    trainer = ids["PrecisionTrainLoRA"]
    chart = page.wait_for(f"() => {{ const s = ({CHART_STATE})({trainer}); return s && s.done ? s : false; }}",
                          timeout=60)
    assert chart["points"] >= steps - 2, chart
    if no_overlaps:
        overlaps = page.evaluate(NODE_OVERLAPS)
        assert overlaps["overlaps"] == [], overlaps
    fit_view(page)
    page.screenshot(shot)
    return "precision_lora/" + os.path.basename(saved[0]), modules


def infer_in_page(page, server, ids: dict, read, node_id: int, shot: str) -> np.ndarray:
    """Run the dropped inference graph from the page; the output `read` (image / frames) finds at `node_id`,
    which is not blank; then strength 0 on Load LoRA (Precision) in the page gives another output (the LoRA is
    what changes it) and the page shows no error of the pack."""
    with_lora = read(server, run(page, server), node_id)
    assert with_lora.std() > 0, with_lora.shape
    fit_view(page)
    page.screenshot(shot)
    number(page, [(ids["PrecisionLoadLoRA"], "strength", 0.0)])
    assert not np.array_equal(read(server, run(page, server), node_id), with_lora)
    assert page.pack_errors() == []
    return with_lora
