"""Qwen-Image real workflows (docs/workflows.md): train_lora_qwen_image.json and inference_qwen_image.json.

Loaded by workflows/build.py (``SPECS``). Model, text encoder and VAE come from ComfyUI's own loaders with the
file names of ComfyUI's own Qwen-Image template (image_qwen_image.json of comfyui_workflow_templates: UNETLoader
qwen_image_fp8_e4m3fn, CLIPLoader qwen_2.5_vl_7b_fp8_scaled type qwen_image, VAELoader qwen_image_vae); the
inference graph samples as that template does (ModelSamplingAuraFlow shift 3.1, KSampler euler / simple, 20
steps, cfg 2.5, EmptySD3LatentImage 1328 x 1328, an empty negative prompt).
"""
from __future__ import annotations

from graph_parts import (bucketed_folder, loaders_train_links, node as _node, patch_and_attach,
                         train_save_graph, train_settings)

MODEL = "qwen_image_fp8_e4m3fn.safetensors"
TEXT_ENCODER = "qwen_2.5_vl_7b_fp8_scaled.safetensors"
VAE = "qwen_image_vae.safetensors"
DATASET = "my_lora_dataset"
LORA_PREFIX = "precision_lora/my_qwen_image_lora"
LORA = LORA_PREFIX + "_00001_.safetensors"  # Save LoRA's first file (ComfyUI's counter)
SHIFT = 3.1  # the template's ModelSamplingAuraFlow shift

TRAIN_NOTE = (
    "Train a Qwen-Image LoRA on your own images (real training)\n\n"
    "To run it, pick names only:\n"
    "1. Load Diffusion Model: your Qwen-Image file in models/diffusion_models (" + MODEL + ";\n"
    "   qwen_image_bf16.safetensors works too; its weights take twice the memory: 41 GB).\n"
    "2. Load CLIP: Qwen2.5-VL-7B in models/text_encoders (" + TEXT_ENCODER + "), type qwen_image.\n"
    "3. Load VAE: the Qwen-Image VAE in models/vae (" + VAE + ").\n"
    "4. Load Image and Text Dataset from Folder: a folder under ComfyUI's input/ with your images (png, jpg,\n"
    "   webp) and, beside each, a .txt of the same name holding its caption (trigger word included).\n\n"
    "Then Run. Precision Resolution Buckets fits every image to about 1024 x 1024 pixels (aspect kept, sides\n"
    "multiples of 16 from the model); Cached Training Dataset (Precision) encodes each image with the VAE and each\n"
    "caption with Qwen2.5-VL once and keeps them in <ComfyUI>/cache/precision_lora/dataset (later runs read them\n"
    "back; a changed image, caption or encoder is encoded again).\n"
    "Attach LoRA: rank 16, targets 'attention' = the image stream's to_q/to_k/to_v/to_out.0 and the text stream's\n"
    "add_q/k/v_proj/to_add_out of each of the 60 blocks ('attention_mlp' adds img_mlp/txt_mlp, 'community' every\n"
    "Linear of the blocks, 'all' every Linear).\n"
    "Train Settings: AdamW at 1e-4, timesteps logit-normal (Qwen-Image is a flow model; target auto), a checkpoint\n"
    "every 250 steps into models/loras/my_qwen_image_lora/ (resume_from continues there).\n"
    "vram_budget_gb=auto fits the run to your GPU: before loading the model, Train LoRA estimates its step and\n"
    "turns on gradient checkpointing, block inputs in host memory and block swap as far as needed, and shows the\n"
    "plan on the node (fp8, 1024 px, rank 16: ~24 GiB with checkpointing; 16 GiB with 22 of 59 blocks swapped;\n"
    "docs/memory.md). Set a number of GiB to leave room for other programs, or 0 to choose yourself.\n"
    "Patch Attention sets the softmax scale of every attention call; it is recorded in the LoRA.\n"
    "Save LoRA writes models/loras/" + LORA + " on the first run (the counter grows; it never\n"
    "overwrites) with its training state beside it; Loss Graph saves the learning curve (PNG + CSV).\n"
    "To use the LoRA: inference_qwen_image.json (or ComfyUI's LoraLoaderModelOnly)."
)

INFER_NOTE = (
    "Generate with a Qwen-Image LoRA exactly as it was trained\n\n"
    "To run it, pick names only: your Qwen-Image file (Load Diffusion Model), Qwen2.5-VL-7B (Load CLIP, type\n"
    "qwen_image), the Qwen-Image VAE (Load VAE) and the LoRA train_lora_qwen_image.json saved (Load LoRA\n"
    "(Precision): " + LORA + " after its first run). Write your prompt (with the\n"
    "trigger word) in the upper CLIP Text Encode; the lower one is the (empty) negative prompt.\n\n"
    "As ComfyUI's own Qwen-Image template: ModelSamplingAuraFlow shift 3.1 (raise it if images come out blurry or\n"
    "dark), Empty SD3 Latent Image 1328 x 1328, KSampler euler / simple, 20 steps, cfg 2.5 (cfg 1.0 is faster and\n"
    "ignores the negative prompt). VAE Decode turns the latent into the image, Save Image writes it.\n"
    "Load LoRA (Precision) applies the attention settings recorded in the file (softmax scale, backend):\n"
    "attention='apply_recorded'. mode='fp32' keeps the LoRA unmerged in fp32 (exact); 'merge' folds it in."
)

LOAD_LORA = {"lora_name": LORA, "strength": 1.0, "mode": "fp32", "attention": "apply_recorded",
             "override_backend": "auto", "override_scale_mode": "default", "override_scale_value": 1.0}


def train_spec() -> dict:
    return {
        "nodes": [
            _node(1, "UNETLoader", [0, 0], {"unet_name": MODEL, "weight_dtype": "default"}, size=[340, 110]),
            *patch_and_attach(2, 3),
            train_settings(4, timestep_sampling="logit_normal"),
            _node(5, "CLIPLoader", [0, 450], {"clip_name": TEXT_ENCODER, "type": "qwen_image", "device": "default"},
                  size=[340, 130]),
            _node(6, "VAELoader", [0, 620], {"vae_name": VAE}, size=[340, 60]),
            *bucketed_folder((7, 8, 9), DATASET, (720, 840, 1050)),
            *train_save_graph((10, 11, 12), steps=1000, name="my_qwen_image_lora", lora_prefix=LORA_PREFIX, save_y=760),
            _node(13, "Note", [1200, 0], {"text": TRAIN_NOTE}, size=[820, 700]),
        ],
        "links": loaders_train_links,
    }


def inference_spec() -> dict:
    return {
        "nodes": [
            _node(1, "UNETLoader", [0, 0], {"unet_name": MODEL, "weight_dtype": "default"}, size=[340, 110]),
            _node(2, "PrecisionLoadLoRA", [400, 0], LOAD_LORA, size=[360, 420]),
            _node(3, "CLIPLoader", [0, 150], {"clip_name": TEXT_ENCODER, "type": "qwen_image", "device": "default"},
                  size=[340, 130]),
            _node(4, "CLIPTextEncode", [0, 320], {"text": "a photo of sks"}, size=[340, 160], title="Positive"),
            _node(5, "CLIPTextEncode", [0, 520], {"text": ""}, size=[340, 120], title="Negative (empty)"),
            _node(6, "ModelSamplingAuraFlow", [400, 470], {"shift": SHIFT}, size=[360, 60]),
            _node(7, "EmptySD3LatentImage", [400, 570], {"width": 1328, "height": 1328, "batch_size": 1},
                  size=[360, 110]),
            _node(8, "KSampler", [800, 0], {
                "seed": 0, "steps": 20, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
                control={"seed": "fixed"}, size=[300, 270]),
            _node(9, "VAELoader", [800, 310], {"vae_name": VAE}, size=[300, 60]),
            _node(10, "VAEDecode", [800, 410], size=[300, 50]),
            _node(11, "SaveImage", [1140, 0], {"filename_prefix": "precision_lora/inference_qwen_image"},
                  size=[400, 440]),
            _node(12, "Note", [0, 720], {"text": INFER_NOTE}, size=[1100, 280]),
        ],
        "links": [
            (1, 0, 2, "model"), (2, 0, 6, "model"), (6, 0, 8, "model"), (3, 0, 4, "clip"), (3, 0, 5, "clip"),
            (4, 0, 8, "positive"), (5, 0, 8, "negative"), (7, 0, 8, "latent_image"),
            (8, 0, 10, "samples"), (9, 0, 10, "vae"), (10, 0, 11, "images"),
        ],
    }


SPECS = {"train_lora_qwen_image": train_spec, "inference_qwen_image": inference_spec}
