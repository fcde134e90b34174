"""Target presets per model family: which Linear layers of a diffusion model a preset name selects.

One registry (``PRESETS``): preset family -> preset name -> regexes matched with ``re.fullmatch`` against
module paths relative to the diffusion model (``double_blocks.0.img_attn.qkv``). The paths are the ones
ComfyUI's own model classes have (ComfyUI 0.33.0 and 0.3.75; ``tests/comfy/test_families.py`` builds every
image and video family of ``comfy/supported_models.py`` and checks each preset against the modules whose
class ComfyUI names an attention / MLP module).

Presets of every family:

- ``attention``: the attention projections (q, k, v, out; fused qkv; Flux-style single blocks, whose
  ``linear1`` / ``linear2`` fuse attention with the MLP);
- ``attention_mlp``: those and the feed-forward layers;
- ``all``: every Linear layer (Flux / Cosmos: every Linear inside the transformer blocks);
- ``community``: what the family's usual trainer targets by default (kohya sd-scripts for SD1.x/SDXL:
  every Linear of the transformer blocks plus ``proj_in`` / ``proj_out``; for DiTs, as musubi-tuner and
  diffusion-pipe do: every Linear inside the repeated transformer blocks);
- ``none``: nothing (``include`` alone picks the modules).

A family the pack has never seen uses ``generic``: a Linear anywhere under a module whose name says
attention (``attn``, ``attn1``, ``self_attn``, ``cross_attention``, ``img_attn`` ...) is an attention
projection, whatever its own name (``q``, ``w1q``, ``to_query``, ``img_attn_qkv`` ...).
"""
from __future__ import annotations

# Any Linear inside a module whose name contains "attn" / "attention" (Wan's self_attn.q, AuraFlow's
# attn.w1q, Kandinsky5's self_attention.to_query, JoyImage's attn.img_attn_qkv, Krea2's attn.wq ...).
# Wan S2V's audio injector is a list of cross-attention modules (audio_injector.injector.3.q / k / v / o).
_ANY_ATTN = (r"(?:.+\.)?[^.]*(?:attn|attention)[^.]*\..+", r"(?:.+\.)?injector\.\d+\.(?:q|k|v|o)")
# Any Linear inside a feed-forward module: mlp / mlpX / img_mlp / ffn / ff / audio_ff / ff_i (HiDream's
# image / text feed-forwards ff_i, ff_t) / feed_forward.
_ANY_MLP = (r"(?:.+\.)?(?:[^.]*(?:mlp|ffn|feed_forward|feedforward)[^.]*|(?:[a-z]+_)?ff(?:_[a-z])?)\..+",)
# Every Linear inside a numbered block of a block list (blocks.3, transformer_blocks.0, double_layers.1 ...).
_BLOCK_LINEARS = (r"(?:.+\.)?[a-z_0-9]*(?:blocks|layers|refiner)\.\d+\..+",)

_FLUX_ATTN = (
    r"double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)",
    # Single-stream blocks fuse attention with the MLP: linear1 = qkv + mlp-in, linear2 = proj + mlp-out.
    r"single_blocks\.\d+\.linear[12]",
)
# HunyuanVideo's text input runs its own small transformer blocks (the token refiner) with self-attention.
_HUNYUAN_REFINER = r"txt_in\.individual_token_refiner\.blocks\.\d+\."
_FLUX_ATTN += (_HUNYUAN_REFINER + r"self_attn\.(qkv|proj)",)
_FLUX_MLP = (r"double_blocks\.\d+\.(img|txt)_mlp\.\d+",)
_FLUX_BLOCKS = (r"(double_blocks|single_blocks)\.\d+\..+",)
_FLUX_ALL = _FLUX_BLOCKS + (_HUNYUAN_REFINER + ".+",)
_COSMOS_SELF = (r"blocks\.\d+\.self_attn\.(q_proj|k_proj|v_proj|output_proj)",)
_COSMOS_CROSS = (r"blocks\.\d+\.cross_attn\.(q_proj|k_proj|v_proj|output_proj)",)
_COSMOS_MLP = (r"blocks\.\d+\.mlp\.layer[12]",)
# CogVideoX's blocks hold their projections directly (blocks.3.q, blocks.3.attn_out, blocks.3.ff_proj).
_COGVIDEOX_ATTN = (r"blocks\.\d+\.(q|k|v|attn_out)",)
_COGVIDEOX_MLP = (r"blocks\.\d+\.(ff_proj|ff_out)",)
_UNET_BLOCK = r"(input_blocks\.\d+|middle_block|output_blocks\.\d+)\.\d+\."
# A spatial transformer's blocks, and the video UNet's (SVD / SV3D) temporal ones after them (time_stack.N:
# self- and cross-attention over frames, a feed-forward and the ff_in mix layer).
_UNET_TRANSFORMER = r"(transformer_blocks|time_stack)\.\d+\."
_UNET_ATTN = (_UNET_BLOCK + _UNET_TRANSFORMER + r"attn[12]\.(to_q|to_k|to_v|to_out\.0)",)
_UNET_MLP = (_UNET_BLOCK + _UNET_TRANSFORMER + r"ff(_in)?\.net\..+",)
# Stable Cascade stage B (the decoder: stage C's latent -> the VAE's 4-channel latent) has attention only at its
# two deepest levels (AttnBlock: attention.attn.to_q / to_k / to_v / out_proj, kv_mapper); the levels above are
# ResBlocks whose only Linears are the channelwise MLP (channelwise.0 in, channelwise.4 out). Family rule: its
# default preset also takes every ResBlock's channelwise MLP, so the default trains every level (attention
# alone lowered a memorisation loss by 11 %, below the 20 % every family reaches in tests/comfy/test_families.py).
_CASCADE_B_CHANNELWISE = (r"(?:down|up)_blocks\.\d+\.\d+\.channelwise\.[04]",)

PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "flux": {"attention": _FLUX_ATTN, "attention_mlp": _FLUX_ATTN + _FLUX_MLP, "all": _FLUX_ALL,
             "community": _FLUX_BLOCKS, "none": ()},
    "cosmos": {
        "attention": _COSMOS_SELF + _COSMOS_CROSS,
        "self_attention": _COSMOS_SELF,
        "attention_mlp": _COSMOS_SELF + _COSMOS_CROSS + _COSMOS_MLP,
        "all": (r"blocks\.\d+\..+",),
        "community": (r"blocks\.\d+\..+",),
        "none": (),
    },
    "cogvideox": {"attention": _COGVIDEOX_ATTN, "attention_mlp": _COGVIDEOX_ATTN + _COGVIDEOX_MLP, "all": (r".+",),
                  "community": (r"blocks\.\d+\..+",), "none": ()},
    "sd_unet": {"attention": _UNET_ATTN, "attention_mlp": _UNET_ATTN + _UNET_MLP, "all": (r".+",),
                "community": (_UNET_BLOCK + r"(" + _UNET_TRANSFORMER + r".+|proj_in|proj_out)",), "none": ()},
    "stable_cascade_b": {"attention": _ANY_ATTN + _CASCADE_B_CHANNELWISE,
                         "attention_mlp": _ANY_ATTN + _CASCADE_B_CHANNELWISE + _ANY_MLP, "all": (r".+",),
                         "community": _BLOCK_LINEARS, "none": ()},
    "generic": {"attention": _ANY_ATTN, "attention_mlp": _ANY_ATTN + _ANY_MLP, "all": (r".+",),
                "community": _BLOCK_LINEARS, "none": ()},
}

# Family names (the pack's short ids and ComfyUI's supported-model class names, lower case, "." and "-"
# removed) whose module paths are one of the registry's families. Anything else is "generic".
_FLUX_LIKE = ("flux", "flux1", "flux2", "chroma", "kontext", "fluxinpaint", "fluxschnell", "chromaradiance",
              "longcatimage", "hunyuanvideo", "hunyuanvideoi2v", "hunyuanvideoskyreelsi2v", "hunyuanimage21",
              "hunyuanimage21refiner", "hunyuanvideo15", "hunyuanvideo15_sr_distilled")
_COSMOS_LIKE = ("cosmos", "cosmos_predict2", "anima", "cosmost2ipredict2", "cosmosi2vpredict2")
_COGVIDEOX = ("cogvideox", "cogvideox_t2v", "cogvideox_i2v", "cogvideox_inpaint")
_SD_UNETS = ("sd15", "sd20", "sd21", "sdxl", "sdxlrefiner", "ssd1b", "segmind_vega", "koala_700m", "koala_1b",
             "sd15_instructpix2pix", "sdxl_instructpix2pix", "sd21unclipl", "sd21uncliph",
             "svd_img2vid", "sv3d_u", "sv3d_p", "stable_zero123", "sd_x4upscaler", "lotusd")
FAMILY_ALIASES: dict[str, str] = {
    **{k: "flux" for k in _FLUX_LIKE}, **{k: "cosmos" for k in _COSMOS_LIKE},
    **{k: "cogvideox" for k in _COGVIDEOX}, **{k: "sd_unet" for k in _SD_UNETS},
    "stable_cascade_b": "stable_cascade_b",
}


def preset_names() -> list[str]:
    """Every preset name of any family, for the node's option list ("attention" first)."""
    names: list[str] = []
    for presets in PRESETS.values():
        names.extend(n for n in presets if n not in names)
    return names


def preset_family(family: str) -> str:
    """Map a model family name (as model_info reports it) to a preset family; unknown → "generic"."""
    key = family.lower().replace(".", "").replace("-", "_")
    return FAMILY_ALIASES.get(key, "generic")
