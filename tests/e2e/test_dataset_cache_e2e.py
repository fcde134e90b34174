"""The dataset cache through a real server's /prompt (issue 23 item 3): the shipped train_lora.json with
Make Training Dataset swapped for PrecisionCachedTrainingDataset (the same links: what the lead's switch of
the workflow does), real-architecture CLIP-L and Flux VAE (tests/real_arch.py).

First Run encodes every image and caption; then another workflow runs and ComfyUI's cache is cleared
(POST /free, as under RAM pressure); a second training Run with one training setting changed re-executes the
dataset node, which reports 0 encoded. A second server process started on the same cache folder (a restart)
reports 0 encoded too. The node's other cache modes: 'rebuild' encodes every item again and rewrites exactly its
entries; 'off' encodes and writes no file. The last test checks that every input of the node took a
non-default value in a prompt this module queued (tests/e2e/options_lib.py's coverage, area "dataset").
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest
import safetensors.torch
import torch
from PIL import Image

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from options_lib import AREAS, coverage  # noqa: E402

FOLDER = "dataset_cache_e2e"
SENT: list[dict] = []  # every prompt this module queued and ComfyUI accepted (for the coverage test)


def _run(server, prompt: dict) -> dict:
    entry = server.run(prompt, timeout=900)
    SENT.append(copy.deepcopy(prompt))
    return entry


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
    write_dataset(comfy_server.base_dir, FOLDER)
    return comfy_server.base_dir


def write_dataset(base: str, name: str) -> None:
    """3 captioned images in ``input/<name>`` whose pixels and captions are new to this session."""
    folder = os.path.join(base, "input", name)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    token = uuid.uuid4().hex[:8]
    rng = np.random.default_rng(int(token, 16))
    for i, (w, h) in enumerate([(64, 64), (64, 64), (80, 48)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(folder, f"img{i}.png"))
        with open(os.path.join(folder, f"img{i}.txt"), "w") as f:
            f.write(f"a photo of sks {token}, item {i}")


def training_prompt(steps: int, folder: str = FOLDER, cache: str = "use") -> tuple[dict, str]:
    """train_lora.json (API twin) with real_arch's names picked and the cache node in Make Training
    Dataset's place (same id, same inputs; kept if the workflow already has it), the dataset folder of this
    module; returns the prompt and the dataset node's id."""
    with open(os.path.join(ROOT, "workflows", "api", "train_lora.json")) as f:
        prompt, _ = real_arch.swap_names(json.load(f))
    (data,) = [k for k, v in prompt.items() if v["class_type"] in ("MakeTrainingDataset", "PrecisionCachedTrainingDataset")]
    prompt[data] = {"class_type": "PrecisionCachedTrainingDataset", "inputs": {**prompt[data]["inputs"], "cache": cache}}
    prompt[prompt[data]["inputs"]["images"][0]]["inputs"]["folder"] = folder
    prompt[_of(prompt, "PrecisionTrainLoRA")]["inputs"]["steps"] = steps
    return prompt, data


def dataset_prompt(folder: str = FOLDER, cache: str = "use") -> tuple[dict, str]:
    """Only the dataset branch of ``training_prompt`` (the cache node is an output node: it runs alone, e.g.
    to encode a dataset ahead of training)."""
    prompt, data = training_prompt(steps=2, folder=folder, cache=cache)
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
    first = _report(_run(server, prompt), data)
    assert first.startswith("3 images (3 distinct): 3 encoded, 0 from cache; 3 captions (3 distinct): 3 encoded, "
                            "0 from cache; cache " + os.path.join(base, "cache", "precision_lora", "dataset")), first
    assert len(os.listdir(os.path.join(base, "cache", "precision_lora", "dataset", "text"))) >= 3
    other = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
             "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}}
    _run(server, other)
    status, _ = server.request("/free", {"free_memory": True})  # ComfyUI drops every cached output
    assert status == 200
    prompt, data = training_prompt(steps=3)  # one training setting changed, as a user retrains
    second = _report(_run(server, prompt), data)
    assert second.startswith("3 images (3 distinct): 0 encoded, 3 from cache; 3 captions (3 distinct): 0 encoded, "
                             "3 from cache;"), second


@pytest.mark.slow  # a second server start (about a minute on 2 shared cores)
def test_a_restarted_server_reads_the_same_cache(server, base, tmp_path):
    """A new ComfyUI process whose base directory links the session's models, input and cache folders."""
    from server_harness import ComfyServer

    prompt, data = dataset_prompt()
    assert len(prompt) == 4 and {"PrecisionCachedTrainingDataset", "VAELoader", "CLIPLoader"} <= {
        v["class_type"] for v in prompt.values()}  # and the image folder loader
    _run(server, prompt)  # fills the cache if the test above did not run
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


def _masked_prompt(folder: str, on_dataset: bool) -> tuple[dict, dict]:
    """``training_prompt`` with Precision Load Image Dataset (mask = files) and Resolution Buckets before the cache
    node; the buckets' masks go to the cache node's masks (``on_dataset``) or to Train LoRA's mask. Returns the
    prompt and the ids of the dataset, training and save nodes."""
    prompt, data = training_prompt(steps=2, folder=folder)
    loader = prompt[data]["inputs"]["images"][0]
    prompt[loader] = {"class_type": "PrecisionLoadImageDataset",
                      "inputs": {"folder": folder, "alpha": "white", "animated": "first_frame",
                                 "missing_caption": "train_empty", "mask": "files"}}
    prompt["buckets"] = {"class_type": "PrecisionResolutionBuckets",
                         "inputs": {"images": [loader, 0], "texts": [loader, 1], "resolution": 64, "multiple": 16,
                                    "max_upscale": 2.0, "masks": [loader, 3]}}
    prompt[data]["inputs"].update(images=["buckets", 0], texts=["buckets", 1])
    train = _of(prompt, "PrecisionTrainLoRA")
    prompt[data if on_dataset else train]["inputs"]["masks" if on_dataset else "mask"] = ["buckets", 3]
    prompt[train]["inputs"]["name"] = f"cache_masks_{int(on_dataset)}"
    return prompt, {"data": data, "train": train, "save": _of(prompt, "PrecisionSaveLoRA")}


def test_masks_on_the_cached_dataset_train_as_train_loras_mask_input_and_are_cached(server, base):
    """Masks from files beside the images (Load Image Dataset mask = files), cropped by Resolution Buckets, given to
    Cached Training Dataset's masks: each rides on its image's LATENT (noise_mask) into Train LoRA, which trains the
    same LoRA, every bit, as with the same masks on its own mask input; a second run reads the masks from the
    cache."""
    folder = "dataset_cache_masks"
    write_dataset(base, folder)
    for i in (0, 2):  # img1 has no mask file: it trains whole
        with Image.open(os.path.join(base, "input", folder, f"img{i}.png")) as im:
            w, h = im.size
        mask = np.zeros((h, w), dtype=np.uint8)
        mask[:, : w // 2] = 255
        Image.fromarray(mask).save(os.path.join(base, "input", folder, f"img{i}_mask.png"))
    loras = {}
    for on_dataset in (True, False):
        prompt, ids = _masked_prompt(folder, on_dataset)
        entry = _run(server, prompt)
        text = _report(entry, ids["data"])
        if on_dataset:
            assert "3 masks (3 distinct, on their latents as noise_mask): 3 computed, 0 from cache" in text, text
        else:
            assert "masks" not in text.split("; cache")[0], text
        (path,) = entry["outputs"][ids["save"]]["text"][:1]
        with safetensors.safe_open(path, "pt") as f:
            loras[on_dataset] = ({k: f.get_tensor(k) for k in f.keys()}, f.metadata()["precision_lora_mask"])
    (on_data, meta_data), (on_input, meta_input) = loras[True], loras[False]
    assert meta_data == meta_input == "3 of 3 samples masked, unmasked_weight 0"
    assert set(on_data) == set(on_input) and on_data
    for k in on_data:
        assert torch.equal(on_data[k], on_input[k]), k
    prompt, ids = _masked_prompt(folder, True)
    prompt[ids["train"]]["inputs"]["steps"] = 1  # a changed run: the dataset node runs again
    text = _report(_run(server, prompt), ids["data"])
    assert "3 masks (3 distinct, on their latents as noise_mask): 0 computed, 3 from cache" in text, text


def _outside_folders(base: str) -> tuple[str, str]:
    """Two datasets of 3 captioned 64x64 images (Resolution Buckets leaves them at their size) with a mask file
    each (left half white): the second's images are the first's with new random pixels where the mask is 0."""
    first, second = "dataset_cache_outside_a", "dataset_cache_outside_b"
    write_dataset(base, first)
    shutil.rmtree(os.path.join(base, "input", second), ignore_errors=True)
    shutil.copytree(os.path.join(base, "input", first), os.path.join(base, "input", second))
    rng = np.random.default_rng(5)
    mask = np.zeros((64, 64), dtype=np.uint8)
    mask[:, :24] = 255
    for i in range(3):
        pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(base, "input", first, f"img{i}.png"))
        other = np.where(mask[..., None] == 0, rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), pixels)
        Image.fromarray(other).save(os.path.join(base, "input", second, f"img{i}.png"))
        for folder in (first, second):
            Image.fromarray(mask).save(os.path.join(base, "input", folder, f"img{i}_mask.png"))
    return first, second


def test_pixels_outside_the_masks_leave_the_lora_unchanged_with_outside_mask_gray(server, base):
    """Issue 38's masked training line through /prompt: two datasets that differ only where their masks are 0,
    Cached Training Dataset outside_mask = gray, Train LoRA at unmasked_weight 0: the same LoRA, every bit. With
    outside_mask = keep the two give different LoRAs (the model reads the whole image as context), so the
    comparison can fail. The gray latents at unmasked_weight 0.5 are refused by Train LoRA (it would train the
    flat gray)."""
    loras, folders = {}, _outside_folders(base)
    for outside in ("gray", "keep"):
        for folder in folders:
            prompt, ids = _masked_prompt(folder, True)
            prompt[ids["data"]]["inputs"]["outside_mask"] = outside
            prompt[ids["train"]]["inputs"]["name"] = f"outside_{outside}_{folder[-1]}"
            entry = _run(server, prompt)
            text = _report(entry, ids["data"])
            assert ("pixels outside the masks set to gray before encoding" in text) == (outside == "gray"), text
            (path,) = entry["outputs"][ids["save"]]["text"][:1]
            with safetensors.safe_open(path, "pt") as f:
                meta = "3 of 3 samples masked, unmasked_weight 0"
                if outside == "gray":
                    meta += ", pixels outside the masks set to gray before encoding"
                assert f.metadata()["precision_lora_mask"] == meta
                loras[outside, folder[-1]] = {k: f.get_tensor(k) for k in f.keys()}
    a, b = loras["gray", "a"], loras["gray", "b"]
    assert set(a) == set(b) and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    kept_a, kept_b = loras["keep", "a"], loras["keep", "b"]
    assert any(not torch.equal(kept_a[k], kept_b[k]) for k in kept_a), "keep: the pixels outside changed nothing"

    prompt, ids = _masked_prompt(folders[0], True)  # the same gray latents at unmasked_weight 0.5: refused
    prompt[ids["data"]]["inputs"]["outside_mask"] = "gray"
    prompt[_of(prompt, "PrecisionTrainSettings")]["inputs"]["unmasked_weight"] = 0.5
    entry = server.wait(server.post_prompt(prompt))
    SENT.append(copy.deepcopy(prompt))
    assert entry["status"]["status_str"] == "error"
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert errors and errors[0]["node_id"] == ids["train"], errors
    assert ("PrecisionTrainLoRA: input 'latents': LATENT 0 was encoded with the pixels outside its mask set to gray "
            "(Cached Training Dataset's outside_mask), and unmasked_weight=0.5 would train the LoRA on that flat "
            "colour there; set unmasked_weight to 0") in errors[0]["exception_message"], errors


def _entries(base: str) -> dict[str, int]:
    """{path under the cache folder: modification time in ns} of every file in the dataset cache."""
    root = os.path.join(base, "cache", "precision_lora", "dataset")
    return {os.path.relpath(os.path.join(d, f), root): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, files in os.walk(root) for f in files}


def test_rebuild_encodes_everything_again_and_rewrites_exactly_its_entries(server, base):
    write_dataset(base, "dataset_cache_rebuild")
    prompt, data = dataset_prompt("dataset_cache_rebuild")
    before = _entries(base)
    first = _report(_run(server, prompt), data)  # cache 'use': encodes the new items and stores them
    assert first.startswith("3 images (3 distinct): 3 encoded, 0 from cache; 3 captions (3 distinct): 3 encoded"), first
    stored = _entries(base)
    new = sorted(set(stored) - set(before))
    assert len(new) == 6 and {p.split(os.sep)[0] for p in new} == {"latents", "text"}, new  # 3 latents, 3 captions
    root = os.path.join(base, "cache", "precision_lora", "dataset")
    contents = {p: safetensors.torch.load_file(os.path.join(root, p)) for p in new}
    prompt, data = dataset_prompt("dataset_cache_rebuild", cache="rebuild")
    rebuilt = _report(_run(server, prompt), data)
    assert rebuilt.startswith("3 images (3 distinct): 3 encoded, 0 from cache; 3 captions (3 distinct): 3 encoded, "
                              "0 from cache; cache " + os.path.join(base, "cache", "precision_lora", "dataset")), rebuilt
    after = _entries(base)
    assert after.keys() == stored.keys(), sorted(set(after) ^ set(stored))  # the same keys: no new entry
    assert sorted(p for p in after if after[p] != stored[p]) == new  # each of its entries written again, no other
    for p in new:  # the same encoders and items: the same values (CPU encodes differ in the last bits run to run)
        again = safetensors.torch.load_file(os.path.join(root, p))
        assert again.keys() == contents[p].keys(), p
        for k, t in again.items():
            torch.testing.assert_close(t, contents[p][k], rtol=1e-4, atol=1e-5, msg=lambda m, p=p: f"{p}: {m}")


def test_cache_off_encodes_and_writes_no_file(server, base):
    write_dataset(base, "dataset_cache_off")
    prompt, data = dataset_prompt("dataset_cache_off", cache="off")
    before = _entries(base)
    text = _report(_run(server, prompt), data)
    assert text.startswith("3 images (3 distinct): 3 encoded, 0 from cache; 3 captions (3 distinct): 3 encoded, "
                           "0 from cache; cache off"), text
    assert _entries(base) == before  # no file added or rewritten


def test_every_input_of_the_cache_node_went_through_the_server(server):
    """Runs last: every input of Cached Training Dataset took a non-default value (sockets connected, each
    cache mode, outside_mask gray) in a prompt queued above. Its widgets, the ``cache`` and ``outside_mask``
    combos, are sent literally: no stock node outputs a COMBO that could carry its options (checked here, so a host that adds one fails this; 0.33's
    GetVideoComponents outputs a video's color space)."""
    info = server.object_info()
    missing, unlinked = coverage(info, AREAS["dataset"], SENT)
    assert missing == [], missing
    assert unlinked == ["PrecisionCachedTrainingDataset.cache", "PrecisionCachedTrainingDataset.outside_mask"], unlinked
    combo_out = sorted(k for k, v in info.items() for t in v.get("output", []) if t == "COMBO" or isinstance(t, list))
    assert set(combo_out) <= {"GetVideoComponents"}, combo_out
