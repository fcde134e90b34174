"""The shipped SDXL workflows run on a real server with only names picked (plus the time cuts stated below):
train_lora_sdxl.json trains from a folder of 3 captioned images through ComfyUI's stock CheckpointLoaderSimple
(MODEL, CLIP-L + CLIP-G, VAE from one file), Resolution Buckets and the cached dataset; inference_sdxl.json
samples an empty latent with the LoRA it saved.

The checkpoint is tests/sdxl_standin.py's: a tiny SDXL UNet (ComfyUI's own SDXL classes, 64/128 channels),
CLIP-L, CLIP-G and the SD VAE at their real sizes. Stock detection knows SDXL only at its full size, so the
session server loads that file as a test-only custom node that adds the tiny UNet's config to ComfyUI's
detection list (tests/conftest.py); the loader and everything after it are stock."""
from __future__ import annotations

import os
import re
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402
from real_workflow_lib import assert_served_as_templates, controls, image, load, of, train_briefly, write_files  # noqa: E402,E501

# The tiny UNet's transformer blocks (input level 1, middle, 2 output blocks), each with attn1 and attn2's
# to_q, to_k, to_v and to_out.0: what the 'attention' preset of an SDXL UNet selects.
ATTENTION_LINEARS = 4 * 2 * 4


@pytest.fixture(scope="module")
def sdxl_files(comfy_server):
    # --sdxl: the tiny SDXL checkpoint, written once per checkout into .cache/real_arch (~1.8 GB, < 1 min)
    return write_files(comfy_server, "real_arch.py", args=("--sdxl",))


def test_shipped_sdxl_workflows_take_model_text_encoders_and_vae_from_one_checkpoint():
    train, infer = load("train_lora_sdxl.json"), load("inference_sdxl.json")
    ckpt = of(train, "CheckpointLoaderSimple")
    assert train[ckpt]["inputs"]["ckpt_name"] == real_arch.SHIPPED["checkpoint"]
    data, buckets = of(train, "PrecisionCachedTrainingDataset"), of(train, "PrecisionResolutionBuckets")
    assert train[data]["inputs"]["clip"] == [ckpt, 1] and train[data]["inputs"]["vae"] == [ckpt, 2]
    assert train[data]["inputs"]["images"] == [buckets, 0] and train[data]["inputs"]["texts"] == [buckets, 1]
    assert train[buckets]["inputs"]["resolution"] == 1024
    attach, settings = of(train, "PrecisionAttachLoRA"), of(train, "PrecisionTrainSettings")
    assert (train[attach]["inputs"]["rank"], train[attach]["inputs"]["targets"]) == (16, "attention")
    assert train[settings]["inputs"]["vram_budget_gb"] == "auto"
    assert train[settings]["inputs"]["timestep_sampling"] == "uniform"
    # the model the trainer gets comes from the checkpoint through Patch Attention and Attach LoRA
    patch = of(train, "PrecisionPatchAttention")
    assert train[attach]["inputs"]["model"] == [patch, 0] and train[patch]["inputs"]["model"] == [ckpt, 0]
    assert not any(v["class_type"].startswith("PrecisionDemo") for v in [*train.values(), *infer.values()])
    ck = of(infer, "CheckpointLoaderSimple")
    sampler = infer[of(infer, "KSampler")]["inputs"]
    assert infer[sampler["latent_image"][0]]["class_type"] == "EmptyLatentImage"
    assert infer[sampler["latent_image"][0]]["inputs"]["width"] == 1024 and sampler["cfg"] > 1
    for side in ("positive", "negative"):
        assert infer[sampler[side][0]]["class_type"] == "CLIPTextEncode"
        assert infer[sampler[side][0]]["inputs"]["clip"] == [ck, 1]
    assert infer[of(infer, "VAEDecode")]["inputs"]["vae"] == [ck, 2]


def test_sdxl_workflows_are_served_as_templates_of_the_pack(server):
    assert_served_as_templates(server, "train_lora_sdxl", "inference_sdxl")


def test_sdxl_training_then_inference_with_names_picked(server, sdxl_files):
    prompt, edits = real_arch.swap_names(load("train_lora_sdxl.json"))
    assert len(edits) == 3, edits  # checkpoint, dataset folder; bucket resolution
    trained = train_briefly(server, prompt, files=sdxl_files, lora_prefix="my_sdxl_lora", shipped_steps=1500,
                            base_model_version="sdxl", head_dim=64)  # SDXL heads: 64 channels
    assert len(trained.modules) == ATTENTION_LINEARS, sorted(trained.modules)
    assert all(re.fullmatch(r"diffusion_model\..+\.transformer_blocks\.0\.attn[12]\.to_(q|k|v|out\.0)", m)
               for m in trained.modules), sorted(trained.modules)
    assert trained.untrained() == set(), "the LoRA did not train"

    infer, edits = real_arch.swap_names(load("inference_sdxl.json"), lora_name=trained.lora_name)
    assert len(edits) == 3, edits  # checkpoint, LoRA; latent size
    pixels = image(server, infer, "with_lora")
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    controls(server, infer, image, pixels)
