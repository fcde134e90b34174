"""The dataset cache through a real server's /prompt (issue 23 item 3): the shipped train_lora.json with
Make Training Dataset swapped for PrecisionCachedTrainingDataset (the same links: what the lead's switch of
the workflow does), real-architecture CLIP-L and Flux VAE (tests/real_arch.py).

First Run encodes every image and caption; then another workflow runs and ComfyUI's cache is cleared
(POST /free, as under RAM pressure); a second training Run with one training setting changed re-executes the
dataset node, which reports 0 encoded. A second server process started on the same cache folder (a restart)
reports 0 encoded too.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402

FOLDER = "dataset_cache_e2e"


def _of(prompt: dict, class_type: str) -> str:
    (nid,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return nid


@pytest.fixture(scope="module")
def base(comfy_server):
    """The real-architecture files, and a dataset of 3 images whose pixels and captions are new to this
    session (so the first Run must encode them all)."""
    from server_harness import server_env

    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "real_arch.py"), comfy_server.base_dir], check=True,
                   env=server_env(), timeout=600)
    folder = os.path.join(comfy_server.base_dir, "input", FOLDER)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    token = uuid.uuid4().hex[:8]
    rng = np.random.default_rng(int(token, 16))
    for i, (w, h) in enumerate([(64, 64), (64, 64), (80, 48)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(folder, f"img{i}.png"))
        with open(os.path.join(folder, f"img{i}.txt"), "w") as f:
            f.write(f"a photo of sks {token}, item {i}")
    return comfy_server.base_dir


def training_prompt(steps: int) -> tuple[dict, str]:
    """train_lora.json (API twin) with real_arch's names picked and the cache node in Make Training
    Dataset's place (same id, same inputs; kept if the workflow already has it), the dataset folder of this
    module; returns the prompt and the dataset node's id."""
    with open(os.path.join(ROOT, "workflows", "api", "train_lora.json")) as f:
        prompt, _ = real_arch.swap_names(json.load(f))
    (data,) = [k for k, v in prompt.items() if v["class_type"] in ("MakeTrainingDataset", "PrecisionCachedTrainingDataset")]
    prompt[data] = {"class_type": "PrecisionCachedTrainingDataset", "inputs": {**prompt[data]["inputs"], "cache": "use"}}
    prompt[prompt[data]["inputs"]["images"][0]]["inputs"]["folder"] = FOLDER
    prompt[_of(prompt, "PrecisionTrainLoRA")]["inputs"]["steps"] = steps
    return prompt, data


def dataset_prompt() -> tuple[dict, str]:
    """Only the dataset branch of ``training_prompt`` (the cache node is an output node: it runs alone, e.g.
    to encode a dataset ahead of training)."""
    prompt, data = training_prompt(steps=2)
    keep, todo = set(), [data]
    while todo:
        nid = todo.pop()
        keep.add(nid)
        todo += [v[0] for v in prompt[nid]["inputs"].values() if isinstance(v, list) and v[0] not in keep]
    return {k: v for k, v in prompt.items() if k in keep}, data


def _report(entry: dict, node: str) -> str:
    cached = [n for m in entry["status"]["messages"] if m[0] == "execution_cached" for n in m[1]["nodes"]]
    assert node not in cached, "the dataset node came from ComfyUI's cache: the scenario did not happen"
    (text,) = entry["outputs"][node]["text"]
    return text


def test_second_training_run_after_another_workflow_encodes_nothing(server, base):
    prompt, data = training_prompt(steps=2)
    first = _report(server.run(prompt, timeout=900), data)
    assert first.startswith("3 images (3 distinct): 3 encoded, 0 from cache; 3 captions (3 distinct): 3 encoded, "
                            "0 from cache; cache " + os.path.join(base, "cache", "precision_lora", "dataset")), first
    assert len(os.listdir(os.path.join(base, "cache", "precision_lora", "dataset", "text"))) >= 3
    other = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
             "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}}
    server.run(other)
    status, _ = server.request("/free", {"free_memory": True})  # ComfyUI drops every cached output
    assert status == 200
    prompt, data = training_prompt(steps=3)  # one training setting changed, as a user retrains
    second = _report(server.run(prompt, timeout=900), data)
    assert second.startswith("3 images (3 distinct): 0 encoded, 3 from cache; 3 captions (3 distinct): 0 encoded, "
                             "3 from cache;"), second


@pytest.mark.slow  # a second server start (about a minute on 2 shared cores)
def test_a_restarted_server_reads_the_same_cache(server, base, tmp_path):
    """A new ComfyUI process whose base directory links the session's models, input and cache folders."""
    from server_harness import ComfyServer

    prompt, data = dataset_prompt()
    assert len(prompt) == 4 and {"PrecisionCachedTrainingDataset", "VAELoader", "CLIPLoader"} <= {
        v["class_type"] for v in prompt.values()}  # and the image folder loader
    server.run(prompt, timeout=900)  # fills the cache if the test above did not run
    other = str(tmp_path / "restarted")
    os.makedirs(os.path.join(other, "models"))
    for sub in ("vae", "text_encoders", "diffusion_models"):
        os.symlink(os.path.join(base, "models", sub), os.path.join(other, "models", sub))
    os.symlink(os.path.join(base, "input"), os.path.join(other, "input"))
    os.symlink(os.path.join(base, "cache"), os.path.join(other, "cache"))
    restarted = ComfyServer.start(other)
    try:
        assert not restarted.pack_import_errors()
        text = _report(restarted.run(prompt, timeout=900), data)
    finally:
        restarted.stop()
    assert text.startswith("3 images (3 distinct): 0 encoded, 3 from cache; 3 captions (3 distinct): 0 encoded, "
                           "3 from cache; cache " + os.path.join(other, "cache", "precision_lora", "dataset")), text
