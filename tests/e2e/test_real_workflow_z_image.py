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

import os
import re
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402
from real_workflow_lib import (assert_served_as_templates, assert_stock_loader_equals_ours_without_the_scale,  # noqa: E402
                               comfy_template, controls, image, load, of, pick_names, stock_loader_output,
                               train_briefly, write_files)

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


def swap_names(prompt: dict, lora_name: str | None = None) -> tuple[dict, list[str]]:
    """The API prompt of a shipped Z-Image workflow with the stand-ins picked; returns it and the edits made
    (what a user does in the page). Every name edit checks the shipped value first. Not a name pick (CPU time):
    Resolution Buckets' resolution and the empty latent's size become 64 (the test images' size)."""
    kinds = {"unet_name": "UNETLoader", "clip_name": "CLIPLoader", "vae_name": "VAELoader",
             "folder": "LoadImageTextDataSetFromFolder"}
    picks = {(kinds[name], name): (SHIPPED[name], STANDIN[name]) for name in SHIPPED}
    return pick_names(prompt, picks, lora_name=lora_name,
                      sizes={"PrecisionResolutionBuckets": {"resolution": 64},
                             "EmptySD3LatentImage": {"width": 64, "height": 64}})


def _template_widgets(template: dict) -> dict[str, list]:
    nodes = [*template["nodes"], *(n for sg in template.get("definitions", {}).get("subgraphs", []) for n in sg["nodes"])]
    return {n["type"]: n.get("widgets_values") for n in nodes}


@pytest.fixture(scope="module")
def z_image_files(comfy_server):
    # the Flux.1 VAE at its real size and the captioned images (real_arch), then the tiny Z-Image and Qwen3-4B
    # (written once per checkout into .cache/real_arch: ~0.9 GB, ~20 s)
    return write_files(comfy_server, "real_arch.py", "z_image_standin.py")


def test_shipped_z_image_workflows_use_the_official_templates_loaders_and_sampling():
    train, infer = load("train_lora_z_image.json"), load("inference_z_image.json")
    template = comfy_template("image_z_image_turbo.json")  # ComfyUI's own Z-Image Turbo template
    assert template is not None, "comfyui_workflow_templates has no image_z_image_turbo.json in this venv"
    tw = _template_widgets(template)
    # the template's own file names, text-encoder type and sampling
    assert tw["UNETLoader"][0] == SHIPPED["unet_name"] and tw["VAELoader"][0] == SHIPPED["vae_name"]
    assert tw["CLIPLoader"][:2] == [SHIPPED["clip_name"], "lumina2"]
    for prompt in (train, infer):
        assert prompt[of(prompt, "UNETLoader")]["inputs"] == {"unet_name": SHIPPED["unet_name"],
                                                             "weight_dtype": "default"}
        clip = prompt[of(prompt, "CLIPLoader")]["inputs"]
        assert (clip["clip_name"], clip["type"]) == (SHIPPED["clip_name"], "lumina2")
        assert prompt[of(prompt, "VAELoader")]["inputs"]["vae_name"] == SHIPPED["vae_name"]
        assert not any(v["class_type"].startswith("PrecisionDemo") for v in prompt.values())
    ksampler = infer[of(infer, "KSampler")]["inputs"]
    seed, _control, steps, cfg, sampler, scheduler, denoise = tw["KSampler"]
    assert (ksampler["cfg"], ksampler["sampler_name"], ksampler["scheduler"], ksampler["denoise"]) \
        == (cfg, sampler, scheduler, denoise) == (1, "res_multistep", "simple", 1)
    # steps: 8 in the template ComfyUI 0.33's package holds (comfyui_workflow_templates 0.11), 9 in 0.3.75's (0.7)
    assert ksampler["steps"] == 8 and steps in (8, 9), (ksampler["steps"], steps)
    shift = infer[of(infer, "ModelSamplingAuraFlow")]["inputs"]
    assert shift["shift"] == tw["ModelSamplingAuraFlow"][0] == 3
    assert infer[ksampler["model"][0]]["class_type"] == "ModelSamplingAuraFlow"
    assert infer[shift["model"][0]]["class_type"] == "PrecisionLoadLoRA"
    assert infer[ksampler["latent_image"][0]]["class_type"] == "EmptySD3LatentImage"
    assert infer[ksampler["latent_image"][0]]["inputs"]["width"] == tw["EmptySD3LatentImage"][0] == 1024
    assert infer[ksampler["negative"][0]]["class_type"] == "ConditioningZeroOut"
    # training: folder -> buckets -> cached dataset with this CLIP and VAE; default preset; budgeted memory
    data, buckets = of(train, "PrecisionCachedTrainingDataset"), of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [of(train, "CLIPLoader"), 0]
    assert train[data]["inputs"]["vae"] == [of(train, "VAELoader"), 0]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["resolution"] == 1024
    attach, settings = of(train, "PrecisionAttachLoRA"), of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    s = train[settings]["inputs"]
    assert (s["vram_budget_gb"], s["timestep_sampling"], s["shift"]) == ("auto", "shift", 3)
    patch = of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0]
    assert train[patch]["inputs"]["model"] == [of(train, "UNETLoader"), 0]


def test_z_image_workflows_are_served_as_templates_of_the_pack(server):
    assert_served_as_templates(server, "train_lora_z_image", "inference_z_image")


def test_z_image_training_then_inference_with_names_picked(server, z_image_files):
    prompt, edits = swap_names(load("train_lora_z_image.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, dataset folder; bucket resolution
    # the pack files ComfyUI's ZImage config under its Lumina 2 family (nodes/model/info.py)
    trained = train_briefly(server, prompt, files=z_image_files, lora_prefix="my_z_image_lora", shipped_steps=2000,
                            base_model_version="lumina2", head_dim=HEAD_DIM)
    assert len(trained.modules) == ATTENTION_LINEARS, sorted(trained.modules)
    assert all(ATTENTION_MODULE.fullmatch(m) for m in trained.modules), sorted(trained.modules)
    assert trained.untrained() == set(), "the LoRA did not train"

    infer, edits = swap_names(load("inference_z_image.json"), lora_name=trained.lora_name)
    assert len(edits) == 5, edits  # model, text encoder, VAE, LoRA; latent size
    pixels = image(server, infer, "with_lora")
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    outs = controls(server, infer, image, pixels)
    # ComfyUI's stock LoraLoaderModelOnly loads every key of the file and gives Load LoRA's image without the
    # recorded scale
    stock = stock_loader_output(server, infer, trained.lora_name, image)
    assert_stock_loader_equals_ours_without_the_scale(stock, pixels, outs)
