"""Loader lists follow the files the pack writes (issue 23 item 7): a Save LoRA run queued from the page puts
the new LoRA into the list of a stock LoRA loader already on the canvas, without the user pressing Refresh
and without a toast (web/lora_refresh.js)."""
from __future__ import annotations

import uuid

import pytest

pytestmark = pytest.mark.browser

ADD_LOADER = """() => {
  const app = window.comfyAPI.app.app;
  const node = window.LiteGraph.createNode("LoraLoaderModelOnly");
  app.graph.add(node);
  return node.id;
}"""

OPTIONS = """(id) => {
  const app = window.comfyAPI.app.app;
  const node = app.graph.getNodeById(id);
  return node.widgets.find((w) => w.name === "lora_name").options.values;
}"""

QUEUE = """async (prefix) => {
  const api = window.comfyAPI.api.api;
  const tiny = "precision_tiny_cosmos.safetensors";
  const prompt = {
    "1": {class_type: "PrecisionLoadDiffusionModel", inputs: {model_name: tiny, weight_dtype: "fp32"}},
    "2": {class_type: "PrecisionAttachLoRA", inputs: {model: ["1", 0], rank: 2, alpha: 2.0, targets: "attention",
      include: "", exclude: "", blocks: "", fp32_accumulation: true, dropout: 0.0, rank_dropout: 0.0,
      module_dropout: 0.0, rslora: false, param_dtype: "fp32", seed: 0, init_lora: "none", dry_run: false}},
    "3": {class_type: "PrecisionSaveLoRA", inputs: {model: ["2", 0], filename_prefix: prefix, folder: "loras",
      save_dtype: "fp32", key_style: "auto", use_counter: true, overwrite: false}},
  };
  const resp = await api.fetchApi("/prompt", {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({prompt, client_id: api.clientId ?? api.initialClientId})});
  return resp.status;
}"""

LISTED = """([id, name]) => {
  const node = window.comfyAPI.app.app.graph.getNodeById(id);
  return node.widgets.find((w) => w.name === "lora_name").options.values.includes(name);
}"""

TOASTS = "() => document.querySelectorAll('.p-toast-message').length"


def test_a_saved_lora_appears_in_a_loader_list_without_refresh(comfy_page):
    prefix = f"browser_refresh/{uuid.uuid4().hex[:8]}"
    saved = f"{prefix}_00001_.safetensors"
    node = comfy_page.evaluate(ADD_LOADER)
    try:
        assert saved not in comfy_page.evaluate(OPTIONS, node)
        assert comfy_page.evaluate(QUEUE, prefix) == 200
        assert comfy_page.wait_for(LISTED, [node, saved], timeout=90)
        assert comfy_page.evaluate(TOASTS) == 0
    finally:
        comfy_page.evaluate("(id) => { const g = window.comfyAPI.app.app.graph; g.remove(g.getNodeById(id)); }", node)
