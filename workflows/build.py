"""Regenerate the example workflows (UI format) and their API-format twins with the real ComfyUI frontend.

    PRECISION_LORA_COMFYUI=.hosts/0.3.75/comfyui .hosts/0.3.75/venv/bin/python workflows/build.py \
        [--server http://127.0.0.1:8188] [name ...]

(ComfyUI 0.3.75's frontend: 0.33.0's frontend 1.49 gives node ids as strings, and the committed workflows keep the
numbers every supported frontend reads; the build says so if started on a newer one.)

The graphs are described once, below, by node type, widget values *by name*, links by input name and
canvas positions. The page of a running ComfyUI (started here on tiny demo models unless --server is
given) builds each graph with LiteGraph, then ``graph.serialize()`` gives the UI file and
``app.graphToPrompt()`` its API twin, exactly as the frontend would save / queue them.
tests/e2e/test_workflows.py checks that the committed pairs still agree and run.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_parts import (bucketed_folder, bucketed_train_links, loss_graph_input, node as _node,  # noqa: E402
                         note as _note, out as output_index, patch_and_attach, train_save_graph, train_settings)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

DEMO_MODEL = "precision_tiny_flux1_dev.safetensors"
DEMO_LORA = "precision_lora/demo_lora.safetensors"  # what train_lora_demo.json saves, what the others load

SWAP_NOTE = (
    "Demo graph: Demo Latent, Demo Conditioning and Demo Latent Preview stand in for the VAE and the text\n"
    "encoders, so it runs on the tiny demo model (precision_tiny_flux1_dev.safetensors, made by\n"
    "scripts/run.sh) on any machine. It is not a start for real training: for that open train_lora.json\n"
    "(your images and captions from a folder -> Cached Training Dataset with your VAE and text encoders ->\n"
    "Train LoRA) and, to use the LoRA, inference_matching_scale.json (Empty latent -> KSampler -> VAE Decode)."
)

# File names the real workflows ship with: the names of the released Flux.1-dev files in ComfyUI's model
# folders. A user whose files are named otherwise picks them from each loader's list.
REAL_MODEL = "flux1-dev.safetensors"
REAL_CLIP_L = "clip_l.safetensors"
REAL_T5 = "t5xxl_fp16.safetensors"
REAL_VAE = "ae.safetensors"
REAL_DATASET = "my_lora_dataset"
REAL_LORA_PREFIX = "precision_lora/my_lora"
# Save LoRA's default counter (ComfyUI's _00001_ suffix) names the first run's file this.
REAL_LORA = REAL_LORA_PREFIX + "_00001_.safetensors"

REAL_TRAIN_NOTE = (
    "Train a Flux.1-dev LoRA on your own images (real training; for the tiny demo see train_lora_demo.json)\n\n"
    "To run it, pick names only:\n"
    "1. Load Diffusion Model (Precision): your Flux.1-dev file in models/diffusion_models (" + REAL_MODEL + ").\n"
    "2. DualCLIPLoader: clip_l and t5xxl from models/text_encoders (type flux).\n"
    "3. Load VAE: the Flux.1 VAE from models/vae (" + REAL_VAE + ").\n"
    "4. Load Image and Text Dataset from Folder: a folder under ComfyUI's input/ with your images (png, jpg,\n"
    "   webp) and, beside each, a .txt of the same name holding its caption (trigger word included).\n"
    "   Cached Training Dataset (Precision) encodes every image with the VAE and every caption with the text\n"
    "   encoders once and keeps them in <ComfyUI>/cache/precision_lora/dataset: later Runs, other workflows\n"
    "   and restarts read them back (a changed image, caption or encoder is encoded again). One latent and\n"
    "   one conditioning per image; images of different sizes train in one run.\n\n"
    "Then Run. Weights load in the file's own dtype (weight_dtype default); the LoRA trains in fp32.\n"
    "Train Settings' vram_budget_gb=auto fits the run to your GPU: before loading the model, Train LoRA\n"
    "estimates its training step and turns on gradient checkpointing and block swap as far as needed; the\n"
    "node shows the plan (e.g. 'checkpointing, 14 of 56 blocks swapped: est. 11.6 GiB of 12'). Set a number\n"
    "of GiB to leave room for other programs, or 0 to choose gradient_checkpointing / swap_blocks yourself.\n"
    "Patch Attention sets the softmax scale of every attention call; it is recorded in the LoRA.\n"
    "Attach LoRA: rank/alpha/targets. Train Settings: optimizer, lr schedule, timesteps, caption dropout.\n"
    "Every 250 steps a checkpoint lands in models/loras/my_lora/ as my_lora_step<N>.safetensors (every LoRA\n"
    "loader lists it) with its training state beside it: resume_from=my_lora/my_lora_step000250.safetensors\n"
    "continues there. The chart on Train LoRA shows the loss live; at the start of a run the node shows the\n"
    "dataset report (samples, sizes, buckets, captions). Stop keeps the LoRA so far.\n"
    "Save LoRA writes models/loras/" + REAL_LORA_PREFIX + "_00001_.safetensors (the counter grows on later\n"
    "runs; it never overwrites) and its training state beside it (same name, .trainstate), so a later\n"
    "Train LoRA with resume_from=" + REAL_LORA + " continues there.\n"
    "Loss Graph saves the learning curve (PNG + CSV).\n"
    "Re-running the unchanged graph does not retrain (seeds are fixed); change an input to retrain.\n\n"
    "Optional: Precision Resolution Buckets between the folder loader and Cached Training Dataset resizes\n"
    "images to one training resolution; Concatenate Text (StringConcatenate) over the captions adds a trigger\n"
    "word to every caption; Precision Load Image Dataset can replace the folder loader (EXIF orientation,\n"
    "16-bit and transparent images, missing captions reported); Precision Preview Settings on Train LoRA's\n"
    "preview input samples images every N steps."
)

REAL_INFER_NOTE = (
    "Generate with a trained LoRA exactly as it was trained (for the tiny demo see inference_demo.json)\n\n"
    "To run it, pick names only: your Flux.1-dev file (Load Diffusion Model), clip_l + t5xxl (DualCLIPLoader,\n"
    "type flux), the Flux.1 VAE (Load VAE) and the LoRA train_lora.json saved (Load LoRA (Precision):\n"
    + REAL_LORA + " after its first run). Write your prompt in CLIP Text Encode.\n\n"
    "Empty SD3 Latent Image gives the empty 16-channel latent Flux samples into (1024 x 1024 here); KSampler\n"
    "denoises it, VAE Decode turns it into the image, Save Image writes it. Flux.1-dev takes its guidance from\n"
    "FluxGuidance (cfg stays 1.0, so the zeroed negative is not used).\n"
    "Load LoRA (Precision) applies the attention settings recorded in the file (softmax scale, backend):\n"
    "attention='apply_recorded'. mode='fp32' keeps the LoRA unmerged in fp32 (exact); 'merge' folds it in."
)

TRAIN_NOTE = (
    "Train a LoRA in the graph\n\n"
    "1. Patch Attention: the softmax scale used for every attention call while training. 'default' is\n"
    "   1/sqrt(head_dim); 'multiplier' scales that; 'absolute' sets it. The resolved value is shown on the\n"
    "   node and recorded in the saved LoRA (ss_attn_softmax_scale), so inference can match it.\n"
    "2. Attach LoRA: rank/alpha and target layers. fp32_accumulation keeps the low-rank path in fp32 and\n"
    "   adds it before the output is rounded (small updates survive a bf16 model).\n"
    "3. Train Settings: optimizer, learning rate schedule, timestep sampling, checkpoints, NaN policy.\n"
    "4. Train LoRA (first): N steps. The node shows the dataset report and the loss live; Stop ends early\n"
    "   and keeps the LoRA so far; Checkpoint now writes models/loras/demo_lora/demo_lora_step<N>.safetensors\n"
    "   (every LoRA loader lists it) with its training state beside it, for resume_from.\n"
    "   A Precision Preview Settings node on its preview input samples images every N steps on the node.\n"
    "5. KSampler + preview: a look at the model with the LoRA half-way.\n"
    "6. Train LoRA (second): continues the same training state (same optimizer, same loss sequence).\n"
    "7. Save LoRA writes models/loras/" + DEMO_LORA + " (kohya keys + metadata) and, from the\n"
    "   training_state link, its training state beside it (demo_lora.trainstate): a later Train LoRA\n"
    "   with resume_from=" + DEMO_LORA + " continues exactly there;\n"
    "   Loss Graph draws the whole run's learning curve (raw + smoothed) and saves it (PNG + CSV)."
)

INFER_NOTE = (
    "Use a trained LoRA exactly as it was trained\n\n"
    "Load LoRA (Precision) reads the attention settings recorded in the file (softmax scale, backend) and\n"
    "applies them: attention='apply_recorded'. The panel on the node lists rank, alpha, steps, softmax\n"
    "scale, backend and base model of the chosen file. mode='fp32' keeps the LoRA unmerged in fp32\n"
    "(exact); 'merge' folds it into the weights (faster, rounds to the model dtype).\n"
    "Run train_lora_demo.json first: it writes " + DEMO_LORA + ", which this graph loads."
)

PROBE_NOTE = (
    "Precision probe\n\n"
    "Measures on your own model and data: how much of the LoRA's signal a bf16 model loses, how saturated\n"
    "attention is, and how often the softmax's largest probability rounds to exactly 1. Connect the model\n"
    "you train (with the LoRA attached or loaded) and latents + conditioning of your images. The report is\n"
    "shown in 'Probe report' (Preview Any) and drawn in 'Probe chart'."
)





LOAD_LORA_WIDGETS = {
    "lora_name": DEMO_LORA, "strength": 1.0, "mode": "fp32", "attention": "apply_recorded",
    "override_backend": "auto", "override_scale_mode": "default", "override_scale_value": 1.0,
}


def _demo_inputs(first_id: int, x: int, y: int) -> list[dict]:
    """Demo Latent and Demo Conditioning, stacked in one column from (x, y)."""
    return [
        _node(first_id, "PrecisionDemoLatent", [x, y], {"width": 64, "height": 64, "batch_size": 1, "seed": 0},
              control={"seed": "fixed"}, size=[340, 160]),
        _node(first_id + 1, "PrecisionDemoConditioning", [x, y + 200], {"text": "a photo of sks", "seed": 0,
              "tokens": 8}, control={"seed": "fixed"}, size=[340, 140]),
    ]


def inference_spec() -> dict:
    return {
        "nodes": [
            _node(1, "PrecisionLoadDiffusionModel", [0, 0], {"model_name": DEMO_MODEL, "weight_dtype": "fp32"},
                  size=[340, 110]),
            _node(2, "PrecisionLoadLoRA", [400, 0], LOAD_LORA_WIDGETS, size=[360, 420]),
            *_demo_inputs(3, 0, 150),
            _node(5, "KSampler", [800, 0], {
                "seed": 7, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
                control={"seed": "fixed"}, size=[300, 270]),
            _node(6, "PrecisionDemoPreview", [800, 310], size=[300, 30]),
            _node(7, "SaveImage", [1140, 0], {"filename_prefix": "precision_lora/inference"}, size=[320, 340]),
            _note(8, [0, 540], [760, 200], INFER_NOTE),
            _note(9, [800, 400], [660, 200], SWAP_NOTE),
        ],
        "links": [
            (1, 0, 2, "model"), (2, 0, 5, "model"), (1, 0, 3, "model"), (1, 0, 4, "model"),
            (4, 0, 5, "positive"), (4, 0, 5, "negative"), (3, 0, 5, "latent_image"),
            (5, 0, 6, "samples"), (6, 0, 7, "images"),
        ],
    }


def probe_spec() -> dict:
    return {
        "nodes": [
            _node(1, "PrecisionLoadDiffusionModel", [0, 0], {"model_name": DEMO_MODEL, "weight_dtype": "bf16"},
                  size=[340, 110]),
            _node(2, "PrecisionLoadLoRA", [400, 0], LOAD_LORA_WIDGETS, size=[360, 420]),
            *_demo_inputs(3, 0, 150),
            _node(5, "PrecisionProbe", [800, 0], {"noise_level": 0.5, "seed": 0, "max_rows": 256},
                  control={"seed": "fixed"}, size=[440, 340]),
            _node(6, "PreviewImage", [1280, 0], size=[360, 340], title="Probe chart"),
            _note(7, [0, 540], [760, 200], PROBE_NOTE),
            _note(8, [800, 400], [660, 200], SWAP_NOTE),
            _node(9, "PreviewAny", [1680, 0], size=[460, 440], title="Probe report"),
        ],
        "links": [
            (1, 0, 2, "model"), (2, 0, 5, "model"), (1, 0, 3, "model"), (1, 0, 4, "model"),
            (3, 0, 5, "latent"), (4, 0, 5, "conditioning"), (5, 1, 6, "images"), (5, 0, 9, "source"),
        ],
    }


def train_spec() -> dict:
    return {
        "nodes": [
            _node(1, "PrecisionLoadDiffusionModel", [0, 0], {"model_name": DEMO_MODEL, "weight_dtype": "fp32"},
                  size=[340, 110]),
            _node(2, "PrecisionPatchAttention", [0, 150], {
                "backend": "auto", "scale_mode": "multiplier", "scale_value": 1.0, "stable_beta": 2.0,
                "softclamp": 0.0, "fp32_softmax": False}, size=[340, 260]),
            # Attach LoRA is ~520 px tall with its adapter inputs, Train Settings ~880 px with EMA and swap.
            _node(3, "PrecisionAttachLoRA", [380, 0], {"rank": 4, "alpha": 4.0, "seed": 0},
                  control={"seed": "fixed"}, size=[340, 500]),
            _node(4, "PrecisionTrainSettings", [380, 550], {}, size=[340, 850]),
            _node(5, "PrecisionDemoLatent", [0, 450], {"width": 64, "height": 64, "batch_size": 2, "seed": 0},
                  control={"seed": "fixed"}, size=[340, 160]),
            _node(6, "PrecisionDemoConditioning", [0, 650], {"text": "a photo of sks", "seed": 0, "tokens": 8},
                  control={"seed": "fixed"}, size=[340, 140]),
            _node(7, "PrecisionTrainLoRA", [760, 0], {"steps": 20, "seed": 0, "name": "demo_lora"},
                  control={"seed": "fixed"}, size=[400, 470], title="Train LoRA (first N steps)"),
            _node(8, "KSampler", [1200, 0], {
                "seed": 7, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
                control={"seed": "fixed"}, size=[300, 270]),
            _node(9, "PrecisionDemoPreview", [1200, 310], size=[300, 30]),
            _node(10, "PreviewImage", [1200, 380], size=[300, 280], title="Preview after the first N steps"),
            # Below the first Train LoRA with room for what it shows once it runs: the dataset report (up to
            # ~230 px) and the preview images (~220 px) make it ~800-930 px tall.
            _node(11, "PrecisionTrainLoRA", [760, 1000], {"steps": 20, "seed": 0, "name": "demo_lora"},
                  control={"seed": "fixed"}, size=[400, 470], title="Train LoRA (N more steps)"),
            _node(12, "PrecisionSaveLoRA", [1200, 1000], {
                "filename_prefix": DEMO_LORA[: -len(".safetensors")], "folder": "loras", "save_dtype": "fp32",
                "key_style": "auto", "use_counter": False, "overwrite": True}, size=[300, 190]),
            _node(13, "PrecisionLossGraph", [1540, 520], {"smoothing": 0.9, "log_scale": False, "width": 768,
                  "height": 384, "filename_prefix": "precision_lora/demo_loss"}, size=[560, 470]),
            _note(14, [1540, 0], [680, 480], TRAIN_NOTE),
            _note(15, [0, 830], [340, 350], SWAP_NOTE),
        ],
        "links": "train",  # filled in by train_links() from the schemas of the training nodes
    }


def real_train_spec() -> dict:
    return {
        "nodes": [
            _node(1, "PrecisionLoadDiffusionModel", [0, 0], {"model_name": REAL_MODEL, "weight_dtype": "default"},
                  size=[340, 110]),
            _node(2, "PrecisionPatchAttention", [0, 150], {
                "backend": "auto", "scale_mode": "multiplier", "scale_value": 1.0, "stable_beta": 2.0,
                "softclamp": 0.0, "fp32_softmax": False}, size=[340, 260]),
            _node(3, "PrecisionAttachLoRA", [380, 0], {"rank": 16, "alpha": 16.0, "seed": 0},
                  control={"seed": "fixed"}, size=[340, 500]),
            _node(4, "PrecisionTrainSettings", [380, 550], {"checkpoint_every": 250, "vram_budget_gb": "auto"},
                  size=[340, 850]),
            _node(5, "DualCLIPLoader", [0, 450], {"clip_name1": REAL_CLIP_L, "clip_name2": REAL_T5, "type": "flux"},
                  size=[340, 130]),
            _node(6, "VAELoader", [0, 620], {"vae_name": REAL_VAE}, size=[340, 60]),
            _node(7, "LoadImageTextDataSetFromFolder", [0, 720], {"folder": REAL_DATASET}, size=[340, 80]),
            _node(8, "PrecisionCachedTrainingDataset", [0, 840], {"cache": "use"}, size=[340, 130]),
            *train_save_graph((9, 10, 11), steps=1000, name="my_lora", lora_prefix=REAL_LORA_PREFIX, save_y=660),
            _note(12, [1200, 0], [760, 600], REAL_TRAIN_NOTE),
        ],
        "links": "real_train",  # filled in by real_train_links() from the schemas
    }


def real_inference_spec() -> dict:
    return {
        "nodes": [
            _node(1, "PrecisionLoadDiffusionModel", [0, 0], {"model_name": REAL_MODEL, "weight_dtype": "default"},
                  size=[340, 110]),
            _node(2, "PrecisionLoadLoRA", [400, 0], {**LOAD_LORA_WIDGETS, "lora_name": REAL_LORA}, size=[360, 420]),
            _node(3, "DualCLIPLoader", [0, 150], {"clip_name1": REAL_CLIP_L, "clip_name2": REAL_T5, "type": "flux"},
                  size=[340, 130]),
            _node(4, "CLIPTextEncode", [0, 320], {"text": "a photo of sks"}, size=[340, 160]),
            _node(5, "FluxGuidance", [0, 520], {"guidance": 3.5}, size=[340, 60]),
            _node(6, "ConditioningZeroOut", [0, 620], size=[340, 30]),
            _node(7, "EmptySD3LatentImage", [400, 460], {"width": 1024, "height": 1024, "batch_size": 1},
                  size=[360, 110]),
            _node(8, "KSampler", [800, 0], {
                "seed": 0, "steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0},
                control={"seed": "fixed"}, size=[300, 270]),
            _node(9, "VAELoader", [800, 310], {"vae_name": REAL_VAE}, size=[300, 60]),
            _node(10, "VAEDecode", [800, 410], size=[300, 50]),
            _node(11, "SaveImage", [1140, 0], {"filename_prefix": "precision_lora/inference"}, size=[400, 440]),
            _note(12, [0, 700], [1100, 320], REAL_INFER_NOTE),
        ],
        "links": [
            (1, 0, 2, "model"), (2, 0, 8, "model"), (3, 0, 4, "clip"), (4, 0, 5, "conditioning"),
            (5, 0, 8, "positive"), (4, 0, 6, "conditioning"), (6, 0, 8, "negative"), (7, 0, 8, "latent_image"),
            (8, 0, 10, "samples"), (9, 0, 10, "vae"), (10, 0, 11, "images"),
        ],
    }


# SDXL (train_lora_sdxl.json, inference_sdxl.json): one checkpoint holds the UNet, CLIP-L + CLIP-G and the VAE.
SDXL_CHECKPOINT = "sd_xl_base_1.0.safetensors"
SDXL_LORA_PREFIX = "precision_lora/my_sdxl_lora"
SDXL_LORA = SDXL_LORA_PREFIX + "_00001_.safetensors"

SDXL_TRAIN_NOTE = (
    "Train an SDXL LoRA on your own images (SDXL 1.0 and its fine-tunes: Illustrious, Pony, NoobAI ...)\n\n"
    "To run it, pick names only:\n"
    "1. Load Checkpoint: your SDXL checkpoint in models/checkpoints (" + SDXL_CHECKPOINT + "). It gives the\n"
    "   UNet (MODEL), the text encoders CLIP-L + CLIP-G (CLIP) and the VAE.\n"
    "2. Load Image and Text Dataset from Folder: a folder under ComfyUI's input/ with your images (png, jpg,\n"
    "   webp) and, beside each, a .txt of the same name holding its caption (trigger word included).\n\n"
    "Then Run. Precision Resolution Buckets fits every image to about 1024 x 1024 pixels (SDXL's size; aspect\n"
    "kept, sides multiples of 8 from the model), Cached Training Dataset (Precision) encodes each image with the\n"
    "VAE and each caption with CLIP-L + CLIP-G once and keeps them in <ComfyUI>/cache/precision_lora/dataset.\n"
    "Attach LoRA: rank 16, targets 'attention' = the attn1/attn2 to_q/to_k/to_v/to_out of every transformer\n"
    "block of the UNet ('community' adds the feed-forwards and proj_in/proj_out, as kohya's sd-scripts do).\n"
    "Train Settings: AdamW at 1e-4, timesteps sampled uniformly (SDXL predicts noise; target auto), a\n"
    "checkpoint every 250 steps into models/loras/my_sdxl_lora/ (resume_from continues there).\n"
    "vram_budget_gb=auto fits the run to your GPU: before loading the model, Train LoRA estimates its step and\n"
    "turns on gradient checkpointing and block swap as far as needed, and shows the plan on the node.\n"
    "Patch Attention sets the softmax scale of every attention call; it is recorded in the LoRA.\n"
    "Save LoRA writes models/loras/" + SDXL_LORA + " on the first run (the counter grows; it never\n"
    "overwrites) with its training state beside it; Loss Graph saves the learning curve (PNG + CSV).\n"
    "To use the LoRA: inference_sdxl.json."
)

SDXL_INFER_NOTE = (
    "Generate with an SDXL LoRA exactly as it was trained\n\n"
    "To run it, pick names only: your SDXL checkpoint (Load Checkpoint) and the LoRA train_lora_sdxl.json saved\n"
    "(Load LoRA (Precision): " + SDXL_LORA + " after its first run). Write your prompt (with the\n"
    "trigger word) in the upper CLIP Text Encode, what to avoid in the lower one.\n\n"
    "Empty Latent Image gives SDXL's 4-channel latent at 1024 x 1024; KSampler (dpmpp_2m, karras, 30 steps,\n"
    "cfg 7) denoises it, VAE Decode turns it into the image, Save Image writes it.\n"
    "Load LoRA (Precision) applies the attention settings recorded in the file (softmax scale, backend):\n"
    "attention='apply_recorded'. mode='fp32' keeps the LoRA unmerged in fp32 (exact); 'merge' folds it in."
)


def sdxl_train_spec() -> dict:
    return {
        "nodes": [
            _node(1, "CheckpointLoaderSimple", [0, 0], {"ckpt_name": SDXL_CHECKPOINT}, size=[340, 100]),
            *patch_and_attach(2, 3),
            train_settings(4, timestep_sampling="uniform"),
            *bucketed_folder((5, 6, 7), REAL_DATASET, (450, 580, 800)),
            *train_save_graph((8, 9, 10), steps=1500, name="my_sdxl_lora", lora_prefix=SDXL_LORA_PREFIX, save_y=700),
            _note(11, [1200, 0], [760, 640], SDXL_TRAIN_NOTE),
        ],
        "links": "sdxl_train",  # filled in by sdxl_train_links() from the schemas
    }


def sdxl_train_links(info: dict) -> list[tuple]:
    """Links of train_lora_sdxl.json: the checkpoint loader (node 1) gives the model, the CLIP and the VAE."""
    ck = "CheckpointLoaderSimple"
    return bucketed_train_links(info, model=(1, output_index(info, ck, "MODEL")),
                                clip=(1, output_index(info, ck, "CLIP")), vae=(1, output_index(info, ck, "VAE")),
                                patch=2, attach=3, settings=4, folder=5, buckets=6, cached=7, train=8, save=9, graph=10)


def sdxl_inference_spec() -> dict:
    return {
        "nodes": [
            _node(1, "CheckpointLoaderSimple", [0, 0], {"ckpt_name": SDXL_CHECKPOINT}, size=[340, 100]),
            _node(2, "PrecisionLoadLoRA", [400, 0], {**LOAD_LORA_WIDGETS, "lora_name": SDXL_LORA}, size=[360, 420]),
            _node(3, "CLIPTextEncode", [0, 150], {"text": "a photo of sks"}, size=[340, 160], title="Positive"),
            _node(4, "CLIPTextEncode", [0, 360], {"text": "blurry, low quality"}, size=[340, 160], title="Negative"),
            _node(5, "EmptyLatentImage", [400, 470], {"width": 1024, "height": 1024, "batch_size": 1},
                  size=[360, 110]),
            _node(6, "KSampler", [800, 0], {
                "seed": 0, "steps": 30, "cfg": 7.0, "sampler_name": "dpmpp_2m", "scheduler": "karras", "denoise": 1.0},
                control={"seed": "fixed"}, size=[300, 270]),
            _node(7, "VAEDecode", [800, 320], size=[300, 50]),
            _node(8, "SaveImage", [1140, 0], {"filename_prefix": "precision_lora/inference_sdxl"}, size=[400, 440]),
            _note(9, [0, 640], [1100, 250], SDXL_INFER_NOTE),
        ],
        "links": [
            (1, 0, 2, "model"), (2, 0, 6, "model"), (1, 1, 3, "clip"), (1, 1, 4, "clip"),
            (3, 0, 6, "positive"), (4, 0, 6, "negative"), (5, 0, 6, "latent_image"),
            (6, 0, 7, "samples"), (1, 2, 7, "vae"), (7, 0, 8, "images"),
        ],
    }


SPECS = {
    "inference_matching_scale": real_inference_spec,
    "train_lora": real_train_spec,
    "inference_demo": inference_spec,
    "precision_probe": probe_spec,
    "train_lora_demo": train_spec,
    "train_lora_sdxl": sdxl_train_spec,
    "inference_sdxl": sdxl_inference_spec,
}


def _family_specs() -> dict:
    """Specs of the per-family workflow modules ``workflows/spec_<family>.py``: each has a ``SPECS`` dict of name ->
    function returning a spec whose ``links`` is a list or a function of ComfyUI's /object_info."""
    found = {}
    for path in sorted(glob.glob(os.path.join(HERE, "spec_*.py"))):
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        clash = set(mod.SPECS) & (set(SPECS) | set(found))
        if clash:
            raise SystemExit(f"{os.path.basename(path)} redefines workflow(s) {sorted(clash)}")
        found.update(mod.SPECS)
    return found


SPECS.update(_family_specs())

BUILD_JS = r"""
async (spec) => {
  const app = window.comfyAPI.app.app;
  const LG = window.LiteGraph;
  await app.loadGraphData({ last_node_id: 0, last_link_id: 0, nodes: [], links: [], groups: [], config: {},
    extra: {}, version: 0.4 }, true, false, null, { showMissingNodesDialog: false, showMissingModelsDialog: false });
  const byId = {};
  for (const n of spec.nodes) {
    const node = LG.createNode(n.type);
    if (!node) throw new Error(`node type ${n.type} is not registered`);
    node.id = n.id;
    app.graph.add(node);
    if (node.id !== n.id && String(node.id) === String(n.id))
      throw new Error(`this frontend gives node ids as ${typeof node.id}s; the committed workflows use numbers, which ` +
        "every supported frontend reads: build them with ComfyUI 0.3.75's (PRECISION_LORA_COMFYUI=" +
        ".hosts/0.3.75/comfyui .hosts/0.3.75/venv/bin/python workflows/build.py)");
    if (node.id !== n.id) throw new Error(`node ${n.type} got id ${node.id}, wanted ${n.id}`);
    for (const [name, value] of Object.entries(n.widgets)) {
      const w = node.widgets?.find((x) => x.name === name);
      if (!w) throw new Error(`${n.type} has no widget ${name} (has ${node.widgets?.map((x) => x.name)})`);
      w.value = value;
    }
    for (const [name, value] of Object.entries(n.control)) {
      const w = node.widgets?.find((x) => x.name === name);
      const c = w?.linkedWidgets?.[0];
      if (!c) throw new Error(`${n.type}.${name} has no control widget`);
      c.value = value;
    }
    if (n.title) node.title = n.title;
    node.pos = n.pos;
    const auto = node.computeSize();
    node.size = n.size ? [Math.max(n.size[0], auto[0]), Math.max(n.size[1], auto[1])] : auto;
    byId[n.id] = node;
  }
  for (const [from, slot, to, input] of spec.links) {
    const target = byId[to];
    const idx = target.findInputSlot(input);
    if (idx < 0) throw new Error(`${target.type} has no input ${input}`);
    const link = byId[from].connect(slot, target, idx);
    if (!link) throw new Error(`could not link ${from}:${slot} -> ${to}.${input}`);
  }
  app.graph.setDirtyCanvas(true, true);
  const workflow = app.graph.serialize();
  const { output } = await app.graphToPrompt();
  return { workflow, api: output };
}
"""


def train_links(info: dict) -> list[tuple]:
    """Links of train_lora_demo.json by the training nodes' input and output names (checked against object_info)."""
    def out(node_type: str, name: str) -> int:
        return output_index(info, node_type, name)

    def inp(node_type: str, name: str) -> str:
        spec = info[node_type]["input"]
        names = [*spec.get("required", {}), *spec.get("optional", {})]
        if name not in names:
            raise SystemExit(f"{node_type} has no input {name!r} (has {names})")
        return name

    t = "PrecisionTrainLoRA"
    model_out, state_out, loss_out = out(t, "model"), out(t, "training_state"), out(t, "loss_map")
    links = [
        (1, 0, 2, "model"), (2, 0, 3, "model"), (1, 0, 5, "model"), (1, 0, 6, "model"),
        (3, 0, 7, inp(t, "model")), (5, 0, 7, inp(t, "latents")), (6, 0, 7, inp(t, "conditioning")),
        (4, 0, 7, inp(t, "settings")),
        (7, model_out, 8, "model"), (6, 0, 8, "positive"), (6, 0, 8, "negative"), (5, 0, 8, "latent_image"),
        (8, 0, 9, "samples"), (9, 0, 10, "images"),
        (7, model_out, 11, inp(t, "model")), (5, 0, 11, inp(t, "latents")), (6, 0, 11, inp(t, "conditioning")),
        (4, 0, 11, inp(t, "settings")), (7, state_out, 11, inp(t, "training_state")),
        (11, model_out, 12, "model"), (11, state_out, 12, inp("PrecisionSaveLoRA", "training_state")),
        (11, loss_out, 13, loss_graph_input(info)),
    ]
    return links


def real_train_links(info: dict) -> list[tuple]:
    """Links of the real train_lora.json, by input and output names (checked against object_info)."""
    def out(node_type: str, name: str) -> int:
        return output_index(info, node_type, name)

    t, d, m = "PrecisionTrainLoRA", "LoadImageTextDataSetFromFolder", "PrecisionCachedTrainingDataset"
    return [
        (1, 0, 2, "model"), (2, 0, 3, "model"), (3, 0, 9, "model"),
        (7, out(d, "images"), 8, "images"), (7, out(d, "texts"), 8, "texts"), (6, 0, 8, "vae"), (5, 0, 8, "clip"),
        (8, out(m, "latents"), 9, "latents"), (8, out(m, "conditioning"), 9, "conditioning"), (4, 0, 9, "settings"),
        (9, out(t, "model"), 10, "model"), (9, out(t, "training_state"), 10, "training_state"),
        (9, out(t, "loss_map"), 11, loss_graph_input(info)),
    ]


def _load_browser():
    spec = importlib.util.spec_from_file_location("precision_browser",
                                                  os.path.join(ROOT, "tests", "browser", "precision_browser.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(names: list[str], server_url: str | None) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import comfy_bootstrap
    from server_harness import ComfyServer

    server = None
    if server_url is None:
        server = ComfyServer.start(comfy_bootstrap.temporary_base("precision_lora_wf_"))
        server_url = server.url
        server.request("/settings/Comfy.TutorialCompleted", True, method="POST")
    bmod = _load_browser()
    browser = bmod.Browser()
    try:
        browser.call("goto", url=server_url + "/", waitFor=bmod.PAGE_READY, timeout=150)
        import urllib.request

        with urllib.request.urlopen(server_url + "/object_info") as r:
            info = json.load(r)
        os.makedirs(os.path.join(HERE, "api"), exist_ok=True)
        for name in names:
            spec = SPECS[name]()
            if spec["links"] == "train":
                spec["links"] = train_links(info)
            elif spec["links"] == "real_train":
                spec["links"] = real_train_links(info)
            elif spec["links"] == "sdxl_train":
                spec["links"] = sdxl_train_links(info)
            elif callable(spec["links"]):
                spec["links"] = spec["links"](info)
            result = browser.evaluate(BUILD_JS, spec)
            workflow = result["workflow"]
            workflow["extra"] = {"ds": {"scale": 0.7, "offset": [520, 40]}}
            workflow["id"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"comfyui-precision-lora/workflows/{name}"))
            with open(os.path.join(HERE, f"{name}.json"), "w") as f:
                json.dump(workflow, f, indent=2)
                f.write("\n")
            with open(os.path.join(HERE, "api", f"{name}.json"), "w") as f:
                json.dump(result["api"], f, indent=2)
                f.write("\n")
            print(f"[Precision LoRA] wrote workflows/{name}.json and workflows/api/{name}.json")
        errors = browser.pack_errors()
        if errors:
            raise SystemExit("[Precision LoRA] errors from the pack's scripts:\n" + "\n".join(errors))
    finally:
        browser.close()
        if server is not None:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", help="URL of a running ComfyUI with this pack (default: start one on tiny models)")
    ap.add_argument("names", nargs="*", default=list(SPECS), help=f"workflows to build (default: all of {list(SPECS)})")
    args = ap.parse_args()
    unknown = [n for n in args.names if n not in SPECS]
    if unknown:
        raise SystemExit(f"unknown workflow(s) {unknown}; known: {list(SPECS)}")
    build(args.names, args.server)


if __name__ == "__main__":
    main()
