"""In the page: the shipped SDXL training workflow, dropped as a user would, runs with Run after picking the
checkpoint and the dataset folder; then the shipped SDXL inference workflow, with the checkpoint and the LoRA
just saved picked, samples an image that the LoRA changes. The checkpoint is tests/sdxl_standin.py's tiny SDXL
(real-size CLIP-L, CLIP-G and VAE), loaded by the stock CheckpointLoaderSimple (see that file for the one
test-only addition: ComfyUI's detection list knows the tiny UNet). What is not a name pick (time on a CPU only):
the training steps (12 of the shipped 1500), the bucket resolution and the empty latent (64 of 1024 px)."""
from __future__ import annotations

import os
import sys

import pytest
from real_workflow_page import api, assert_queues, drop, image, infer_in_page, number, pick, train_in_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import real_arch  # noqa: E402
from real_workflow_lib import write_files  # noqa: E402


@pytest.fixture(scope="module")
def sdxl_files(comfy_server):
    return write_files(comfy_server, "real_arch.py", args=("--sdxl",))


def test_sdxl_workflows_run_after_picking_names(comfy_page, comfy_server, sdxl_files):
    page = comfy_page
    page.console(clear=True)
    ids = drop(page, "train_lora_sdxl.json")
    pick(page, [(ids["CheckpointLoaderSimple"], "ckpt_name", real_arch.SDXL_NAME),
                (ids["LoadImageTextDataSetFromFolder"], "folder", real_arch.DATASET)])
    # Not names (time only): 12 of the shipped 1500 steps; buckets of 64 px (the test images) instead of 1024.
    number(page, [(ids["PrecisionTrainLoRA"], "steps", 12), (ids["PrecisionResolutionBuckets"], "resolution", 64)])
    want, edits = real_arch.swap_names(api("train_lora_sdxl.json"))
    assert len(edits) == 3, edits  # checkpoint, folder; resolution
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = 12
    assert_queues(page, want)
    lora_name, _ = train_in_page(page, comfy_server, ids, files=sdxl_files, lora_prefix="my_sdxl_lora", steps=12,
                                 base_model_version="sdxl", shot="real_sdxl_train_finished")

    ids = drop(page, "inference_sdxl.json")
    pick(page, [(ids["CheckpointLoaderSimple"], "ckpt_name", real_arch.SDXL_NAME),
                (ids["PrecisionLoadLoRA"], "lora_name", lora_name)])
    # not a name (time only): 64 of the shipped 1024
    number(page, [(ids["EmptyLatentImage"], side, 64) for side in ("width", "height")])
    want, edits = real_arch.swap_names(api("inference_sdxl.json"), lora_name=lora_name)
    assert len(edits) == 3, edits  # checkpoint, LoRA; latent size
    assert_queues(page, want)
    with_lora = infer_in_page(page, comfy_server, ids, image, ids["SaveImage"], "real_sdxl_infer_image")
    assert with_lora.shape == (64, 64, 3)
