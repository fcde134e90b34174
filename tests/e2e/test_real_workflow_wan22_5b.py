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
import os
import re
import sys

import pytest
from safetensors import safe_open

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import wan22_5b_standin as standin  # noqa: E402
from real_workflow_lib import (assert_served_as_templates, assert_stock_loader_equals_ours_without_the_scale,  # noqa: E402
                               comfy_template, controls, load, of, stock_loader_output, train_briefly, video,
                               write_files)

# The tiny model's 2 blocks, each with self_attn and cross_attn's q, k, v and o: what 'attention' selects in Wan.
ATTENTION_LINEARS = 2 * 2 * 4
STEPS = 8


def _template() -> dict | None:
    """ComfyUI's own Wan 2.2 5B text/image-to-video template: {node type: widgets_values of its active nodes of that
    type, in file order}."""
    template = comfy_template("video_wan2_2_5B_ti2v.json")
    if template is None:
        return None
    found: dict = {}
    for n in template["nodes"]:
        if n.get("mode", 0) == 0:
            found.setdefault(n["type"], []).append(n.get("widgets_values"))
    return {k: v[0] if len(v) == 1 else v for k, v in found.items()}


@pytest.fixture(scope="module")
def wan_files(comfy_server):
    # the stand-ins, written once per checkout into .cache/real_arch (the VAE: 1.4 GB, < 1 min) and linked in
    return write_files(comfy_server, "wan22_5b_standin.py")


def test_shipped_wan22_5b_workflows_are_comfyuis_template_with_the_lora():
    train, infer = load("train_lora_wan22_5b.json"), load("inference_wan22_5b.json")
    template = _template()
    assert template is not None, "this host's venv has no comfyui_workflow_templates with video_wan2_2_5B_ti2v.json"
    # the template's files, sampler, shift, latent and frame rate
    for prompt in (train, infer):
        assert prompt[of(prompt, "UNETLoader")]["inputs"]["unet_name"] == template["UNETLoader"][0]
        clip = prompt[of(prompt, "CLIPLoader")]["inputs"]
        assert [clip["clip_name"], clip["type"]] == template["CLIPLoader"][:2] == [standin.SHIPPED["clip"], "wan"]
        assert prompt[of(prompt, "VAELoader")]["inputs"]["vae_name"] == template["VAELoader"][0]
    sampler = infer[of(infer, "KSampler")]["inputs"]
    _, _, steps, cfg, sampler_name, scheduler, denoise = template["KSampler"]
    assert (sampler["steps"], sampler["cfg"], sampler["sampler_name"], sampler["scheduler"], sampler["denoise"]) == (
        steps, cfg, sampler_name, scheduler, denoise)
    shift = infer[sampler["model"][0]]
    assert shift["class_type"] == "ModelSamplingSD3" and [shift["inputs"]["shift"]] == template["ModelSamplingSD3"]
    lora = infer[shift["inputs"]["model"][0]]
    assert lora["class_type"] == "PrecisionLoadLoRA" and lora["inputs"]["model"] == [of(infer, "UNETLoader"), 0]
    latent = infer[sampler["latent_image"][0]]
    assert latent["class_type"] == "Wan22ImageToVideoLatent"
    size = [latent["inputs"][k] for k in ("width", "height", "length", "batch_size")]
    assert size == template["Wan22ImageToVideoLatent"], size
    assert latent["inputs"]["vae"] == [of(infer, "VAELoader"), 0]
    negative = infer[sampler["negative"][0]]["inputs"]["text"]
    assert [negative] in template["CLIPTextEncode"], "the template's negative prompt"
    # the template's frame rate (its Create Video), written by Save Animated WEBP from VAE Decode's frames
    save = infer[of(infer, "SaveAnimatedWEBP")]["inputs"]
    assert [save["fps"]] == template["CreateVideo"] and save["images"] == [of(infer, "VAEDecode"), 0]
    # training: images -> buckets (multiple from the model) -> cached dataset with the wan CLIP and the Wan 2.2 VAE
    data, buckets = of(train, "PrecisionCachedTrainingDataset"), of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [of(train, "CLIPLoader"), 0]
    assert train[data]["inputs"]["vae"] == [of(train, "VAELoader"), 0]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["multiple"] == 0 and train[buckets]["inputs"]["model"] == [of(train, "UNETLoader"), 0]
    attach, settings = of(train, "PrecisionAttachLoRA"), of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    assert train[settings]["inputs"]["vram_budget_gb"] == "auto"
    patch = of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0] and train[patch]["inputs"]["model"] == [of(train, "UNETLoader"), 0]
    assert not any(v["class_type"].startswith("PrecisionDemo") for v in [*train.values(), *infer.values()])


def test_wan22_5b_workflows_are_served_as_templates_of_the_pack(server):
    assert_served_as_templates(server, "train_lora_wan22_5b", "inference_wan22_5b")


def test_wan22_5b_training_then_inference_with_names_picked(server, wan_files):
    prompt, edits = standin.swap_names(load("train_lora_wan22_5b.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, dataset folder; bucket resolution
    # one head of 128 channels in the stand-in (the released 5B: 24 heads of 128, the same scale)
    trained = train_briefly(server, prompt, files=wan_files, lora_prefix="my_wan22_5b_lora", shipped_steps=1500,
                            steps=STEPS, base_model_version="WAN22_T2V", head_dim=128)
    assert len(trained.modules) == ATTENTION_LINEARS, sorted(trained.modules)
    assert all(re.fullmatch(r"diffusion_model\.blocks\.[01]\.(self_attn|cross_attn)\.[qkvo]", m)
               for m in trained.modules), sorted(trained.modules)
    assert trained.untrained() == set(), "the LoRA did not train"
    # every image was encoded on its own as a one-frame video: 3 LATENTs of (1, 48, 1, 4, 4) (64 px / 16), in the
    # dataset cache and in the run's dataset report (64 px: the Wan 2.2 VAE's 16, not 8, per latent pixel)
    md = trained.metadata
    assert md["precision_lora_dataset"].startswith("dataset: 3 samples from 3 LATENT inputs; sizes 64x64 px x3"), md
    assert md["ss_resolution"] == "(64, 64)", md
    shapes = []
    for path in glob.glob(os.path.join(wan_files, "cache", "precision_lora", "dataset", "latents", "*.safetensors")):
        with safe_open(path, "pt") as f:
            shapes += [tuple(f.get_slice(k).get_shape()) for k in f.keys()]
    assert sum(s == (1, 48, 1, 4, 4) for s in shapes) >= 3, shapes

    infer, edits = standin.swap_names(load("inference_wan22_5b.json"), lora_name=trained.lora_name)
    assert len(edits) == 5, edits  # model, text encoder, VAE, LoRA; latent size and frames
    sampler = of(infer, "KSampler")
    assert infer[sampler]["inputs"]["steps"] == 20
    infer[sampler]["inputs"]["steps"] = 4  # time only
    frames = video(server, infer, "with_lora")
    assert frames.shape == (1, 64, 64, 3) and frames.std() > 0, frames.shape
    outs = controls(server, infer, video, frames)
    # ComfyUI's stock LoraLoaderModelOnly in place of Load LoRA (Precision): every key of the file applies, and it
    # gives the video Load LoRA gives at the default attention scale (measured: a gap of 0.0, the LoRA's effect 18
    # of 255)
    stock = stock_loader_output(server, infer, trained.lora_name, video)
    assert_stock_loader_equals_ours_without_the_scale(stock, frames, outs)
