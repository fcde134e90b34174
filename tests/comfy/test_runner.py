"""The headless runner (runner/headless.py) in-process: the training part of each shipped training workflow,
run by the runner, writes the same LoRA bit for bit (CPU fp32) as the whole workflow through ComfyUI's
executor; --steps / --resume; clear errors for files it cannot run; progress lines."""
from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch
from safetensors import safe_open

from comfy_harness import ROOT, run_graph

WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, "workflows", "api", "*.json")))
TRAINING = [p for p in WORKFLOWS if any(n["class_type"] == "PrecisionTrainLoRA" for n in json.load(open(p)).values())]


def _demo_only(path: str) -> bool:
    """Every file the workflow names is a tiny demo model (the real-model workflows need downloads)."""
    names = [v for n in json.load(open(path)).values() for v in n["inputs"].values() if isinstance(v, str)]
    return all(not v.endswith((".safetensors", ".ckpt", ".pt")) or v.startswith("precision_tiny_") for v in names) \
        and not any(n["class_type"].startswith("Load") for n in json.load(open(path)).values())


RUNNABLE = [p for p in TRAINING if _demo_only(p)]
DEMO_TRAIN = os.path.join(ROOT, "workflows", "api", "train_lora_demo.json")
if not os.path.exists(DEMO_TRAIN):  # before the demo/real split of the shipped workflows
    DEMO_TRAIN = os.path.join(ROOT, "workflows", "api", "train_lora.json")


@pytest.fixture(scope="module")
def headless(pack_module):
    import folder_paths

    tiny = pack_module("demo.tiny_models")
    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    for family in ("cosmos", "flux1_dev", "flux2"):
        path = os.path.join(folder, tiny.demo_model_filename(family))
        if not os.path.exists(path):
            tiny.write_tiny_model(family, path, seed=0)
    return pack_module("runner.headless")


def _prompt(path: str, tag: str, steps: int = 2, checkpoint_every: int | None = None) -> dict:
    """The workflow with a few steps and file names of its own (runs must not collide in one base folder)."""
    prompt = json.load(open(path))
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "PrecisionTrainLoRA":
            inputs["steps"], inputs["name"] = steps, f"runner_{tag}"
        elif node["class_type"] in ("PrecisionSaveLoRA", "PrecisionLossGraph"):
            inputs["filename_prefix"] = f"precision_lora/runner_{tag}_{node['class_type']}"
        elif node["class_type"] == "PrecisionTrainSettings" and checkpoint_every is not None:
            inputs["checkpoint_every"] = checkpoint_every
    return prompt


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _lora_written(result) -> str:
    loras = [p for p in result.written if p.endswith(".safetensors") and "checkpoints" not in p]
    assert len(loras) == 1, result.written
    return loras[0]


@pytest.mark.slow
@pytest.mark.parametrize("path", RUNNABLE, ids=os.path.basename)
def test_runner_writes_the_lora_the_whole_workflow_writes(headless, one_thread, path) -> None:
    lines: list[str] = []
    result = headless.run(_prompt(path, "a"), echo=lines.append, progress_every_s=0)
    assert result.success, result.error
    by_runner = _tensors(_lora_written(result))
    graph = run_graph(_prompt(path, "b"))  # the whole graph (sampling and previews too), as the server runs it
    assert graph["success"], graph["messages"][-1:]
    saves = [graph["outputs"][i][0] for i, n in _prompt(path, "b").items() if n["class_type"] == "PrecisionSaveLoRA"]
    by_graph = _tensors(saves[0][0] if isinstance(saves[0], list) else saves[0])
    assert by_runner.keys() == by_graph.keys() and by_runner
    for key, value in by_graph.items():
        assert torch.equal(by_runner[key], value), key
    assert any(float(v.abs().max()) > 0 for k, v in by_runner.items() if "up" in k)  # trained: not all zeros
    # progress: one line per step with the loss, an ETA from the second step on
    steps = [ln for ln in lines if " step " in ln and "loss" in ln]
    assert len(steps) == 2 * len([n for n in _prompt(path, "a").values() if n["class_type"] == "PrecisionTrainLoRA"])
    assert "ETA" in steps[1] and "ETA" not in steps[0]


@pytest.mark.slow
def test_runner_resume_continues_the_identical_run(headless, one_thread) -> None:
    path = DEMO_TRAIN
    whole = headless.run(_prompt(path, "whole", steps=3), echo=lambda _: None)  # steps 1..3 then 4..6
    assert whole.success, whole.error
    first = headless.run(_prompt(path, "first", steps=1, checkpoint_every=2), echo=lambda _: None)  # 1, then 2
    assert first.success, first.error
    ck = [p for p in first.written if re.search(r"_s(tep)?0*2\.state\.pt$", p)]
    assert len(ck) == 1, first.written
    # --resume with a path outside the checkpoint folder: staged into it, then continued by the first train node.
    outside = os.path.join(os.path.dirname(os.path.dirname(ck[0])), "moved_ck.state.pt")
    os.replace(ck[0], outside)
    lines: list[str] = []
    resumed = headless.run(_prompt(path, "resumed", steps=2), resume=outside, echo=lines.append,  # 3..4, 5..6
                           progress_every_s=0)
    assert resumed.success, resumed.error
    assert any("step 3/4" in ln for ln in lines) and any("step 6/6" in ln for ln in lines), lines
    a, b = _tensors(_lora_written(whole)), _tensors(_lora_written(resumed))
    for key, value in a.items():
        assert torch.equal(value, b[key]), key
    state = lambda r: torch.load([p for p in r.written if p.endswith(".state.pt") and "checkpoints" in p  # noqa: E731
                                  and not re.search(r"_s(tep)?\d+\.state\.pt$", p)][0],
                                 weights_only=True)
    assert [p["loss"] for p in state(whole)["history"]] == [p["loss"] for p in state(resumed)["history"]]


@pytest.mark.slow
def test_ctrl_c_cancels_like_the_ui_with_a_checkpoint(headless, one_thread) -> None:
    import signal

    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if " step 2/" in line:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C in the terminal sends

    result = headless.run(_prompt(DEMO_TRAIN, "ctrl_c", steps=4), echo=echo, progress_every_s=0)
    assert not result.success and "interrupted" in result.error, result.error
    assert any(ln.startswith("cancelling:") for ln in lines), lines
    states = [p for p in result.written if re.search(r"_s(tep)?0*2\.state\.pt$", p)]
    assert len(states) == 1, result.written  # the checkpoint of the last complete step
    assert torch.load(states[0], weights_only=True)["step"] == 2
    assert not any(" step 3/" in ln for ln in lines)  # it ended there, the second train node never ran
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is Python's again


def test_non_training_workflows_are_refused_with_the_reason(headless) -> None:
    for path in WORKFLOWS:
        if path not in TRAINING:
            with pytest.raises(headless.WorkflowError, match="no PrecisionTrainLoRA node"):
                headless.training_targets(headless.load_workflow(path))
    assert RUNNABLE, "no shipped training workflow that runs on the demo models"


def test_ui_format_and_missing_files_are_refused(headless, tmp_path) -> None:
    with pytest.raises(headless.WorkflowError, match=r"UI format.*Export \(API\)"):
        headless.load_workflow(os.path.join(ROOT, "workflows", "train_lora.json"))
    with pytest.raises(headless.WorkflowError, match="not found"):
        headless.load_workflow(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(headless.WorkflowError, match="not an API-format workflow"):
        headless.load_workflow(str(tmp_path / "bad.json"))
    with pytest.raises(headless.WorkflowError, match="no training state file"):
        headless.stage_resume(str(tmp_path / "missing.state.pt"), str(tmp_path / "ck"))


def test_training_part_leaves_out_sampling_and_overrides_apply(headless) -> None:
    prompt = headless.load_workflow(DEMO_TRAIN)
    targets = headless.training_targets(prompt)
    kinds = {prompt[t]["class_type"] for t in targets}
    assert kinds == {"PrecisionTrainLoRA", "PrecisionSaveLoRA", "PrecisionLossGraph"}
    assert {prompt[t]["class_type"] for t in headless.training_targets(prompt, writers=False)} == {"PrecisionTrainLoRA"}
    changed = headless.with_overrides(prompt, steps=7, resume_name="x.state.pt")
    trains = headless.train_nodes(prompt)
    assert [changed[t]["inputs"]["steps"] for t in trains] == [7] * len(trains)
    roots = [t for t in trains if changed[t]["inputs"].get("resume_from") == "x.state.pt"]
    assert len(roots) == 1 and "training_state" not in prompt[roots[0]]["inputs"]
    assert prompt[roots[0]]["inputs"]["resume_from"] == ""  # the caller's prompt is not modified
    with pytest.raises(headless.WorkflowError, match="--steps 0"):
        headless.with_overrides(prompt, steps=0)
    two_roots = {**prompt, "99": json.loads(json.dumps(prompt[roots[0]]))}
    with pytest.raises(headless.WorkflowError, match="exactly one PrecisionTrainLoRA that starts a run"):
        headless.with_overrides(two_roots, resume_name="x.state.pt")


def test_progress_lines_give_step_loss_and_eta(headless) -> None:
    lines: list[str] = []
    now = iter([10.0, 12.0, 14.0, 16.0])
    progress = headless.Progress(lines.append, clock=lambda: next(now), every_s=0)
    for step, loss in ((1, 0.5), (2, None), (3, 0.25), (4, 0.125)):
        progress.event("precision_lora.train_step", {"node": "7", "step": step, "total": 10, "loss": loss, "lr": 1e-4})
    assert lines[0] == "[train 7] step 1/10  loss 0.500000  lr 0.0001"
    assert lines[1].startswith("[train 7] step 2/10  loss skipped (non-finite)")
    # the first step (model load included) is left out of the rate: 2 s/step, 6 steps left at step 4
    assert lines[3] == "[train 7] step 4/10  loss 0.125000  lr 0.0001  2.00 s/step  ETA 0:00:12"


def test_progress_lines_are_throttled_but_keep_first_and_last(headless) -> None:
    lines: list[str] = []
    clock = iter([0.1 * i for i in range(30)])
    progress = headless.Progress(lines.append, clock=lambda: next(clock), every_s=1.0)
    for step in range(1, 31):  # 30 steps at 0.1 s each
        progress.event("precision_lora.train_step", {"node": "7", "step": step, "total": 30, "loss": 0.5, "lr": 1e-4})
    shown = [int(ln.split()[3].split("/")[0]) for ln in lines]
    assert shown[0] == 1 and shown[-1] == 30
    assert 3 <= len(shown) <= 5, shown  # about one per second of the 2.9 s, not 30
