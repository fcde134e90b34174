"""The headless runner (scripts/train.py) against the real server: the same API workflow writes the same LoRA
bit for bit (CPU fp32) either way, a training state from either side continues on the other, and a
2-process torchrun (gloo) run equals one process within fp32 rounding, its checkpoint continuing in the UI.

Every run is a separate process with its own base folder (the tiny demo models linked in); the server is
the session's (tests/conftest.py). Each workflow is the shipped demo training workflow with 2 + 2 steps, a
global batch of 2 (both demo latents, so the 2 ranks get one each) and a checkpoint every 2 steps.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from server_harness import PYTHON, ROOT, free_port, server_env

pytestmark = pytest.mark.e2e

WF = os.path.join(ROOT, "workflows", "api", "train_lora_demo.json")
if not os.path.exists(WF):  # before the demo/real split of the shipped workflows
    WF = os.path.join(ROOT, "workflows", "api", "train_lora.json")
# Two ranks vs one process: the same global-batch gradient summed in another order (see
# tests/unit/test_distributed.py); measured differences are ~1e-7 relative.
RTOL, ATOL = 1e-5, 1e-6


def _prompt(tag: str, steps: int = 2, resume: str = "") -> dict:
    prompt = json.load(open(WF))
    trains = sorted((k for k, v in prompt.items() if v["class_type"] == "PrecisionTrainLoRA"), key=int)
    for k, node in prompt.items():
        inputs = node["inputs"]
        if node["class_type"] == "PrecisionTrainLoRA":
            inputs["steps"], inputs["name"] = steps, f"e2e_runner_{tag}"
            if k == trains[0]:
                inputs["resume_from"] = resume
        elif node["class_type"] in ("PrecisionSaveLoRA", "PrecisionLossGraph"):
            inputs["filename_prefix"] = f"precision_lora/e2e_runner_{tag}_{node['class_type']}"
        elif node["class_type"] == "PrecisionTrainSettings":
            inputs["checkpoint_every"], inputs["batch_size"] = 2, 2
    return prompt


def _base(bases, server, name: str) -> str:
    base = str(bases / name)
    os.makedirs(os.path.join(base, "models"))
    os.symlink(os.path.join(server.base_dir, "models", "diffusion_models"),
               os.path.join(base, "models", "diffusion_models"))
    return base


def _runner(base: str, prompt: dict, *args: str, ranks: int = 1, timeout: float = 400) -> str:
    path = os.path.join(base, "workflow_api.json")
    with open(path, "w") as f:
        json.dump(prompt, f)
    cmd = [os.path.join(ROOT, "scripts", "train.py"), path, "--base-directory", base, *args]
    if ranks > 1:
        port = free_port()
        cmd = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
               "--master_port", str(port), *cmd]
    # One process runs with the server's thread count: CPU kernels split large reductions by thread, so
    # another count rounds differently (torchrun gives each rank one thread itself).
    proc = subprocess.run([PYTHON, *cmd], capture_output=True, text=True, timeout=timeout, env=server_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc.stdout + proc.stderr  # what the terminal shows: the runner's lines and the log


def _lora(base: str, tag: str) -> dict[str, torch.Tensor]:
    path = os.path.join(base, "models", "loras", "precision_lora", f"e2e_runner_{tag}_PrecisionSaveLoRA.safetensors")
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _state(base: str, tag: str) -> dict:
    # Save LoRA's training state, beside its LoRA
    return torch.load(os.path.join(base, "models", "loras", "precision_lora",
                                   f"e2e_runner_{tag}_PrecisionSaveLoRA.trainstate"), weights_only=True)


def _files(base: str) -> list[str]:
    """Every file a run wrote into its base folder (relative paths; the linked models left out)."""
    found = []
    for top in ("output", os.path.join("models", "loras")):
        for dirpath, _, files in os.walk(os.path.join(base, top)):
            found += [os.path.relpath(os.path.join(dirpath, f), base) for f in files]
    return sorted(found)


def _checkpoint(base: str, tag: str, step: int) -> str:
    """The training state of the periodic checkpoint at ``step`` (wherever the pack puts checkpoints)."""
    found = [f for f in _files(base) if re.search(rf"e2e_runner_{tag}_s(tep)?0*{step}\.trainstate$", f)]
    assert len(found) == 1, _files(base)
    return os.path.join(base, found[0])


def _hand_to_ui(server, state_path: str, name: str) -> str:
    """Copy a checkpoint (state and LoRA) where the UI's resume_from finds it by plain file name."""
    folder = os.path.join(server.base_dir, "output", "precision_lora", "checkpoints")
    os.makedirs(folder, exist_ok=True)
    shutil.copyfile(state_path, os.path.join(folder, name + ".trainstate"))
    lora = state_path[: -len(".trainstate")] + ".safetensors"
    if os.path.exists(lora):
        shutil.copyfile(lora, os.path.join(folder, name + ".safetensors"))
    return name + ".trainstate"


def _losses(state: dict) -> list[float]:
    return [p["loss"] for p in state["history"]]


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return tmp_path_factory.mktemp("runner_bases")


@pytest.fixture(scope="module")
def ui_run(comfy_server):
    """The workflow through the server: 2 + 2 steps, checkpoints at 2 and 4."""
    comfy_server.run(_prompt("ui"), timeout=600)
    return comfy_server.base_dir


@pytest.mark.slow
def test_runner_writes_the_lora_the_server_writes_and_prints_progress(server, ui_run, bases) -> None:
    base = _base(bases, server, "one")
    out = _runner(base, _prompt("one"))  # all of ComfyUI's nodes and the custom nodes, as the server loads them
    _equal(_lora(base, "one"), _lora(ui_run, "ui"))
    assert _losses(_state(base, "one")) == _losses(_state(ui_run, "ui"))
    # one progress line per reported step (2 + 2 steps: every step), the train node's line, not a second copy
    steps = [m.group(1) for m in re.finditer(r"PrecisionTrainLoRA: step (\d+/\d+) loss \S+ \(smoothed\) lr \S+ "
                                             r"[\d.]+ it/s ETA \d+:\d\d:\d\d$", out, re.M)]
    assert steps == ["1/2", "2/2", "3/4", "4/4"], out[-3000:]
    assert len(re.findall(r"\bstep \d+/\d+", out)) == 4, out[-3000:]
    assert "e2e_runner_one_PrecisionSaveLoRA.safetensors" in out  # it says what it wrote


@pytest.mark.slow
def test_a_ui_state_continues_in_the_runner_and_a_runner_state_in_the_ui(server, ui_run, bases) -> None:
    # UI checkpoint at step 2 -> runner (a path outside its base folder), 1 + 1 more steps.
    base = _base(bases, server, "cont")
    _runner(base, _prompt("cont", steps=1), "--resume", _checkpoint(ui_run, "ui", 2), "--only-this-pack")
    _equal(_lora(base, "cont"), _lora(ui_run, "ui"))
    assert _losses(_state(base, "cont")) == _losses(_state(ui_run, "ui"))
    # The runner's checkpoint at step 4 (written by its second train node) -> the UI, 1 + 1 more steps: the
    # same place as the UI's own run of 3 + 3 steps.
    back = _hand_to_ui(server, _checkpoint(base, "cont", 4), "e2e_runner_from_runner_step4")
    server.run(_prompt("ui_more", steps=1, resume=back), timeout=600)  # steps 5 and 6 in the UI
    server.run(_prompt("ui_long", steps=3), timeout=600)  # steps 1..6 in the UI in one go
    _equal(_lora(server.base_dir, "ui_more"), _lora(server.base_dir, "ui_long"))
    assert _losses(_state(server.base_dir, "ui_more")) == _losses(_state(server.base_dir, "ui_long"))


@pytest.mark.slow
def test_runner_on_the_real_training_workflow_writes_the_servers_lora(server, bases) -> None:
    """train_lora.json (ComfyUI's dataset, CLIP and VAE nodes) with tests/real_arch.py's files picked."""
    import glob

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import real_arch

    subprocess.run([PYTHON, os.path.join(ROOT, "tests", "real_arch.py"), server.base_dir], check=True,
                   env=server_env(), timeout=600)  # writes only what is missing
    shipped = json.load(open(os.path.join(ROOT, "workflows", "api", "train_lora.json")))
    prompt, _ = real_arch.swap_names(shipped)
    for node in prompt.values():
        if node["class_type"] == "PrecisionTrainLoRA":
            node["inputs"]["steps"], node["inputs"]["name"] = 2, "e2e_runner_real"
        elif node["class_type"] in ("PrecisionSaveLoRA", "PrecisionLossGraph"):
            node["inputs"]["filename_prefix"] = f"precision_lora/e2e_runner_real_{node['class_type']}"
    server.run(prompt, timeout=900)
    base = str(bases / "real")
    os.makedirs(os.path.join(base, "models"))
    for sub in ("diffusion_models", "vae", "text_encoders"):
        os.symlink(os.path.join(server.base_dir, "models", sub), os.path.join(base, "models", sub))
    os.symlink(os.path.join(server.base_dir, "input"), os.path.join(base, "input"))
    _runner(base, prompt, "--only-this-pack")  # ComfyUI's own nodes (dataset, CLIP, VAE) load with it

    def lora(root: str) -> dict[str, torch.Tensor]:
        (path,) = glob.glob(os.path.join(root, "models", "loras", "precision_lora",
                                         "e2e_runner_real_PrecisionSaveLoRA*.safetensors"))
        with safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    ui, headless = lora(server.base_dir), lora(base)
    _equal(headless, ui)
    assert any(float(v.abs().max()) > 0 for k, v in ui.items() if "lora_up" in k)  # it trained


@pytest.mark.slow
def test_two_torchrun_ranks_equal_one_process_and_their_checkpoint_continues_in_the_ui(server, ui_run, bases) -> None:
    base = _base(bases, server, "ddp")
    out = _runner(base, _prompt("ddp"), "--only-this-pack", ranks=2)
    assert "data parallel: 2 processes" in out
    assert out.count("step 4/4") == 1  # rank 0 prints, rank 1 does not
    one, two = _lora(ui_run, "ui"), _lora(base, "ddp")
    assert one.keys() == two.keys()
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, rtol=0, atol=ATOL)
    assert _losses(_state(base, "ddp")) == pytest.approx(_losses(_state(ui_run, "ui")), rel=RTOL)
    # only rank 0 wrote: the same files as a one-process run of the runner (no second copy of anything)
    one_files = [f.replace("e2e_runner_one", "e2e_runner_ddp") for f in _files(str(bases / "one"))] \
        if (bases / "one").exists() else None  # the first test's run, when it ran
    written = _files(base)
    assert one_files is None or written == one_files, (written, one_files)
    assert sum("e2e_runner_ddp_PrecisionSaveLoRA.safetensors" in f for f in written) == 1, written
    # the 2-process checkpoint at step 2 continues in the UI (one process) like the UI's own run
    name = _hand_to_ui(server, _checkpoint(base, "ddp", 2), "e2e_runner_from_ddp_step2")
    server.run(_prompt("ui_from_ddp", steps=1, resume=name), timeout=600)
    continued = _losses(_state(server.base_dir, "ui_from_ddp"))
    assert continued[:2] == _losses(_state(base, "ddp"))[:2]  # the history came with the state
    assert continued == pytest.approx(_losses(_state(ui_run, "ui")), rel=RTOL)
