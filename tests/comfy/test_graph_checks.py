"""Rules across nodes refused before anything runs (issue 23 item 8), in the headless runner (the server's
/prompt is tested in tests/e2e/test_states_e2e.py): the runner marks the prompt as the server's on_prompt
handler does, and ComfyUI's validation refuses it naming both inputs, before any node executes."""
from __future__ import annotations

import json
import os

import pytest

from comfy_harness import ROOT

DEMO_TRAIN = os.path.join(ROOT, "workflows", "api", "train_lora_demo.json")


@pytest.fixture(scope="module")
def headless(pack_module):
    import folder_paths

    tiny = pack_module("demo.tiny_models")
    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    path = os.path.join(folder, tiny.demo_model_filename("cosmos"))
    if not os.path.exists(path):
        tiny.write_tiny_model("cosmos", path, seed=0)
    return pack_module("runner.headless")


def test_caption_dropout_without_the_empty_caption_is_refused_before_anything_runs(headless):
    prompt = json.load(open(DEMO_TRAIN))
    settings = next(k for k, n in prompt.items() if n["class_type"] == "PrecisionTrainSettings")
    prompt[settings]["inputs"]["caption_dropout"] = 0.1
    lines: list[str] = []
    result = headless.run(prompt, echo=lines.append)
    assert not result.success and result.written == []
    assert (f"PrecisionTrainLoRA: input 'empty_conditioning' is not connected, but input 'caption_dropout'=0.1 of "
            f"node {settings} (PrecisionTrainSettings) needs it: connect the empty caption's conditioning") in result.error
    assert not [ln for ln in lines if "dataset:" in ln or "step " in ln]  # no node ran


def test_a_prompt_that_breaks_no_rule_is_left_unchanged(pack_module):
    checks = pack_module("nodes.checks.graph")
    prompt = json.load(open(DEMO_TRAIN))
    before = json.dumps(prompt, sort_keys=True)
    assert checks.on_prompt({"prompt": prompt})["prompt"] is prompt and json.dumps(prompt, sort_keys=True) == before
    assert checks.on_prompt({"no prompt": 1}) == {"no prompt": 1} and checks.on_prompt(None) is None


def test_a_settings_value_its_own_node_refuses_is_not_reported_twice(pack_module):
    """dop_multiplier=1e9 is above the input's maximum (100): the settings node's error, not Train LoRA's too."""
    checks = pack_module("nodes.checks.graph")
    prompt = json.load(open(DEMO_TRAIN))
    settings = next(k for k, n in prompt.items() if n["class_type"] == "PrecisionTrainSettings")
    prompt[settings]["inputs"]["dop_multiplier"] = 1e9
    assert list(checks.problems(prompt)) == []
    prompt[settings]["inputs"]["dop_multiplier"] = 50.0
    assert [(name, node) for node, name, _ in checks.problems(prompt)] == [
        ("class_conditioning", k) for k, n in prompt.items() if n["class_type"] == "PrecisionTrainLoRA"]
