"""Training through a real ComfyUI server from an API prompt: progress + train_step events on the websocket,
the trained LoRA saved, and the saved file loaded by stock ComfyUI (UNETLoader + LoraLoaderModelOnly)
giving the same sample as the model the training node returned."""
from __future__ import annotations

import json
import math
import os
import uuid

import pytest
import safetensors.torch
import torch
import websocket

from training.settings import TrainSettings

pytestmark = pytest.mark.e2e

COSMOS = "precision_tiny_cosmos.safetensors"
ATTACH = dict(rank=4, alpha=4.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
              dry_run=False, init_lora="none")
STEPS = 4


def _sampling(model: list, latent_node: str, cond_node: str, prefix: str, first_id: int) -> dict:
    a, b = str(first_id), str(first_id + 1)
    return {
        a: {"class_type": "KSampler", "inputs": {
            "model": model, "positive": [cond_node, 0], "negative": [cond_node, 0], "latent_image": [latent_node, 0],
            "seed": 3, "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        b: {"class_type": "SaveLatent", "inputs": {"samples": [a, 0], "filename_prefix": prefix}},
    }


def _train_prompt() -> dict:
    settings = {**TrainSettings(learning_rate=1e-2).to_dict()}
    prompt = {
        "1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": COSMOS, "weight_dtype": "fp32"}},
        "2": {"class_type": "PrecisionAttachLoRA", "inputs": {"model": ["1", 0], **ATTACH}},
        "3": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["1", 0], "text": "sks", "seed": 0, "tokens": 8}},
        "4": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["1", 0], "width": 32, "height": 32, "batch_size": 1, "seed": 1}},
        "5": {"class_type": "PrecisionTrainSettings", "inputs": settings},
        "6": {"class_type": "PrecisionTrainLoRA", "inputs": {
            "model": ["2", 0], "latents": ["4", 0], "conditioning": ["3", 0], "settings": ["5", 0],
            "steps": STEPS, "seed": 0, "name": "e2e_train"}},
        "7": {"class_type": "PrecisionSaveLoRA", "inputs": {
            "model": ["6", 0], "filename_prefix": "e2e_train/lora", "folder": "loras", "save_dtype": "fp32",
            "key_style": "auto", "use_counter": True, "overwrite": False}},
        "8": {"class_type": "PrecisionLossGraph", "inputs": {
            "loss": ["6", 2], "smoothing": 0.5, "log_scale": False, "width": 256, "height": 128,
            "filename_prefix": "e2e_train/loss"}},
    }
    prompt.update(_sampling(["6", 0], "4", "3", "e2e_train/trained", 9))
    return prompt


def _run_with_events(server, prompt: dict, timeout: float = 300, client_id: str | None = None) -> tuple[dict, list[dict]]:
    """Queue ``prompt`` and collect its websocket events; returns (history entry, events)."""
    events, prompt_id = _run_controlled(server, prompt, lambda data: None, timeout, client_id)
    return server.wait(prompt_id), events


def _latent(server, entry: dict, node: str) -> torch.Tensor:
    saved = entry["outputs"][node]["latents"][0]
    return safetensors.torch.load_file(server.output_path(saved["subfolder"], saved["filename"]))["latent_tensor"]


def test_training_over_http_with_events_and_stock_loadable_lora(server):
    client_id = str(uuid.uuid4())
    entry, events = _run_with_events(server, _train_prompt(), client_id=client_id)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[:3000]
    steps = [e["data"] for e in events if e["type"] == "precision_lora.train_step"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["node"] == "6" and s["total"] == STEPS and math.isfinite(s["loss"]) and s["lr"] == 1e-2 for s in steps)
    progress = [e["data"] for e in events if e["type"] == "progress" and e["data"].get("node") == "6"]
    # ComfyUI 0.33 throttles progress-bar messages (one per 100 ms at most; the first and the last always
    # go out): the bar may skip steps, the pack's own train_step events above never do
    values = [p["value"] for p in progress]
    assert values[0] == 1 and values[-1] == STEPS and progress[-1]["max"] == STEPS, values
    assert values == sorted(set(values)) and set(values) <= set(range(1, STEPS + 1)), values
    done = [e["data"] for e in events if e["type"] == "precision_lora.train_done"]
    assert done and done[-1]["steps"] == STEPS and done[-1]["stopped"] is False
    status, history = server.get(f"/precision_lora/train/history?client_id={client_id}")
    assert status == 200 and history["running"] is False and len(history["points"]) == STEPS
    assert server.get("/precision_lora/train/history?client_id=someone-else")[1]["points"] == []  # D6
    assert entry["outputs"]["8"]["images"][0]["filename"].endswith(".png")

    (path,) = entry["outputs"]["7"]["text"]
    name = os.path.relpath(path, os.path.join(server.base_dir, "models", "loras"))
    trained = _latent(server, entry, "10")
    before = server.log_text().count("lora key not loaded")
    stock_prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": COSMOS, "weight_dtype": "default"}},
        "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": name, "strength_model": 1.0}},
        "3": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["1", 0], "text": "sks", "seed": 0, "tokens": 8}},
        "4": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["1", 0], "width": 32, "height": 32, "batch_size": 1, "seed": 1}},
        **_sampling(["2", 0], "4", "3", "e2e_train/stock", 5),
        **_sampling(["1", 0], "4", "3", "e2e_train/base", 7),
    }
    stock_entry = server.run(stock_prompt)
    stock, base = _latent(server, stock_entry, "6"), _latent(server, stock_entry, "8")
    assert server.log_text().count("lora key not loaded") == before == 0
    torch.testing.assert_close(stock, trained, rtol=1e-4, atol=1e-4)
    assert (base - trained).abs().max() > 1e-2, "the trained LoRA must change the sample for the match to mean anything"


def test_control_route_without_training_is_409(server):
    status, body = server.request("/precision_lora/train/control", {"action": "stop", "client_id": "x"})
    assert (status, body) == (409, {"ok": False, "error": "no training is running"})


def test_two_chained_training_nodes_save_the_same_lora_as_one(server):
    """In the real executor: Train(2) -> Train(2, training_state) saves the same tensors as Train(4)."""
    prompt = _train_prompt()
    for key in ("8", "9", "10"):
        del prompt[key]
    prompt["6"]["inputs"]["steps"] = 2
    prompt["11"] = {"class_type": "PrecisionTrainLoRA", "inputs": {
        "model": ["6", 0], "latents": ["4", 0], "conditioning": ["3", 0], "settings": ["5", 0],
        "training_state": ["6", 1], "steps": 2, "seed": 0, "name": "e2e_chain"}}
    prompt["7"]["inputs"].update(model=["11", 0], filename_prefix="e2e_chain/two")
    prompt["12"] = {"class_type": "PrecisionTrainLoRA", "inputs": {
        "model": ["2", 0], "latents": ["4", 0], "conditioning": ["3", 0], "settings": ["5", 0],
        "steps": 4, "seed": 0, "name": "e2e_chain"}}
    prompt["13"] = {"class_type": "PrecisionSaveLoRA", "inputs": {**prompt["7"]["inputs"], "model": ["12", 0],
                                                                  "filename_prefix": "e2e_chain/one"}}
    entry = server.run(prompt)
    (two,), (one,) = entry["outputs"]["7"]["text"], entry["outputs"]["13"]["text"]
    a, b = safetensors.torch.load_file(two), safetensors.torch.load_file(one)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("lora_up.weight") and a[k].abs().max() > 0 for k in a)



def test_a_model_from_the_stock_loader_trains_the_same_lora(server):
    """UNETLoader (ComfyUI's *Load Diffusion Model*, inference-mode weights) -> Attach -> Train -> Save gives
    the same LoRA as the same graph on PrecisionLoadDiffusionModel (both fp32 on this CPU)."""
    saved = {}
    for loader in ("precision", "stock"):
        prompt = _train_prompt()
        for key in ("8", "9", "10"):
            del prompt[key]
        prompt["6"]["inputs"].update(steps=2, name=f"e2e_loader_{loader}")
        prompt["7"]["inputs"]["filename_prefix"] = f"e2e_loader/{loader}"
        if loader == "stock":
            prompt["1"] = {"class_type": "UNETLoader", "inputs": {"unet_name": COSMOS, "weight_dtype": "default"}}
        entry = server.run(prompt)
        (path,) = entry["outputs"]["7"]["text"]
        saved[loader] = safetensors.torch.load_file(path)
    ours, stock = saved["precision"], saved["stock"]
    assert ours.keys() == stock.keys() and len(ours) > 0
    assert all(torch.equal(ours[k], stock[k]) for k in ours)
    assert any(k.endswith("lora_up.weight") and ours[k].abs().max() > 0 for k in ours)

def _run_controlled(server, prompt: dict, on_step, timeout: float = 300,
                    client_id: str | None = None) -> tuple[list[dict], str]:
    """Queue ``prompt`` as ``client_id``; call ``on_step(step_data)`` on every train_step event; return
    (events, prompt_id)."""
    client_id = client_id or str(uuid.uuid4())
    ws = websocket.create_connection(f"ws://127.0.0.1:{server.port}/ws?clientId={client_id}", timeout=timeout)
    try:
        prompt_id = server.post_prompt(prompt, client_id=client_id)
        events = []
        while True:
            raw = ws.recv()
            if not isinstance(raw, str):
                continue  # binary previews
            msg = json.loads(raw)
            events.append(msg)
            if msg["type"] == "precision_lora.train_step":
                on_step(msg["data"])
            if msg["type"] in ("execution_success", "execution_error", "execution_interrupted") and \
                    msg.get("data", {}).get("prompt_id") == prompt_id:
                return events, prompt_id
    finally:
        ws.close()


def _long_prompt(name: str) -> dict:
    prompt = _train_prompt()
    for key in ("8", "9", "10"):
        del prompt[key]
    prompt["6"]["inputs"].update(steps=500, name=name)
    prompt["7"]["inputs"]["filename_prefix"] = f"{name}/lora"
    return prompt


def test_stop_and_checkpoint_now_over_http(server):
    """Also D6 (issue 13): another client is refused, and 40 checkpoint requests write one checkpoint."""
    asked, me = {}, str(uuid.uuid4())

    def ask(action, client=me, **extra):
        return server.request("/precision_lora/train/control", {"action": action, "client_id": client, **extra})

    def control(step):
        if step["step"] == 1:
            asked["intruder"] = [ask("stop", "intruder"), ask("checkpoint", "intruder")]
            asked["checkpoint"] = [ask("checkpoint", node_id="6") for _ in range(40)]
        if step["step"] == 3 and "stop" not in asked:
            asked["stop"] = ask("stop")

    events, _ = _run_controlled(server, _long_prompt("e2e_stop"), control, client_id=me)
    assert [r[0] for r in asked["intruder"]] == [403, 403]
    assert all(r[0] == 200 and r[1]["ok"] for r in asked["checkpoint"])
    queued = sum(not r[1]["coalesced"] for r in asked["checkpoint"])
    assert 1 <= queued <= 5  # one, or a few when steps finish while the 40 requests arrive; never one each
    asked["checkpoint"] = asked["checkpoint"][0]
    assert asked["checkpoint"][0] == 200 and asked["checkpoint"][1]["ok"] is True
    assert asked["stop"][0] == 200 and asked["stop"][1]["action"] == "stop"
    done = [e["data"] for e in events if e["type"] == "precision_lora.train_done"][-1]
    assert done["stopped"] is True and 3 <= done["steps"] < 10
    assert events[-1]["type"] == "execution_success"  # a stop ends training; the graph goes on (LoRA saved)
    folder = os.path.join(server.base_dir, "models", "loras", "e2e_stop")  # where LoRA loaders list them
    names = os.listdir(folder)
    assert any(n.startswith("e2e_stop_step000002") or n.startswith("e2e_stop_step000001") for n in names), names
    assert os.path.basename(done["checkpoint"]) in names
    loras = [n for n in names if n.startswith("e2e_stop_step") and n.endswith(".safetensors")]
    assert len(loras) <= queued + 1, loras  # the requested ones and the one Stop writes; never one per request


def test_cancel_over_http_leaves_a_loadable_checkpoint(server):
    def cancel(step):
        if step["step"] == 2:
            server.interrupt()

    events, _ = _run_controlled(server, _long_prompt("e2e_cancel"), cancel)
    assert events[-1]["type"] == "execution_interrupted"
    done = [e["data"] for e in events if e["type"] == "precision_lora.train_done"][-1]
    assert done["stopped"] is True and done["steps"] >= 2 and os.path.isfile(done["checkpoint"])
    tensors = safetensors.torch.load_file(done["checkpoint"])
    assert tensors and all(torch.isfinite(t).all() for t in tensors.values())
    state = torch.load(done["checkpoint"][: -len(".safetensors")] + ".trainstate", weights_only=True)
    assert state["step"] == done["steps"] and len(state["history"]) == done["steps"]
