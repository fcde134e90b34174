"""The shipped Wan 2.2 5B (TI2V) workflows run on a real server with only names picked (plus the time cuts stated
below): train_lora_wan22_5b.json trains from a folder of 3 captioned images, each a one-frame video, through ComfyUI's
stock UNETLoader, CLIPLoader (type wan) and VAELoader, Resolution Buckets and the cached dataset;
inference_wan22_5b.json samples ComfyUI's Wan 2.2 5B template's video latent with the LoRA it saved.

The files are tests/wan22_5b_standin.py's: a tiny Wan 2.2 5B diffusion model (ComfyUI's own WAN22 class, 2 blocks of
width 128, the released keys: stock detection loads it), the Wan 2.2 VAE at its real size (705 M parameters) and a
tiny umt5-xxl (ComfyUI's own T5 class, 2 blocks, 4096 wide as the released one): umt5-xxl's 5.7 B parameters are
unaffordable on a CPU, and ComfyUI knows only that size, so the session server loads the stand-in module as a
test-only custom node that lets the stock CLIPLoader build the tiny config (tests/conftest.py); the loaders and
everything after them are stock."""
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
from safetensors import safe_open

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import wan22_5b_standin as standin  # noqa: E402

WF = os.path.join(ROOT, "workflows")
# The tiny model's 2 blocks, each with self_attn and cross_attn's q, k, v and o: what 'attention' selects in Wan.
ATTENTION_LINEARS = 2 * 2 * 4
STEPS = 8


def _load(name: str) -> dict:
    with open(os.path.join(WF, "api", name)) as f:
        return json.load(f)


def _of(prompt: dict, class_type: str) -> str:
    (nid,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return nid


def _template() -> dict | None:
    """ComfyUI's own Wan 2.2 5B text/image-to-video template, from the comfyui_workflow_templates packages of this
    host's venv: {node type: widgets_values of its active nodes of that type, in file order}."""
    import site

    for d in site.getsitepackages():
        for path in glob.glob(os.path.join(d, "comfyui_workflow_templates*", "templates", "video_wan2_2_5B_ti2v.json")):
            with open(path) as f:
                nodes = json.load(f)["nodes"]
            found: dict = {}
            for n in nodes:
                if n.get("mode", 0) == 0:
                    found.setdefault(n["type"], []).append(n.get("widgets_values"))
            return {k: v[0] if len(v) == 1 else v for k, v in found.items()}
    return None


@pytest.fixture(scope="module")
def wan_files(comfy_server):
    from server_harness import server_env

    # the stand-ins, written once per checkout into .cache/real_arch (the VAE: 1.4 GB, < 1 min) and linked in
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "wan22_5b_standin.py"), comfy_server.base_dir],
                   check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def test_shipped_wan22_5b_workflows_are_comfyuis_template_with_the_lora():
    train, infer = _load("train_lora_wan22_5b.json"), _load("inference_wan22_5b.json")
    template = _template()
    assert template is not None, "this host's venv has no comfyui_workflow_templates with video_wan2_2_5B_ti2v.json"
    # the template's files, sampler, shift, latent and frame rate
    for prompt in (train, infer):
        assert prompt[_of(prompt, "UNETLoader")]["inputs"]["unet_name"] == template["UNETLoader"][0]
        clip = prompt[_of(prompt, "CLIPLoader")]["inputs"]
        assert [clip["clip_name"], clip["type"]] == template["CLIPLoader"][:2] == [standin.SHIPPED["clip"], "wan"]
        assert prompt[_of(prompt, "VAELoader")]["inputs"]["vae_name"] == template["VAELoader"][0]
    sampler = infer[_of(infer, "KSampler")]["inputs"]
    _, _, steps, cfg, sampler_name, scheduler, denoise = template["KSampler"]
    assert (sampler["steps"], sampler["cfg"], sampler["sampler_name"], sampler["scheduler"], sampler["denoise"]) == (
        steps, cfg, sampler_name, scheduler, denoise)
    shift = infer[sampler["model"][0]]
    assert shift["class_type"] == "ModelSamplingSD3" and [shift["inputs"]["shift"]] == template["ModelSamplingSD3"]
    lora = infer[shift["inputs"]["model"][0]]
    assert lora["class_type"] == "PrecisionLoadLoRA" and lora["inputs"]["model"] == [_of(infer, "UNETLoader"), 0]
    latent = infer[sampler["latent_image"][0]]
    assert latent["class_type"] == "Wan22ImageToVideoLatent"
    size = [latent["inputs"][k] for k in ("width", "height", "length", "batch_size")]
    assert size == template["Wan22ImageToVideoLatent"], size
    assert latent["inputs"]["vae"] == [_of(infer, "VAELoader"), 0]
    negative = infer[sampler["negative"][0]]["inputs"]["text"]
    assert [negative] in template["CLIPTextEncode"], "the template's negative prompt"
    # the template's frame rate (its Create Video), written by Save Animated WEBP from VAE Decode's frames
    save = infer[_of(infer, "SaveAnimatedWEBP")]["inputs"]
    assert [save["fps"]] == template["CreateVideo"] and save["images"] == [_of(infer, "VAEDecode"), 0]
    # training: images -> buckets (multiple from the model) -> cached dataset with the wan CLIP and the Wan 2.2 VAE
    data, buckets = _of(train, "PrecisionCachedTrainingDataset"), _of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [_of(train, "CLIPLoader"), 0]
    assert train[data]["inputs"]["vae"] == [_of(train, "VAELoader"), 0]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["multiple"] == 0 and train[buckets]["inputs"]["model"] == [_of(train, "UNETLoader"), 0]
    attach, settings = _of(train, "PrecisionAttachLoRA"), _of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    assert train[settings]["inputs"]["vram_budget_gb"] == "auto"
    patch = _of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0] and train[patch]["inputs"]["model"] == [_of(train, "UNETLoader"), 0]
    assert not any(v["class_type"].startswith("PrecisionDemo") for v in [*train.values(), *infer.values()])


def test_wan22_5b_workflows_are_served_as_templates_of_the_pack(server):
    status, templates = server.get("/api/workflow_templates")
    assert status == 200, templates
    names = {n for pack, files in templates.items() if "precision" in pack for n in files}
    assert {"train_lora_wan22_5b", "inference_wan22_5b"} <= names, templates


def test_wan22_5b_training_then_inference_with_names_picked(server, wan_files):
    prompt, edits = standin.swap_names(_load("train_lora_wan22_5b.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, dataset folder; bucket resolution
    trainer = _of(prompt, "PrecisionTrainLoRA")
    # Not names (CPU time, and an effect visible in a few steps): STEPS of the shipped 1500 at 100x the learning
    # rate, a non-default softmax scale recorded.
    assert prompt[trainer]["inputs"]["steps"] == 1500
    prompt[trainer]["inputs"]["steps"] = STEPS
    settings, patch = _of(prompt, "PrecisionTrainSettings"), _of(prompt, "PrecisionPatchAttention")
    assert prompt[settings]["inputs"]["learning_rate"] == 1e-4 and prompt[patch]["inputs"]["scale_value"] == 1
    prompt[settings]["inputs"]["learning_rate"] = 1e-2
    prompt[patch]["inputs"]["scale_value"] = 0.8
    loras = os.path.join(wan_files, "models", "loras", "precision_lora")
    before = set(glob.glob(os.path.join(loras, "my_wan22_5b_lora_*.safetensors")))
    entry = server.run(prompt, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(os.path.join(loras, "my_wan22_5b_lora_*.safetensors"))) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
        keys = list(f.keys())
        ups = [f.get_tensor(k) for k in keys if k.endswith("lora_up.weight")]
    assert md["ss_steps"] == str(STEPS) and md["ss_base_model_version"] == "WAN22_T2V", md
    assert md["ss_attn_scale_mode"] == "multiplier" and float(md["ss_attn_scale_value"]) == 0.8
    # one head of 128 channels in the stand-in (the released 5B: 24 heads of 128, the same scale)
    assert math.isclose(float(md["ss_attn_softmax_scale"]), 0.8 / math.sqrt(128), rel_tol=1e-9)
    modules = {k[: -len(".lora_up.weight")] for k in keys if k.endswith(".lora_up.weight")}
    assert len(modules) == ATTENTION_LINEARS, sorted(modules)
    assert all(re.fullmatch(r"diffusion_model\.blocks\.[01]\.(self_attn|cross_attn)\.[qkvo]", m) for m in modules), \
        sorted(modules)
    assert ups and all(bool(u.abs().sum() > 0) for u in ups), "the LoRA did not train"
    # every image was encoded on its own as a one-frame video: 3 LATENTs of (1, 48, 1, 4, 4) (64 px / 16), in the
    # dataset cache and in the run's dataset report (64 px: the Wan 2.2 VAE's 16, not 8, per latent pixel)
    assert md["precision_lora_dataset"].startswith("dataset: 3 samples from 3 LATENT inputs; sizes 64x64 px x3"), md
    assert md["ss_resolution"] == "(64, 64)", md
    shapes = []
    for path in glob.glob(os.path.join(wan_files, "cache", "precision_lora", "dataset", "latents", "*.safetensors")):
        with safe_open(path, "pt") as f:
            shapes += [tuple(f.get_slice(k).get_shape()) for k in f.keys()]
    assert sum(s == (1, 48, 1, 4, 4) for s in shapes) >= 3, shapes
    loss_csv = glob.glob(server.output_path("precision_lora", "my_wan22_5b_lora_loss*.csv"))
    assert loss_csv, os.listdir(server.output_path("precision_lora"))
    with open(sorted(loss_csv)[-1]) as f:
        rows = [line.split(",") for line in f.read().strip().splitlines()[1:]]
    assert len(rows) == STEPS and all(math.isfinite(float(r[1])) for r in rows)

    lora_name = "precision_lora/" + os.path.basename(saved[0])
    infer, edits = standin.swap_names(_load("inference_wan22_5b.json"), lora_name=lora_name)
    assert len(edits) == 5, edits  # model, text encoder, VAE, LoRA; latent size and frames
    sampler = _of(infer, "KSampler")
    assert infer[sampler]["inputs"]["steps"] == 20
    infer[sampler]["inputs"]["steps"] = 4  # time only
    frames = _video(server, infer, "with_lora")
    assert frames.shape == (1, 64, 64, 3) and frames.std() > 0, frames.shape
    # controls: the LoRA's weights off (strength 0, recorded scale kept), the recorded scale off (LoRA kept)
    loader, videos = _of(infer, "PrecisionLoadLoRA"), {}
    for inputs, what in (({"strength": 0.0}, "the LoRA's weights"), ({"attention": "ignore"}, "its recorded scale")):
        control = json.loads(json.dumps(infer))
        control[loader]["inputs"].update(inputs)
        videos[what] = _video(server, control, "control_" + "_".join(inputs))
    unchanged = [what for what, video in videos.items() if np.array_equal(video, frames)]
    assert unchanged == [], f"changed nothing in the video: {unchanged}"

    # ComfyUI's stock LoraLoaderModelOnly in place of Load LoRA (Precision): every key of the file applies (ComfyUI
    # logs each key it cannot place), and it gives the video Load LoRA gives at the default attention scale
    stock = json.loads(json.dumps(infer))
    stock[loader] = {"class_type": "LoraLoaderModelOnly",
                     "inputs": {"model": infer[loader]["inputs"]["model"], "lora_name": lora_name, "strength_model": 1.0}}
    log_start = len(server.log_text())
    stock_frames = _video(server, stock, "stock_loader")
    log = server.log_text()[log_start:]
    assert "lora key not loaded" not in log, [ln for ln in log.splitlines() if "lora key not loaded" in ln]
    same_scale, off = videos["its recorded scale"].astype(float), videos["the LoRA's weights"].astype(float)
    gap, lora_effect = np.abs(stock_frames - same_scale).mean(), np.abs(off - frames.astype(float)).mean()
    assert gap < lora_effect / 4, (gap, lora_effect)  # measured: 0.0 and 18 (of 255)


def _video(server, prompt: dict, tag: str) -> np.ndarray:
    """Runs the prompt (its Save Animated WEBP prefix tagged) and returns the saved video's frames (n, h, w, 3)."""
    from PIL import Image, ImageSequence

    prompt = json.loads(json.dumps(prompt))
    save = _of(prompt, "SaveAnimatedWEBP")
    prompt[save]["inputs"]["filename_prefix"] += "_" + tag
    out = server.run(prompt, timeout=600)
    (item,) = out["outputs"][save]["images"]
    with Image.open(server.output_path(item["subfolder"], item["filename"])) as img:
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(img)])
