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

import os
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "workflows"))
import qwen_image_standin as standin  # noqa: E402
import spec_qwen_image as spec  # noqa: E402
from real_workflow_lib import (assert_served_as_templates, assert_stock_loader_equals_ours_without_the_scale,  # noqa: E402
                               controls, image, load, of, stock_loader_output, train_briefly, write_files)

SHIPPED = {("UNETLoader", "unet_name"): spec.MODEL, ("CLIPLoader", "clip_name"): spec.TEXT_ENCODER,
           ("VAELoader", "vae_name"): spec.VAE, ("LoadImageTextDataSetFromFolder", "folder"): spec.DATASET}
# What the 'attention' preset selects in each of the tiny transformer's 2 blocks: the image stream's projections
# and the text stream's (Qwen-Image's joint attention), 8 Linears a block.
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
HEAD_DIM = standin.TINY_DIT["attention_head_dim"]


@pytest.fixture(scope="module")
def qwen_files(comfy_server):
    if standin.link_cached(comfy_server.base_dir):  # the files of this fingerprint are in .cache/real_arch
        return comfy_server.base_dir
    # written once per checkout into .cache/real_arch (~270 MB, mostly the VAE; < 1 min) and linked
    return write_files(comfy_server, "qwen_image_standin.py")


def test_shipped_qwen_image_workflows_use_comfyuis_loaders_and_template_sampling():
    train, infer = load("train_lora_qwen_image.json"), load("inference_qwen_image.json")
    for prompt in (train, infer):
        assert prompt[of(prompt, "UNETLoader")]["inputs"] == {"unet_name": "qwen_image_fp8_e4m3fn.safetensors",
                                                               "weight_dtype": "default"}
        clip = prompt[of(prompt, "CLIPLoader")]["inputs"]
        assert (clip["clip_name"], clip["type"]) == ("qwen_2.5_vl_7b_fp8_scaled.safetensors", "qwen_image")
        assert prompt[of(prompt, "VAELoader")]["inputs"]["vae_name"] == "qwen_image_vae.safetensors"
    unet, clip, vae = of(train, "UNETLoader"), of(train, "CLIPLoader"), of(train, "VAELoader")
    data, buckets = of(train, "PrecisionCachedTrainingDataset"), of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [clip, 0] and train[data]["inputs"]["vae"] == [vae, 0]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["resolution"] == 1024 and train[buckets]["inputs"]["model"] == [unet, 0]
    attach, settings = of(train, "PrecisionAttachLoRA"), of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    assert train[settings]["inputs"]["vram_budget_gb"] == "auto"
    patch = of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0] and train[patch]["inputs"]["model"] == [unet, 0]
    assert not any(v["class_type"].startswith("PrecisionDemo") for v in [*train.values(), *infer.values()])
    # inference samples as ComfyUI's own Qwen-Image template (image_qwen_image.json) does
    sampler = infer[of(infer, "KSampler")]["inputs"]
    assert {k: sampler[k] for k in ("steps", "cfg", "sampler_name", "scheduler")} == {
        "steps": 20, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple"}
    shift = sampler["model"][0]
    assert infer[shift]["class_type"] == "ModelSamplingAuraFlow" and infer[shift]["inputs"]["shift"] == 3.1
    loader = infer[shift]["inputs"]["model"][0]
    assert infer[loader]["class_type"] == "PrecisionLoadLoRA"
    assert infer[loader]["inputs"]["model"] == [of(infer, "UNETLoader"), 0]
    assert infer[loader]["inputs"]["lora_name"] == "precision_lora/my_qwen_image_lora_00001_.safetensors"
    latent = infer[sampler["latent_image"][0]]
    assert latent["class_type"] == "EmptySD3LatentImage" and latent["inputs"]["width"] == 1328
    texts = [infer[sampler[side][0]] for side in ("positive", "negative")]
    assert [t["class_type"] for t in texts] == ["CLIPTextEncode"] * 2 and texts[1]["inputs"]["text"] == ""
    assert all(t["inputs"]["clip"] == [of(infer, "CLIPLoader"), 0] for t in texts)
    assert infer[of(infer, "VAEDecode")]["inputs"]["vae"] == [of(infer, "VAELoader"), 0]


def test_qwen_image_workflows_are_served_as_templates_of_the_pack(server):
    assert_served_as_templates(server, "train_lora_qwen_image", "inference_qwen_image")


def test_qwen_image_training_then_inference_with_names_picked(server, qwen_files):
    prompt, edits = standin.swap_names(load("train_lora_qwen_image.json"), SHIPPED)
    assert len(edits) == 5, edits  # diffusion model, text encoder, VAE, dataset folder; bucket resolution
    trained = train_briefly(server, prompt, files=qwen_files, lora_prefix="my_qwen_image_lora", shipped_steps=1000,
                            base_model_version="qwen_image", head_dim=HEAD_DIM)
    want = {f"diffusion_model.transformer_blocks.{b}.attn.{p}" for b in range(2) for p in ATTENTION}
    assert trained.modules == want, sorted(trained.modules ^ want)
    # Every projection trained but the last block's text query and text output: its text stream is discarded
    # (the model's output is the image tokens), so they get no gradient (true of the released model's block 59).
    frozen = trained.untrained()
    assert frozen == {f"diffusion_model.transformer_blocks.1.attn.{p}" for p in ("add_q_proj", "to_add_out")}, frozen

    infer, edits = standin.swap_names(load("inference_qwen_image.json"), SHIPPED, lora_name=trained.lora_name)
    assert len(edits) == 5, edits  # diffusion model, text encoder, VAE, LoRA; latent size
    # not a name (CPU time only): 4 of the template's 20 sampling steps
    sampler = infer[of(infer, "KSampler")]["inputs"]
    assert sampler["steps"] == 20
    sampler["steps"] = 4
    pixels = image(server, infer, "with_lora")
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    outs = controls(server, infer, image, pixels)
    # ComfyUI's stock LoraLoaderModelOnly loads the same file in Load LoRA (Precision)'s place: every key applied
    # and the image Load LoRA gives without the recorded scale
    stock = stock_loader_output(server, infer, trained.lora_name, image)
    assert_stock_loader_equals_ours_without_the_scale(stock, pixels, outs)
