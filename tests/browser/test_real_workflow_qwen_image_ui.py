"""In the page: the shipped Qwen-Image training workflow, dropped as a user would, runs with Run after picking the
diffusion model, the text encoder, the VAE and the dataset folder; then the shipped Qwen-Image inference workflow,
with the same files and the LoRA just saved picked, samples an image that the LoRA changes.

The files are tests/qwen_image_standin.py's: a tiny Qwen-Image transformer (ComfyUI's own class, 2 blocks), the
Qwen-Image VAE (Wan 2.1) at its real size, and ComfyUI's own Qwen2.5-VL-7B text model class at a tiny config
(width 64, 2 layers; the real tokenizer): the 7 B encoder is unaffordable on a test machine. Stock detection knows
neither tiny model, so the session server loads that file as a test-only custom node adding their configs; the
loaders (UNETLoader, CLIPLoader type qwen_image, VAELoader) and everything after them are stock. What is not a
name pick (time on a CPU only): the training steps (12 of the shipped 1000), the bucket resolution and the empty
latent (64 of 1024 and 1328 px), the sampling steps (4 of 20)."""
from __future__ import annotations

import os
import sys

import pytest
from real_workflow_page import api, assert_queues, drop, image, infer_in_page, number, pick, train_in_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "workflows"))
import qwen_image_standin as standin  # noqa: E402
import spec_qwen_image as spec  # noqa: E402
from real_workflow_lib import write_files  # noqa: E402

SHIPPED = {("UNETLoader", "unet_name"): spec.MODEL, ("CLIPLoader", "clip_name"): spec.TEXT_ENCODER,
           ("VAELoader", "vae_name"): spec.VAE, ("LoadImageTextDataSetFromFolder", "folder"): spec.DATASET}


@pytest.fixture(scope="module")
def qwen_files(comfy_server):
    if standin.link_cached(comfy_server.base_dir):
        return comfy_server.base_dir
    return write_files(comfy_server, "qwen_image_standin.py")


def _name_picks(ids: dict) -> list[tuple]:
    return [(ids[kind], name, value) for (kind, name), value in standin.PICKS.items() if kind in ids]


def test_qwen_image_workflows_run_after_picking_names(comfy_page, comfy_server, qwen_files):
    page = comfy_page
    page.console(clear=True)
    ids = drop(page, "train_lora_qwen_image.json")
    picks = _name_picks(ids)
    assert len(picks) == 4, picks  # diffusion model, text encoder, VAE, dataset folder
    pick(page, picks)
    # Not names (time only): 12 of the shipped 1000 steps; buckets of 64 px (the test images) instead of 1024.
    number(page, [(ids["PrecisionTrainLoRA"], "steps", 12), (ids["PrecisionResolutionBuckets"], "resolution", 64)])
    want, edits = standin.swap_names(api("train_lora_qwen_image.json"), SHIPPED)
    assert len(edits) == 5, edits  # 4 names; resolution
    want[str(ids["PrecisionTrainLoRA"])]["inputs"]["steps"] = 12
    assert_queues(page, want)
    lora_name, _ = train_in_page(page, comfy_server, ids, files=qwen_files, lora_prefix="my_qwen_image_lora",
                                 steps=12, base_model_version="qwen_image", shot="real_qwen_image_train_finished")

    ids = drop(page, "inference_qwen_image.json")
    picks = _name_picks(ids) + [(ids["PrecisionLoadLoRA"], "lora_name", lora_name)]
    assert len(picks) == 4, picks  # diffusion model, text encoder, VAE, LoRA
    pick(page, picks)
    # not names (time only): 64 of the shipped 1328 px, 4 of the 20 steps
    number(page, [(ids["EmptySD3LatentImage"], side, 64) for side in ("width", "height")]
           + [(ids["KSampler"], "steps", 4)])
    want, edits = standin.swap_names(api("inference_qwen_image.json"), SHIPPED, lora_name=lora_name)
    assert len(edits) == 5, edits  # 4 names; latent size
    want[str(ids["KSampler"])]["inputs"]["steps"] = 4
    assert_queues(page, want)
    with_lora = infer_in_page(page, comfy_server, ids, image, ids["SaveImage"], "real_qwen_image_infer_image")
    assert with_lora.shape == (64, 64, 3)
