"""The shipped Qwen-Image workflows run on a real server with only names picked (plus the time cuts stated below):
train_lora_qwen_image.json trains from a folder of 3 captioned images through ComfyUI's stock UNETLoader,
CLIPLoader (type qwen_image) and VAELoader, Resolution Buckets and the cached dataset; inference_qwen_image.json
samples an empty latent as ComfyUI's Qwen-Image template does (ModelSamplingAuraFlow, KSampler) with the LoRA it
saved, and ComfyUI's stock LoraLoaderModelOnly loads that LoRA too.

The files are tests/qwen_image_standin.py's: a tiny Qwen-Image transformer (ComfyUI's own class, 2 blocks), the
Qwen-Image VAE (Wan 2.1) at its real size, and ComfyUI's own Qwen2.5-VL-7B text model class at a tiny config
(width 64, 2 layers; the real tokenizer and chat template): the 7 B encoder is unaffordable on a test machine.
Stock detection knows neither tiny model, so the session server loads that file as a test-only custom node that
adds their configs (tests/conftest.py); the loaders and everything after them are stock."""
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
sys.path.insert(0, os.path.join(ROOT, "workflows"))
import qwen_image_standin as standin  # noqa: E402
import spec_qwen_image as spec  # noqa: E402

WF = os.path.join(ROOT, "workflows")
SHIPPED = {("UNETLoader", "unet_name"): spec.MODEL, ("CLIPLoader", "clip_name"): spec.TEXT_ENCODER,
           ("VAELoader", "vae_name"): spec.VAE, ("LoadImageTextDataSetFromFolder", "folder"): spec.DATASET}
# What the 'attention' preset selects in each of the tiny transformer's 2 blocks: the image stream's projections
# and the text stream's (Qwen-Image's joint attention), 8 Linears a block.
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
HEAD_DIM = standin.TINY_DIT["attention_head_dim"]


def _load(name: str) -> dict:
    with open(os.path.join(WF, "api", name)) as f:
        return json.load(f)


def _of(prompt: dict, class_type: str) -> str:
    (nid,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return nid


@pytest.fixture(scope="module")
def qwen_files(comfy_server):
    from server_harness import server_env

    if standin.link_cached(comfy_server.base_dir):  # the files of this fingerprint are in .cache/real_arch
        return comfy_server.base_dir
    # written once per checkout into .cache/real_arch (~270 MB, mostly the VAE; < 1 min) and linked
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "qwen_image_standin.py"), comfy_server.base_dir],
                   check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def test_shipped_qwen_image_workflows_use_comfyuis_loaders_and_template_sampling():
    train, infer = _load("train_lora_qwen_image.json"), _load("inference_qwen_image.json")
    for prompt in (train, infer):
        assert prompt[_of(prompt, "UNETLoader")]["inputs"] == {"unet_name": "qwen_image_fp8_e4m3fn.safetensors",
                                                               "weight_dtype": "default"}
        clip = prompt[_of(prompt, "CLIPLoader")]["inputs"]
        assert (clip["clip_name"], clip["type"]) == ("qwen_2.5_vl_7b_fp8_scaled.safetensors", "qwen_image")
        assert prompt[_of(prompt, "VAELoader")]["inputs"]["vae_name"] == "qwen_image_vae.safetensors"
    unet, clip, vae = _of(train, "UNETLoader"), _of(train, "CLIPLoader"), _of(train, "VAELoader")
    data, buckets = _of(train, "PrecisionCachedTrainingDataset"), _of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [clip, 0] and train[data]["inputs"]["vae"] == [vae, 0]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["resolution"] == 1024 and train[buckets]["inputs"]["model"] == [unet, 0]
    attach, settings = _of(train, "PrecisionAttachLoRA"), _of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    assert train[settings]["inputs"]["vram_budget_gb"] == "auto"
    patch = _of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0] and train[patch]["inputs"]["model"] == [unet, 0]
    assert not any(v["class_type"].startswith("PrecisionDemo") for v in [*train.values(), *infer.values()])
    # inference samples as ComfyUI's own Qwen-Image template (image_qwen_image.json) does
    sampler = infer[_of(infer, "KSampler")]["inputs"]
    assert {k: sampler[k] for k in ("steps", "cfg", "sampler_name", "scheduler")} == {
        "steps": 20, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple"}
    shift = sampler["model"][0]
    assert infer[shift]["class_type"] == "ModelSamplingAuraFlow" and infer[shift]["inputs"]["shift"] == 3.1
    loader = infer[shift]["inputs"]["model"][0]
    assert infer[loader]["class_type"] == "PrecisionLoadLoRA"
    assert infer[loader]["inputs"]["model"] == [_of(infer, "UNETLoader"), 0]
    assert infer[loader]["inputs"]["lora_name"] == "precision_lora/my_qwen_image_lora_00001_.safetensors"
    latent = infer[sampler["latent_image"][0]]
    assert latent["class_type"] == "EmptySD3LatentImage" and latent["inputs"]["width"] == 1328
    texts = [infer[sampler[side][0]] for side in ("positive", "negative")]
    assert [t["class_type"] for t in texts] == ["CLIPTextEncode"] * 2 and texts[1]["inputs"]["text"] == ""
    assert all(t["inputs"]["clip"] == [_of(infer, "CLIPLoader"), 0] for t in texts)
    assert infer[_of(infer, "VAEDecode")]["inputs"]["vae"] == [_of(infer, "VAELoader"), 0]


def test_qwen_image_workflows_are_served_as_templates_of_the_pack(server):
    status, templates = server.get("/api/workflow_templates")
    assert status == 200, templates
    names = {n for pack, files in templates.items() if "precision" in pack for n in files}
    assert {"train_lora_qwen_image", "inference_qwen_image"} <= names, templates


def test_qwen_image_training_then_inference_with_names_picked(server, qwen_files):
    prompt, edits = standin.swap_names(_load("train_lora_qwen_image.json"), SHIPPED)
    assert len(edits) == 5, edits  # diffusion model, text encoder, VAE, dataset folder; bucket resolution
    trainer = _of(prompt, "PrecisionTrainLoRA")
    # Not names (CPU time, and an effect visible in 11 steps): 11 of the shipped 1000 steps at 100x the learning
    # rate, a non-default softmax scale recorded.
    assert prompt[trainer]["inputs"]["steps"] == 1000
    steps = prompt[trainer]["inputs"]["steps"] = 11
    settings, patch = _of(prompt, "PrecisionTrainSettings"), _of(prompt, "PrecisionPatchAttention")
    assert prompt[settings]["inputs"]["learning_rate"] == 1e-4 and prompt[patch]["inputs"]["scale_value"] == 1
    prompt[settings]["inputs"]["learning_rate"] = 1e-2
    prompt[patch]["inputs"]["scale_value"] = 0.8
    loras = os.path.join(qwen_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_qwen_image_lora_*.safetensors")))
    entry = server.run(prompt, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_qwen_image_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
        keys = list(f.keys())
        ups = {k[: -len(".lora_up.weight")]: f.get_tensor(k) for k in keys if k.endswith(".lora_up.weight")}
    assert md["ss_steps"] == str(steps) and md["ss_base_model_version"] == "qwen_image", md
    assert md["ss_attn_scale_mode"] == "multiplier" and float(md["ss_attn_scale_value"]) == 0.8
    assert math.isclose(float(md["ss_attn_softmax_scale"]), 0.8 / math.sqrt(HEAD_DIM), rel_tol=1e-9)
    modules = set(ups)
    want = {f"diffusion_model.transformer_blocks.{b}.attn.{p}" for b in range(2) for p in ATTENTION}
    assert modules == want, sorted(modules ^ want)
    # Every projection trained but the last block's text query and text output: its text stream is discarded
    # (the model's output is the image tokens), so they get no gradient (true of the released model's block 59).
    frozen = {m for m, u in ups.items() if not bool(u.abs().sum() > 0)}
    assert frozen == {f"diffusion_model.transformer_blocks.1.attn.{p}" for p in ("add_q_proj", "to_add_out")}, frozen
    loss_csv = glob.glob(server.output_path("precision_lora", "my_qwen_image_lora_loss*.csv"))
    assert loss_csv, os.listdir(server.output_path("precision_lora"))
    with open(sorted(loss_csv)[-1]) as f:
        rows = [line.split(",") for line in f.read().strip().splitlines()[1:]]
    assert len(rows) == steps and all(math.isfinite(float(r[1])) for r in rows)

    lora_name = "precision_lora/" + os.path.basename(saved[0])
    infer, edits = standin.swap_names(_load("inference_qwen_image.json"), SHIPPED, lora_name=lora_name)
    assert len(edits) == 5, edits  # diffusion model, text encoder, VAE, LoRA; latent size
    # not a name (CPU time only): 4 of the template's 20 sampling steps
    sampler = infer[_of(infer, "KSampler")]["inputs"]
    assert sampler["steps"] == 20
    sampler["steps"] = 4
    pixels = _image(server, infer)
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    # controls: the LoRA's weights off (strength 0, recorded scale kept), the recorded scale off (LoRA kept), both
    # off (the base model's image)
    loader, images = _of(infer, "PrecisionLoadLoRA"), {}
    for what, inputs in (("strength 0", {"strength": 0.0}), ("attention ignore", {"attention": "ignore"}),
                         ("both off", {"strength": 0.0, "attention": "ignore"})):
        images[what] = _image(server, _variant(infer, loader, inputs, what))
    assert [w for w, img in images.items() if np.array_equal(img, pixels)] == [], "changed nothing in the image"

    # ComfyUI's stock LoraLoaderModelOnly loads the same file in Load LoRA (Precision)'s place: every key applied
    # (no 'lora key not loaded') and the image is not the base model's.
    stock = json.loads(json.dumps(infer))
    stock[loader] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": infer[loader]["inputs"]["model"], "lora_name": lora_name, "strength_model": 1.0}}
    log_start = len(server.log_text())
    stock_image = _image(server, _variant(stock, loader, {}, "stock"))
    not_loaded = [line for line in server.log_text()[log_start:].splitlines() if "lora key not loaded" in line]
    assert not_loaded == [], not_loaded[:5]
    assert not np.array_equal(stock_image, images["both off"]), "the stock loader's LoRA changed nothing"


def _variant(prompt: dict, loader: str, inputs: dict, what: str) -> dict:
    out = json.loads(json.dumps(prompt))
    out[loader]["inputs"].update(inputs)
    out[_of(prompt, "SaveImage")]["inputs"]["filename_prefix"] += "_" + re.sub(r"\W+", "_", what)
    return out


def _image(server, prompt: dict) -> np.ndarray:
    out = server.run(prompt, timeout=600)
    assert out["status"]["status_str"] == "success", out["status"]
    img = out["outputs"][_of(prompt, "SaveImage")]["images"][0]
    return np.asarray(Image.open(server.output_path(img["subfolder"], img["filename"])))
