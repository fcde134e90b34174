"""The shipped SDXL workflows run on a real server with only names picked (plus the time cuts stated below):
train_lora_sdxl.json trains from a folder of 3 captioned images through ComfyUI's stock CheckpointLoaderSimple
(MODEL, CLIP-L + CLIP-G, VAE from one file), Resolution Buckets and the cached dataset; inference_sdxl.json
samples an empty latent with the LoRA it saved.

The checkpoint is tests/sdxl_standin.py's: a tiny SDXL UNet (ComfyUI's own SDXL classes, 64/128 channels),
CLIP-L, CLIP-G and the SD VAE at their real sizes. Stock detection knows SDXL only at its full size, so the
session server loads that file as a test-only custom node that adds the tiny UNet's config to ComfyUI's
detection list (tests/conftest.py); the loader and everything after it are stock."""
from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402

WF = os.path.join(ROOT, "workflows")
# The tiny UNet's transformer blocks (input level 1, middle, 2 output blocks), each with attn1 and attn2's
# to_q, to_k, to_v and to_out.0: what the 'attention' preset of an SDXL UNet selects.
ATTENTION_LINEARS = 4 * 2 * 4


def _load(name: str) -> dict:
    with open(os.path.join(WF, "api", name)) as f:
        return json.load(f)


def _of(prompt: dict, class_type: str) -> str:
    (nid,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return nid


@pytest.fixture(scope="module")
def sdxl_files(comfy_server):
    from server_harness import server_env

    # --sdxl: the tiny SDXL checkpoint, written once per checkout into .cache/real_arch (~1.8 GB, < 1 min)
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "real_arch.py"), comfy_server.base_dir, "--sdxl"],
                   check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def test_shipped_sdxl_workflows_take_model_text_encoders_and_vae_from_one_checkpoint():
    train, infer = _load("train_lora_sdxl.json"), _load("inference_sdxl.json")
    ckpt = _of(train, "CheckpointLoaderSimple")
    assert train[ckpt]["inputs"]["ckpt_name"] == real_arch.SHIPPED["checkpoint"]
    data, buckets = _of(train, "PrecisionCachedTrainingDataset"), _of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [ckpt, 1] and train[data]["inputs"]["vae"] == [ckpt, 2]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["resolution"] == 1024
    attach, settings = _of(train, "PrecisionAttachLoRA"), _of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    assert train[settings]["inputs"]["vram_budget_gb"] == "auto"
    assert train[settings]["inputs"]["timestep_sampling"] == "uniform"
    # the model the trainer gets comes from the checkpoint through Patch Attention and Attach LoRA
    patch = _of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0] and train[patch]["inputs"]["model"] == [ckpt, 0]
    assert not any(v["class_type"].startswith("PrecisionDemo") for v in [*train.values(), *infer.values()])
    ck = _of(infer, "CheckpointLoaderSimple")
    sampler = infer[_of(infer, "KSampler")]["inputs"]
    assert infer[sampler["latent_image"][0]]["class_type"] == "EmptyLatentImage"
    assert infer[sampler["latent_image"][0]]["inputs"]["width"] == 1024 and sampler["cfg"] > 1
    for side in ("positive", "negative"):
        assert infer[sampler[side][0]]["class_type"] == "CLIPTextEncode"
        assert infer[sampler[side][0]]["inputs"]["clip"] == [ck, 1]
    assert infer[_of(infer, "VAEDecode")]["inputs"]["vae"] == [ck, 2]


def test_sdxl_workflows_are_served_as_templates_of_the_pack(server):
    status, templates = server.get("/api/workflow_templates")
    assert status == 200, templates
    names = {n for pack, files in templates.items() if "precision" in pack for n in files}
    assert {"train_lora_sdxl", "inference_sdxl"} <= names, templates


def test_sdxl_training_then_inference_with_names_picked(server, sdxl_files):
    prompt, edits = real_arch.swap_names(_load("train_lora_sdxl.json"))
    assert len(edits) == 3, edits  # checkpoint, dataset folder; bucket resolution
    trainer = _of(prompt, "PrecisionTrainLoRA")
    # Not names (CPU time, and an effect visible in 11 steps, as tests/e2e/test_real_workflow.py): 11 of the
    # shipped 1500 steps at 100x the learning rate, a non-default softmax scale recorded.
    assert prompt[trainer]["inputs"]["steps"] == 1500
    steps = prompt[trainer]["inputs"]["steps"] = 11
    settings, patch = _of(prompt, "PrecisionTrainSettings"), _of(prompt, "PrecisionPatchAttention")
    assert prompt[settings]["inputs"]["learning_rate"] == 1e-4 and prompt[patch]["inputs"]["scale_value"] == 1
    prompt[settings]["inputs"]["learning_rate"] = 1e-2
    prompt[patch]["inputs"]["scale_value"] = 0.8
    loras = os.path.join(sdxl_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_sdxl_lora_*.safetensors")))
    entry = server.run(prompt, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_sdxl_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
        keys = list(f.keys())
        ups = [f.get_tensor(k) for k in keys if k.endswith("lora_up.weight")]
    assert md["ss_steps"] == str(steps) and md["ss_base_model_version"] == "sdxl"
    assert md["ss_attn_scale_mode"] == "multiplier" and float(md["ss_attn_scale_value"]) == 0.8
    assert math.isclose(float(md["ss_attn_softmax_scale"]), 0.8 / 8.0, rel_tol=1e-9)  # SDXL heads: 64 channels
    modules = {k[: -len(".lora_up.weight")] for k in keys if k.endswith(".lora_up.weight")}
    assert len(modules) == ATTENTION_LINEARS, sorted(modules)
    assert all(re.fullmatch(r"diffusion_model\..+\.transformer_blocks\.0\.attn[12]\.to_(q|k|v|out\.0)", m)
               for m in modules), sorted(modules)
    assert ups and all(bool(u.abs().sum() > 0) for u in ups), "the LoRA did not train"
    loss_csv = glob.glob(server.output_path("precision_lora", "my_sdxl_lora_loss*.csv"))
    assert loss_csv, os.listdir(server.output_path("precision_lora"))
    with open(sorted(loss_csv)[-1]) as f:
        rows = [line.split(",") for line in f.read().strip().splitlines()[1:]]
    assert len(rows) == steps and all(math.isfinite(float(r[1])) for r in rows)

    lora_name = "precision_lora/" + os.path.basename(saved[0])
    infer, edits = real_arch.swap_names(_load("inference_sdxl.json"), lora_name=lora_name)
    assert len(edits) == 3, edits  # checkpoint, LoRA; latent size
    pixels = _image(server, infer)
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    # controls: the LoRA's weights off (strength 0, recorded scale kept), the recorded scale off (LoRA kept)
    loader, unchanged = _of(infer, "PrecisionLoadLoRA"), []
    for inputs, what in (({"strength": 0.0}, "the LoRA's weights"), ({"attention": "ignore"}, "its recorded scale")):
        control = json.loads(json.dumps(infer))
        control[loader]["inputs"].update(inputs)
        control[_of(infer, "SaveImage")]["inputs"]["filename_prefix"] += "_control_" + "_".join(inputs)
        if np.array_equal(_image(server, control), pixels):
            unchanged.append(what)
    assert unchanged == [], f"changed nothing in the image: {unchanged}"


def _image(server, prompt: dict) -> np.ndarray:
    out = server.run(prompt, timeout=600)
    img = out["outputs"][_of(prompt, "SaveImage")]["images"][0]
    return np.asarray(Image.open(server.output_path(img["subfolder"], img["filename"])))
