"""Precision Load Image Dataset from the page (issue 23 items 4, 5): a graph dropped as a user drops a file,
Run pressed, and the dataset report (every decision and missing caption, by file) reaches the page's
Preview Any node exactly as the server computed it."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from test_chart_binding_ui import _drop_api_text
from test_training_ui import _run_from_page

pytestmark = pytest.mark.browser

FOLDER = "image_dataset_ui"

PREVIEW_TEXT = """() => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === "PreviewAny");
  const w = node?.widgets?.find((x) => typeof x.value === "string" && x.value.includes("images from input/"));
  return w ? w.value : false;
}"""


def _folder(base_dir: str) -> None:
    path = os.path.join(base_dir, "input", FOLDER)
    os.makedirs(path, exist_ok=True)
    Image.fromarray(np.full((32, 32), 40000, dtype=np.uint16)).save(os.path.join(path, "a_gray16.png"))
    clear = np.zeros((32, 32, 4), dtype=np.uint8)
    clear[:, 16:] = (255, 0, 0, 255)
    Image.fromarray(clear, "RGBA").save(os.path.join(path, "b_alpha.png"))
    Image.new("RGB", (32, 32), (0, 0, 255)).save(os.path.join(path, "c_nocap.png"))
    for stem in ("a_gray16", "b_alpha"):
        with open(os.path.join(path, stem + ".txt"), "w", encoding="utf-8") as f:
            f.write(f"a photo of {stem}")


def test_load_image_dataset_report_shows_on_the_page(comfy_page, comfy_server):
    _folder(comfy_server.base_dir)
    prompt = {
        "1": {"class_type": "PrecisionLoadImageDataset", "inputs": {
            "folder": FOLDER, "alpha": "white", "animated": "first_frame", "missing_caption": "train_empty"}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 2]}},
    }
    _drop_api_text(comfy_page, "image_dataset_api.json", json.dumps(prompt))
    entry = _run_from_page(comfy_page, comfy_server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:2000]
    sent = entry["prompt"][2]["1"]["inputs"]
    assert sent["folder"] == FOLDER and sent["alpha"] == "white", sent  # the page queued the dropped values
    (report,) = entry["outputs"]["2"]["text"]
    lines = report.splitlines()
    assert lines[0] == f"3 images from input/{FOLDER} (3 files, name order): 2 with a caption, 1 without", lines
    assert "b_alpha.png: transparent pixels (50 % of the pixels) composited on white" in lines
    assert "c_nocap.png: no caption (c_nocap.txt not found): trains on the empty caption" in lines
    assert comfy_page.wait_for(PREVIEW_TEXT, timeout=30) == report
    assert comfy_page.pack_errors() == []


MASKS = "image_dataset_ui_masks"
ATTACH = dict(rank=4, alpha=4.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
              dry_run=False, init_lora="none")


def _half_opaque(base_dir: str, folder: str, name: str, colour: tuple[int, int, int], caption: str) -> None:
    """One 64x64 RGBA image ``<name>.png`` in ``input/<folder>``: its top half opaque ``colour``, the rest
    transparent (its alpha channel is the mask), with its caption beside it."""
    path = os.path.join(base_dir, "input", folder)
    os.makedirs(path, exist_ok=True)
    top = np.zeros((64, 64, 4), dtype=np.uint8)
    top[:32] = (*colour, 255)
    Image.fromarray(top, "RGBA").save(os.path.join(path, f"{name}.png"))
    with open(os.path.join(path, f"{name}.txt"), "w", encoding="utf-8") as f:
        f.write(caption)


def _alpha_masked_dataset(folder: str) -> dict:
    """Nodes "1" and "2" of an API prompt: Precision Load Image Dataset (mask = alpha) on ``folder``, then
    Resolution Buckets (64 px) with its masks."""
    return {
        "1": {"class_type": "PrecisionLoadImageDataset", "inputs": {
            "folder": folder, "alpha": "white", "animated": "first_frame", "missing_caption": "train_empty",
            "mask": "alpha"}},
        "2": {"class_type": "PrecisionResolutionBuckets", "inputs": {
            "images": ["1", 0], "texts": ["1", 1], "resolution": 64, "multiple": 16, "max_upscale": 2.0,
            "masks": ["1", 3]}},
    }


def test_masked_training_with_the_best_validation_lora_from_the_page(comfy_page, comfy_server):
    """Masked loss and keep_best_validation from the page: Load Image Dataset's mask (alpha) through Resolution
    Buckets' masks into Train LoRA's mask, Train Settings' unmasked_weight and keep_best_validation; the page queues
    the links and values as dropped and the saved LoRA says what the server did with them."""
    from training.settings import TrainSettings

    _half_opaque(comfy_server.base_dir, MASKS, "n", (30, 30, 200), "n")
    settings = TrainSettings(learning_rate=1e-2, unmasked_weight=0.25, validate_every_n_steps=1,
                             validation_fraction=0.5, keep_best_validation=True).to_dict()
    prompt = {
        **_alpha_masked_dataset(MASKS),
        "3": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {
            "model_name": "precision_tiny_flux1_dev.safetensors", "weight_dtype": "fp32"}},
        "4": {"class_type": "PrecisionAttachLoRA", "inputs": {"model": ["3", 0], **ATTACH}},
        "5": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["3", 0], "text": "sks", "seed": 0,
                                                                    "tokens": 8}},
        "6": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["3", 0], "width": 64, "height": 64,
                                                              "batch_size": 2, "seed": 1}},
        "7": {"class_type": "PrecisionTrainSettings", "inputs": settings},
        "8": {"class_type": "PrecisionTrainLoRA", "inputs": {
            "model": ["4", 0], "latents": ["6", 0], "conditioning": ["5", 0], "settings": ["7", 0], "steps": 3,
            "seed": 0, "name": "ui_masks", "mask": ["2", 3]}},
        "9": {"class_type": "PrecisionSaveLoRA", "inputs": {
            "model": ["8", 0], "filename_prefix": "ui_masks/ui_masks", "folder": "loras", "save_dtype": "fp32",
            "key_style": "auto", "use_counter": True, "overwrite": False}},
    }
    _drop_api_text(comfy_page, "masked_training_api.json", json.dumps(prompt))
    entry = _run_from_page(comfy_page, comfy_server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:2000]
    sent = entry["prompt"][2]
    assert sent["8"]["inputs"]["mask"] == ["2", 3] and sent["2"]["inputs"]["masks"] == ["1", 3], sent
    assert sent["1"]["inputs"]["mask"] == "alpha" and sent["7"]["inputs"]["unmasked_weight"] == 0.25 and \
        sent["7"]["inputs"]["keep_best_validation"] is True, sent
    md = _metadata(entry["outputs"]["9"]["text"][0])
    assert md["precision_lora_mask"] == "2 of 2 samples masked, unmasked_weight 0.25", md
    best, step = md["precision_lora_validation_best"].split(" at step ")
    assert md["precision_lora_kept"] == (f"the LoRA of step {step} of 3: the lowest validation loss ({best}; "
                                         "keep_best_validation)"), md
    assert comfy_page.pack_errors() == []



def _metadata(path: str) -> dict:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return f.metadata()


CACHE_MASKS = "image_dataset_ui_cache_masks"


def test_masks_through_the_cached_dataset_from_the_page(comfy_page, comfy_server):
    """Cached Training Dataset's masks from the page: Load Image Dataset (mask = alpha) → Resolution Buckets' masks →
    the cache node's masks (with Load VAE and Load CLIP: a tiny TAESD VAE, tests/real_arch.py's real-size CLIP-L),
    its latents into Train LoRA without Train LoRA's own mask, outside_mask gray. The page queues the link and the
    widget as dropped; the node's report says the mask rides on its latent and the pixels outside it were set to
    gray, and the saved LoRA says its one sample trained masked that way."""
    import subprocess
    import sys

    import real_arch
    from server_harness import server_env

    root, base = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), comfy_server.base_dir
    vae = os.path.join(base, "models", "vae", "precision_ui_cache_masks_taesd.safetensors")
    os.makedirs(os.path.dirname(vae), exist_ok=True)
    for cmd in ([os.path.join(root, "tests", "real_arch.py"), base], [os.path.join(root, "tests", "preview_vae.py"), vae]):
        subprocess.run([sys.executable, *cmd], check=True, env=server_env(), timeout=600)
    _half_opaque(base, CACHE_MASKS, "t", (200, 30, 30), "a photo of sks")
    prompt = {
        **_alpha_masked_dataset(CACHE_MASKS),
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": os.path.basename(vae)}},
        "4": {"class_type": "CLIPLoader", "inputs": {"clip_name": real_arch.CLIP_L_NAME, "type": "stable_diffusion",
                                                     "device": "default"}},
        "5": {"class_type": "PrecisionCachedTrainingDataset", "inputs": {
            "images": ["2", 0], "vae": ["3", 0], "clip": ["4", 0], "texts": ["2", 1], "cache": "off",
            "masks": ["2", 3], "outside_mask": "gray"}},
        "6": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {
            "model_name": real_arch.TINY_FLUX_NAME, "weight_dtype": "fp32"}},
        "7": {"class_type": "PrecisionAttachLoRA", "inputs": {"model": ["6", 0], **ATTACH}},
        "8": {"class_type": "PrecisionTrainLoRA", "inputs": {
            "model": ["7", 0], "latents": ["5", 0], "conditioning": ["5", 1], "steps": 2, "seed": 0,
            "name": "ui_cache_masks"}},
        "9": {"class_type": "PrecisionSaveLoRA", "inputs": {
            "model": ["8", 0], "filename_prefix": "ui_cache_masks/ui_cache_masks", "folder": "loras",
            "save_dtype": "fp32", "key_style": "auto", "use_counter": True, "overwrite": False}},
    }
    _drop_api_text(comfy_page, "cache_masks_api.json", json.dumps(prompt))
    entry = _run_from_page(comfy_page, comfy_server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:2000]
    sent = entry["prompt"][2]
    assert sent["5"]["inputs"]["masks"] == ["2", 3] and "mask" not in sent["8"]["inputs"], sent
    assert sent["5"]["inputs"]["outside_mask"] == "gray", sent
    (report,) = entry["outputs"]["5"]["text"]
    assert "1 masks (1 distinct, on their latents as noise_mask): 1 computed, 0 from cache" in report, report
    assert "pixels outside the masks set to gray before encoding" in report, report
    md = _metadata(entry["outputs"]["9"]["text"][0])
    assert md["precision_lora_mask"] == ("1 of 1 samples masked, unmasked_weight 0, pixels outside the masks set to "
                                         "gray before encoding"), md
    assert comfy_page.pack_errors() == []
