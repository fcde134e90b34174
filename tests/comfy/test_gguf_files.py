"""The GGUF files the GGUF tests train on (tests/gguf_models.py), read back by ComfyUI-GGUF itself (the real pack,
tests/other_packs.py): the K-quant encoder against ComfyUI-GGUF's dequantizer and gguf-py's, and every tensor of the
tiny model's files within its GGML type's error of the original, as *Unet Loader (GGUF)* loads them.
"""
from __future__ import annotations

import os

import pytest
import torch

import gguf_models
import other_packs

pytestmark = pytest.mark.usefixtures("one_thread")

TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K"]
F16_SLACK = 2**-10  # ComfyUI-GGUF multiplies scale and quant in fp16 (its default dequant dtype): one more rounding


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.double().reshape(-1, size)


def max_error(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """The largest error of each weight of ``x`` (rows, cols) in GGML type ``qtype``, from its block's values:
    legacy quants round to a step of the block's largest magnitude / 127 (Q8_0, half a step) or / 8, / 16 (Q4_0,
    Q5_0: the largest weight maps to -8 / -16, so the other side clamps: up to one step); K-quants to half a step of
    their 32-weight sub-block's range / (2^bits - 1), widened by the 6-bit rounding of its scale and min (1/63 of
    the super-block's largest). Plus the fp16 rounding of ComfyUI-GGUF's own arithmetic."""
    x64 = x.double()
    if qtype in ("F16", "BF16"):
        return x64.abs() * (2**-11 if qtype == "F16" else 2**-8) + 1e-7
    if qtype in ("Q8_0", "Q4_0", "Q5_0"):
        amax = _blocks(x, 32).abs().amax(-1, keepdim=True)
        step = amax / {"Q8_0": 127, "Q4_0": 8, "Q5_0": 16}[qtype] * (1 + 2**-10)
        bound = step / 2 if qtype == "Q8_0" else step
        return (bound.expand(-1, 32).reshape(x.shape) + x64.abs() * F16_SLACK)
    qmax = 2 ** gguf_models.K_BITS[qtype] - 1
    sub = x64.reshape(-1, 8, 32)
    mins = (-sub.amin(-1)).clamp(min=0)
    dmin = mins.amax(-1, keepdim=True) / 63 * 1.01
    need = (sub.amax(-1) + mins + dmin) / qmax
    step = need + need.amax(-1, keepdim=True) / 63 * 1.01
    # fp16 products d·sc·q and dmin·m, each up to twice the sub-block's largest magnitude, then their difference
    slack = sub.abs().amax(-1) * 4 * F16_SLACK
    return ((step / 2 + slack)[..., None]).expand(-1, -1, 32).reshape(x.shape)


@pytest.fixture(scope="module")
def gg(pack):
    return other_packs.load_in_process(other_packs.GGUF)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
def test_the_k_quant_encoder_writes_blocks_comfyui_gguf_dequantizes_to_the_weight(gg, qtype):
    """A weight with all-positive, all-negative, zero and outlier sub-blocks, encoded by tests/gguf_models.py:
    ComfyUI-GGUF's dequantizer gives it back within the format's error (``max_error``), and gguf-py's own
    dequantizer reads the same values from the same bytes (so the layout is GGML's, not one both could misread)."""
    import gguf

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1024, generator=gen) / 16
    w[1] = w[1].abs()
    w[2] = -w[2].abs()
    w[3, :32] = 0
    w[4, 7] = 3.0  # an outlier: its super-block's scales are large, the others' are not
    raw = gguf_models.quantize(w, qtype)
    qt = gguf.GGMLQuantizationType[qtype]
    assert raw.shape == (16, 1024 // 256 * gguf.GGML_QUANT_SIZES[qt][1])
    tensor = gg.ops.GGMLTensor(torch.from_numpy(raw), tensor_type=qt, tensor_shape=w.shape)
    ours = gg.dequant.dequantize_tensor(tensor, torch.float32).as_subclass(torch.Tensor)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qt))
    excess = float(((ours.double() - w.double()).abs() - max_error(w, qtype)).max())
    assert excess <= 0, f"{qtype}: a weight is off by {excess:.3g} more than the format's error"
    assert float((ours - theirs).abs().max()) <= float(theirs.abs().max()) * F16_SLACK
    assert float((ours - w).norm() / w.norm()) > 1e-4  # it really quantized (a copy would pass any bound)


@pytest.mark.parametrize("qtype", TYPES)
def test_every_tensor_of_the_tiny_file_loads_within_its_types_error(gg, pack_module, qtype, tmp_path):
    """The tiny Cosmos written in ``qtype`` (from its bf16 original) and loaded by ComfyUI-GGUF's Unet Loader (GGUF):
    each weight is a GGMLTensor of the type the conversion rules give (tiny and 1-D tensors F32, rows the blocks do
    not divide F16, the rest ``qtype``), most of the model is in ``qtype``, and dequantized it is within that type's
    error of the original."""
    import folder_paths

    tiny = pack_module("demo.tiny_models")
    original = {k: v.to(torch.bfloat16).float() for k, v in tiny.tiny_state_dict(gguf_models.tiny_cosmos(tiny)).items()}
    name = f"gguf_files_{qtype}.gguf"
    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    os.makedirs(folder, exist_ok=True)
    types = gguf_models.write_gguf(original, os.path.join(folder, name), qtype)
    in_type = sum(v.numel() for k, v in original.items() if types[k] == qtype)
    assert in_type > 0.9 * sum(v.numel() for v in original.values())
    with torch.inference_mode():
        model = gg.nodes.UnetLoaderGGUF().load_unet(name)[0]
    checked = 0
    for key, p in model.model.diffusion_model.named_parameters():
        if type(p).__name__ != "GGMLTensor":
            continue
        assert p.tensor_type.name == types[key], key
        got = gg.dequant.dequantize_tensor(p, torch.float32).as_subclass(torch.Tensor).double()
        error = (got - original[key].double()).abs()
        bound = torch.zeros_like(error) if types[key] == "F32" else max_error(original[key], types[key])
        excess = float((error - bound).max())
        assert excess <= 0, f"{key} ({types[key]}): a weight is off by {excess:.3g} more than the format's error"
        checked += 1
    assert checked >= 140  # every block Linear (14 per block, 10 blocks) and the embedders
