"""Tiny models of ComfyUI's image and video families, built at test time from ComfyUI's own classes.

``TINY[name]`` is a ``comfy.supported_models`` class name -> what to add to that class's ``unet_config``
so its diffusion model is a few MB (widths 64, 1-2 blocks; HiDream O1's text width 3072, see TINY) with the
module paths and code paths of the released model; ``CONTEXT[name]`` the text width (and pooled width) its
conditioning carries.
``build(name)`` returns a ModelPatcher with seeded random fp32 weights; ``latent``, ``conditioning`` what the
family's nodes give (a packed LATENT for LTX-2, token ids for HiDream O1); ``denoise(model)`` runs one euler
step through ComfyUI's sampler (extra_conds, wrappers, transformer_options as KSampler runs).
"""
from __future__ import annotations

import math
import sys
import contextlib
from contextlib import contextmanager

import torch

# The UNets' tiny layout (2 levels of 32 / 64 channels, one res block each), what detection gives at this size.
_UNET = {"use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4, "legacy": False,
         "use_spatial_transformer": True, "model_channels": 32, "num_res_blocks": [1, 1], "channel_mult": [1, 2],
         "context_dim": 64}
_SD15 = {**_UNET, "transformer_depth": [1, 1], "transformer_depth_middle": 1, "transformer_depth_output": [1, 1, 1, 1],
         "num_heads": 2, "num_head_channels": -1}
_SD2 = {**_UNET, "transformer_depth": [1, 1], "transformer_depth_middle": 1, "num_heads": -1, "num_head_channels": 16}
_SVD = {**_SD2, "in_channels": 8, "num_classes": "sequential", "transformer_depth_output": [1, 1, 1, 1],
        "extra_ff_mix_layer": True, "use_spatial_context": True, "merge_strategy": "learned_with_images",
        "merge_factor": 0.0, "video_kernel_size": [3, 1, 1], "use_temporal_resblock": True,
        "use_temporal_attention": True, "disable_temporal_crossattention": False}
_XL = {**_UNET, "num_classes": "sequential", "transformer_depth": [0, 1], "num_head_channels": 16}

# supported_models class -> unet_config additions (tiny widths; the class's own match keys are kept).
TINY: dict[str, dict] = {
    "SD3": {"depth": 2, "patch_size": 2, "adm_in_channels": 32, "pos_embed_max_size": 16, "num_patches": 256,
            "context_embedder_config": {"target": "torch.nn.Linear",
                                        "params": {"in_features": 64, "out_features": 128}}},
    "PixArtAlpha": {"input_size": 8, "hidden_size": 64, "depth": 2, "num_heads": 2, "caption_channels": 64,
                    "micro_condition": False, "model_max_length": 8, "pe_interpolation": 1.0},
    "PixArtSigma": {"input_size": 8, "hidden_size": 64, "depth": 2, "num_heads": 2, "caption_channels": 64,
                    "micro_condition": False, "model_max_length": 8, "pe_interpolation": 1.0},
    "HunyuanDiT": {"input_size": (8, 8), "hidden_size": 64, "depth": 2, "num_heads": 2, "text_states_dim": 64,
                   "text_states_dim_t5": 64, "text_len": 8, "text_len_t5": 8},
    "HunyuanDiT1": {"input_size": (8, 8), "hidden_size": 64, "depth": 2, "num_heads": 2, "text_states_dim": 64,
                    "text_states_dim_t5": 64, "text_len": 8, "text_len_t5": 8},
    "ErnieImage": {"hidden_size": 64, "num_attention_heads": 2, "num_layers": 2, "ffn_hidden_size": 128,
                   "text_in_dim": 64, "rope_axes_dim": (8, 12, 12)},
    "GenmoMochi": {"hidden_size_x": 64, "hidden_size_y": 32, "mlp_ratio_x": 192.0, "mlp_ratio_y": 2.0,
                   "depth": 2, "num_heads": 2, "t5_feat_dim": 64, "t5_token_length": 8, "in_channels": 12,
                   "learn_sigma": False, "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0,
                   "use_t5": True, "attend_to_padding": False, "posenc_preserve_area": True, "timestep_scale": 1000.0},
    "AuraFlow": {"dim": 64, "n_layers": 2, "n_double_layers": 1, "n_heads": 2, "global_conddim": 64,
                 "cond_seq_dim": 64, "max_seq": 256},
    "WAN21_T2V": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                  "in_dim": 16, "out_dim": 16},
    "WAN21_I2V": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                  "in_dim": 36, "out_dim": 16},
    "WAN21_FunControl2V": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64,
                           "freq_dim": 32, "in_dim": 48, "out_dim": 16},
    "WAN21_Camera": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                     "in_dim": 32, "out_dim": 16, "in_dim_control_adapter": 24},
    "WAN22_Camera": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                     "in_dim": 36, "out_dim": 16, "in_dim_control_adapter": 24},
    # VACE: the T2V blocks and a control branch (vace_blocks, every num_layers // vace_layers-th block) on the
    # VACE frames (16 + 16 latent channels) and their mask (64 channels): vace_in_dim 96
    "WAN21_Vace": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                   "in_dim": 16, "out_dim": 16, "vace_in_dim": 96, "vace_layers": 1},
    # HuMo (1.7B build: 16 input channels, no concat): every block has an audio cross-attention on the
    # audio projection's tokens (Whisper features; the projection's widths are fixed in ComfyUI's class)
    "WAN21_HuMo": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                   "in_dim": 16, "out_dim": 16},
    # S2V: audio injected (cross-attention) after the blocks audio_inject_layers names; wav2vec2 features
    "WAN22_S2V": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                  "in_dim": 16, "out_dim": 16, "audio_inject_layers": [0, 1]},
    # Wan 2.2 Animate: the I2V blocks, a pose patch embedding and a face adapter (a face block after every 5th
    # block: 5 blocks here) on a StyleGAN-style motion encoder of 512x512 face crops (its widths fixed by ComfyUI)
    "WAN22_Animate": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 5, "text_dim": 64, "freq_dim": 32,
                      "in_dim": 36, "out_dim": 16},
    # Wan Animate 2: I2V-shaped blocks with a pose branch (the pose video's tokens add keys / values to the
    # generation's self-attention frame by frame); latent frame 0 is the reference slot, so 2 frames
    "WAN_Animate2": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                     "in_dim": 36, "out_dim": 16},
    # Wan 2.1 variants on the T2V blocks: CausalAR (Self-Forcing-style autoregressive build), FlowRVS (video
    # segmentation as image-to-image flow), SCAIL / SCAIL 2 (pose-driven animation: 20 input channels,
    # reference image tokens ahead of the video's)
    "WAN21_CausalAR_T2V": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64,
                           "freq_dim": 32, "in_dim": 16, "out_dim": 16},
    "WAN21_FlowRVS": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                      "in_dim": 16, "out_dim": 16},
    "WAN21_SCAIL": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                    "in_dim": 20, "out_dim": 16},
    "WAN21_SCAIL2": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                     "in_dim": 20, "out_dim": 16},
    # WanDancer: I2V-shaped blocks, a music encoder (its widths fixed by ComfyUI: 256, 4 heads) whose features a
    # cross-attention injects after the blocks audio_inject_layers names, a second (global) patch embedding / head
    "WAN22_WanDancer": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                        "in_dim": 36, "out_dim": 16, "audio_inject_layers": [0, 1]},
    "WAN22_T2V": {"dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "text_dim": 64, "freq_dim": 32,
                  "in_dim": 48},
    "CogVideoX_T2V": {"num_attention_heads": 2, "attention_head_dim": 48, "text_embed_dim": 64, "num_layers": 2,
                      "time_embed_dim": 32, "sample_width": 8, "sample_height": 8, "sample_frames": 1,
                      "max_text_seq_length": 8},
    "CogVideoX_I2V": {"num_attention_heads": 2, "attention_head_dim": 48, "text_embed_dim": 64, "num_layers": 2,
                      "time_embed_dim": 32, "sample_width": 8, "sample_height": 8, "sample_frames": 1,
                      "max_text_seq_length": 8, "in_channels": 32},
    # Cosmos 1.0 (Cosmos-1.0-Diffusion 7B / 14B; not Cosmos-Predict2, the pack's own tiny model): GeneralDIT, an EDM
    # model, with detection's layout (THWBD blocks, rope3d, learnable extra position embeddings, AdaLN-LoRA) at
    # 2 heads of 32; I2V adds the inverted frame mask as a 17th input channel
    "CosmosT2V": {"max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16, "out_channels": 16,
                  "patch_spatial": 2, "patch_temporal": 1, "model_channels": 64, "block_config": "FA-CA-MLP",
                  "concat_padding_mask": True, "pos_emb_cls": "rope3d", "pos_emb_learnable": False,
                  "pos_emb_interpolation": "crop", "block_x_format": "THWBD", "affline_emb_norm": True,
                  "use_adaln_lora": True, "adaln_lora_dim": 16, "num_blocks": 2, "num_heads": 2,
                  "extra_per_block_abs_pos_emb": True, "extra_per_block_abs_pos_emb_type": "learnable",
                  "crossattn_emb_channels": 64},
    # CogVideoX inpainting (CogVideoX-Fun): the I2V blocks on 48 input channels, the noisy latent and a 32-channel
    # concat condition (the masked video's latent and its mask)
    "CogVideoX_Inpaint": {"num_attention_heads": 2, "attention_head_dim": 48, "text_embed_dim": 64, "num_layers": 2,
                          "time_embed_dim": 32, "sample_width": 8, "sample_height": 8, "sample_frames": 1,
                          "max_text_seq_length": 8, "in_channels": 48},
    "Kandinsky5": {"model_dim": 64, "ff_dim": 128, "in_text_dim": 64, "in_text_dim2": 32, "time_dim": 32,
                   "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": (8, 12, 12)},
    "Kandinsky5Image": {"model_dim": 64, "ff_dim": 128, "in_text_dim": 64, "in_text_dim2": 32, "time_dim": 32,
                        "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": (8, 12, 12)},
    "Krea2": {"features": 64, "tdim": 32, "txtdim": 64, "heads": 2, "kvheads": 2, "layers": 2, "txtlayers": 2,
              "txtheads": 2, "txtkvheads": 2},
    "JoyImage": {"hidden_size": 64, "num_attention_heads": 2, "text_dim": 64, "num_layers": 2,
                 "rope_dim_list": [8, 12, 12]},
    "Ideogram4": {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 32, "intermediate_size": 128,
                  "adaln_dim": 32, "llm_features_dim": 64, "mrope_section": (6, 5, 5)},
    "Lens": {"num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2, "enc_hidden_dim": 64,
             "axes_dims_rope": (8, 12, 12)},
    "QwenImage": {"num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 64,
                  "axes_dims_rope": (8, 12, 12)},
    "Lumina2": {"in_channels": 16, "dim": 64, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                "multiple_of": 16, "cap_feat_dim": 64, "axes_dims": (8, 12, 12)},
    # Z-Image's modulation is 256 wide, so its width is at least 256
    "ZImage": {"in_channels": 16, "dim": 256, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2,
               "multiple_of": 16, "cap_feat_dim": 64, "axes_dims": (32, 48, 48), "z_image_modulation": True},
    # Z-Image pixel space: Z-Image's blocks on RGB patches (patch 4 here) and an MLP decoder per patch
    "ZImagePixelSpace": {"in_channels": 3, "dim": 256, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2,
                         "n_kv_heads": 2, "multiple_of": 16, "cap_feat_dim": 64, "axes_dims": (32, 48, 48),
                         "z_image_modulation": True, "patch_size": 4, "decoder_hidden_size": 32,
                         "decoder_num_res_blocks": 1, "decoder_max_freqs": 4, "decoder_in_channels": 48},
    "MageFlow": {"num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 64,
                 "axes_dims_rope": (8, 12, 12)},
    # The UNets (openaimodel's UNetModel): ComfyUI detects them from a state dict, so the class's unet_config
    # holds only its match keys; the rest is what detection would give at this size.
    "SD15": {"use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4, "legacy": False,
             "use_spatial_transformer": True, "model_channels": 32, "num_res_blocks": [1, 1], "channel_mult": [1, 2],
             "transformer_depth": [1, 1], "transformer_depth_middle": 1, "transformer_depth_output": [1, 1, 1, 1],
             "context_dim": 64, "num_heads": 2, "num_head_channels": -1},
    "SDXL": {"use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4, "legacy": False,
             "use_spatial_transformer": True, "num_classes": "sequential", "model_channels": 32,
             "num_res_blocks": [1, 1], "channel_mult": [1, 2], "transformer_depth": [0, 1],
             "transformer_depth_middle": 1, "transformer_depth_output": [0, 0, 1, 1], "context_dim": 64,
             "num_head_channels": 16},
    # The UNet variants (#25): SD15's / SDXL's tiny layout with what sets each class apart at its released size
    # (model_detection's configs): v-prediction and linear projections (SD 2.x), an adm vector (unCLIP's noisy
    # CLIP image embedding and noise level, the refiner's aesthetic score), no middle transformer or uneven
    # output depths (SSD-1B, Vega, KOALA), concatenated input channels (instruct-pix2pix, the x4 upscaler, Zero123).
    "SD20": {**_SD2, "transformer_depth_output": [1, 1, 1, 1]},
    "SD21UnclipL": {**_SD2, "num_classes": "sequential", "transformer_depth_output": [1, 1, 1, 1]},
    "SD21UnclipH": {**_SD2, "num_classes": "sequential", "transformer_depth_output": [1, 1, 1, 1]},
    "SDXLRefiner": {**_XL, "transformer_depth_middle": 1, "transformer_depth_output": [0, 0, 1, 1]},
    "SSD1B": {**_XL, "transformer_depth_middle": -1, "transformer_depth_output": [0, 0, 2, 1]},
    "Segmind_Vega": {**_XL, "transformer_depth_middle": -1, "transformer_depth_output": [0, 0, 1, 1]},
    "KOALA_700M": {**_XL, "transformer_depth_middle": -2, "transformer_depth_output": [0, 0, 1, 1]},
    "KOALA_1B": {**_XL, "transformer_depth_middle": 1, "transformer_depth_output": [0, 0, 1, 1]},
    "SD15_instructpix2pix": {**_SD15, "in_channels": 8},
    "SDXL_instructpix2pix": {**_XL, "in_channels": 8, "transformer_depth_middle": 1,
                             "transformer_depth_output": [0, 0, 1, 1]},
    "SD_X4Upscaler": {**_SD2, "in_channels": 7, "num_classes": 1000, "disable_self_attentions": [True, False],
                      "num_heads": 2, "num_head_channels": -1, "transformer_depth_output": [1, 1, 1, 1]},
    "Stable_Zero123": {**_SD15, "in_channels": 8},
    # Stable Video Diffusion / SV3D: the video UNet (a temporal res block after every res block, a temporal
    # transformer with self- and cross-attention after every spatial one, learned merges), as detection sets it
    "SVD_img2vid": {**_SVD, "adm_in_channels": 768},
    "SV3D_u": {**_SVD, "adm_in_channels": 256},
    "SV3D_p": {**_SVD, "adm_in_channels": 1280},
    # Chroma: Flux's blocks without the per-block modulation; the approximator's out_dim is the width
    "Chroma": {"in_channels": 64, "out_channels": 64, "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0,
               "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 10000,
               "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 64, "hidden_dim": 128, "n_layers": 2,
               "txt_ids_dims": [], "vec_in_dim": None},
    # Flux.1 dev / schnell / Fill (inpaint: 16 + 16 masked-image + 64 mask channels) and Flux.2 from their classes at the
    # widths of the pack's own tiny models (demo/tiny_models.py), which other tests use; here as every row is built
    "Flux": {"in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 64, "hidden_size": 64,
             "mlp_ratio": 4.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "axes_dim": [8, 12, 12],
             "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True, "txt_ids_dims": []},
    "Flux2": {"in_channels": 128, "out_channels": 128, "vec_in_dim": None, "context_in_dim": 64, "hidden_size": 64,
              "mlp_ratio": 3.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "axes_dim": [8, 8, 8, 8],
              "theta": 2000, "patch_size": 1, "qkv_bias": False, "ops_bias": False, "global_modulation": True,
              "mlp_silu_act": True, "default_ref_method": "index", "ref_index_scale": 10.0, "guidance_embed": True,
              "txt_ids_dims": [3]},
    # Chroma Radiance: Chroma in pixel space, a NeRF-style head decodes each patch (patch 4 here, 16 released)
    "ChromaRadiance": {"in_channels": 3, "out_channels": 3, "context_in_dim": 64, "hidden_size": 64,
                       "mlp_ratio": 4.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
                       "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 4, "qkv_bias": True, "in_dim": 64,
                       "out_dim": 64, "hidden_dim": 128, "n_layers": 2, "txt_ids_dims": [], "vec_in_dim": None,
                       "nerf_hidden_size": 32, "nerf_mlp_ratio": 4, "nerf_depth": 2, "nerf_max_freqs": 8,
                       "nerf_tile_size": 512, "nerf_final_head_type": "conv", "nerf_embedder_dtype": torch.float32,
                       "use_x0": False, "use_sequential_txt_ids": False},
    "HunyuanVideo": {"in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2], "vec_in_dim": 32,
                     "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1,
                     "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True,
                     "guidance_embed": True, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
                     "vision_in_dim": None, "meanflow_sum": False},
    # HiDream: one caption projection per block from the Llama layers llama_layers picks, one for T5 (last)
    "HiDream": {"patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 1, "num_single_layers": 1,
                "attention_head_dim": 32, "num_attention_heads": 2, "caption_channels": [64, 64], "text_emb_dim": 32,
                "num_routed_experts": 4, "num_activated_experts": 2, "axes_dims_rope": [16, 8, 8],
                "max_resolution": [128, 128], "llama_layers": [0, 1]},
    "Omnigen2": {"patch_size": 2, "in_channels": 16, "out_channels": None, "hidden_size": 64, "num_layers": 2,
                 "num_refiner_layers": 1, "num_attention_heads": 2, "num_kv_heads": 2, "multiple_of": 16,
                 "ffn_dim_multiplier": None, "norm_eps": 1e-05, "axes_dim_rope": [8, 12, 12],
                 "axes_lens": [1024, 1664, 1664], "text_feat_dim": 64, "timestep_scale": 1000.0},
    # HunyuanVideo 1.5 (T2V): 32-channel latents; the image condition and its mask are concatenated (zeros
    # without an image), byT5 glyph text and SigLIP vision tokens are optional inputs
    "HunyuanVideo15": {"in_channels": 65, "out_channels": 32, "patch_size": [1, 1, 1], "vec_in_dim": None,
                       "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1,
                       "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True,
                       "guidance_embed": False, "byt5": True, "meanflow": False, "use_cond_type_embedding": True,
                       "vision_in_dim": 1152, "meanflow_sum": True},
    # HunyuanVideo 1.5 SR (distilled): 1.5's blocks on the noise (32), the low-resolution latent and the start
    # image's with their masks (HunyuanVideo15SuperResolution's 66 channels): 98 in
    "HunyuanVideo15_SR_Distilled": {"in_channels": 98, "out_channels": 32, "patch_size": [1, 1, 1],
                                    "vec_in_dim": None, "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0,
                                    "num_heads": 2, "depth": 1, "depth_single_blocks": 1, "axes_dim": [8, 12, 12],
                                    "theta": 256, "qkv_bias": True, "guidance_embed": False, "byt5": True,
                                    "meanflow": False, "use_cond_type_embedding": True, "vision_in_dim": 1152,
                                    "meanflow_sum": True},
    # LongCat-Image: Flux's blocks without a pooled vector or guidance, Qwen2.5-VL text (3584 wide: a match key)
    "LongCatImage": {"in_channels": 16, "out_channels": 16, "patch_size": 2, "context_in_dim": 3584,
                     "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
                     "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "guidance_embed": False,
                     "vec_in_dim": None, "txt_ids_dims": [1, 2]},
    "HunyuanVideoI2V": {"in_channels": 33, "out_channels": 16, "patch_size": [1, 2, 2], "vec_in_dim": 32,
                        "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1,
                        "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True,
                        "guidance_embed": True, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
                        "vision_in_dim": None, "meanflow_sum": False},
    "HunyuanVideoSkyreelsI2V": {"in_channels": 32, "out_channels": 16, "patch_size": [1, 2, 2], "vec_in_dim": 32,
                                "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1,
                                "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True,
                                "guidance_embed": True, "byt5": False, "meanflow": False,
                                "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False},
    # HunyuanImage 2.1: HunyuanVideo's class on 2D, 64-channel latents (32x down), patch 1
    "HunyuanImage21": {"in_channels": 64, "out_channels": 64, "patch_size": [1, 1], "vec_in_dim": None,
                       "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1,
                       "depth_single_blocks": 1, "axes_dim": [16, 16], "theta": 256, "qkv_bias": True,
                       "guidance_embed": False, "byt5": True, "meanflow": False, "use_cond_type_embedding": False,
                       "vision_in_dim": None, "meanflow_sum": False},
    # HunyuanImage 2.1's refiner: HunyuanVideo's class on 3D latents whose format packs two 32-channel frames into
    # 64 channels; the input image's latent is concatenated (64 + 64 in), meanflow's time_r disabled by its conds
    "HunyuanImage21Refiner": {"in_channels": 128, "out_channels": 64, "patch_size": [1, 1, 1], "vec_in_dim": None,
                              "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1,
                              "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True,
                              "guidance_embed": True, "byt5": False, "meanflow": True,
                              "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False},
    # Boogu: Omnigen2's blocks after a dual-stream stage (image / instruction attention)
    "Boogu": {"hidden_size": 64, "num_layers": 1, "num_double_stream_layers": 1, "num_refiner_layers": 1,
              "num_attention_heads": 2, "num_kv_heads": 2, "multiple_of": 16, "axes_dim_rope": [8, 12, 12],
              "instruction_feat_dim": 64},
    # PixelDiT (T2I): pixel space, a patch-level DiT then pixel-level blocks with their own attention; its
    # detection gives only image_model (the class's defaults are the released 1024px model), so every width here
    "PixelDiTT2I": {"num_groups": 2, "hidden_size": 64, "pixel_hidden_size": 8, "pixel_attn_hidden_size": 32,
                    "pixel_num_groups": 2, "patch_depth": 2, "pixel_depth": 1, "patch_size": 4, "txt_embed_dim": 64,
                    "txt_max_length": 8},
    # PiD: PixelDiT decoding / upscaling a latent (lq_latent, a 16-channel Flux / SD3 latent at 1/32 of the
    # output here: sr_scale 4 x 8 px) injected through sigma-gated projections before every lq_interval-th patch
    # block; detection gives lq_hidden_dim and lq_interval (14 blocks / 7 gates released), the rest as PixelDiT
    "PiD": {"num_groups": 2, "hidden_size": 64, "pixel_hidden_size": 8, "pixel_attn_hidden_size": 32,
            "pixel_num_groups": 2, "patch_depth": 2, "pixel_depth": 1, "patch_size": 4, "txt_embed_dim": 64,
            "txt_max_length": 8, "lq_hidden_dim": 32, "lq_interval": 2, "lq_num_res_blocks": 1,
            "lq_latent_channels": 16, "latent_spatial_down_factor": 8},
    # SeedVR2 (video restoration, its 3B layout: swiglu MLPs, every block multimodal): the degraded video's latent
    # and a mask channel are its `condition` (SeedVR2Conditioning); text is a fixed 5120-wide embedding
    "SeedVR2": {"vid_dim": 64, "heads": 2, "head_dim": 32, "num_layers": 2, "norm_eps": 1e-5, "mlp_type": "swiglu",
                "vid_out_norm": True, "rope_dim": 24},
    # Stable Cascade stage C (the prior, 16-channel latents); detection gives the stage and, per size, the
    # widths / blocks.
    "Stable_Cascade_C": {"c_cond": 64, "c_hidden": [64, 64], "nhead": [2, 2], "blocks": [[1, 1], [1, 1]],
                         "c_clip_text": 64, "c_clip_text_pooled": 64, "c_r": 64},
    # Stable Cascade stage B (the decoder to the VAE's 4-channel latent; stage C's latent is its `effnet` input):
    # four levels, attention (AttnBlock) only at the two deepest ones, ResBlocks' channelwise MLPs everywhere
    "Stable_Cascade_B": {"c_hidden": [32, 32, 64, 64], "nhead": [-1, -1, 2, 2], "blocks": [[1, 1, 1, 1], [1, 1, 1, 1]],
                         "block_repeat": [[1, 1, 1, 1], [1, 1, 1, 1]], "c_cond": 64, "c_clip": 64, "c_r": 64},
    "LTXV": {"cross_attention_dim": 64, "attention_head_dim": 32, "num_attention_heads": 2, "caption_channels": 64,
             "num_layers": 2},
    # LTX-2 (LTXAV): LTXV's video stream plus an audio stream (its own attention, audio-video cross-attention);
    # its LATENT packs a video and an audio latent (LTXVConcatAVLatent, see PACKED). The text connectors (run on
    # unprocessed text only) at 2 heads of 32 too: at their class widths (30 x 128) they held 700 M parameters
    "LTXAV": {"cross_attention_dim": 64, "attention_head_dim": 32, "num_attention_heads": 2, "caption_channels": 64,
              "num_layers": 2, "audio_cross_attention_dim": 32, "audio_attention_head_dim": 16,
              "audio_num_attention_heads": 2, "connector_attention_head_dim": 32,
              "connector_num_attention_heads": 2},
    # HiDream O1: a pixel DiT inside Qwen3-VL's language model (2 layers, 2 heads of 32, GQA with 1 k/v head; a
    # 1-block vision tower). Its text width is 3072, not 64: the pixel head writes a 32x32 RGB patch (3072
    # values, patch size fixed by ComfyUI) from one RMS-normalised hidden state, and at 64 wide no hidden state
    # brings the random head's output nearer the image than 0.71x of its start (the released model is 4096
    # wide). The width costs little but the full-vocabulary token table (see _fill).
    "HiDreamO1": {"text_config_overrides": {"hidden_size": 3072, "intermediate_size": 128, "num_hidden_layers": 2,
                                            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                                            "rope_dims": [8, 4, 4]},
                  "vision_config_overrides": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                                              "depth": 1, "deepstack_visual_indexes": ()}},
    # MiniMax H3: video (24 channels) and stereo audio in one packed sequence [text | audio | video] (see PACKED),
    # 2 blocks of 2 heads of 32 (24 rotated), a 1-block token refiner on the 48-wide text (tests/minimax_h3_tiny.py)
    "MiniMaxH3": {"hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1, "num_attention_heads": 2,
                  "attention_head_dim": 32, "ffn_hidden_size": 128, "text_dim": 48, "timestep_input_dim": 32,
                  "time_embed_hidden_size": 64, "time_embed_dim": 32, "rope_inv_freq_len": 4},
}
TINY["CosmosI2V"] = {**TINY["CosmosT2V"], "in_channels": 17}
TINY["FluxSchnell"] = {**TINY["Flux"], "guidance_embed": False}
TINY["FluxInpaint"] = {**TINY["Flux"], "in_channels": 96}
# Cosmos-Predict2 (text-to-image 2B / 14B; image-to-video adds the frame mask channel): MiniTrainDIT with the layout
# ComfyUI's detection gives, at 2 heads of 32
TINY["CosmosT2IPredict2"] = {
    "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16, "out_channels": 16, "patch_spatial": 2,
    "patch_temporal": 1, "model_channels": 64, "num_heads": 2, "num_blocks": 2, "concat_padding_mask": True,
    "crossattn_emb_channels": 64, "pos_emb_cls": "rope3d", "pos_emb_learnable": True, "pos_emb_interpolation": "crop",
    "min_fps": 1, "max_fps": 30, "use_adaln_lora": True, "adaln_lora_dim": 16, "extra_per_block_abs_pos_emb": False,
    "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0, "rope_t_extrapolation_ratio": 1.0,
    "rope_enable_fps_modulation": False}
TINY["CosmosI2VPredict2"] = {**TINY["CosmosT2IPredict2"], "in_channels": 17}
# unet_config keys ComfyUI 0.33's detection gives that 0.3.75's model classes do not take (left out there).
NEWER_KEYS: dict[str, tuple[str, ...]] = {"Flux": ("txt_ids_dims",), "FluxSchnell": ("txt_ids_dims",),
                                            "FluxInpaint": ("txt_ids_dims",), "Flux2": ("txt_ids_dims",),
                                            "Chroma": ("txt_ids_dims", "vec_in_dim"), "HunyuanVideo": ("meanflow_sum",),
                                            "HunyuanVideo15": ("meanflow_sum",),
                                            "HunyuanVideo15_SR_Distilled": ("meanflow_sum",), "HunyuanImage21": ("meanflow_sum",),
                                            "HunyuanVideoI2V": ("meanflow_sum",),
                                            "HunyuanVideoSkyreelsI2V": ("meanflow_sum",),
                                            "HunyuanImage21Refiner": ("meanflow_sum",),
                                            "ChromaRadiance": ("txt_ids_dims", "vec_in_dim", "use_x0",
                                                               "use_sequential_txt_ids")}
# SD 2.x classes whose released weights model_type detects as v-prediction (SD 2.0 / 2.1 768-v, unCLIP): build
# hands get_model the norm bias it probes (state_dict), so the tiny model is the v-prediction model.
V_PREDICTION_PROBE: tuple[str, ...] = ("SD20", "SD21UnclipL", "SD21UnclipH")
# Text width each family's conditioning carries, and its pooled width (None: no pooled output).
CONTEXT: dict[str, tuple[int, int | None]] = {
    "SD3": (64, 32), "SDXL": (64, 1280), "Kandinsky5": (64, 32), "Kandinsky5Image": (64, 32), "Krea2": (128, None),
    "Lens": (256, None), "HunyuanVideo": (64, 32), "HunyuanVideoI2V": (64, 32), "HunyuanVideoSkyreelsI2V": (64, 32),
    "HiDream": (64, 32), "Stable_Cascade_C": (64, 64), "Flux": (64, 32), "FluxSchnell": (64, 32),
    "FluxInpaint": (64, 32),
    "Stable_Cascade_B": (64, 64), "LongCatImage": (3584, None), "SeedVR2": (5120, None),
    "LTXAV": (128, None),  # the video and the audio text connector's outputs, caption_channels (64) each
    "MiniMaxH3": (48, None),  # Qwen3-VL's hidden states at the tiny text_dim (projected and refined in the model)
    "SDXLRefiner": (64, 1280), "SSD1B": (64, 1280), "Segmind_Vega": (64, 1280), "KOALA_700M": (64, 1280),
    "KOALA_1B": (64, 1280), "SDXL_instructpix2pix": (64, 1280),
    "Stable_Zero123": (68, None),  # StableZero123_Conditioning: the CLIP image embedding + 4 camera values, 1 token
}
# Tokens of the text condition where the family's node gives a fixed number (Zero123: one image token).
# SVD / SV3D: the CLIP image embedding, one token (their nodes' `pooled`).
TOKENS: dict[str, int] = {"Stable_Zero123": 1, "SVD_img2vid": 1, "SV3D_u": 1, "SV3D_p": 1}
# Conditioning entries besides the text (what the family's text encoder or conditioning node adds), key -> kind:
# - "mask": (1, tokens) of ones ("int_mask": int64, as ComfyUI's tokenizers give it); "text": (1, tokens, 64)
#   like the context; "layers": (1, 2, tokens, 64), a text encoder's hidden states of every layer (HiDream's
#   Llama: the model picks its layers by llama_layers); "none": the key with None (Chroma's T5 and HunyuanVideo
#   1.5's Qwen encoders have no pooled output; the base class reads the key).
# - image-to-video inputs, as ComfyUI's nodes give them for a one-frame clip: "clip_vision" (a CLIP vision
#   output, penultimate states 257 x 1280), "start_latent" (the start image's latent, 16 channels), "start_mask"
#   (zeros: the frame is given) from WanImageToVideo (HunyuanImageToVideo's "v1 (concat)" gives the same two);
#   "control_latent" from WanFunControlToVideo (the control video's latent and the start image's, 16 channels
#   each); "camera" from WanCameraEmbedding (Pluecker embedding: 6 x 4 frames = 24 channels at pixel
#   resolution), which WanCameraImageToVideo adds to the start latent and mask.
# - audio, as ComfyUI's nodes give it for one latent frame: "humo_audio" (WanHuMoImageToVideo: Whisper
#   features, 8-frame windows of 5 layer groups x 1280), "s2v_audio" (WanSoundImageToVideo: wav2vec2's 25
#   layers x 1024, 4 audio frames per latent frame).
# - "face": WanAnimateToVideo's face video (512x512 crops in [-1, 1], one frame); its pose video latent is a
#   "start_latent"-shaped latent.
# - "refiner_latent": the image HunyuanRefinerLatent concatenates (the refiner VAE's 32 channels, 1 frame).
EXTRAS: dict[str, dict[str, str]] = {
    "HunyuanDiT": {"attention_mask": "mask", "conditioning_mt5xl": "text", "attention_mask_mt5xl": "mask"},
    "LTXV": {"attention_mask": "mask"}, "GenmoMochi": {"attention_mask": "int_mask"},
    "Omnigen2": {"attention_mask": "int_mask"}, "Boogu": {"attention_mask": "int_mask"}, "HiDream": {"conditioning_llama3": "layers"},
    "Chroma": {"pooled_output": "none"}, "ChromaRadiance": {"pooled_output": "none"},
    "Flux2": {"pooled_output": "none"},  # Mistral / Qwen3 give none; 0.3.75's Flux2 reads the key
    "HunyuanVideo15": {"pooled_output": "none"}, "LongCatImage": {"pooled_output": "none"},
    "HunyuanVideo15_SR_Distilled": {"pooled_output": "none", "concat_latent_image": "sr_latent",
                                    "noise_augmentation": "sr_noise"},
    "HunyuanVideoI2V": {"concat_latent_image": "start_latent", "concat_mask": "start_mask"},
    "HunyuanVideoSkyreelsI2V": {"concat_latent_image": "start_latent"},
    "WAN21_I2V": {"clip_vision_output": "clip_vision", "concat_latent_image": "start_latent",
                  "concat_mask": "start_mask"},
    "WAN21_FunControl2V": {"clip_vision_output": "clip_vision", "concat_latent_image": "control_latent"},
    "WAN21_Camera": {"clip_vision_output": "clip_vision", "concat_latent_image": "start_latent",
                     "concat_mask": "start_mask", "camera_conditions": "camera"},
    "WAN22_Camera": {"concat_latent_image": "start_latent", "concat_mask": "start_mask",
                     "camera_conditions": "camera"},
    "HunyuanImage21Refiner": {"concat_latent_image": "refiner_latent"},
    "WAN22_Animate": {"clip_vision_output": "clip_vision", "concat_latent_image": "start_latent",
                      "concat_mask": "start_mask", "pose_video_latent": "start_latent", "face_video_pixels": "face"},
    "WAN_Animate2": {"clip_vision_output": "clip_vision", "concat_latent_image": "start_latent",
                     "concat_mask": "start_mask", "pose_video_latent": "pose_latent"},
    "HunyuanDiT1": {"attention_mask": "mask", "conditioning_mt5xl": "text", "attention_mask_mt5xl": "mask"},
    "CogVideoX_I2V": {"concat_latent_image": "start_latent"},
    "CogVideoX_Inpaint": {"concat_latent_image": "control_latent"},
    "WAN21_SCAIL": {"reference_latents": "reference"}, "WAN21_SCAIL2": {"reference_latents": "reference"},
    "WAN22_WanDancer": {"clip_vision_output": "clip_vision", "clip_vision_output_ref": "clip_vision",
                        "concat_latent_image": "start_latent", "concat_mask": "start_mask",
                        "audio_embed": "music", "fps": "fps", "audio_inject_scale": "one"},
    "PiD": {"lq_latent": "lq_latent", "degrade_sigma": "zero_sigma"},
    "SeedVR2": {"condition": "seedvr_condition"},
    "WAN21_HuMo": {"audio_embed": "humo_audio"}, "WAN22_S2V": {"audio_embed": "s2v_audio"},
    "MiniMaxH3": {"minimax_token_tags": "int_mask"},  # its text encoder's per-token modality tags (1: text)
    "SD21UnclipL": {"unclip_conditioning": "unclip_768"}, "SD21UnclipH": {"unclip_conditioning": "unclip_1024"},
    "SD15_instructpix2pix": {"concat_latent_image": "image_latent"},
    "SDXL_instructpix2pix": {"concat_latent_image": "image_latent"},
    "Stable_Zero123": {"concat_latent_image": "image_latent"},
    "SD_X4Upscaler": {"concat_image": "x4_pixels", "noise_augmentation": "x4_noise"},
    # SVD_img2vid_Conditioning's defaults; SV3D_Conditioning's per-frame elevation / azimuth lists
    "SVD_img2vid": {"concat_latent_image": "image_latent", "motion_bucket_id": "svd_motion", "fps": "svd_fps",
                    "augmentation_level": "zero"},
    "SV3D_u": {"concat_latent_image": "image_latent", "elevation": "sv3d_angles", "azimuth": "sv3d_angles"},
    "SV3D_p": {"concat_latent_image": "image_latent", "elevation": "sv3d_angles", "azimuth": "sv3d_angles"},
}
# Latent channels where the VAE's differ from the latent format's: HunyuanImage 2.1's refiner VAE gives 32
# channels (1 frame) that the format's process_in packs into 64 (the start frame repeated).
LATENT_CHANNELS: dict[str, int] = {"HunyuanImage21Refiner": 32}
# Families sampled from an empty latent, as their latent node gives it (KSampler's fix_empty_latent_channels
# then widens it to the format's channels): HunyuanRefinerLatent's zeros, the input image a concat condition.
EMPTY_LATENT: tuple[str, ...] = ("HunyuanImage21Refiner",)
# Latent frames where one is not enough (Wan Animate 2: frame 0 is the reference image's slot).
FRAMES: dict[str, int] = {"WAN_Animate2": 2}
# The video UNet's latent holds its frames in the batch (SVD_img2vid_Conditioning's latent: frames x 4 x h x w;
# num_video_frames is the batch). The scale checks (denoise) run 2 frames, so the temporal attention mixes
# frames (over one frame its softmax is 1 whatever the scale); the memorisation check trains one frame, as Train
# LoRA splits a LATENT's batch into samples. SV3D's azimuths for 2 frames are 0 and 360: the [0.0] given, repeated.
VIDEO_BATCH: dict[str, int] = {"SVD_img2vid": 2, "SV3D_u": 2, "SV3D_p": 2}
# Packed LATENTs (ComfyUI's NestedTensor): class -> the part shapes a latent node joins. LTX-2: a video
# (1, 128, frames, h, w) and an audio latent (1, 8, frames, 16) joined by LTXVConcatAVLatent.
# MiniMax H3: a video (1, 24, frames, h, w) and a stereo audio latent (1, 32, 2, frames), time last, as
# EmptyMiniMaxH3LatentAV shapes them for 5 video frames of 64 px.
PACKED: dict[str, tuple[tuple[int, ...], ...]] = {"LTXAV": ((1, 128, 2, 2, 2), (1, 8, 4, 16)),
                                                  "MiniMaxH3": ((1, 24, 2, 4, 4), (1, 32, 2, 8))}
# Image side in pixels (32 unless the family needs more: PixArt's position embedding needs 512; HiDream O1's
# 32-pixel patches: 512 gives 2 x 2 patches, the latent side being size / 8).
PIXELS: dict[str, int] = {"PixArtAlpha": 512, "PixArtSigma": 512, "ChromaRadiance": 128, "PixelDiTT2I": 128, "PiD": 128,
                          "ZImagePixelSpace": 128, "Stable_Cascade_B": 128,
                          "WAN22_WanDancer": 64, "HiDreamO1": 512}


def _norm_gains(module: torch.nn.Module) -> set[str]:
    """Names of the gains of every normalisation layer, found by class (GroupNorm, LayerNorm, RMSNorm, ...):
    the UNets name theirs by index (``input_blocks.1.0.in_layers.0``, ``out.0``), Lumina's ``cap_embedder.0``."""
    gains = {f"{owner}.{p}" if owner else p for owner, sub in module.named_modules() if "Norm" in type(sub).__name__
             for p, _ in sub.named_parameters(recurse=False) if p in ("weight", "scale")}
    # SeedVR2's AdaSingle multiplies the normalised input by (time-embedding scale + its own `<layer>_scale`)
    # with no 1 added: its `_scale` parameters are gains
    return gains | {f"{owner}.{p}" for owner, sub in module.named_modules() if type(sub).__name__ == "AdaSingle"
                    for p, _ in sub.named_parameters(recurse=False) if p.endswith("_scale")}


# Tensors above this many elements (only HiDream O1's 151,936-token table at 3072 wide: 467 M) repeat a seeded
# block of TABLE_BLOCK rows: drawing every number took 30 s and twice the table's memory.
LARGE, TABLE_BLOCK = 1 << 25, 4096


def _fill(module: torch.nn.Module, seed: int) -> None:
    """ComfyUI's ops leave weights uninitialised: fan-in scaled matrices, gains near 1, small biases.

    Gains are found by class, not by a "norm" in the name: a UNet's GroupNorm gains at 0.02 (what a bias gets)
    scaled its output to ~2 % of the noise it predicts (std 0.019) and capped what any LoRA could change."""
    gen, gains = torch.Generator().manual_seed(seed), _norm_gains(module)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2 and p.numel() > LARGE:
                block = torch.randn((TABLE_BLOCK, *p.shape[1:]), generator=gen) / math.sqrt(math.prod(p.shape[1:]))
                for start in range(0, p.shape[0], TABLE_BLOCK):
                    rows = p[start:start + TABLE_BLOCK]
                    rows.copy_(block[:rows.shape[0]])
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))
            elif name in gains or ("norm" in name and name.endswith(("weight", "scale"))):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


# Classes built like the rows but not in the table: LotusD (depth / normal estimation, x0-prediction from the
# image latent; Train LoRA refuses it by name, tests/comfy/test_families.py checks the refusal and the scale).
UNTRAINED: dict[str, dict] = {
    "LotusD": {**_SD2, "adm_in_channels": 4, "num_classes": "sequential", "transformer_depth_output": [1, 1, 1, 1]},
}


def available(name: str) -> str | None:
    """Why this ComfyUI cannot build ``name`` (it has no such class), or None."""
    import comfy.supported_models as sm

    return None if hasattr(sm, name) else f"ComfyUI here has no supported model {name}"


def state_dict(name: str, seed: int = 0) -> dict:
    """What ``get_model`` reads from the file besides the diffusion model's weights (STATE)."""
    gen = torch.Generator().manual_seed(seed + 7)
    if name == "Stable_Zero123":  # its cc_projection (CLIP image embedding + 4 camera values -> context width)
        width = CONTEXT[name][0]
        return {"cc_projection.weight": torch.randn((width - 4, width), generator=gen) / math.sqrt(width),
                "cc_projection.bias": 0.02 * torch.randn((width - 4,), generator=gen)}
    if name in V_PREDICTION_PROBE:  # SD 2.x 768-v: model_type reads this norm bias's spread (> 0.09: v)
        return {"output_blocks.11.1.transformer_blocks.0.norm1.bias": torch.randn((64,), generator=gen)}
    return {}


def build(name: str, seed: int = 0):
    """A ModelPatcher around ComfyUI's own model class ``name`` at the tiny config, fp32, CPU."""
    import comfy.model_patcher
    import comfy.supported_models as sm

    import comfyui_version

    cls = getattr(sm, name)
    older = comfyui_version.__version__.startswith("0.3.")
    tiny = {k: v for k, v in {**TINY, **UNTRAINED}[name].items() if not (older and k in NEWER_KEYS.get(name, ()))}
    config = cls({**cls.unet_config, **tiny})
    config.unet_config.update(tiny)  # over the class's unet_extra_config (released sizes)
    config.set_inference_dtype(torch.float32, None)
    with torch.inference_mode(False):
        # ComfyUI loads under inference mode; 0.3.75's Stable_Zero123 copies its cc_projection into a parameter
        # in place, which needs no_grad outside it
        with torch.no_grad() if name == "Stable_Zero123" else contextlib.nullcontext():
            model = config.get_model(state_dict(name, seed), "")
        _fill(model.diffusion_model, seed)
        for buf_name, buf in model.diffusion_model.named_buffers():
            if buf_name.endswith("pos_embed"):  # a buffer ComfyUI loads from the file (SD3): torch.empty here
                buf.copy_(0.02 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)))
        if name == "MiniMaxH3":  # its rotary frequencies, another buffer ComfyUI loads from the file
            import minimax_h3_tiny

            minimax_h3_tiny.fill_buffers(model.diffusion_model)
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def context_width(name: str) -> tuple[int, int | None]:
    return CONTEXT.get(name, (64, None))


def packed_latent(name: str, seed: int = 0) -> dict:
    """The LATENT of a packed family (PACKED): seeded parts joined by ComfyUI's own node (LTXVConcatAVLatent)."""
    from comfy_extras.nodes_lt import LTXVConcatAVLatent

    gen = torch.Generator().manual_seed(seed)
    video, audio = (torch.randn(shape, generator=gen) for shape in PACKED[name])
    return LTXVConcatAVLatent.execute({"samples": video}, {"samples": audio}).args[0]


def latent(model, seed: int = 0, frames: int = 1, size: int = 32) -> torch.Tensor:
    """A seeded latent of the model's channels: (1, C, H, W), or (1, C, frames, H, W) for video models; for a
    packed family (PACKED) its parts joined by ComfyUI's own latent node (LTXVConcatAVLatent: a NestedTensor)."""
    fmt = model.model.latent_format
    gen = torch.Generator().manual_seed(seed)
    name = type(model.model.model_config).__name__
    if name in PACKED:
        return packed_latent(name, seed)["samples"]
    spatial = (size // 8, size // 8)
    channels = LATENT_CHANNELS.get(type(fmt).__name__, fmt.latent_channels)
    shape = (1, channels, frames, *spatial) if fmt.latent_dimensions == 3 else (1, channels, *spatial)
    if name in VIDEO_BATCH:  # frames in the batch
        shape = (frames, channels, *spatial)
    return torch.randn(shape, generator=gen)


# Inputs the memorisation check leaves out (the forward counts keep them): Wan Animate's face crop runs a
# StyleGAN-style motion encoder at 512x512 whose widths ComfyUI fixes (~5 s a training step on 1 CPU thread,
# 2 min a row); the face adapter it feeds is not in the default preset, so the LoRA trained is the same modules.
NOT_IN_TRAINING: frozenset[str] = frozenset({"face"})


def token_conditioning(prompt: str = "a red fox in the snow") -> list:
    """What ComfyUI's HiDream O1 text encoder gives (a tokenizer only): the prompt's token ids, which the model's
    extra_conds lays out with the image patches (and a surrogate tensor of the ids)."""
    from comfy.text_encoders.hidream_o1 import HiDreamO1Tokenizer

    pairs = HiDreamO1Tokenizer().tokenize_with_weights(prompt)["hidream_o1"][0]
    ids = torch.tensor([[int(p[0]) for p in pairs]])
    return [[ids.unsqueeze(-1).float(), {"text_input_ids": ids}]]


# Families whose conditioning is token ids, not embeddings: class -> prompt.
TOKEN_IDS: dict[str, str] = {"HiDreamO1": "a red fox in the snow"}


def conditioning(name: str, seed: int = 0, tokens: int = 8, training: bool = False) -> list:
    if name in TOKEN_IDS:
        return token_conditioning(TOKEN_IDS[name])
    width, pooled = context_width(name)
    tokens = TOKENS.get(name, tokens)
    gen = torch.Generator().manual_seed(seed + 1)
    extra = {"pooled_output": torch.randn((1, pooled), generator=gen)} if pooled else {}
    for key, kind in EXTRAS.get(name, {}).items():
        if training and kind in NOT_IN_TRAINING:
            continue
        if kind == "text":
            extra[key] = torch.randn((1, tokens, 64), generator=gen)
        elif kind == "clip_vision":
            import comfy.clip_vision

            extra[key] = comfy.clip_vision.Output()
            extra[key]["penultimate_hidden_states"] = torch.randn((1, 257, 1280), generator=gen)
        elif kind == "start_latent":  # as many frames as the latent (Animate 2: the reference and one more)
            extra[key] = torch.randn((1, 16, FRAMES.get(name, 1), 4, 4), generator=gen)
        elif kind == "control_latent":
            extra[key] = torch.randn((1, 32, 1, 4, 4), generator=gen)
        elif kind == "camera":
            extra[key] = torch.randn((1, 24, 1, 32, 32), generator=gen)
        elif kind == "humo_audio":
            extra[key] = torch.randn((1, 1, 8, 5, 1280), generator=gen)
        elif kind == "s2v_audio":
            extra[key] = torch.randn((1, 25, 1024, 4), generator=gen)
        elif kind == "refiner_latent":
            extra[key] = torch.randn((1, 32, 1, 4, 4), generator=gen)
        elif kind == "face":
            extra[key] = torch.rand((1, 3, 1, 512, 512), generator=gen) * 2 - 1
        elif kind == "pose_latent":  # the pose video's latent: the generated frames, not the reference slot
            extra[key] = torch.randn((1, 16, 1, 4, 4), generator=gen)
        elif kind == "reference":  # a reference image's latent, listed as ReferenceLatent / the node lists it
            extra[key] = [torch.randn((1, 16, 1, 4, 4), generator=gen)]
        elif kind == "sr_latent":  # HunyuanVideo15SuperResolution: the low-resolution latent and its mask channel
            extra[key] = torch.zeros((1, 66, 1, 4, 4))
            extra[key][:, 33:65] = torch.randn((1, 32, 1, 4, 4), generator=gen)
            extra[key][:, 65] = 1
        elif kind == "sr_noise":  # the node's default noise augmentation of the low-resolution latent
            extra[key] = 0.7
        elif kind == "music":  # WanDancer's music features (35 per video frame at 30 fps)
            extra[key] = torch.randn((1, 4, 35), generator=gen)
        elif kind == "fps":  # the rate WanDancer's audio node gives (30: the base patch embedding / head)
            extra[key] = 30.0
        elif kind == "one":
            extra[key] = 1.0
        elif kind == "lq_latent":  # PiDConditioning: the low-quality image's latent (format's process_in), 4-D
            extra[key] = torch.randn((1, 16, 4, 4), generator=gen)
        elif kind == "zero_sigma":  # PiDConditioning's default degrade_sigma
            extra[key] = torch.tensor([0.0])
        elif kind == "seedvr_condition":  # SeedVR2Conditioning: the degraded video's latent and a ones mask channel
            extra[key] = torch.cat((torch.randn((1, 16, 1, 4, 4), generator=gen), torch.ones((1, 1, 1, 4, 4))), dim=1)
        elif kind in ("unclip_768", "unclip_1024"):  # unCLIPConditioning: a CLIP vision output's image embedding
            import comfy.clip_vision

            embeds = comfy.clip_vision.Output()
            embeds["image_embeds"] = torch.randn((1, int(kind[7:])), generator=gen)
            extra[key] = [{"clip_vision_output": embeds, "strength": 1.0, "noise_augmentation": 0.0}]
        elif kind == "image_latent":  # InstructPixToPixConditioning / StableZero123_Conditioning: the image's latent
            extra[key] = torch.randn((1, 4, 4, 4), generator=gen)
        elif kind == "x4_pixels":  # SD_4XUpscale_Conditioning: the low-resolution image in [-1, 1], latent-sized
            extra[key] = torch.rand((1, 3, 4, 4), generator=gen) * 2 - 1
        elif kind == "x4_noise":  # SD_4XUpscale_Conditioning's noise_augmentation; the node's default is 0
            extra[key] = 0.2
        elif kind == "svd_motion":
            extra[key] = 127
        elif kind == "svd_fps":
            extra[key] = 6
        elif kind == "zero":
            extra[key] = 0.0
        elif kind == "sv3d_angles":  # one frame: elevation 0 (the node's default), azimuth 0 (the first view)
            extra[key] = [0.0]
        elif kind == "start_mask":
            extra[key] = torch.zeros((1, 1, FRAMES.get(name, 1), 4, 4))
        elif kind == "none":
            extra[key] = None
        elif kind == "layers":
            extra[key] = torch.randn((1, 2, tokens, 64), generator=gen)
        else:
            extra[key] = torch.ones((1, tokens), dtype=torch.int64 if kind == "int_mask" else torch.float32)
    return [[torch.randn((1, tokens, width), generator=gen), extra]]


def denoise(model, name: str, seed: int = 0) -> torch.Tensor:
    """One euler step (cfg 1: one forward) through ComfyUI's sampler (a packed family's output flat), a new
    generation each call: HiDream O1's prompt-prefix key / value cache (kept on the model across runs, keyed by
    token ids) is cleared first, so every call computes the prefix with its own attention."""
    import comfy.sample

    clear = getattr(model.model.diffusion_model, "clear_kv_cache", None)
    if clear is not None:
        clear()

    x = latent(model, seed, frames=VIDEO_BATCH.get(name, FRAMES.get(name, 1)), size=PIXELS.get(name, 32))
    if name in EMPTY_LATENT:
        x = comfy.sample.fix_empty_latent_channels(model, torch.zeros_like(x))
    cond = conditioning(name, seed)
    noise = comfy.sample.prepare_noise(x, seed)
    out = comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, x, disable_pbar=True, seed=seed)
    if name in PACKED:  # a NestedTensor: every part's values, flat (video then audio)
        out = torch.cat([part.flatten() for part in out.unbind()])
    return out


def attention_functions() -> set[int]:
    """ids of ComfyUI's attention functions (``comfy.ldm.modules.attention``), as modules bind them."""
    import comfy.ldm.modules.attention as attn

    names = [n for n in dir(attn) if n.startswith("attention_") or n.startswith("optimized_attention")]
    return {id(getattr(attn, n)) for n in names if callable(getattr(attn, n)) and n != "optimized_attention_for_device"}


@contextmanager
def count_attention_calls():
    """Counts every attention call of a stock forward: ComfyUI's attention functions where comfy.ldm modules
    bound them, and ``scaled_dot_product_attention`` called from anywhere but inside one of those."""
    targets, saved, counts, depth = attention_functions(), [], {"comfy": 0, "sdpa": 0}, [0]

    def counting(func, kind):
        def call(*args, **kwargs):
            if not depth[0] or kind == "comfy":
                counts[kind] += 1
            depth[0] += 1
            try:
                return func(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name, module in list(sys.modules.items()):
        if name.startswith("comfy.ldm") and module is not None:
            for attr, value in list(vars(module).items()):
                if id(value) in targets:
                    saved.append((module, attr, value))
                    setattr(module, attr, counting(value, "comfy"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    saved.append((torch.nn.functional, "scaled_dot_product_attention", sdpa))
    torch.nn.functional.scaled_dot_product_attention = counting(sdpa, "sdpa")
    try:
        yield counts
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
