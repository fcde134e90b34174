"""In the page: the shipped Wan 2.2 5B training workflow, dropped as a user would, runs with Run after picking the
model, text encoder, VAE and dataset folder; then the shipped Wan 2.2 5B inference workflow, with those and the LoRA
just saved picked, samples a video that the LoRA changes. The files are tests/wan22_5b_standin.py's (a tiny Wan 2.2
5B diffusion model that stock detection loads, the Wan 2.2 VAE at its real size, a tiny umt5-xxl that stock
CLIPLoader type wan loads through the stand-in's test-only registration; see that file). What is not a name pick
(time on a CPU only): the training steps (6 of the shipped 1500), the bucket resolution (64 of 960 px), the video
latent (64 x 64, 1 frame of the shipped 1280 x 704, 121) and the sampling steps (4 of 20)."""
from __future__ import annotations

import os
import sys

import pytest
from real_workflow_page import api, assert_queues, drop, frames, infer_in_page, number, pick, train_in_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import wan22_5b_standin as standin  # noqa: E402
from real_workflow_lib import write_files  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def wan_files(comfy_server):
    return write_files(comfy_server, "wan22_5b_standin.py")


def _files(ids: dict) -> list[tuple]:
    return [(ids["UNETLoader"], "unet_name", standin.MODEL_NAME), (ids["CLIPLoader"], "clip_name", standin.CLIP_NAME),
            (ids["VAELoader"], "vae_name", standin.VAE_NAME)]


def test_wan22_5b_workflows_run_after_picking_names(comfy_page, comfy_server, wan_files):
    page = comfy_page
    page.console(clear=True)
    ids = drop(page, "train_lora_wan22_5b.json")
    pick(page, [*_files(ids), (ids["LoadImageTextDataSetFromFolder"], "folder", standin.DATASET)])
    number(page, [(ids["PrecisionTrainLoRA"], "steps", STEPS), (ids["PrecisionResolutionBuckets"], "resolution", 64)])
    want, edits = standin.swap_names(api("train_lora_wan22_5b.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, folder; resolution
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = STEPS
    assert_queues(page, want)
    lora_name, _ = train_in_page(page, comfy_server, ids, files=wan_files, lora_prefix="my_wan22_5b_lora",
                                 steps=STEPS, base_model_version="WAN22_T2V", shot="real_wan22_5b_train_finished")

    ids = drop(page, "inference_wan22_5b.json")
    pick(page, [*_files(ids), (ids["PrecisionLoadLoRA"], "lora_name", lora_name)])
    latent = ids["Wan22ImageToVideoLatent"]
    number(page, [(latent, "width", 64), (latent, "height", 64), (latent, "length", 1), (ids["KSampler"], "steps", 4)])
    want, edits = standin.swap_names(api("inference_wan22_5b.json"), lora_name=lora_name)
    assert len(edits) == 5, edits  # model, text encoder, VAE, LoRA; latent size and frames
    want[str(ids["KSampler"])]["inputs"]["steps"] = 4
    assert_queues(page, want)
    with_lora = infer_in_page(page, comfy_server, ids, frames, ids["SaveAnimatedWEBP"], "real_wan22_5b_infer_video")
    assert with_lora.shape == (1, 64, 64, 3), with_lora.shape
