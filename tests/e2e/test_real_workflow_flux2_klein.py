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

import os
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import flux2_klein_standin as standin  # noqa: E402
from real_workflow_lib import (assert_served_as_templates, assert_stock_loader_equals_ours_without_the_scale,  # noqa: E402
                               controls, image, load, of, stock_loader_output, train_briefly)

HEAD_DIM = 128  # Flux.2's heads (klein 4B: 24 of them; the stand-in: 2)


@pytest.fixture(scope="module")
def files(comfy_server):
    return standin.files_for(comfy_server)


def test_shipped_klein_workflows_use_comfyuis_loaders_and_its_klein_template_sampling():
    train, infer = load("train_lora_flux2_klein.json"), load("inference_flux2_klein.json")
    for prompt in (train, infer):
        unet, clip, vae = (prompt[of(prompt, t)]["inputs"] for t in ("UNETLoader", "CLIPLoader", "VAELoader"))
        assert (unet["unet_name"], unet["weight_dtype"]) == ("flux-2-klein-base-4b.safetensors", "default")
        assert (clip["clip_name"], clip["type"]) == ("qwen_3_4b.safetensors", "flux2")
        assert vae["vae_name"] == "flux2-vae.safetensors"
        assert not any(v["class_type"].startswith("PrecisionDemo") for v in prompt.values())
    unet, clip, vae = (of(train, t) for t in ("UNETLoader", "CLIPLoader", "VAELoader"))
    data, buckets = of(train, "PrecisionCachedTrainingDataset"), of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [clip, 0] and train[data]["inputs"]["vae"] == [vae, 0]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["resolution"] == 1024 and train[buckets]["inputs"]["model"] == [unet, 0]
    attach, settings = of(train, "PrecisionAttachLoRA"), of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    assert train[settings]["inputs"]["vram_budget_gb"] == "auto"
    patch = of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0] and train[patch]["inputs"]["model"] == [unet, 0]
    # inference as ComfyUI's klein base template: 20 steps of Flux2Scheduler at the latent's size, cfg 5, euler
    sampler = infer[of(infer, "SamplerCustomAdvanced")]["inputs"]
    latent, sigmas = infer[sampler["latent_image"][0]], infer[sampler["sigmas"][0]]
    guider, pick = infer[sampler["guider"][0]], infer[sampler["sampler"][0]]
    assert latent["class_type"] == "EmptyFlux2LatentImage" and sigmas["class_type"] == "Flux2Scheduler"
    assert (latent["inputs"]["width"], latent["inputs"]["height"]) == (sigmas["inputs"]["width"],
                                                                        sigmas["inputs"]["height"]) == (1024, 1024)
    assert sigmas["inputs"]["steps"] == 20 and pick["inputs"]["sampler_name"] == "euler"
    assert guider["class_type"] == "CFGGuider" and guider["inputs"]["cfg"] == 5
    assert infer[guider["inputs"]["model"][0]]["class_type"] == "PrecisionLoadLoRA"
    for side in ("positive", "negative"):
        assert infer[guider["inputs"][side][0]]["inputs"]["clip"] == [of(infer, "CLIPLoader"), 0]
    assert infer[of(infer, "VAEDecode")]["inputs"]["vae"] == [of(infer, "VAELoader"), 0]


def test_klein_workflows_are_served_as_templates_of_the_pack(server):
    assert_served_as_templates(server, "train_lora_flux2_klein", "inference_flux2_klein")


def _expected_modules() -> set[str]:
    """Kohya names of the default preset's Linears on the tiny klein (Flux's key style)."""
    double = {f"lora_unet_double_blocks_{i}_{s}_attn_{p}" for i in range(standin.KLEIN_TINY["depth"])
              for s in ("img", "txt") for p in ("qkv", "proj")}
    single = {f"lora_unet_single_blocks_{i}_linear{j}" for i in range(standin.KLEIN_TINY["depth_single_blocks"])
              for j in (1, 2)}
    return double | single


def test_klein_training_then_inference_with_names_picked(server, files):
    prompt, edits = standin.swap_names(load("train_lora_flux2_klein.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, dataset folder; bucket resolution
    trained = train_briefly(server, prompt, files=files, lora_prefix="my_klein_lora", shipped_steps=1500,
                            base_model_version="flux2", head_dim=HEAD_DIM)
    assert len(trained.modules) == standin.ATTENTION_TARGETS and trained.modules == _expected_modules(), \
        sorted(trained.modules)
    assert trained.untrained() == set(), "the LoRA did not train"

    infer, edits = standin.swap_names(load("inference_flux2_klein.json"), lora_name=trained.lora_name)
    assert len(edits) == 6, edits  # model, text encoder, VAE, LoRA; latent and scheduler size
    sigmas = of(infer, "Flux2Scheduler")
    assert infer[sigmas]["inputs"]["steps"] == 20
    infer[sigmas]["inputs"]["steps"] = 2  # not a name (CPU time only)
    pixels = image(server, infer, "with_lora")
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    outs = controls(server, infer, image, pixels)
    # ComfyUI's own LoraLoaderModelOnly in place of Load LoRA (Precision): every key of the file matches a module
    # of the klein model and it changes the image as the pack's loader does without the recorded scale.
    stock = stock_loader_output(server, infer, trained.lora_name, image)
    assert_stock_loader_equals_ours_without_the_scale(stock, pixels, outs)
