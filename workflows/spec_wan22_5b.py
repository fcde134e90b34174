"""Wan 2.2 5B (TI2V) workflows: train_lora_wan22_5b.json (a LoRA from a folder of captioned images, each trained as
a one-frame video) and inference_wan22_5b.json (ComfyUI's own Wan 2.2 5B text-to-video template's sampling with
the LoRA). Read by workflows/build.py (SPECS); the file names are those of ComfyUI's template
(video_wan2_2_5B_ti2v in comfyui_workflow_templates)."""
from __future__ import annotations

from graph_parts import (bucketed_folder, loaders_train_links, node as _node, patch_and_attach,
                         train_save_graph, train_settings)

MODEL = "wan2.2_ti2v_5B_fp16.safetensors"
CLIP = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
VAE = "wan2.2_vae.safetensors"
DATASET = "my_lora_dataset"
LORA_PREFIX = "precision_lora/my_wan22_5b_lora"
LORA = LORA_PREFIX + "_00001_.safetensors"  # Save LoRA's counter names the first run's file this
# ComfyUI's template: 1280 x 704, 121 frames at 24 fps, shift 8, uni_pc / simple, 20 steps, cfg 5, and its negative.
WIDTH, HEIGHT, FRAMES, FPS = 1280, 704, 121, 24
SHIFT = 8.0
NEGATIVE = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，丑陋的，"
            "残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，"
            "三条腿，背景人很多，倒着走")

TRAIN_NOTE = (
    "Train a Wan 2.2 5B (TI2V) LoRA on your own images\n\n"
    "To run it, pick names only (the files of ComfyUI's Wan 2.2 5B template):\n"
    "1. Load Diffusion Model: " + MODEL + " from models/diffusion_models.\n"
    "2. Load CLIP: " + CLIP + " from models/text_encoders (type wan).\n"
    "3. Load VAE: " + VAE + " from models/vae (the Wan 2.2 VAE, 48 channels; not the Wan 2.1 one).\n"
    "4. Load Image and Text Dataset from Folder: a folder under ComfyUI's input/ with your images and, beside\n"
    "   each, a .txt of the same name holding its caption (trigger word included).\n"
    "Resolution Buckets resizes every image to about 960 x 960 pixels of area (Wan 2.2 5B's 1280 x 704 is\n"
    "0.9 MP), keeping its aspect, in steps of 32 (the VAE's 16 x the model's 2 x 2 patches). Cached Training\n"
    "Dataset encodes each image with the VAE as a one-frame video (latent 1 x 48 x 1 x h/16 x w/16) and each\n"
    "caption with umt5-xxl once, and keeps them in <ComfyUI>/cache/precision_lora/dataset for later Runs.\n\n"
    "Then Run. Attach LoRA trains the attention projections of every block (self_attn and cross_attn q, k, v,\n"
    "o: 8 layers x 30 blocks); 'attention_mlp' adds the feed-forward layers. Train Settings: timesteps\n"
    "'shift' 3 (as Wan trainers usually do), vram_budget_gb=auto fits the run to your GPU (gradient\n"
    "checkpointing and block swap as far as needed; the node shows the plan). Every 250 steps a checkpoint\n"
    "lands in models/loras/my_wan22_5b_lora/. Save LoRA writes models/loras/" + LORA + "\n"
    "(the counter grows; it never overwrites) with its training state beside it; Loss Graph saves the\n"
    "learning curve.\n"
    "Video clips instead of images: replace the folder loader with Precision Load Video Dataset (mp4/webm\n"
    "clips + .txt captions, frame_rule 4k+1 for Wan: 1, 5, 9 ... frames); each clip trains as one video\n"
    "latent. See docs/video.md (also ComfyUI's Load Video + Get Video Components).\n"
    "To use the LoRA: inference_wan22_5b.json."
)

INFER_NOTE = (
    "Generate a Wan 2.2 5B video with a LoRA exactly as it was trained\n\n"
    "To run it, pick names only: " + MODEL + " (Load Diffusion Model), " + CLIP + "\n"
    "(Load CLIP, type wan), " + VAE + " (Load VAE) and the LoRA train_lora_wan22_5b.json saved (Load LoRA\n"
    "(Precision): " + LORA + " after its first run). Write your prompt (with the trigger word) in\n"
    "Positive; Negative is the template's.\n\n"
    "As ComfyUI's Wan 2.2 5B template: ModelSamplingSD3 shift 8, Wan22ImageToVideoLatent 1280 x 704, 121 frames\n"
    "(connect a Load Image to its start_image for image-to-video), KSampler uni_pc / simple, 20 steps, cfg 5;\n"
    "VAE Decode turns the latent into 121 frames; Save Animated WEBP writes them at the template's 24 fps\n"
    "(output/precision_lora/). For an mp4, Create Video + Save Video (as the template) take the same frames.\n"
    "Load LoRA (Precision) applies the attention settings recorded in the file (softmax scale, backend):\n"
    "attention='apply_recorded'. mode='fp32' keeps the LoRA unmerged in fp32 (exact); 'merge' folds it in."
)


def train_spec() -> dict:
    return {
        "nodes": [
            _node(1, "UNETLoader", [0, 0], {"unet_name": MODEL, "weight_dtype": "default"}, size=[340, 100]),
            *patch_and_attach(2, 3),
            train_settings(4, timestep_sampling="shift", shift=3.0),
            _node(5, "CLIPLoader", [0, 450], {"clip_name": CLIP, "type": "wan", "device": "default"}, size=[340, 110]),
            _node(6, "VAELoader", [0, 600], {"vae_name": VAE}, size=[340, 60]),
            *bucketed_folder((7, 8, 9), DATASET, (700, 820, 1040), resolution=960),
            *train_save_graph((10, 11, 12), steps=1500, name="my_wan22_5b_lora", lora_prefix=LORA_PREFIX, save_y=700),
            _node(13, "Note", [1200, 0], {"text": TRAIN_NOTE}, size=[780, 640]),
        ],
        "links": loaders_train_links,
    }


def inference_spec() -> dict:
    return {
        "nodes": [
            _node(1, "UNETLoader", [0, 0], {"unet_name": MODEL, "weight_dtype": "default"}, size=[340, 100]),
            _node(2, "CLIPLoader", [0, 140], {"clip_name": CLIP, "type": "wan", "device": "default"}, size=[340, 110]),
            _node(3, "VAELoader", [0, 290], {"vae_name": VAE}, size=[340, 60]),
            _node(4, "PrecisionLoadLoRA", [400, 0], {
                "lora_name": LORA, "strength": 1.0, "mode": "fp32", "attention": "apply_recorded",
                "override_backend": "auto", "override_scale_mode": "default", "override_scale_value": 1.0},
                  size=[360, 420]),
            _node(5, "ModelSamplingSD3", [400, 470], {"shift": SHIFT}, size=[360, 60]),
            _node(6, "CLIPTextEncode", [0, 390], {"text": "a video of sks, the camera slowly moves right"},
                  size=[340, 160], title="Positive"),
            _node(7, "CLIPTextEncode", [0, 590], {"text": NEGATIVE}, size=[340, 200], title="Negative"),
            _node(8, "Wan22ImageToVideoLatent", [400, 580], {"width": WIDTH, "height": HEIGHT, "length": FRAMES,
                  "batch_size": 1}, size=[360, 170]),
            _node(9, "KSampler", [800, 0], {
                "seed": 0, "steps": 20, "cfg": 5.0, "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0},
                control={"seed": "fixed"}, size=[300, 270]),
            _node(10, "VAEDecode", [800, 320], size=[300, 50]),
            # Save Animated WEBP, not the template's Create Video + Save Video: those two gained inputs in ComfyUI
            # 0.33 (bit_depth, a format combo with sub-widgets), so one saved graph would not fit 0.3.75 and 0.33.
            _node(11, "SaveAnimatedWEBP", [1140, 0], {"filename_prefix": "precision_lora/wan22_5b", "fps": float(FPS),
                  "lossless": False, "quality": 90, "method": "default"}, size=[420, 520]),
            _node(12, "Note", [0, 840], {"text": INFER_NOTE}, size=[1100, 260]),
        ],
        "links": [
            (1, 0, 4, "model"), (4, 0, 5, "model"), (5, 0, 9, "model"), (2, 0, 6, "clip"), (2, 0, 7, "clip"),
            (6, 0, 9, "positive"), (7, 0, 9, "negative"), (3, 0, 8, "vae"), (8, 0, 9, "latent_image"),
            (9, 0, 10, "samples"), (3, 0, 10, "vae"), (10, 0, 11, "images"),
        ],
    }


SPECS = {"train_lora_wan22_5b": train_spec, "inference_wan22_5b": inference_spec}
