"""The example workflows: each UI file and its API twin describe the same graph, and every twin runs on
the tiny demo models on the real server (training produces the LoRA that inference and the probe load)."""
from __future__ import annotations

import copy
import glob
import json
import math
import os
import shutil
import uuid

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WF = os.path.join(ROOT, "workflows")
UI_FILES = sorted(glob.glob(os.path.join(WF, "*.json")))
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
# Display-only widgets the frontend adds to some core nodes: not saved in widgets_values, but sent in the
# prompt with an empty value (the server ignores them).
FRONTEND_PROMPT_WIDGETS = {"PreviewAny": {"preview": ""}}
DEMO_LORA = "precision_lora/demo_lora.safetensors"


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _is_widget(spec: list, forced_too: bool = False) -> bool:
    kind, opts = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    if isinstance(kind, list):
        return True
    return kind in WIDGET_TYPES and (forced_too or not opts.get("forceInput"))


def _has_control_widget(name: str, spec: list) -> bool:
    """The frontend adds a 'control after generate' widget (one more widgets_values entry) to INT inputs
    with control_after_generate, or, when the spec does not say, to INT inputs named seed / noise_seed;
    and to combos that ask for it."""
    kind, opts = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    flag = opts.get("control_after_generate")
    if kind == "INT":
        return bool(flag) if flag is not None else name in ("seed", "noise_seed")
    return bool(flag)


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """The API prompt a UI-format workflow stands for, from ComfyUI's node schemas (no frontend)."""
    links = {link[0]: link for link in workflow["links"]}
    out = {}
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_ONLY or node.get("mode", 0) in (2, 4):
            continue
        assert node["type"] in object_info, f"node type {node['type']} unknown to the server"
        info = object_info[node["type"]]
        specs = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
        order = info.get("input_order") or {k: list(v) for k, v in info["input"].items() if k != "hidden"}
        names = [*order.get("required", []), *order.get("optional", [])]
        values = list(node.get("widgets_values") or [])
        # A file saved by a frontend whose schema still had a now force-input STRING as a widget (0.3.75's
        # MakeTrainingDataset.texts; 0.33 forces it to a socket) carries its value too: count it then.
        plain = sum(1 + int(_has_control_widget(n, specs[n])) for n in names if _is_widget(specs[n]))
        forced_too = len(values) > plain
        inputs, i = dict(FRONTEND_PROMPT_WIDGETS.get(node["type"], {})), 0
        for name in names:
            if _is_widget(specs[name], forced_too):
                assert i < len(values), f"node {node['id']} ({node['type']}): no widget value for {name}"
                inputs[name] = values[i]
                i += 1 + int(_has_control_widget(name, specs[name]))
        assert i == len(values), f"node {node['id']} ({node['type']}): {len(values)} widget values, schema uses {i}"
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                link = links[slot["link"]]
                assert link[3] == node["id"], f"link {link[0]} does not end at node {node['id']}"
                inputs[slot["name"]] = [str(link[1]), link[2]]
        out[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return out


def strip_meta(prompt: dict) -> dict:
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


def test_workflow_set_is_complete():
    names = sorted(os.path.basename(p) for p in UI_FILES)
    assert {"train_lora.json", "inference_matching_scale.json", "train_lora_demo.json", "inference_demo.json"} <= set(names)
    assert names == sorted(os.path.basename(p) for p in glob.glob(os.path.join(WF, "api", "*.json"))), \
        "every UI workflow has an API twin under workflows/api and vice versa"


@pytest.mark.parametrize("path", UI_FILES, ids=os.path.basename)
def test_ui_file_and_api_twin_describe_the_same_graph(server, path):
    workflow = _load(path)
    twin = _load(os.path.join(WF, "api", os.path.basename(path)))
    info = server.object_info()
    converted = ui_to_api(workflow, info)
    assert sorted(converted) == sorted(twin), "same node ids"
    for node_id, node in converted.items():
        assert node["class_type"] == twin[node_id]["class_type"], node_id
        assert node["inputs"] == twin[node_id]["inputs"], f"node {node_id} ({node['class_type']})"
    # only core and pack nodes: every type is known to a server that has nothing but this pack
    for node in workflow["nodes"]:
        assert node["type"] in info or node["type"] in FRONTEND_ONLY, node["type"]
    # the canvas explains itself
    notes = [n for n in workflow["nodes"] if n["type"] in ("Note", "MarkdownNote")]
    assert notes and all(len(n["widgets_values"][0]) > 80 for n in notes)


def test_converter_catches_a_changed_widget_value_and_a_rewired_link(server):
    """The equality check above can fail: a one-value or one-link change is seen."""
    info = server.object_info()
    workflow = _load(os.path.join(WF, "inference_matching_scale.json"))
    twin = strip_meta(_load(os.path.join(WF, "api", "inference_matching_scale.json")))
    changed = copy.deepcopy(workflow)
    ks = next(n for n in changed["nodes"] if n["type"] == "KSampler")
    ks["widgets_values"][2] += 1  # steps (after seed and its control value)
    assert ui_to_api(changed, info) != twin
    rewired = copy.deepcopy(workflow)
    link = next(lk for lk in rewired["links"] if lk[4] == 0 and lk[3] == ks["id"])  # KSampler.model
    link[1] = next(n["id"] for n in rewired["nodes"] if n["type"] == "PrecisionLoadDiffusionModel")
    assert ui_to_api(rewired, info) != twin
    assert ui_to_api(workflow, info) == twin


# ---- the twins run ------------------------------------------------------------------------------------

TRAIN_SCALE_MULTIPLIER = 0.8  # not the default, so "the recorded scale is applied" is observable
TRAIN_LR = 1e-2  # the demo's 1e-4 for 6 steps moves no pixel of the 8-bit image


def _nodes_of(prompt: dict, class_type: str) -> list[str]:
    return sorted((k for k, v in prompt.items() if v["class_type"] == class_type), key=int)


@pytest.fixture(scope="module")
def trained(comfy_server):
    """Runs the training twin (fewer steps, a larger learning rate so that the LoRA visibly changes an image
    in 6 steps, a non-default scale); returns (entry, prompt, lora path)."""
    prompt = _load(os.path.join(WF, "api", "train_lora_demo.json"))
    for nid in _nodes_of(prompt, "PrecisionTrainLoRA"):
        prompt[nid]["inputs"]["steps"] = 3
    prompt[_nodes_of(prompt, "PrecisionTrainSettings")[0]]["inputs"]["learning_rate"] = TRAIN_LR
    att = _nodes_of(prompt, "PrecisionPatchAttention")[0]
    prompt[att]["inputs"]["scale_mode"] = "multiplier"
    prompt[att]["inputs"]["scale_value"] = TRAIN_SCALE_MULTIPLIER
    entry = comfy_server.run(prompt, timeout=600)
    path = os.path.join(comfy_server.base_dir, "models", "loras", *DEMO_LORA.split("/"))
    return entry, prompt, path


def test_training_twin_writes_the_lora_with_its_attention_settings(server, trained):
    entry, prompt, path = trained
    assert os.path.isfile(path), f"no LoRA at {path}"
    with safe_open(path, "pt") as f:
        md = f.metadata()
        keys = list(f.keys())
    assert any(k.startswith("lora_unet_") for k in keys), keys[:5]  # kohya keys for Flux
    head_dim = 32  # tiny Flux.1: hidden 64, 2 heads
    assert math.isclose(float(md["ss_attn_softmax_scale"]), TRAIN_SCALE_MULTIPLIER / math.sqrt(head_dim), rel_tol=1e-9)
    assert md["ss_network_dim"] == str(prompt[_nodes_of(prompt, "PrecisionAttachLoRA")[0]]["inputs"]["rank"])
    assert md["ss_lora_fp32_accumulation"].lower() == "true"
    # the preview and the learning curve were produced
    images = [img for out in entry["outputs"].values() for img in out.get("images", [])]
    assert len(images) >= 2, entry["outputs"]
    # the metadata route the loader's panel uses reports it
    status, body = server.get("/precision_lora/lora/metadata?name=" + DEMO_LORA.replace("/", "%2F"))
    assert status == 200, body
    assert body["summary"]["rank"] == md["ss_network_dim"]
    assert body["summary"]["softmax_scale"] == md["ss_attn_softmax_scale"]
    # Save LoRA's training_state link: the run's state (2 x 3 steps) beside the LoRA, resumable by its name
    state = torch.load(path[: -len(".safetensors")] + ".trainstate", weights_only=True)
    assert state["step"] == 6 and len(state["history"]) == 6 and md["ss_steps"] == "6"


def _saved_image(server, entry: dict, node_id: str) -> np.ndarray:
    img = entry["outputs"][node_id]["images"][0]
    return np.asarray(Image.open(server.output_path(img["subfolder"], img["filename"])))


def _fresh_lora(server, trained) -> str:
    """The file the training twin wrote, under a name this server session has never loaded: ComfyUI caches a
    node's output by its inputs, so an earlier run on demo_lora (e.g. the browser tests') cannot stand in."""
    fresh = f"precision_lora/e2e_{uuid.uuid4().hex}.safetensors"
    shutil.copyfile(trained[2], os.path.join(server.base_dir, "models", "loras", *fresh.split("/")))
    return fresh


def _variant(prompt: dict, loader: str, save: str | None = None, **inputs) -> dict:
    out = copy.deepcopy(prompt)
    out[loader]["inputs"].update(inputs)
    if save is not None:
        out[save]["inputs"]["filename_prefix"] = "precision_lora/inference_" + "_".join(inputs)
    return out


def test_inference_twin_uses_the_trained_lora_and_its_scale(server, trained):
    """Controls: strength 0 (the LoRA's weights off, its recorded scale still applied) and attention ignore
    (the LoRA on, the recorded scale not applied); both together give the base model's image."""
    prompt = _load(os.path.join(WF, "api", "inference_demo.json"))
    save = _nodes_of(prompt, "SaveImage")[0]
    loader = _nodes_of(prompt, "PrecisionLoadLoRA")[0]
    assert prompt[loader]["inputs"]["lora_name"] == DEMO_LORA
    prompt[loader]["inputs"]["lora_name"] = _fresh_lora(server, trained)
    with_lora = _saved_image(server, server.run(prompt), save)
    assert with_lora.shape == (64, 64, 3)
    images = {}
    for name, inputs in {"strength 0": {"strength": 0.0}, "attention ignore": {"attention": "ignore"},
                         "both off": {"strength": 0.0, "attention": "ignore"}}.items():
        images[name] = _saved_image(server, server.run(_variant(prompt, loader, save, **inputs)), save)
    assert not np.array_equal(with_lora, images["strength 0"]), "the LoRA's weights changed nothing"
    assert not np.array_equal(with_lora, images["attention ignore"]), "the recorded softmax scale changed nothing"
    assert not np.array_equal(images["strength 0"], images["both off"]), "the scale alone changed nothing"
    base = copy.deepcopy(prompt)
    base[_nodes_of(prompt, "KSampler")[0]]["inputs"]["model"] = prompt[loader]["inputs"]["model"]
    base[save]["inputs"]["filename_prefix"] = "precision_lora/inference_base"
    assert np.array_equal(_saved_image(server, server.run(base), save), images["both off"])


def _probe_text(server, prompt: dict) -> str:
    entry = server.run(prompt)
    probe, preview = _nodes_of(prompt, "PrecisionProbe")[0], _nodes_of(prompt, "PreviewImage")[0]
    assert entry["outputs"][preview]["images"], entry["outputs"]
    return "".join(entry["outputs"][probe]["text"])


def test_probe_twin_reports_the_trained_lora_and_its_scale(server, trained):
    """The report names the scale recorded in the LoRA and measures the LoRA's layers; with attention ignore it
    reports the default scale, with strength 0 no delta to measure."""
    prompt = _load(os.path.join(WF, "api", "precision_probe.json"))
    loader = _nodes_of(prompt, "PrecisionLoadLoRA")[0]
    prompt[loader]["inputs"]["lora_name"] = _fresh_lora(server, trained)
    scale = TRAIN_SCALE_MULTIPLIER / math.sqrt(32)  # tiny Flux.1: head_dim 32
    text = _probe_text(server, prompt)
    assert f"scale {scale:.4g} ({TRAIN_SCALE_MULTIPLIER:g}x default)" in text, text
    assert "LoRA delta survival" in text and "model (energy-weighted)" in text, text
    assert "softmax scale is 0.8x the default" in text, text
    ignored = _probe_text(server, _variant(prompt, loader, attention="ignore"))
    assert f"scale {1 / math.sqrt(32):.4g} (1x default)" in ignored, ignored
    assert "model (energy-weighted)" in ignored and "softmax scale is" not in ignored, ignored
    off = _probe_text(server, _variant(prompt, loader, strength=0.0))
    assert "model (energy-weighted)" not in off, off
