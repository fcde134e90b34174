"""describe_model's head_dim (the softmax scale a saved LoRA records) for models whose config names no head
width: Qwen-Image's detection gives only its block count, so the width must come from its attention modules."""
from __future__ import annotations

import math

import pytest

import families


def test_qwen_image_head_dim_comes_from_its_attention_modules(pack_module):
    info_mod = pack_module("nodes.model.info")
    model = families.build("QwenImage")
    # as a released file is detected: the block count, nothing about heads or their width
    model.model.model_config.unet_config = {"image_model": "qwen_image", "in_channels": 64, "num_layers": 2}
    tiny = families.TINY["QwenImage"]
    info = info_mod.describe_model(model)
    assert (info.heads, info.head_dim) == (tiny["num_attention_heads"], tiny["attention_head_dim"])
    assert math.isclose(info.default_scale, 1 / math.sqrt(tiny["attention_head_dim"]))
    # so the LoRA metadata records the scale of a patched model (it recorded only the backend before)
    md = pack_module("nodes.lora.glue").attention_metadata(model, info)
    assert float(md["ss_attn_softmax_scale"]) == pytest.approx(1 / math.sqrt(tiny["attention_head_dim"]))


def test_modules_that_disagree_on_head_width_leave_it_unknown(pack_module):
    import torch

    info_mod = pack_module("nodes.model.info")

    class Attn(torch.nn.Module):
        def __init__(self, heads, dim_head):
            super().__init__()
            self.heads, self.dim_head = heads, dim_head

    mixed = torch.nn.Sequential(Attn(2, 32), Attn(4, 64))
    assert info_mod.attention_modules_head_dim(mixed) == (None, None)
    assert info_mod.attention_modules_head_dim(torch.nn.Sequential(Attn(2, 32), Attn(2, 32))) == (2, 32)
    assert info_mod.attention_modules_head_dim(torch.nn.Linear(2, 2)) == (None, None)


@pytest.mark.parametrize("name", ["WAN21_T2V", "WAN22_T2V"])
def test_wan_head_dim_comes_from_its_width_dim(pack_module, name):
    """Wan's config names its width ``dim`` (detection: num_heads = dim // 128) and its attention modules keep
    ``num_heads`` / ``head_dim``, not ``heads`` / ``dim_head``: the width must be read from ``dim``."""
    info_mod = pack_module("nodes.model.info")
    model = families.build(name)
    tiny = families.TINY[name]
    info = info_mod.describe_model(model)
    assert (info.heads, info.head_dim) == (tiny["num_heads"], tiny["dim"] // tiny["num_heads"])
    md = pack_module("nodes.lora.glue").attention_metadata(model, info)
    assert float(md["ss_attn_softmax_scale"]) == pytest.approx(1 / math.sqrt(tiny["dim"] // tiny["num_heads"]))


@pytest.mark.parametrize("name", ["Lumina2", "ZImage"])
def test_lumina2_and_z_image_head_dim_comes_from_n_heads_and_dim(pack_module, name):
    """Lumina 2 and Z-Image (NextDiT) name their heads ``n_heads`` and their width ``dim`` (detection: Z-Image 30
    heads of 3840), and their JointAttention modules keep ``n_local_heads`` / ``head_dim``: both from the config."""
    info_mod = pack_module("nodes.model.info")
    model = families.build(name)
    tiny = families.TINY[name]
    info = info_mod.describe_model(model)
    assert (info.heads, info.head_dim) == (tiny["n_heads"], tiny["dim"] // tiny["n_heads"])
    md = pack_module("nodes.lora.glue").attention_metadata(model, info)
    assert float(md["ss_attn_softmax_scale"]) == pytest.approx(1 / math.sqrt(tiny["dim"] // tiny["n_heads"]))
