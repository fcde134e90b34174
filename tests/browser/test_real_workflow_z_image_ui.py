"""In the page: the shipped Z-Image training workflow, dropped as a user would, runs with Run after picking the
diffusion model, the text encoder, the VAE and the dataset folder; then the shipped Z-Image inference workflow,
with the same files and the LoRA just saved picked, samples an image that the LoRA changes.

Stand-ins (see tests/e2e/test_real_workflow_z_image.py and tests/z_image_standin.py): a tiny Z-Image and a tiny
Qwen3-4B built with ComfyUI's own classes (the real 6 B and 4 B are unaffordable on a test machine; the
session server registers their tiny configs with ComfyUI's detection as a test-only custom node) and the
Flux.1 VAE at its real size, each loaded by the stock UNETLoader / CLIPLoader / VAELoader. What is not a name
pick (time on a CPU only): the training steps (12 of the shipped 2000), the bucket resolution and the empty
latent (64 of 1024 px)."""
from __future__ import annotations

import os
import sys

import pytest
from real_workflow_page import api, assert_queues, drop, image, infer_in_page, number, pick, train_in_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from real_workflow_lib import write_files  # noqa: E402
from test_real_workflow_z_image import STANDIN, swap_names  # noqa: E402


@pytest.fixture(scope="module")
def z_image_files(comfy_server):
    return write_files(comfy_server, "real_arch.py", "z_image_standin.py")


def _files(ids: dict) -> list[tuple]:
    return [(ids["UNETLoader"], "unet_name", STANDIN["unet_name"]),
            (ids["CLIPLoader"], "clip_name", STANDIN["clip_name"]),
            (ids["VAELoader"], "vae_name", STANDIN["vae_name"])]


def test_z_image_workflows_run_after_picking_names(comfy_page, comfy_server, z_image_files):
    page = comfy_page
    page.console(clear=True)
    ids = drop(page, "train_lora_z_image.json")
    pick(page, [*_files(ids), (ids["LoadImageTextDataSetFromFolder"], "folder", STANDIN["folder"])])
    # Not names (time only): 12 of the shipped 2000 steps; buckets of 64 px (the test images) instead of 1024.
    number(page, [(ids["PrecisionTrainLoRA"], "steps", 12), (ids["PrecisionResolutionBuckets"], "resolution", 64)])
    want, edits = swap_names(api("train_lora_z_image.json"))
    assert len(edits) == 5, edits  # model, text encoder, VAE, folder; resolution
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = 12
    assert_queues(page, want)
    lora_name, _ = train_in_page(page, comfy_server, ids, files=z_image_files, lora_prefix="my_z_image_lora",
                                 steps=12, base_model_version="lumina2", shot="real_z_image_train_finished")

    ids = drop(page, "inference_z_image.json")
    pick(page, [*_files(ids), (ids["PrecisionLoadLoRA"], "lora_name", lora_name)])
    # not a name (time only): 64 of the shipped 1024
    number(page, [(ids["EmptySD3LatentImage"], side, 64) for side in ("width", "height")])
    want, edits = swap_names(api("inference_z_image.json"), lora_name=lora_name)
    assert len(edits) == 5, edits  # model, text encoder, VAE, LoRA; latent size
    assert_queues(page, want)
    with_lora = infer_in_page(page, comfy_server, ids, image, ids["SaveImage"], "real_z_image_infer_image")
    assert with_lora.shape == (64, 64, 3)
