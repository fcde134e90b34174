"""PrecisionSaveLoRA files load in stock ComfyUI (LoraLoaderModelOnly) with no missing keys and the same
output; PrecisionLoadLoRA re-applies the recorded attention settings; bad files give clear errors."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from models import denoise, randomize_lora, tiny_cosmos, tiny_flux1, tiny_flux2

FAMILIES = {"flux1": tiny_flux1, "flux2": tiny_flux2, "cosmos": tiny_cosmos}
SAVE_ARGS = dict(folder="loras", save_dtype="fp32", key_style="auto", use_counter=True, overwrite=False)
LOAD_ARGS = dict(strength=1.0, mode="fp32", attention="apply_recorded", override_backend="auto",
                 override_scale_mode="default", override_scale_value=1.0)




@pytest.fixture(scope="module")
def glue(pack_module):
    return pack_module("nodes.lora.glue")


@pytest.fixture(scope="module")
def cfg_cls(pack_module):
    return pack_module("lora.config").LoRAConfig


@pytest.fixture(scope="module")
def attn(pack_module):
    return pack_module("nodes.attention.glue"), pack_module("attention.config").AttentionConfig


def node(node_id):
    import comfy_harness

    return comfy_harness.node_class(node_id)


def loras_dir() -> str:
    import folder_paths

    return folder_paths.get_folder_paths("loras")[0]


def lora_name(path: str) -> str:
    return os.path.relpath(path, loras_dir()).replace(os.sep, "/")


def save(model, prefix: str, **kw) -> str:
    return node("PrecisionSaveLoRA").execute(model, prefix, **{**SAVE_ARGS, **kw}).result[0]


def trained(glue, cfg_cls, base, seed=1, **cfg):
    model = glue.attach_lora(base, cfg_cls(**{"rank": 4, "targets": "attention_mlp", **cfg}))
    randomize_lora(glue.get_lora_set(model), seed)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_saved_lora_loads_in_stock_comfyui_with_same_output(family, glue, cfg_cls, caplog):
    import nodes as comfy_nodes
    from lora.file import read_lora_file

    base = FAMILIES[family]()
    model = trained(glue, cfg_cls, base)
    expected = denoise(model)
    path = save(model, f"stock/{family}")
    tensors, md = read_lora_file(path)
    prefix = "lora_unet_" if family != "cosmos" else "diffusion_model."
    assert all(k.startswith(prefix) for k in tensors) and sum(k.endswith(".alpha") for k in tensors) == len(tensors) // 3
    assert md["ss_network_dim"] == "4" and md["ss_base_model_version"] in ("flux1", "flux2", "cosmos_predict2")
    assert md["ss_lora_fp32_accumulation"] == "True" and "ss_attn_softmax_scale" in md
    with caplog.at_level(logging.WARNING):
        stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, lora_name(path), 1.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    assert len(stock.patches) == len(glue.get_lora_set(model).adapters())
    torch.testing.assert_close(denoise(stock), expected, rtol=1e-4, atol=1e-4)
    ours = node("PrecisionLoadLoRA").execute(base, lora_name(path), **LOAD_ARGS).result[0]
    torch.testing.assert_close(denoise(ours), expected, rtol=1e-5, atol=1e-5)


def test_load_lora_applies_recorded_scale_like_patch_attention_by_hand(glue, cfg_cls, attn):
    attention_glue, AttentionConfig = attn
    base = tiny_flux1()
    scaled = AttentionConfig(scale_mode="multiplier", scale_value=1.7)
    model = trained(glue, cfg_cls, attention_glue.patch_attention(base, scaled), seed=2)
    expected = denoise(model)
    path = save(model, "attn/scaled")
    loaded = node("PrecisionLoadLoRA").execute(base, lora_name(path), **LOAD_ARGS).result[0]
    assert attention_glue.get_attention_config(loaded) == scaled
    lora_only = node("PrecisionLoadLoRA").execute(base, lora_name(path), **{**LOAD_ARGS, "attention": "ignore"}).result[0]
    by_hand = node("PrecisionPatchAttention").execute(lora_only, backend="auto", scale_mode="multiplier", scale_value=1.7,
                                                      stable_beta=2.0, softclamp=0.0, fp32_softmax=False).result[0]
    out = denoise(loaded)
    assert torch.equal(out, denoise(by_hand))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    ignored = node("PrecisionLoadLoRA").execute(base, lora_name(path), **{**LOAD_ARGS, "attention": "ignore"}).result[0]
    assert attention_glue.get_attention_config(ignored) is None
    assert (denoise(ignored) - out).abs().max() > 1e-4  # the scale matters, so the test above can fail
    over = node("PrecisionLoadLoRA").execute(base, lora_name(path), **{
        **LOAD_ARGS, "attention": "override", "override_scale_mode": "absolute", "override_scale_value": 0.2}).result[0]
    assert attention_glue.get_attention_config(over) == AttentionConfig(scale_mode="absolute", scale_value=0.2)


def test_load_lora_warns_when_model_is_patched_differently(glue, cfg_cls, attn, caplog):
    attention_glue, AttentionConfig = attn
    base = tiny_flux1()
    path = save(trained(glue, cfg_cls, attention_glue.patch_attention(base, AttentionConfig(scale_mode="multiplier",
                                                                                             scale_value=1.5))), "attn/warn")
    incoming = attention_glue.patch_attention(base, AttentionConfig(scale_mode="multiplier", scale_value=0.5))
    with caplog.at_level(logging.WARNING):
        node("PrecisionLoadLoRA").execute(incoming, lora_name(path), **{**LOAD_ARGS, "attention": "ignore"})
    assert any("was trained with attention" in r.getMessage() and "keeping the model's" in r.getMessage()
               for r in caplog.records)


def test_foreign_lora_without_metadata_loads_with_default_attention(glue, cfg_cls, attn, tmp_path):
    from lora.file import lora_state_dict, save_lora_file

    attention_glue, _ = attn
    base = tiny_cosmos()
    model = trained(glue, cfg_cls, base, seed=3)
    path = save_lora_file(os.path.join(loras_dir(), "foreign", "plain.safetensors"),
                          lora_state_dict(glue.get_lora_set(model), "diffusion_model"), {}, overwrite=True)
    fp32 = node("PrecisionLoadLoRA").execute(base, lora_name(path), **LOAD_ARGS).result
    merged = node("PrecisionLoadLoRA").execute(base, lora_name(path), **{**LOAD_ARGS, "mode": "merge"}).result[0]
    assert attention_glue.get_attention_config(fp32[0]) is None and "no settings recorded" in fp32[1]
    torch.testing.assert_close(denoise(fp32[0]), denoise(merged), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(denoise(fp32[0]), denoise(model), rtol=1e-5, atol=1e-5)


def test_init_from_saved_lora_continues_and_rank_mismatch_errors(glue, cfg_cls):
    base = tiny_flux2()
    model = trained(glue, cfg_cls, base, seed=4)
    path = save(model, "init/src")
    cont = glue.attach_lora(base, cfg_cls(rank=4, targets="attention_mlp", alpha=8.0), init_file=path)
    torch.testing.assert_close(denoise(cont), denoise(model), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"has rank 4 but rank=8: set rank to 4"):
        glue.attach_lora(base, cfg_cls(rank=8, targets="attention_mlp"), init_file=path)


def test_save_naming_counter_overwrite_and_escape(glue, cfg_cls):
    model = trained(glue, cfg_cls, tiny_flux1())
    first, second = save(model, "names/run"), save(model, "names/run")
    assert [os.path.basename(p) for p in (first, second)] == ["run_00001_.safetensors", "run_00002_.safetensors"]
    fixed = save(model, "names/fixed", use_counter=False)
    with pytest.raises(ValueError, match=r"PrecisionSaveLoRA: fixed.safetensors exists in .*: enable overwrite"):
        save(model, "names/fixed", use_counter=False)
    assert save(model, "names/fixed", use_counter=False, overwrite=True) == fixed
    before = sorted(os.listdir(os.path.dirname(loras_dir())))
    for bad, why in (("../escape", "contains '..'"), ("/tmp/abs", "is an absolute path"), ("dir/", "ends with a folder separator and has no file name")):
        with pytest.raises(ValueError, match=rf"PrecisionSaveLoRA: input 'filename_prefix'='{bad}' {why}"):
            save(model, bad)
        assert why in node("PrecisionSaveLoRA").validate_inputs(filename_prefix=bad)
    assert sorted(os.listdir(os.path.dirname(loras_dir()))) == before
    assert not [f for _r, _d, fs in os.walk(loras_dir()) for f in fs if f.endswith(".partial")]
    with pytest.raises(ValueError, match=r"input 'model' carries no LoRA: connect the output of Attach LoRA"):
        save(tiny_flux1(), "names/none")


def test_load_lora_bad_files(glue, cfg_cls):
    base = tiny_flux1()
    good = save(trained(glue, cfg_cls, base), "bad/good")
    data = open(good, "rb").read()
    trunc = os.path.join(loras_dir(), "bad", "truncated.safetensors")
    with open(trunc, "wb") as f:
        f.write(data[: len(data) // 3])
    with pytest.raises(ValueError, match=r"^\[Precision LoRA\] PrecisionLoadLoRA: input 'lora_name'='bad/truncated.safetensors': "
                                         r"cannot read LoRA file .*truncated\.safetensors.*corrupt or truncated"):
        node("PrecisionLoadLoRA").execute(base, "bad/truncated.safetensors", **LOAD_ARGS)
    cosmos_lora = save(trained(glue, cfg_cls, tiny_cosmos()), "bad/cosmos")
    for mode in ("fp32", "merge"):
        with pytest.raises(ValueError, match=r"PrecisionLoadLoRA: lora_name 'bad/cosmos_00001_.safetensors': none of its .* keys"):
            node("PrecisionLoadLoRA").execute(base, lora_name(cosmos_lora), **{**LOAD_ARGS, "mode": mode})


def test_trainer_info_and_attention_reach_the_metadata(glue, cfg_cls, attn):
    from lora.file import read_lora_file

    attention_glue, AttentionConfig = attn
    model = trained(glue, cfg_cls, attention_glue.patch_attention(tiny_cosmos(), AttentionConfig(scale_mode="absolute",
                                                                                                 scale_value=0.25)))
    glue.get_lora_set(model).info.update({"ss_steps": "7", "ss_training_started_at": "123.0"})
    _t, md = read_lora_file(save(model, "meta/info", save_dtype="fp16"))
    assert md["ss_steps"] == "7" and md["ss_training_started_at"] == "123.0"
    assert float(md["ss_attn_softmax_scale"]) == 0.25 and md["ss_attn_scale_mode"] == "absolute"
    assert md["ss_key_style"] == "diffusion_model" and md["ss_save_dtype"] == "fp16"
    assert float(md["ss_training_finished_at"]) > 0 and md["precision_lora_version"]
    assert AttentionConfig.from_metadata(md) == AttentionConfig(scale_mode="absolute", scale_value=0.25)


def test_fp16_overflow_and_non_finite_files_are_refused_by_the_nodes(glue, cfg_cls):
    """D1 (issue 13): Save LoRA with save_dtype=fp16 wrote inf (values above 65504) and Load LoRA applied
    it silently (a NaN image reported as success)."""
    from safetensors.torch import load_file, save_file

    model = trained(glue, cfg_cls, tiny_flux1())
    lora_set = glue.get_lora_set(model)
    with torch.no_grad():
        next(iter(lora_set.adapters().values())).up[0, 0] = 2.0e5
    os.makedirs(loras_dir(), exist_ok=True)
    before = sorted(os.listdir(loras_dir()))
    with pytest.raises(ValueError, match=r"PrecisionSaveLoRA: input 'save_dtype'='fp16': save dtype fp16 cannot hold "
                                         r"'lora_unet_.*': its largest value 2e\+05 is above fp16's maximum 65504"):
        save(model, "overflow/fp16", save_dtype="fp16")
    assert sorted(os.listdir(loras_dir())) == before
    path = save(model, "overflow/fp32")  # fp32 holds it
    tensors = {k: v.to(torch.float16) for k, v in load_file(path).items()}
    save_file(tensors, os.path.join(loras_dir(), "overflow", "foreign_fp16.safetensors"))  # as another tool would
    with pytest.raises(ValueError, match=r"PrecisionLoadLoRA: input 'lora_name'='overflow/foreign_fp16.safetensors': "
                                         r"LoRA file '.*foreign_fp16.safetensors' holds NaN/inf in "
                                         r"'lora_unet_.*' .* save it again as fp32"):
        node("PrecisionLoadLoRA").execute(tiny_flux1(), "overflow/foreign_fp16.safetensors", **LOAD_ARGS)
