"""The shipped real-training workflows run on a real server with only file and folder names picked (plus the
two differences tests/real_arch.py's swap_names states): train_lora.json trains from a folder of 3 captioned
images through ComfyUI's own dataset, VAE and text-encoder nodes, and inference_matching_scale.json samples an
empty latent with the LoRA it saved."""
from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402
from real_workflow_lib import controls, image, load, of, train_briefly, write_files  # noqa: E402


@pytest.fixture(scope="module")
def real_files(comfy_server):
    return write_files(comfy_server, "real_arch.py")


def test_shipped_real_workflows_use_comfyui_nodes_for_data_vae_and_text():
    train, infer = load("train_lora.json"), load("inference_matching_scale.json")
    kinds = {v["class_type"] for v in train.values()}
    assert {"LoadImageTextDataSetFromFolder", "PrecisionCachedTrainingDataset", "DualCLIPLoader", "VAELoader"} <= kinds
    assert not any(k.startswith("PrecisionDemo") for k in kinds | {v["class_type"] for v in infer.values()})
    data = of(train, "PrecisionCachedTrainingDataset")
    trainer = of(train, "PrecisionTrainLoRA")
    assert train[trainer]["inputs"]["latents"] == [data, 0] and train[trainer]["inputs"]["conditioning"] == [data, 1]
    for prompt in (train, infer):
        assert prompt[of(prompt, "PrecisionLoadDiffusionModel")]["inputs"]["weight_dtype"] == "default"
    sampler = infer[of(infer, "KSampler")]["inputs"]
    assert infer[sampler["latent_image"][0]]["class_type"] == "EmptySD3LatentImage"
    assert infer[of(infer, "VAEDecode")]["inputs"]["samples"] == [of(infer, "KSampler"), 0]


def test_real_training_then_inference_with_names_picked(server, real_files):
    prompt, edits = real_arch.swap_names(load("train_lora.json"))
    assert len(edits) == 4, edits  # model, text encoder, VAE, dataset folder
    # Not a name: the shipped 1000 steps took 2.5 min (0.33.0) and 8 min (0.3.75) of this test on 2 shared CPU
    # cores, over the suite's budget; 11 steps run the same nodes (the browser test runs 12: a different prompt,
    # so neither is served from ComfyUI's cache of the other in one session).
    trained = train_briefly(server, prompt, files=real_files, lora_prefix="my_lora", shipped_steps=1000,
                            base_model_version="flux1", head_dim=None)
    assert trained.untrained() == set(), "the LoRA did not train"

    infer, edits = real_arch.swap_names(load("inference_matching_scale.json"), lora_name=trained.lora_name)
    assert len(edits) == 5, edits  # model, text encoder, VAE, LoRA; latent size
    pixels = image(server, infer, "with_lora")
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
    controls(server, infer, image, pixels)
