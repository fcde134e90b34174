"""Flux.2 klein 4B workflows for workflows/build.py: train_lora_flux2_klein.json and its inference twin
inference_flux2_klein.json.

ComfyUI's own loaders with the names of the files ComfyUI's Flux.2 klein template loads
(comfyui_workflow_templates, ``image_flux2_klein_text_to_image``): UNETLoader (Load Diffusion Model) with the
*base* 4B model (the template family ships a base model, sampled with CFG in 20 steps, and a 4-step distilled
one; a LoRA trains on the base), CLIPLoader type flux2 with Qwen3-4B, VAELoader with the Flux.2 VAE. The
inference graph samples as that template's base subgraph does: Flux2Scheduler (20 steps) -> CFGGuider (cfg 5,
an empty negative prompt) -> SamplerCustomAdvanced (euler) on EmptyFlux2LatentImage, then VAE Decode.
"""
from __future__ import annotations

from graph_parts import (bucketed_folder, bucketed_train_links, node as _node, note as _note, patch_and_attach,
                         train_save_graph, train_settings)

KLEIN_MODEL = "flux-2-klein-base-4b.safetensors"
KLEIN_TEXT_ENCODER = "qwen_3_4b.safetensors"
KLEIN_VAE = "flux2-vae.safetensors"
KLEIN_DATASET = "my_lora_dataset"
KLEIN_LORA_PREFIX = "precision_lora/my_klein_lora"
# Save LoRA's default counter (ComfyUI's _00001_ suffix) names the first run's file this.
KLEIN_LORA = KLEIN_LORA_PREFIX + "_00001_.safetensors"

KLEIN_TRAIN_NOTE = (
    "Train a Flux.2 klein 4B LoRA on your own images\n\n"
    "To run it, pick names only:\n"
    "1. Load Diffusion Model: the klein *base* model in models/diffusion_models (" + KLEIN_MODEL + ",\n"
    "   or its fp8 file). Train on the base model, not the 4-step distilled flux-2-klein-4b (a distilled\n"
    "   model's guidance is baked in); the LoRA has the same keys on both, so the distilled model loads it.\n"
    "2. Load CLIP: Qwen3-4B from models/text_encoders (" + KLEIN_TEXT_ENCODER + "), type flux2.\n"
    "3. Load VAE: the Flux.2 VAE from models/vae (" + KLEIN_VAE + ").\n"
    "4. Load Image and Text Dataset from Folder: a folder under ComfyUI's input/ with your images (png, jpg,\n"
    "   webp) and, beside each, a .txt of the same name holding its caption (trigger word included).\n\n"
    "Then Run. Precision Resolution Buckets fits every image to about 1024 x 1024 pixels (aspect kept, sides\n"
    "multiples of 16 from the model), Cached Training Dataset (Precision) encodes each image with the VAE and\n"
    "each caption with Qwen3-4B once and keeps them in <ComfyUI>/cache/precision_lora/dataset.\n"
    "Attach LoRA: rank 16, targets 'attention' = img_attn/txt_attn qkv + proj of the 5 double blocks and\n"
    "linear1/linear2 of the 20 single blocks (60 Linears; 'community' adds the double blocks' MLPs).\n"
    "Train Settings: AdamW at 1e-4, timesteps logit-normal (flow matching, target auto), a checkpoint every\n"
    "250 steps into models/loras/my_klein_lora/ (resume_from continues there).\n"
    "vram_budget_gb=auto fits the run to your GPU: before loading the model, Train LoRA estimates its step and\n"
    "turns on gradient checkpointing and block swap as far as needed, and shows the plan on the node.\n"
    "Patch Attention sets the softmax scale of every attention call; it is recorded in the LoRA.\n"
    "Save LoRA writes models/loras/" + KLEIN_LORA + " on the first run (the counter grows; it never\n"
    "overwrites) with its training state beside it; Loss Graph saves the learning curve (PNG + CSV).\n"
    "To use the LoRA: inference_flux2_klein.json."
)

KLEIN_INFER_NOTE = (
    "Generate with a Flux.2 klein 4B LoRA exactly as it was trained\n\n"
    "To run it, pick names only: the klein base model (Load Diffusion Model: " + KLEIN_MODEL + "),\n"
    "Qwen3-4B (Load CLIP, type flux2), the Flux.2 VAE (Load VAE) and the LoRA train_lora_flux2_klein.json saved\n"
    "(Load LoRA (Precision): " + KLEIN_LORA + " after its first run). Write your prompt (with the\n"
    "trigger word) in the upper CLIP Text Encode; the lower one is the negative (empty, as ComfyUI's template).\n\n"
    "As ComfyUI's Flux.2 klein base template: Empty Flux 2 Latent at 1024 x 1024, Flux2Scheduler (20 steps, the\n"
    "same width and height), CFGGuider (cfg 5), euler, SamplerCustomAdvanced; VAE Decode and Save Image.\n"
    "For the distilled flux-2-klein-4b: 4 steps, cfg 1.\n"
    "Load LoRA (Precision) applies the attention settings recorded in the file (softmax scale, backend):\n"
    "attention='apply_recorded'. mode='fp32' keeps the LoRA unmerged in fp32 (exact); 'merge' folds it in."
)

LOAD_LORA_WIDGETS = {
    "lora_name": KLEIN_LORA, "strength": 1.0, "mode": "fp32", "attention": "apply_recorded",
    "override_backend": "auto", "override_scale_mode": "default", "override_scale_value": 1.0,
}


def _loaders(model_pos, clip_pos, vae_pos) -> list[dict]:
    """UNETLoader, CLIPLoader and VAELoader (ids 1, 2, 3) with the template's file names."""
    return [
        _node(1, "UNETLoader", model_pos, {"unet_name": KLEIN_MODEL, "weight_dtype": "default"}, size=[340, 100]),
        _node(2, "CLIPLoader", clip_pos, {"clip_name": KLEIN_TEXT_ENCODER, "type": "flux2"}, size=[340, 110]),
        _node(3, "VAELoader", vae_pos, {"vae_name": KLEIN_VAE}, size=[340, 60]),
    ]


def train_spec() -> dict:
    return {
        "nodes": [
            *_loaders([0, 0], [0, 450], [0, 610]),
            *patch_and_attach(4, 5),
            train_settings(6, timestep_sampling="logit_normal"),
            *bucketed_folder((7, 8, 9), KLEIN_DATASET, (710, 830, 1050)),
            *train_save_graph((10, 11, 12), steps=1500, name="my_klein_lora", lora_prefix=KLEIN_LORA_PREFIX, save_y=760),
            _note(13, [1200, 0], [900, 700], KLEIN_TRAIN_NOTE),
        ],
        "links": train_links,
    }


def train_links(info: dict) -> list[tuple]:
    """Links of train_lora_flux2_klein.json (its loaders are nodes 1-3, Patch Attention 4, Attach LoRA 5)."""
    return bucketed_train_links(info, model=(1, 0), clip=(2, 0), vae=(3, 0), patch=4, attach=5, settings=6,
                                folder=7, buckets=8, cached=9, train=10, save=11, graph=12)


def inference_spec() -> dict:
    return {
        "nodes": [
            *_loaders([0, 0], [0, 150], [1140, 560]),
            _node(4, "PrecisionLoadLoRA", [400, 0], LOAD_LORA_WIDGETS, size=[360, 420]),
            _node(5, "CLIPTextEncode", [0, 310], {"text": "a photo of sks"}, size=[340, 160], title="Positive"),
            _node(6, "CLIPTextEncode", [0, 510], {"text": ""}, size=[340, 120], title="Negative"),
            _node(7, "EmptyFlux2LatentImage", [400, 470], {"width": 1024, "height": 1024, "batch_size": 1},
                  size=[360, 110]),
            _node(8, "Flux2Scheduler", [400, 620], {"steps": 20, "width": 1024, "height": 1024}, size=[360, 110]),
            _node(9, "CFGGuider", [800, 0], {"cfg": 5.0}, size=[300, 100]),
            _node(10, "KSamplerSelect", [800, 140], {"sampler_name": "euler"}, size=[300, 60]),
            _node(11, "RandomNoise", [800, 240], {"noise_seed": 0}, control={"noise_seed": "fixed"}, size=[300, 90]),
            _node(12, "SamplerCustomAdvanced", [800, 370], size=[300, 130]),
            _node(13, "VAEDecode", [800, 540], size=[300, 50]),
            _node(14, "SaveImage", [1140, 0], {"filename_prefix": "precision_lora/inference_flux2_klein"},
                  size=[400, 520]),
            _note(15, [0, 780], [1100, 270], KLEIN_INFER_NOTE),
        ],
        "links": inference_links,
    }


def inference_links(info: dict) -> list[tuple]:
    """Links of inference_flux2_klein.json (SamplerCustomAdvanced's outputs by name)."""
    names = info["SamplerCustomAdvanced"]["output_name"]
    if "output" not in names:
        raise SystemExit(f"SamplerCustomAdvanced has no output 'output' (has {names})")
    return [
        (1, 0, 4, "model"), (4, 0, 9, "model"), (2, 0, 5, "clip"), (2, 0, 6, "clip"),
        (5, 0, 9, "positive"), (6, 0, 9, "negative"),
        (11, 0, 12, "noise"), (9, 0, 12, "guider"), (10, 0, 12, "sampler"), (8, 0, 12, "sigmas"),
        (7, 0, 12, "latent_image"),
        (12, names.index("output"), 13, "samples"), (3, 0, 13, "vae"), (13, 0, 14, "images"),
    ]


SPECS = {
    "train_lora_flux2_klein": train_spec,
    "inference_flux2_klein": inference_spec,
}
