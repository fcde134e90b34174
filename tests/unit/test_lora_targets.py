"""Target selection: presets per family, include/exclude, block filters, dry run, errors."""
from __future__ import annotations

import pytest

from lora.targets import (block_of, dry_run, parse_blocks, plan_targets, preset_family, preset_names,
                          select_targets)

H = 64
FLUX = {
    "img_in": (16, H), "time_in.in_layer": (256, H), "final_layer.linear": (H, 64),
    **{f"double_blocks.{i}.{s}_attn.qkv": (H, 3 * H) for i in range(2) for s in ("img", "txt")},
    **{f"double_blocks.{i}.{s}_attn.proj": (H, H) for i in range(2) for s in ("img", "txt")},
    **{f"double_blocks.{i}.{s}_mlp.{j}": (H, H) for i in range(2) for s in ("img", "txt") for j in (0, 2)},
    **{f"double_blocks.{i}.{s}_mod.lin": (H, 6 * H) for i in range(2) for s in ("img", "txt")},
    **{f"single_blocks.{i}.linear1": (H, 7 * H) for i in range(3)},
    **{f"single_blocks.{i}.linear2": (5 * H, H) for i in range(3)},
    **{f"single_blocks.{i}.modulation.lin": (H, 3 * H) for i in range(3)},
}
COSMOS = {
    "t_embedder.1.linear_1": (H, H), "x_embedder.proj.1": (68, H),
    **{f"blocks.{i}.{a}.{p}": (H, H) for i in range(3) for a in ("self_attn", "cross_attn")
       for p in ("q_proj", "k_proj", "v_proj", "output_proj")},
    **{f"blocks.{i}.mlp.layer{j}": (H, H) for i in range(3) for j in (1, 2)},
    **{f"blocks.{i}.adaln_modulation_mlp.1": (H, 3 * H) for i in range(3)},
}


def test_flux_presets():
    attn = select_targets(FLUX, "flux1", "attention")
    assert set(attn) == {k for k in FLUX if "_attn." in k or ".linear1" in k or ".linear2" in k}
    assert len(attn) == 8 + 6
    mlp = select_targets(FLUX, "flux2", "attention_mlp")
    assert set(mlp) - set(attn) == {k for k in FLUX if "_mlp." in k}
    every = select_targets(FLUX, "chroma", "all")
    assert set(every) == {k for k in FLUX if k.startswith(("double_blocks", "single_blocks"))}


def test_cosmos_presets():
    attn = select_targets(COSMOS, "cosmos_predict2", "attention")
    assert len(attn) == 3 * 8 and all("_attn." in k for k in attn)
    assert len(select_targets(COSMOS, "cosmos_predict2", "self_attention")) == 12
    assert set(select_targets(COSMOS, "anima", "attention_mlp")) == set(attn) | {k for k in COSMOS if ".mlp." in k}


def test_include_exclude_and_blocks():
    sel = select_targets(FLUX, "flux1", "attention", include=r"img_mlp\.0$", exclude=r"txt_attn")
    assert "double_blocks.1.img_mlp.0" in sel and not any("txt_attn" in k for k in sel)
    only_inc = select_targets(FLUX, "flux1", "none", include=r"^final_layer")
    assert list(only_inc) == ["final_layer.linear"] and only_inc["final_layer.linear"] == (H, 64)
    blk = select_targets(FLUX, "flux1", "attention", blocks="double_blocks:1, single_blocks:0-1")
    assert set(blk) == {"double_blocks.1.img_attn.qkv", "double_blocks.1.img_attn.proj", "double_blocks.1.txt_attn.qkv",
                        "double_blocks.1.txt_attn.proj", "single_blocks.0.linear1", "single_blocks.0.linear2",
                        "single_blocks.1.linear1", "single_blocks.1.linear2"}
    any_group = select_targets(COSMOS, "cosmos_predict2", "attention", blocks="2")
    assert len(any_group) == 8 and all(k.startswith("blocks.2.") for k in any_group)


def test_block_parsing():
    assert block_of("double_blocks.12.img_attn.qkv") == ("double_blocks", 12)
    assert block_of("blocks.3.mlp.layer1") == ("blocks", 3)
    assert block_of("final_layer.linear") is None
    assert [(r.group, r.start, r.stop) for r in parse_blocks("0-3; single_blocks:7")] == [(None, 0, 3), ("single_blocks", 7, 7)]
    with pytest.raises(ValueError, match=r"blocks filter item 'foo:1' is invalid"):
        parse_blocks("foo:1")


def test_dry_run_lists_shapes():
    infos = dry_run(FLUX, "flux1", "attention", blocks="single_blocks:2")
    assert [i.describe() for i in infos] == ["single_blocks.2.linear1  (64 -> 448)", "single_blocks.2.linear2  (320 -> 64)"]


def test_no_match_error_lists_available_modules():
    with pytest.raises(ValueError) as e:
        select_targets(FLUX, "flux1", "attention", include="", exclude=".", blocks="")
    msg = str(e.value)
    assert "no module matches targets='attention'" in msg and "exclude='.'" in msg
    assert f"{len(FLUX)} linear layers" in msg
    assert "double_blocks.0.img_attn.proj" in msg


def test_preset_not_in_family_and_unknown_family():
    with pytest.raises(ValueError, match=r"targets='self_attention' is not a preset of model family 'flux1'"):
        select_targets(FLUX, "flux1", "self_attention")
    assert preset_family("some_new_dit") == "generic" and preset_family("flux2") == "flux"
    assert preset_family("sdxl") == "sd_unet" and preset_family("WAN21_T2V") == "generic"
    generic = select_targets({"layers.0.attn.to_q": (8, 8), "layers.0.ff.net": (8, 8)}, "some_new_dit", "attention")
    assert list(generic) == ["layers.0.attn.to_q"]
    assert preset_names()[0] == "attention"


def test_block_indices_are_bounded_and_named_in_the_error():
    """Issue 13 fuzzing: a 5000-digit block index raised Python's int-conversion limit error, naming neither
    the input nor a fix."""
    import pytest

    from lora.targets import parse_blocks

    with pytest.raises(ValueError, match=r"blocks filter item '9999.*\(5000 characters\) is invalid: use 'N', 'N-M'"):
        parse_blocks("9" * 5000)
    with pytest.raises(ValueError, match=r"blocks filter item '0\\n1' is invalid"):
        parse_blocks("0\n1")
    assert parse_blocks("double_blocks:0-5, 7")[1].start == 7


# Module paths as ComfyUI 0.33's classes name them (one block each; tests/comfy/test_families.py checks the
# presets on the real classes of every family).
WAN = {"text_embedding.0": (H, H), "time_projection.1": (H, 6 * H), "head.head": (H, 64),
       **{f"blocks.0.{a}.{p}": (H, H) for a in ("self_attn", "cross_attn") for p in "qkvo"},
       "blocks.0.ffn.0": (H, 4 * H), "blocks.0.ffn.2": (4 * H, H)}
KREA2 = {"first": (H, H), "txtfusion.projector": (12, 1),
         **{f"blocks.0.attn.{p}": (H, H) for p in ("wq", "wk", "wv", "gate", "wo")},
         **{f"blocks.0.mlp.{p}": (H, H) for p in ("gate", "up", "down")}}
COGVIDEOX = {"patch_embed.text_proj": (H, H), "time_embedding_linear_1": (H, H), "proj_out": (H, 64),
             **{f"blocks.0.{p}": (H, H) for p in ("q", "k", "v", "attn_out", "ff_proj", "ff_out", "norm1.linear")}}


def test_generic_attention_matches_any_projection_under_an_attention_module():
    """Wan / AuraFlow / Kandinsky5 / JoyImage name their projections q, w1q, to_query, img_attn_qkv: the
    default preset matched none of them (issue 25)."""
    assert set(select_targets(WAN, "WAN21_T2V", "attention")) == {k for k in WAN if "_attn." in k}
    assert set(select_targets(WAN, "WAN21_T2V", "attention_mlp")) == {k for k in WAN if k.startswith("blocks.")}
    assert set(select_targets(WAN, "WAN21_T2V", "community")) == {k for k in WAN if k.startswith("blocks.")}
    other = {"double_layers.0.attn.w1q": (H, H), "visual_transformer_blocks.0.self_attention.to_query": (H, H),
             "double_blocks.0.attn.img_attn_qkv": (H, 3 * H), "double_layers.0.modC.1": (H, H),
             "double_blocks.0.img_mlp.net.0.proj": (H, H)}
    assert set(select_targets(other, "brand_new_model", "attention")) == set(list(other)[:3])
    assert set(select_targets(other, "brand_new_model", "attention_mlp")) == set(other) - {"double_layers.0.modC.1"}


def test_cogvideox_projections_sit_directly_in_its_blocks():
    assert set(select_targets(COGVIDEOX, "CogVideoX_T2V", "attention")) == {
        f"blocks.0.{p}" for p in ("q", "k", "v", "attn_out")}
    assert len(select_targets(COGVIDEOX, "cogvideox_i2v", "attention_mlp")) == 6


def test_module_narrower_than_the_rank_is_left_out_and_reported():
    plan = plan_targets(KREA2, "Krea2", "all", rank=4)
    assert "txtfusion.projector" not in plan.chosen and len(plan.chosen) == len(KREA2) - 1
    assert plan.report_lines() == ["left out (narrower than rank 4): txtfusion.projector  (12 -> 1)"]
    assert plan_targets(KREA2, "Krea2", "attention", rank=4).narrow == ()
    # named by include: the user asked for it, so it is an error naming the module, its shape and the fix
    with pytest.raises(ValueError, match=r"include='projector' names 'txtfusion\.projector' \(12 -> 1\), narrower "
                                         r"than rank=4: use rank <= 1"):
        plan_targets(KREA2, "Krea2", "none", include="projector", rank=4)
    with pytest.raises(ValueError, match=r"rank=4 exceeds the width of 'txtfusion\.projector' \(1x12\): use rank <= 1, "
                                         r"the widest of the 1 modules targets='all'"):
        plan_targets({"txtfusion.projector": (12, 1)}, "Krea2", "all", rank=4)


def test_sd_unet_community_is_kohyas_transformer_block_set():
    unet = {"input_blocks.1.1.proj_in": (H, H), "input_blocks.1.1.transformer_blocks.0.attn1.to_q": (H, H),
            "input_blocks.1.1.transformer_blocks.0.ff.net.0.proj": (H, 8 * H), "time_embed.0": (H, H),
            "middle_block.1.transformer_blocks.0.attn2.to_out.0": (H, H), "output_blocks.2.1.proj_out": (H, H)}
    assert set(select_targets(unet, "sdxl", "attention")) == {
        "input_blocks.1.1.transformer_blocks.0.attn1.to_q", "middle_block.1.transformer_blocks.0.attn2.to_out.0"}
    assert set(select_targets(unet, "sd15", "community")) == set(unet) - {"time_embed.0"}
