"""The shipped Z-Image workflows run on a real server with only names picked (plus the time cuts stated below):
train_lora_z_image.json trains from a folder of 3 captioned images through ComfyUI's stock UNETLoader,
CLIPLoader (type lumina2) and VAELoader, Resolution Buckets and the cached dataset; inference_z_image.json
samples an empty latent with the LoRA it saved, as ComfyUI's own Z-Image Turbo template samples.

Stand-ins (nothing downloaded): the diffusion model is tests/z_image_standin.py's tiny Z-Image (ComfyUI's own
ZImage config and NextDiT class, width 256, 2 layers and 2 + 2 refiner layers, the released file's keys); the
text encoder is its tiny Qwen3-4B (ComfyUI's own Qwen3_4B class at the real width 2560 and vocabulary, 28
small layers: the real 4 B parameters are unaffordable on a test machine); the VAE is tests/real_arch.py's
Flux.1 VAE at its real size. Stock detection knows Z-Image only at width 3840 and builds Qwen3-4B at its full
depth, so the session server loads z_image_standin.py as a test-only custom node that registers the two tiny
configs (tests/conftest.py); the loaders and everything after them are stock."""
from __future__ import annotations

import glob
import json
import math
import os
import re
import site
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
# What the shipped workflows hold (ComfyUI's Z-Image Turbo template's file names) and what the tests pick.
SHIPPED = {"unet_name": "z_image_turbo_bf16.safetensors", "clip_name": "qwen_3_4b.safetensors",
           "vae_name": "ae.safetensors", "folder": "my_lora_dataset"}
STANDIN = {"unet_name": "real_arch_tiny_z_image.safetensors", "clip_name": "real_arch_qwen3_4b_tiny.safetensors",
           "vae_name": real_arch.VAE_NAME, "folder": real_arch.DATASET}
# The stand-in's attention blocks (2 main layers, 2 noise-refiner and 2 context-refiner layers), each with its
# fused qkv and its out projection: what the 'attention' preset selects.
ATTENTION_MODULE = re.compile(r"diffusion_model\.(layers|noise_refiner|context_refiner)\.[01]\.attention\.(qkv|out)")
ATTENTION_LINEARS = 3 * 2 * 2
HEAD_DIM = 128  # Z-Image's heads (3840 / 30), kept by the stand-in (256 / 2)


def _load(name: str) -> dict:
    with open(os.path.join(WF, "api", name)) as f:
        return json.load(f)


def _of(prompt: dict, class_type: str) -> str:
    (nid,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return nid


def swap_names(prompt: dict, lora_name: str | None = None) -> tuple[dict, list[str]]:
    """The API prompt of a shipped Z-Image workflow with the stand-ins picked; returns it and the edits made
    (what a user does in the page). Every name edit checks the shipped value first. Not a name pick (CPU time):
    Resolution Buckets' resolution and the empty latent's size become 64 (the test images' size)."""
    out, edits = json.loads(json.dumps(prompt)), []
    for nid, node in out.items():
        inputs = node["inputs"]
        for name in SHIPPED:
            if name in inputs and node["class_type"] in ("UNETLoader", "CLIPLoader", "VAELoader",
                                                          "LoadImageTextDataSetFromFolder"):
                assert inputs[name] == SHIPPED[name], (nid, name, inputs[name])
                inputs[name] = STANDIN[name]
                edits.append(f"{nid}.{name}")
        if node["class_type"] == "PrecisionLoadLoRA" and lora_name is not None:
            inputs["lora_name"] = lora_name
            edits.append(f"{nid}.lora_name")
        elif node["class_type"] == "PrecisionResolutionBuckets":
            inputs["resolution"] = 64
            edits.append(f"{nid}.resolution")
        elif node["class_type"] == "EmptySD3LatentImage":
            inputs["width"] = inputs["height"] = 64
            edits.append(f"{nid}.width/height")
    return out, edits


def _official_template() -> dict | None:
    """ComfyUI's own Z-Image Turbo template (comfyui_workflow_templates, installed with each host)."""
    for sp in site.getsitepackages():
        for path in glob.glob(os.path.join(sp, "comfyui_workflow_templates*", "templates", "image_z_image_turbo.json")):
            with open(path) as f:
                return json.load(f)
    return None


def _template_widgets(template: dict) -> dict[str, list]:
    nodes = [*template["nodes"], *(n for sg in template.get("definitions", {}).get("subgraphs", []) for n in sg["nodes"])]
    return {n["type"]: n.get("widgets_values") for n in nodes}


@pytest.fixture(scope="module")
def z_image_files(comfy_server):
    from server_harness import server_env

    # the Flux.1 VAE at its real size and the captioned images (real_arch), then the tiny Z-Image and Qwen3-4B
    # (written once per checkout into .cache/real_arch: ~0.9 GB, ~20 s)
    for script in ("real_arch.py", "z_image_standin.py"):
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", script), comfy_server.base_dir],
                       check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def test_shipped_z_image_workflows_use_the_official_templates_loaders_and_sampling():
    train, infer = _load("train_lora_z_image.json"), _load("inference_z_image.json")
    template = _official_template()
    assert template is not None, "comfyui_workflow_templates has no image_z_image_turbo.json in this venv"
    tw = _template_widgets(template)
    # the template's own file names, text-encoder type and sampling
    assert tw["UNETLoader"][0] == SHIPPED["unet_name"] and tw["VAELoader"][0] == SHIPPED["vae_name"]
    assert tw["CLIPLoader"][:2] == [SHIPPED["clip_name"], "lumina2"]
    for prompt in (train, infer):
        assert prompt[_of(prompt, "UNETLoader")]["inputs"] == {"unet_name": SHIPPED["unet_name"],
                                                             "weight_dtype": "default"}
        clip = prompt[_of(prompt, "CLIPLoader")]["inputs"]
        assert (clip["clip_name"], clip["type"]) == (SHIPPED["clip_name"], "lumina2")
        assert prompt[_of(prompt, "VAELoader")]["inputs"]["vae_name"] == SHIPPED["vae_name"]
        assert not any(v["class_type"].startswith("PrecisionDemo") for v in prompt.values())
    ksampler = infer[_of(infer, "KSampler")]["inputs"]
    seed, _control, steps, cfg, sampler, scheduler, denoise = tw["KSampler"]
    assert (ksampler["cfg"], ksampler["sampler_name"], ksampler["scheduler"], ksampler["denoise"]) \
        == (cfg, sampler, scheduler, denoise) == (1, "res_multistep", "simple", 1)
    # steps: 8 in the template ComfyUI 0.33's package holds (comfyui_workflow_templates 0.11), 9 in 0.3.75's (0.7)
    assert ksampler["steps"] == 8 and steps in (8, 9), (ksampler["steps"], steps)
    shift = infer[_of(infer, "ModelSamplingAuraFlow")]["inputs"]
    assert shift["shift"] == tw["ModelSamplingAuraFlow"][0] == 3
    assert infer[ksampler["model"][0]]["class_type"] == "ModelSamplingAuraFlow"
    assert infer[shift["model"][0]]["class_type"] == "PrecisionLoadLoRA"
    assert infer[ksampler["latent_image"][0]]["class_type"] == "EmptySD3LatentImage"
    assert infer[ksampler["latent_image"][0]]["inputs"]["width"] == tw["EmptySD3LatentImage"][0] == 1024
    assert infer[ksampler["negative"][0]]["class_type"] == "ConditioningZeroOut"
    # training: folder -> buckets -> cached dataset with this CLIP and VAE; default preset; budgeted memory
    data, buckets = _of(train, "PrecisionCachedTrainingDataset"), _of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [_of(train, "CLIPLoader"), 0]
    assert train[data]["inputs"]["vae"] == [_of(train, "VAELoader"), 0]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["resolution"] == 1024
    attach, settings = _of(train, "PrecisionAttachLoRA"), _of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    s = train[settings]["inputs"]
    assert (s["vram_budget_gb"], s["timestep_sampling"], s["shift"]) == ("auto", "shift", 3)
    patch = _of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0]
    assert train[patch]["inputs"]["model"] == [_of(train, "UNETLoader"), 0]


def test_z_image_workflows_are_served_as_templates_of_the_pack(server):
    status, templates = server.get("/api/workflow_templates")
    assert status == 200, templates
    names = {n for pack, files in templates.items() if "precision" in pack for n in files}
    assert {"train_lora_z_image", "inference_z_image"} <= names, templates


def test_z_image_training_then_inference_with_names_picked(server, z_image_files):
    prompt, edits = swap_names(_load("train_lora_z_image.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, dataset folder; bucket resolution
    trainer = _of(prompt, "PrecisionTrainLoRA")
    # Not names (CPU time, and an effect visible in 11 steps): 11 of the shipped 2000 steps at 100x the
    # learning rate, a non-default softmax scale recorded.
    assert prompt[trainer]["inputs"]["steps"] == 2000
    steps = prompt[trainer]["inputs"]["steps"] = 11
    settings, patch = _of(prompt, "PrecisionTrainSettings"), _of(prompt, "PrecisionPatchAttention")
    assert prompt[settings]["inputs"]["learning_rate"] == 1e-4 and prompt[patch]["inputs"]["scale_value"] == 1
    prompt[settings]["inputs"]["learning_rate"] = 1e-2
    prompt[patch]["inputs"]["scale_value"] = 0.8
    loras = os.path.join(z_image_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_z_image_lora_*.safetensors")))
    entry = server.run(prompt, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_z_image_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
        keys = list(f.keys())
        ups = [f.get_tensor(k) for k in keys if k.endswith("lora_up.weight")]
    # the pack files ComfyUI's ZImage config under its Lumina 2 family (nodes/model/info.py)
    assert md["ss_steps"] == str(steps) and md["ss_base_model_version"] == "lumina2", md
    attn = {k: v for k, v in md.items() if k.startswith("ss_attn")}
    assert attn.get("ss_attn_scale_mode") == "multiplier" and float(attn.get("ss_attn_scale_value", 0)) == 0.8, attn
    assert math.isclose(float(md["ss_attn_softmax_scale"]), 0.8 / math.sqrt(HEAD_DIM), rel_tol=1e-9), attn
    modules = {k[: -len(".lora_up.weight")] for k in keys if k.endswith(".lora_up.weight")}
    assert len(modules) == ATTENTION_LINEARS and all(ATTENTION_MODULE.fullmatch(m) for m in modules), sorted(modules)
    assert ups and all(bool(u.abs().sum() > 0) for u in ups), "the LoRA did not train"
    loss_csv = glob.glob(server.output_path("precision_lora", "my_z_image_lora_loss*.csv"))
    assert loss_csv, os.listdir(server.output_path("precision_lora"))
    with open(sorted(loss_csv)[-1]) as f:
        rows = [line.split(",") for line in f.read().strip().splitlines()[1:]]
    assert len(rows) == steps and all(math.isfinite(float(r[1])) for r in rows)

    lora_name = "precision_lora/" + os.path.basename(saved[0])
    infer, edits = swap_names(_load("inference_z_image.json"), lora_name=lora_name)
    assert len(edits) == 5, edits  # model, text encoder, VAE, LoRA; latent size
    pixels = _image(server, infer)
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    # controls: the LoRA's weights off (strength 0, recorded scale kept), the recorded scale off (LoRA kept)
    loader, unchanged, without = _of(infer, "PrecisionLoadLoRA"), [], None
    for inputs, what in (({"strength": 0.0}, "the LoRA's weights"), ({"attention": "ignore"}, "its recorded scale")):
        control = json.loads(json.dumps(infer))
        control[loader]["inputs"].update(inputs)
        control[_of(infer, "SaveImage")]["inputs"]["filename_prefix"] += "_control_" + "_".join(inputs)
        image = _image(server, control)
        without = image if without is None else without
        if np.array_equal(image, pixels):
            unchanged.append(what)
    assert unchanged == [], f"changed nothing in the image: {unchanged}"
    # ComfyUI's stock LoraLoaderModelOnly loads every key of the file (none "not loaded") and it changes the image
    stock = json.loads(json.dumps(infer))
    stock[loader] = {"class_type": "LoraLoaderModelOnly",
                     "inputs": {"model": infer[loader]["inputs"]["model"], "lora_name": lora_name, "strength_model": 1.0}}
    stock[_of(infer, "SaveImage")]["inputs"]["filename_prefix"] += "_stock"
    not_loaded = server.log_text().count("lora key not loaded")
    assert not np.array_equal(_image(server, stock), without), "the stock loader's LoRA changed nothing"
    assert server.log_text().count("lora key not loaded") == not_loaded


def _image(server, prompt: dict) -> np.ndarray:
    out = server.run(prompt, timeout=600)
    img = out["outputs"][_of(prompt, "SaveImage")]["images"][0]
    return np.asarray(Image.open(server.output_path(img["subfolder"], img["filename"])))
