"""The shipped Flux.2 klein workflows run on a real server with only names picked (plus the time cuts stated
below): train_lora_flux2_klein.json trains from a folder of 3 captioned images through ComfyUI's stock
UNETLoader, CLIPLoader (type flux2) and VAELoader, Resolution Buckets and the cached dataset;
inference_flux2_klein.json samples an empty Flux.2 latent as ComfyUI's klein base template does (Flux2Scheduler,
CFGGuider, SamplerCustomAdvanced) with the LoRA it saved, and ComfyUI's own LoraLoaderModelOnly loads that LoRA
with every key matched.

The files are tests/flux2_klein_standin.py's: a tiny klein DiT (ComfyUI's Flux.2 classes, released keys; stock
detection loads it as is), the tiny Qwen3-4B of tests/z_image_standin.py (registered as a test-only custom
node) and the Flux.2 VAE at its real size. ComfyUI 0.3.75 has no Flux.2 klein: the run is skipped there with
the reason read from that ComfyUI's source."""
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
import flux2_klein_standin as standin  # noqa: E402

WF = os.path.join(ROOT, "workflows")
HEAD_DIM = 128  # Flux.2's heads (klein 4B: 24 of them; the stand-in: 2)


def _load(name: str) -> dict:
    with open(os.path.join(WF, "api", name)) as f:
        return json.load(f)


def _of(prompt: dict, class_type: str) -> str:
    (nid,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return nid


@pytest.fixture(scope="module")
def files(comfy_server):
    return standin.files_for(comfy_server)


def test_shipped_klein_workflows_use_comfyuis_loaders_and_its_klein_template_sampling():
    train, infer = _load("train_lora_flux2_klein.json"), _load("inference_flux2_klein.json")
    for prompt in (train, infer):
        unet, clip, vae = (prompt[_of(prompt, t)]["inputs"] for t in ("UNETLoader", "CLIPLoader", "VAELoader"))
        assert (unet["unet_name"], unet["weight_dtype"]) == ("flux-2-klein-base-4b.safetensors", "default")
        assert (clip["clip_name"], clip["type"]) == ("qwen_3_4b.safetensors", "flux2")
        assert vae["vae_name"] == "flux2-vae.safetensors"
        assert not any(v["class_type"].startswith("PrecisionDemo") for v in prompt.values())
    unet, clip, vae = (_of(train, t) for t in ("UNETLoader", "CLIPLoader", "VAELoader"))
    data, buckets = _of(train, "PrecisionCachedTrainingDataset"), _of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [clip, 0] and train[data]["inputs"]["vae"] == [vae, 0]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["resolution"] == 1024 and train[buckets]["inputs"]["model"] == [unet, 0]
    attach, settings = _of(train, "PrecisionAttachLoRA"), _of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    assert train[settings]["inputs"]["vram_budget_gb"] == "auto"
    patch = _of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0] and train[patch]["inputs"]["model"] == [unet, 0]
    # inference as ComfyUI's klein base template: 20 steps of Flux2Scheduler at the latent's size, cfg 5, euler
    sampler = infer[_of(infer, "SamplerCustomAdvanced")]["inputs"]
    latent, sigmas = infer[sampler["latent_image"][0]], infer[sampler["sigmas"][0]]
    guider, pick = infer[sampler["guider"][0]], infer[sampler["sampler"][0]]
    assert latent["class_type"] == "EmptyFlux2LatentImage" and sigmas["class_type"] == "Flux2Scheduler"
    assert (latent["inputs"]["width"], latent["inputs"]["height"]) == (sigmas["inputs"]["width"],
                                                                        sigmas["inputs"]["height"]) == (1024, 1024)
    assert sigmas["inputs"]["steps"] == 20 and pick["inputs"]["sampler_name"] == "euler"
    assert guider["class_type"] == "CFGGuider" and guider["inputs"]["cfg"] == 5
    assert infer[guider["inputs"]["model"][0]]["class_type"] == "PrecisionLoadLoRA"
    for side in ("positive", "negative"):
        assert infer[guider["inputs"][side][0]]["inputs"]["clip"] == [_of(infer, "CLIPLoader"), 0]
    assert infer[_of(infer, "VAEDecode")]["inputs"]["vae"] == [_of(infer, "VAELoader"), 0]


def test_klein_workflows_are_served_as_templates_of_the_pack(server):
    status, templates = server.get("/api/workflow_templates")
    assert status == 200, templates
    names = {n for pack, found in templates.items() if "precision" in pack for n in found}
    assert {"train_lora_flux2_klein", "inference_flux2_klein"} <= names, templates


def _expected_modules() -> set[str]:
    """Kohya names of the default preset's Linears on the tiny klein (Flux's key style)."""
    double = {f"lora_unet_double_blocks_{i}_{s}_attn_{p}" for i in range(standin.KLEIN_TINY["depth"])
              for s in ("img", "txt") for p in ("qkv", "proj")}
    single = {f"lora_unet_single_blocks_{i}_linear{j}" for i in range(standin.KLEIN_TINY["depth_single_blocks"])
              for j in (1, 2)}
    return double | single


def test_klein_training_then_inference_with_names_picked(server, files):
    prompt, edits = standin.swap_names(_load("train_lora_flux2_klein.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, dataset folder; bucket resolution
    trainer = _of(prompt, "PrecisionTrainLoRA")
    # Not names (CPU time, and an effect visible in 11 steps): 11 of the shipped 1500 steps at 100x the
    # learning rate, a non-default softmax scale recorded.
    assert prompt[trainer]["inputs"]["steps"] == 1500
    steps = prompt[trainer]["inputs"]["steps"] = 11
    settings, patch = _of(prompt, "PrecisionTrainSettings"), _of(prompt, "PrecisionPatchAttention")
    assert prompt[settings]["inputs"]["learning_rate"] == 1e-4 and prompt[patch]["inputs"]["scale_value"] == 1
    prompt[settings]["inputs"]["learning_rate"] = 1e-2
    prompt[patch]["inputs"]["scale_value"] = 0.8
    loras = os.path.join(files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_klein_lora_*.safetensors")))
    entry = server.run(prompt, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_klein_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
        keys = list(f.keys())
        ups = [f.get_tensor(k) for k in keys if k.endswith("lora_up.weight")]
    assert md["ss_steps"] == str(steps) and md["ss_base_model_version"] == "flux2", md
    assert md["ss_attn_scale_mode"] == "multiplier" and float(md["ss_attn_scale_value"]) == 0.8
    assert math.isclose(float(md["ss_attn_softmax_scale"]), 0.8 / math.sqrt(HEAD_DIM), rel_tol=1e-9)
    modules = {k[: -len(".lora_up.weight")] for k in keys if k.endswith(".lora_up.weight")}
    assert len(modules) == standin.ATTENTION_TARGETS and modules == _expected_modules(), sorted(modules)
    assert ups and all(bool(u.abs().sum() > 0) for u in ups), "the LoRA did not train"
    loss_csv = glob.glob(server.output_path("precision_lora", "my_klein_lora_loss*.csv"))
    assert loss_csv, os.listdir(server.output_path("precision_lora"))
    with open(sorted(loss_csv)[-1]) as f:
        rows = [line.split(",") for line in f.read().strip().splitlines()[1:]]
    assert len(rows) == steps and all(math.isfinite(float(r[1])) for r in rows)

    lora_name = "precision_lora/" + os.path.basename(saved[0])
    infer, edits = standin.swap_names(_load("inference_flux2_klein.json"), lora_name=lora_name)
    assert len(edits) == 6, edits  # model, text encoder, VAE, LoRA; latent and scheduler size
    sigmas = _of(infer, "Flux2Scheduler")
    assert infer[sigmas]["inputs"]["steps"] == 20
    infer[sigmas]["inputs"]["steps"] = 2  # not a name (CPU time only)
    pixels = _image(server, infer, "with_lora")
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    # controls: the LoRA's weights off (strength 0, recorded scale kept), the recorded scale off (LoRA kept)
    loader, unchanged, controls = _of(infer, "PrecisionLoadLoRA"), [], {}
    for inputs, what in (({"strength": 0.0}, "the LoRA's weights"), ({"attention": "ignore"}, "its recorded scale")):
        control = json.loads(json.dumps(infer))
        control[loader]["inputs"].update(inputs)
        controls[what] = _image(server, control, "control_" + "_".join(inputs))
        if np.array_equal(controls[what], pixels):
            unchanged.append(what)
    assert unchanged == [], f"changed nothing in the image: {unchanged}"

    # ComfyUI's own LoraLoaderModelOnly in place of Load LoRA (Precision): every key of the file matches a
    # module of the klein model (ComfyUI warns 'lora key not loaded' for any that does not) and it changes
    # the image as the pack's loader does without the recorded scale.
    stock = json.loads(json.dumps(infer))
    stock[loader] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": infer[loader]["inputs"]["model"], "lora_name": lora_name, "strength_model": 1.0}}
    log_start = len(server.log_text())
    stock_pixels = _image(server, stock, "stock_loader")
    not_loaded = re.findall(r"lora key not loaded: (\S+)", server.log_text()[log_start:])
    assert not_loaded == [], not_loaded
    base, plain = (controls[w].astype(np.float64) for w in ("the LoRA's weights", "its recorded scale"))
    effect, off = np.abs(plain - base).mean(), np.abs(stock_pixels.astype(np.float64) - plain).mean()
    assert effect > 0 and off < 0.1 * effect, (effect, off)


def _image(server, prompt: dict, tag: str) -> np.ndarray:
    save = _of(prompt, "SaveImage")
    prompt = json.loads(json.dumps(prompt))
    prompt[save]["inputs"]["filename_prefix"] = "precision_lora/klein_e2e_" + tag
    out = server.run(prompt, timeout=600)
    assert out["status"]["status_str"] == "success", out["status"]
    img = out["outputs"][save]["images"][0]
    return np.asarray(Image.open(server.output_path(img["subfolder"], img["filename"])))
