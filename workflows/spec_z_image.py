"""Z-Image (Turbo) workflows: train_lora_z_image.json and inference_z_image.json (loaded by workflows/build.py).

Z-Image is a Lumina-2-style single-stream DiT (ComfyUI's ``ZImage`` / ``NextDiT``, 6 B parameters) with the
Qwen3-4B text encoder and the Flux.1 VAE. Loaders, file names and sampling are those of ComfyUI's own template
"Z-Image-Turbo Text to Image" (comfyui_workflow_templates: image_z_image_turbo.json): UNETLoader
z_image_turbo_bf16.safetensors, CLIPLoader qwen_3_4b.safetensors (type lumina2), VAELoader ae.safetensors,
ModelSamplingAuraFlow shift 3, KSampler 8 steps, cfg 1, res_multistep / simple, EmptySD3LatentImage 1024.
"""
from __future__ import annotations

from graph_parts import (bucketed_folder, loaders_train_links, node as _node, note as _note, patch_and_attach,
                         train_save_graph, train_settings)


MODEL = "z_image_turbo_bf16.safetensors"
TEXT_ENCODER = "qwen_3_4b.safetensors"
TEXT_ENCODER_TYPE = "lumina2"
VAE = "ae.safetensors"
DATASET = "my_lora_dataset"
SHIFT = 3.0  # Z-Image's sampling shift (ComfyUI's ZImage config and the template's ModelSamplingAuraFlow)
LORA_PREFIX = "precision_lora/my_z_image_lora"
LORA = LORA_PREFIX + "_00001_.safetensors"

TRAIN_NOTE = (
    "Train a Z-Image LoRA on your own images (Z-Image Turbo; Z-Image base trains the same way)\n\n"
    "To run it, pick names only:\n"
    "1. Load Diffusion Model: your Z-Image file in models/diffusion_models (" + MODEL + ";\n"
    "   for the base model pick z_image_bf16.safetensors).\n"
    "2. Load CLIP: Qwen3-4B from models/text_encoders (" + TEXT_ENCODER + "), type " + TEXT_ENCODER_TYPE + ".\n"
    "3. Load VAE: the Flux.1 VAE from models/vae (" + VAE + ").\n"
    "4. Load Image and Text Dataset from Folder: a folder under ComfyUI's input/ with your images (png, jpg,\n"
    "   webp) and, beside each, a .txt of the same name holding its caption (trigger word included).\n\n"
    "Then Run. Precision Resolution Buckets fits every image to about 1024 x 1024 pixels (aspect kept, sides\n"
    "multiples of 16: the VAE's 8 x Z-Image's 2 x 2 patches), Cached Training Dataset (Precision) encodes each\n"
    "image with the VAE and each caption with Qwen3-4B once and keeps them in <ComfyUI>/cache/precision_lora/\n"
    "dataset (later Runs and restarts read them back).\n"
    "Attach LoRA: rank 16, targets 'attention' = the fused qkv and out projections of every block (main layers,\n"
    "noise and context refiners); 'attention_mlp' adds the feed-forwards.\n"
    "Train Settings: AdamW at 1e-4, timesteps sampled with shift 3 (Z-Image's own sampling shift), a\n"
    "checkpoint every 250 steps into models/loras/my_z_image_lora/ (resume_from continues there).\n"
    "vram_budget_gb=auto fits the run to your GPU: before loading the model, Train LoRA estimates its step and\n"
    "turns on gradient checkpointing and block swap as far as needed, and shows the plan on the node.\n"
    "Turbo is distilled to 8 steps: a long run on it slowly undoes that; keep runs short or train on the base.\n"
    "Patch Attention sets the softmax scale of every attention call; it is recorded in the LoRA.\n"
    "Save LoRA writes models/loras/" + LORA + " on the first run (the counter grows; it never\n"
    "overwrites) with its training state beside it; Loss Graph saves the learning curve (PNG + CSV).\n"
    "To use the LoRA: inference_z_image.json."
)

INFER_NOTE = (
    "Generate with a Z-Image LoRA exactly as it was trained\n\n"
    "To run it, pick names only: your Z-Image file (Load Diffusion Model, " + MODEL + "), Qwen3-4B\n"
    "(Load CLIP, " + TEXT_ENCODER + ", type " + TEXT_ENCODER_TYPE + "), the Flux.1 VAE (Load VAE, " + VAE + ")\n"
    "and the LoRA train_lora_z_image.json saved (Load LoRA (Precision): " + LORA + "\n"
    "after its first run). Write your prompt (with the trigger word) in CLIP Text Encode.\n\n"
    "As ComfyUI's Z-Image Turbo template: ModelSamplingAuraFlow shift 3, Empty SD3 Latent Image (16 channels,\n"
    "1024 x 1024), KSampler 8 steps, cfg 1 (the zeroed negative is not used), res_multistep / simple; VAE\n"
    "Decode and Save Image. For the base model (z_image_bf16.safetensors) ComfyUI's template uses 25 steps,\n"
    "cfg 4 and a written negative prompt.\n"
    "Load LoRA (Precision) applies the attention settings recorded in the file (softmax scale, backend):\n"
    "attention='apply_recorded'. mode='fp32' keeps the LoRA unmerged in fp32 (exact); 'merge' folds it in."
)


def train_spec() -> dict:
    return {
        "nodes": [
            _node(1, "UNETLoader", [0, 0], {"unet_name": MODEL, "weight_dtype": "default"}, size=[340, 100]),
            *patch_and_attach(2, 3),
            train_settings(4, timestep_sampling="shift", shift=SHIFT),
            _node(5, "CLIPLoader", [0, 450], {"clip_name": TEXT_ENCODER, "type": TEXT_ENCODER_TYPE}, size=[340, 110]),
            _node(6, "VAELoader", [0, 600], {"vae_name": VAE}, size=[340, 60]),
            *bucketed_folder((7, 8, 9), DATASET, (700, 820, 1030)),
            *train_save_graph((10, 11, 12), steps=2000, name="my_z_image_lora", lora_prefix=LORA_PREFIX, save_y=720),
            _note(13, [1200, 0], [800, 660], TRAIN_NOTE),
        ],
        "links": loaders_train_links,
    }


def inference_spec() -> dict:
    return {
        "nodes": [
            _node(1, "UNETLoader", [0, 0], {"unet_name": MODEL, "weight_dtype": "default"}, size=[340, 100]),
            _node(2, "PrecisionLoadLoRA", [400, 0], {
                "lora_name": LORA, "strength": 1.0, "mode": "fp32", "attention": "apply_recorded",
                "override_backend": "auto", "override_scale_mode": "default", "override_scale_value": 1.0}, size=[360, 420]),
            _node(3, "ModelSamplingAuraFlow", [800, 0], {"shift": SHIFT}, size=[300, 60]),
            _node(4, "CLIPLoader", [0, 150], {"clip_name": TEXT_ENCODER, "type": TEXT_ENCODER_TYPE}, size=[340, 110]),
            _node(5, "CLIPTextEncode", [0, 300], {"text": "a photo of sks"}, size=[340, 160]),
            _node(6, "ConditioningZeroOut", [0, 500], size=[340, 30]),
            _node(7, "EmptySD3LatentImage", [400, 470], {"width": 1024, "height": 1024, "batch_size": 1},
                  size=[360, 110]),
            _node(8, "KSampler", [800, 100], {
                "seed": 0, "steps": 8, "cfg": 1.0, "sampler_name": "res_multistep", "scheduler": "simple",
                "denoise": 1.0}, control={"seed": "fixed"}, size=[300, 270]),
            _node(9, "VAELoader", [800, 410], {"vae_name": VAE}, size=[300, 60]),
            _node(10, "VAEDecode", [800, 510], size=[300, 50]),
            _node(11, "SaveImage", [1140, 0], {"filename_prefix": "precision_lora/inference_z_image"},
                  size=[400, 440]),
            _note(12, [0, 640], [1100, 290], INFER_NOTE),
        ],
        "links": [
            (1, 0, 2, "model"), (2, 0, 3, "model"), (3, 0, 8, "model"), (4, 0, 5, "clip"),
            (5, 0, 8, "positive"), (5, 0, 6, "conditioning"), (6, 0, 8, "negative"), (7, 0, 8, "latent_image"),
            (8, 0, 10, "samples"), (9, 0, 10, "vae"), (10, 0, 11, "images"),
        ],
    }


SPECS = {
    "train_lora_z_image": train_spec,
    "inference_z_image": inference_spec,
}
