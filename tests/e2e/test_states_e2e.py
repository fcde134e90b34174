"""Training states through a real server's /prompt, ComfyUI's validation included (issue 22 item 2, issue 23
item 2): Save LoRA keeps A/final's and B/final's states apart beside their LoRAs, resuming A (by the absolute
path the node shows) continues A's run bit for bit, a state that is not its LoRA's is refused at validation
naming both files, and a missing folder is refused with the form resume_from takes."""
from __future__ import annotations

import os
import shutil
import uuid

import pytest
import safetensors.torch
import torch

from training.settings import TrainSettings

pytestmark = pytest.mark.e2e

COSMOS = "precision_tiny_cosmos.safetensors"
ATTACH = dict(rank=2, alpha=2.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
              dry_run=False, init_lora="none")


def _chain(prompt: dict, first: int, lr: float, steps: int, prefix: str, **train) -> str:
    """Settings -> Train LoRA -> Save LoRA (with the training state) on nodes 1-4; returns Save LoRA's id."""
    s, t, v = (str(first + i) for i in range(3))
    prompt[s] = {"class_type": "PrecisionTrainSettings", "inputs": TrainSettings(learning_rate=lr).to_dict()}
    prompt[t] = {"class_type": "PrecisionTrainLoRA", "inputs": {
        "model": ["2", 0], "latents": ["4", 0], "conditioning": ["3", 0], "settings": [s, 0], "steps": steps,
        "seed": 0, "name": f"e2e_states_{first}", **train}}
    prompt[v] = {"class_type": "PrecisionSaveLoRA", "inputs": {
        "model": [t, 0], "filename_prefix": prefix, "folder": "loras", "save_dtype": "fp32", "key_style": "auto",
        "use_counter": True, "overwrite": False, "training_state": [t, 1]}}
    return v


def _base() -> dict:
    return {
        "1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": COSMOS, "weight_dtype": "fp32"}},
        "2": {"class_type": "PrecisionAttachLoRA", "inputs": {"model": ["1", 0], **ATTACH}},
        "3": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["1", 0], "text": "sks", "seed": 0, "tokens": 4}},
        "4": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["1", 0], "width": 16, "height": 16, "batch_size": 1, "seed": 1}},
    }


def _refusal(server, prompt: dict) -> str:
    status, body = server.request("/prompt", {"prompt": prompt, "client_id": str(uuid.uuid4())})
    assert status == 400, body
    return " | ".join(e.get("details", "") for errs in body["node_errors"].values() for e in errs["errors"])


def test_states_stay_with_their_lora_and_resume_only_their_run(server):
    prompt = _base()
    save_a = _chain(prompt, 10, 1e-2, 2, "e2e_states/A/final")
    save_b = _chain(prompt, 20, 3e-2, 2, "e2e_states/B/final")
    save_ref = _chain(prompt, 30, 1e-2, 4, "e2e_states/ref")
    out = server.run(prompt)["outputs"]
    (a_lora, a_state), (b_lora, b_state) = out[save_a]["text"], out[save_b]["text"]
    assert os.path.basename(a_lora) == os.path.basename(b_lora) == "final_00001_.safetensors"
    assert a_state == a_lora[: -len(".safetensors")] + ".trainstate" and os.path.isfile(a_state)
    assert b_state == b_lora[: -len(".safetensors")] + ".trainstate" and os.path.isfile(b_state)
    assert os.path.dirname(a_lora).endswith("e2e_states/A") and os.path.dirname(b_lora).endswith("e2e_states/B")

    # resume A by the absolute path the node shows: the same LoRA as 4 steps in one run
    prompt = _base()
    resumed = _chain(prompt, 40, 1e-2, 2, "e2e_states/A_resumed", resume_from=a_lora)
    (path, _), (ref, _) = server.run(prompt)["outputs"][resumed]["text"], out[save_ref]["text"]
    got, want = safetensors.torch.load_file(path), safetensors.torch.load_file(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    # B's state beside A's LoRA (what the shared checkpoint folder did before): refused at validation
    shutil.copy(b_state, a_state)
    prompt = _base()
    _chain(prompt, 40, 1e-2, 2, "e2e_states/A_resumed", resume_from="e2e_states/A/final_00001_.safetensors")
    details = _refusal(server, prompt)
    assert (f"the training state {os.path.realpath(a_state)} does not belong to the LoRA "
            f"{os.path.realpath(a_lora)}") in details, details

    prompt = _base()
    _chain(prompt, 40, 1e-2, 2, "e2e_states/none", resume_from="no_such_folder/final_00001_.safetensors")
    details = _refusal(server, prompt)
    assert "there is no folder 'no_such_folder'" in details and "my_lora/my_lora_step000072.safetensors" in details


@pytest.mark.parametrize("setting, needed", [("caption_dropout", "empty_conditioning"),
                                             ("dop_multiplier", "class_conditioning")])
def test_settings_that_need_a_train_input_are_refused_when_queued(server, setting, needed):
    """Issue 23 item 8: refused by /prompt (before any node runs, so before any caption is encoded), naming
    both inputs and nodes; connected, the same prompt is accepted and trains."""
    prompt = _base()
    save = _chain(prompt, 50, 1e-3, 1, f"e2e_rules/{setting}")
    prompt["50"]["inputs"][setting] = 0.1
    before = server.log_text().count("PrecisionTrainLoRA: dataset:")
    details = _refusal(server, prompt)
    assert (f"PrecisionTrainLoRA: input '{needed}' is not connected, but input '{setting}'=0.1 of node 50 "
            f"(PrecisionTrainSettings) needs it: connect") in details, details
    assert server.log_text().count("PrecisionTrainLoRA: dataset:") == before  # nothing ran
    prompt["51"]["inputs"][needed] = ["3", 0]
    assert os.path.isfile(server.run(prompt)["outputs"][save]["text"][0])
