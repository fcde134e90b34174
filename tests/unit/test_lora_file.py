"""LoRA file format: keys, .alpha, dtypes, metadata, atomic save, read errors, key parsing."""
from __future__ import annotations

import json
import os

import pytest
import torch

from lora.config import LoRAConfig
from lora.layer import LoRASet
from lora.file import (default_key_style, file_rank, lora_metadata, lora_state_dict, parse_lora_tensors,
                                read_lora_file, save_lora_file)

SHAPES = {"double_blocks.0.img_attn.qkv": (16, 48), "single_blocks.0.linear2": (40, 16)}


def _set(rank=4, **kw) -> LoRASet:
    s = LoRASet(LoRAConfig(rank=rank, alpha=2.0, **kw), SHAPES)
    with torch.no_grad():
        for a in s.adapters().values():
            a.up.normal_()
            a.mark_modified()
    return s


def test_kohya_and_diffusion_model_keys_with_alpha():
    s = _set()
    kohya = lora_state_dict(s, "kohya", "fp32")
    assert set(kohya) == {f"lora_unet_{p}.{k}" for p in ("double_blocks_0_img_attn_qkv", "single_blocks_0_linear2")
                          for k in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert kohya["lora_unet_single_blocks_0_linear2.lora_down.weight"].shape == (4, 40)
    assert kohya["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item() == 2.0
    dm = lora_state_dict(s, "diffusion_model", torch.bfloat16)
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight" in dm
    assert dm["diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight"].dtype == torch.bfloat16
    assert dm["diffusion_model.double_blocks.0.img_attn.qkv.alpha"].dtype == torch.float32
    assert default_key_style("flux1") == "kohya" and default_key_style("cosmos_predict2") == "diffusion_model"


def test_rslora_alpha_reproduces_scale_under_comfy_rule():
    s = _set(rslora=True)
    sd = lora_state_dict(s, "kohya", "fp16")
    alpha = sd["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item()
    assert alpha / 4 == pytest.approx(s.config.scale) and s.config.scale == pytest.approx(1.0)


def test_save_read_roundtrip_and_parse(tmp_path):
    s = _set()
    md = lora_metadata(s.config, family="flux1", key_style="kohya", mixed_precision="bf16", extra={"ss_steps": 12})
    path = save_lora_file(str(tmp_path / "a.safetensors"), lora_state_dict(s, "kohya"), md)
    tensors, md2 = read_lora_file(path)
    assert md2 == md and md2["ss_steps"] == "12" and md2["ss_network_dim"] == "4" and md2["ss_network_alpha"] == "2.0"
    args = json.loads(md2["ss_network_args"])
    assert args["targets"] == "attention" and args["fp32_accumulation"] is True
    parsed = parse_lora_tensors(tensors, SHAPES)
    assert file_rank(parsed) == 4
    for path_, a in s.adapters().items():
        assert torch.equal(parsed[path_].down, a.down) and torch.equal(parsed[path_].up, a.up)
        assert parsed[path_].scale == pytest.approx(0.5)
    assert os.listdir(tmp_path) == ["a.safetensors"]


def test_never_overwrites_unless_asked(tmp_path):
    s = _set()
    path = str(tmp_path / "x.safetensors")
    save_lora_file(path, lora_state_dict(s, "kohya"), {"k": "1"})
    with pytest.raises(FileExistsError, match="exists: choose another name or enable overwrite"):
        save_lora_file(path, lora_state_dict(s, "kohya"), {"k": "2"})
    assert read_lora_file(path)[1] == {"k": "1"}
    save_lora_file(path, lora_state_dict(s, "kohya"), {"k": "2"}, overwrite=True)
    assert read_lora_file(path)[1] == {"k": "2"}


def test_bad_metadata_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"metadata values must be strings; got \{'ss_steps': 'int'\}"):
        save_lora_file(str(tmp_path / "y.safetensors"), lora_state_dict(_set(), "kohya"), {"ss_steps": 3})
    assert os.listdir(tmp_path) == []


def test_corrupt_and_truncated_files(tmp_path):
    good = save_lora_file(str(tmp_path / "g.safetensors"), lora_state_dict(_set(), "kohya"), {})
    data = open(good, "rb").read()
    trunc = tmp_path / "t.safetensors"
    trunc.write_bytes(data[: len(data) // 2])
    junk = tmp_path / "j.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    for bad in (trunc, junk):
        with pytest.raises(ValueError, match=rf"cannot read LoRA file '{bad}'.*corrupt or truncated"):
            read_lora_file(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_lora_file(str(tmp_path / "missing.safetensors"))


def test_parse_errors():
    sd = lora_state_dict(_set(), "kohya")
    with pytest.raises(ValueError, match=r"none of its 6 keys .* matches a linear layer of this model"):
        parse_lora_tensors(sd, {"blocks.0.self_attn.q_proj": (16, 16)})
    bad_rank = dict(sd)
    bad_rank["lora_unet_single_blocks_0_linear2.lora_up.weight"] = torch.zeros(16, 3)
    with pytest.raises(ValueError, match=r"rank mismatch at 'single_blocks.0.linear2': down \(4, 40\) vs up \(16, 3\)"):
        parse_lora_tensors(bad_rank, SHAPES)
    with pytest.raises(ValueError, match=r"'double_blocks.0.img_attn.qkv' is 96x16 in this model"):
        parse_lora_tensors(sd, {**SHAPES, "double_blocks.0.img_attn.qkv": (16, 96)})
    extra = {**sd, "lora_unet_other_layer.lora_up.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"1 keys do not match this model \(e.g. \['lora_unet_other_layer.lora_up.weight'\]\)"):
        parse_lora_tensors(extra, SHAPES)


def test_peft_names_and_missing_alpha_use_comfy_rule():
    s = _set()
    sd = {}
    for path, a in s.adapters().items():
        sd[f"diffusion_model.{path}.lora_A.weight"] = a.down.detach()
        sd[f"diffusion_model.{path}.lora_B.weight"] = a.up.detach()
    parsed = parse_lora_tensors(sd, SHAPES)
    assert all(f.scale == 1.0 for f in parsed.values())  # no .alpha -> scale 1.0, as ComfyUI does


def test_pack_version_is_pyprojects_as_a_toml_parser_reads_it():
    """PACK_VERSION (written into every saved LoRA) is read from pyproject.toml by a small parser; a real TOML
    parser reads the same [project] version, and it is the only version string of the pack."""
    import re

    from lora.file import PACK_VERSION

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml with tomllib")

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert PACK_VERSION == version
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)  # the Comfy Registry's X.Y.Z
    meta = lora_metadata(LoRAConfig(rank=4), family="flux1", key_style="kohya", mixed_precision="fp32")
    assert meta["precision_lora_version"] == version
    with open(os.path.join(root, "lora", "file.py"), encoding="utf-8") as f:
        assert not re.search(r"PACK_VERSION\s*=\s*[\"']", f.read())  # not written down a second time


@pytest.mark.parametrize("text, expected", [
    ('[project]\nname = "x"\nversion = "1.2.3"\n', "1.2.3"),
    ('[project]\nversion = "1.2.3"  # a comment\n', "1.2.3"),
    ("[project]\nversion = '4.5.6'\n", "4.5.6"),
    ('[tool.other]\nversion = "9.9.9"\n[project]\nversion = "1.0.0"\n', "1.0.0"),  # another table's version
    ('[project]\nname = "x"\n[tool.other]\nversion = "9.9.9"\n', "unknown"),  # [project] has none
    ('[project]\nname = "x"\n[[tool.list]]\nversion = "9.9.9"\n', "unknown"),  # an array of tables ends it
    ('[project]\n# version = "0.0.1"\nversion = "2.0.0"\n', "2.0.0"),  # a commented-out line
])
def test_read_pack_version(tmp_path, text, expected):
    from lora.file import read_pack_version

    path = tmp_path / "pyproject.toml"
    path.write_text(text, encoding="utf-8")
    assert read_pack_version(str(path)) == expected
    assert read_pack_version(str(tmp_path / "missing.toml")) == "unknown"


def test_fp16_overflow_is_refused_not_written_as_inf(tmp_path):
    """D1 (issue 13): save_dtype=fp16 wrote inf for values above 65504, and loading it was silent."""
    s = _set()
    with torch.no_grad():
        s.adapters()["single_blocks.0.linear2"].up[0, 0] = 1.0e5
    with pytest.raises(ValueError, match=r"save dtype fp16 cannot hold 'lora_unet_single_blocks_0_linear2.lora_up.weight': "
                                         r"its largest value 1e\+05 is above fp16's maximum 65504 .* save as fp32"):
        lora_state_dict(s, "kohya", "fp16")
    for dtype in ("fp32", "bf16"):  # both hold 1e5
        assert all(torch.isfinite(t).all() for t in lora_state_dict(s, "kohya", dtype).values())


def test_non_finite_tensors_are_never_written_nor_loaded(tmp_path):
    """D1 (issue 13): nothing non-finite reaches a LoRA file, and a foreign file holding inf is refused."""
    from safetensors.torch import save_file

    from training.guard import NonFiniteError

    tensors = lora_state_dict(_set(), "kohya", "fp32")
    key = "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"
    tensors[key][0, 0] = float("inf")
    target = str(tmp_path / "bad.safetensors")
    with pytest.raises(NonFiniteError, match=rf"'{key}' holds NaN/inf"):
        save_lora_file(target, tensors, {})
    assert os.listdir(tmp_path) == []
    save_file(tensors, target)  # written by another tool
    with pytest.raises(ValueError, match=rf"bad.safetensors' holds NaN/inf in '{key}' .* save it again as fp32"):
        read_lora_file(target)
