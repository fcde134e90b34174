"""In the page: the shipped Flux.2 klein training workflow, dropped as a user would, runs with Run after picking
the diffusion model, the text encoder, the VAE and the dataset folder; then the shipped klein inference
workflow, with the same files and the LoRA just saved picked, samples an image that the LoRA changes. The files
are tests/flux2_klein_standin.py's (a tiny klein DiT that stock detection loads, the tiny Qwen3-4B of
tests/z_image_standin.py, the Flux.2 VAE at its real size), loaded by the stock UNETLoader, CLIPLoader (type
flux2) and VAELoader. What is not a name pick (time on a CPU only): the training steps (12 of the shipped 1500),
the sampling steps (2 of 20), the bucket resolution and the latent / scheduler size (64 of 1024 px).
ComfyUI 0.3.75 has no Flux.2 klein: skipped there with the reason read from that ComfyUI's source."""
from __future__ import annotations

import os
import sys

import pytest
from real_workflow_page import api, assert_queues, drop, image, infer_in_page, number, pick, train_in_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import flux2_klein_standin as standin  # noqa: E402


@pytest.fixture(scope="module")
def klein_files(comfy_server):
    return standin.files_for(comfy_server)


def _files(ids: dict) -> list[tuple]:
    return [(ids["UNETLoader"], "unet_name", standin.KLEIN_NAME),
            (ids["CLIPLoader"], "clip_name", standin.TEXT_ENCODER_NAME),
            (ids["VAELoader"], "vae_name", standin.VAE_NAME)]


def test_klein_workflows_run_after_picking_names(comfy_page, comfy_server, klein_files):
    page = comfy_page
    page.console(clear=True)
    ids = drop(page, "train_lora_flux2_klein.json")
    pick(page, [*_files(ids), (ids["LoadImageTextDataSetFromFolder"], "folder", standin.DATASET)])
    # Not names (time only): 12 of the shipped 1500 steps; buckets of 64 px (the test images) instead of 1024.
    number(page, [(ids["PrecisionTrainLoRA"], "steps", 12), (ids["PrecisionResolutionBuckets"], "resolution", 64)])
    want, edits = standin.swap_names(api("train_lora_flux2_klein.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, folder; resolution
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = 12
    assert_queues(page, want)
    lora_name, modules = train_in_page(page, comfy_server, ids, files=klein_files, lora_prefix="my_klein_lora",
                                       steps=12, base_model_version="flux2", shot="real_klein_train_finished")
    assert len(modules) == standin.ATTENTION_TARGETS, sorted(modules)

    ids = drop(page, "inference_flux2_klein.json")
    pick(page, [*_files(ids), (ids["PrecisionLoadLoRA"], "lora_name", lora_name)])
    # not names (time only): 64 of the shipped 1024 px, 2 of the shipped 20 steps
    number(page, [(ids[node], side, 64) for node in ("EmptyFlux2LatentImage", "Flux2Scheduler")
                  for side in ("width", "height")] + [(ids["Flux2Scheduler"], "steps", 2)])
    want, edits = standin.swap_names(api("inference_flux2_klein.json"), lora_name=lora_name)
    assert len(edits) == 6, edits  # model, text encoder, VAE, LoRA; latent and scheduler size
    want[str(ids["Flux2Scheduler"])]["inputs"]["steps"] = 2
    assert_queues(page, want)
    with_lora = infer_in_page(page, comfy_server, ids, image, ids["SaveImage"], "real_klein_infer_image")
    assert with_lora.shape == (64, 64, 3)
