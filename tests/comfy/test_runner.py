"""The headless runner (runner/headless.py) in-process: the training part of each shipped training workflow,
run by the runner, writes the same LoRA bit for bit (CPU fp32) as the whole workflow through ComfyUI's
executor; --steps / --resume; clear errors for files it cannot run; progress lines."""
from __future__ import annotations

import glob
import json
import logging
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
# The train node's progress line (nodes/train/node.py ConsoleLine); group 1 is the step.
PROGRESS = re.compile(r"PrecisionTrainLoRA: step (\d+)/\d+ loss \S+ \(smoothed\) lr \S+ [\d.]+ it/s ETA \d+:\d\d:\d\d$")
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
    result = headless.run(_prompt(path, "a"), echo=lines.append)
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
    # progress: one line per step (2 steps: every step) with the smoothed loss, lr, it/s and ETA
    steps = [ln for ln in lines if PROGRESS.search(ln)]
    assert len(steps) == 2 * len([n for n in _prompt(path, "a").values() if n["class_type"] == "PrecisionTrainLoRA"])


@pytest.mark.slow
def test_runner_resume_continues_the_identical_run(headless, one_thread) -> None:
    path = DEMO_TRAIN
    whole = headless.run(_prompt(path, "whole", steps=3), echo=lambda _: None)  # steps 1..3 then 4..6
    assert whole.success, whole.error
    first = headless.run(_prompt(path, "first", steps=1, checkpoint_every=2), echo=lambda _: None)  # 1, then 2
    assert first.success, first.error
    ck = [p for p in first.written if re.search(r"_s(tep)?0*2\.trainstate$", p)]
    assert len(ck) == 1, first.written
    # --resume with a checkpoint outside the checkpoint folder, written by an earlier version (its state named
    # .state.pt), given by its LoRA file: staged into the folder under the current suffix, then continued by
    # the first train node exactly as a .trainstate is.
    outside = os.path.join(os.path.dirname(os.path.dirname(ck[0])), "moved_ck")
    os.replace(ck[0], outside + ".state.pt")
    os.replace(ck[0][: -len(".trainstate")] + ".safetensors", outside + ".safetensors")
    lines: list[str] = []
    resumed = headless.run(_prompt(path, "resumed", steps=2), resume=outside + ".safetensors", echo=lines.append)  # 3..4, 5..6
    assert resumed.success, resumed.error
    import folder_paths

    staged = [n for n in os.listdir(os.path.join(folder_paths.get_output_directory(), "precision_lora", "checkpoints"))
              if n.startswith("moved_ck")]
    assert any(re.fullmatch(r"moved_ck(_\d+)?\.trainstate", n) for n in staged), staged
    assert not [n for n in staged if n.endswith(".state.pt")], staged  # the old suffix is never written
    assert any("step 3/4" in ln for ln in lines) and any("step 6/6" in ln for ln in lines), lines
    a, b = _tensors(_lora_written(whole)), _tensors(_lora_written(resumed))
    for key, value in a.items():
        assert torch.equal(value, b[key]), key
    # Save LoRA's state, beside its LoRA (not a step checkpoint's)
    state = lambda r: torch.load([p for p in r.written if p.endswith(".trainstate")  # noqa: E731
                                  and not re.search(r"_s(tep)?\d+\.trainstate$", p)][0],
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

    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN in a background job
    result = headless.run(_prompt(DEMO_TRAIN, "ctrl_c", steps=4), echo=echo)
    assert not result.success and "interrupted" in result.error, result.error
    assert any(ln.startswith("cancelling:") for ln in lines), lines
    states = [p for p in result.written if re.search(r"_s(tep)?0*2\.trainstate$", p)]
    assert len(states) == 1, result.written  # the checkpoint of the last complete step
    assert torch.load(states[0], weights_only=True)["step"] == 2
    assert not any(" step 3/" in ln for ln in lines)  # it ended there, the second train node never ran
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C is handled as before the run again


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
        headless.stage_resume(str(tmp_path / "missing.trainstate"), str(tmp_path / "ck"))


def test_training_part_leaves_out_sampling_and_overrides_apply(headless) -> None:
    prompt = headless.load_workflow(DEMO_TRAIN)
    targets = headless.training_targets(prompt)
    kinds = {prompt[t]["class_type"] for t in targets}
    assert kinds == {"PrecisionTrainLoRA", "PrecisionSaveLoRA", "PrecisionLossGraph"}
    assert {prompt[t]["class_type"] for t in headless.training_targets(prompt, writers=False)} == {"PrecisionTrainLoRA"}
    changed = headless.with_overrides(prompt, steps=7, resume_name="x.trainstate")
    trains = headless.train_nodes(prompt)
    assert [changed[t]["inputs"]["steps"] for t in trains] == [7] * len(trains)
    roots = [t for t in trains if changed[t]["inputs"].get("resume_from") == "x.trainstate"]
    assert len(roots) == 1 and "training_state" not in prompt[roots[0]]["inputs"]
    assert prompt[roots[0]]["inputs"]["resume_from"] == ""  # the caller's prompt is not modified
    with pytest.raises(headless.WorkflowError, match="--steps 0"):
        headless.with_overrides(prompt, steps=0)
    two_roots = {**prompt, "99": json.loads(json.dumps(prompt[roots[0]]))}
    with pytest.raises(headless.WorkflowError, match="exactly one PrecisionTrainLoRA that starts a run"):
        headless.with_overrides(two_roots, resume_name="x.trainstate")


def test_a_headless_run_prints_one_progress_line_per_reported_step(headless, one_thread, caplog) -> None:
    """The train node's progress line goes to the runner's console instead of ComfyUI's log, so the terminal
    shows each report once (both used to print one); the line keeps its step, smoothed loss, lr, it/s, ETA."""
    lines: list[str] = []
    with caplog.at_level(logging.INFO):
        result = headless.run(_prompt(DEMO_TRAIN, "one_line", steps=3), echo=lines.append)  # steps 1..3, 4..6
    assert result.success, result.error
    printed = [int(m.group(1)) for m in map(PROGRESS.search, lines) if m]
    assert printed == [1, 2, 3, 4, 5, 6], lines  # 3 steps per node: every step reported, each once
    assert not [r.getMessage() for r in caplog.records if PROGRESS.search(r.getMessage())]  # not logged too
    assert not [ln for ln in lines if re.search(r"step \d+/\d+", ln) and not PROGRESS.search(ln)], lines
    assert any(ln.startswith("[train ") and " done at step 6" in ln for ln in lines), lines  # a node's end: a line of its own


def test_resume_from_a_lora_without_a_state_names_both_suffixes(headless, tmp_path) -> None:
    """A checkpoint LoRA's state is its .trainstate, else the .state.pt of earlier versions: the error names both."""
    with pytest.raises(headless.WorkflowError, match=r"no training state file .*ck\.trainstate or .*ck\.state\.pt"):
        headless.stage_resume(str(tmp_path / "ck.safetensors"), str(tmp_path / "out"))
