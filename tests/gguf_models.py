"""Tiny GGUF diffusion models for tests, written at test time (never committed), as ComfyUI-GGUF's loader reads them.

The tiny Cosmos-Predict2 of ``demo/tiny_models.py`` (ComfyUI's stock detection loads it, so ComfyUI-GGUF's
*Unet Loader (GGUF)* does too), 256 channels wide: every Linear of its blocks has rows of 256 or 1024 weights, so
each block type quantizes them, the K-quants' 256-weight super-blocks included (the 192-wide demo model's rows
are not a multiple of 256). The state dict is converted the way ComfyUI-GGUF's ``tools/convert.py`` and its
patched ``llama-quantize`` do (read there, not copied): 1-D and tiny (<= 1024 weights) tensors and Cosmos'
``pos_embedder`` stay F32, a tensor whose rows do not split into the type's blocks falls back to F16, the rest is
stored in the asked type; the file's architecture is ``cosmos``.

gguf-py 0.19 writes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 itself and raises ``NotImplementedError`` for the
K-quants; ``encode_k`` below encodes Q4_K and Q5_K following GGML's block layout (ggml-common.h ``block_q4_K`` /
``block_q5_K``), with a plain min/max choice of the 6-bit sub-block scales and mins (llama.cpp searches them
better; the layout, which the dequantizers read, is the same).

    write_gguf(sd, path, "Q8_0")     the file; returns {tensor name: GGML type name}
    encode_k(w, bits)                Q4_K (bits 4) / Q5_K (bits 5) blocks of a (rows, 256·k) weight, uint8
"""
from __future__ import annotations

import os

import numpy as np
import torch

TINY_WIDTH = 256  # the tiny Cosmos' channels: rows of 256 / 1024 weights in every block Linear
QUANTIZATION_THRESHOLD = 1024  # tensors of at most this many weights stay F32 (tools/convert.py)
HIGH_PRECISION = ("pos_embedder",)  # Cosmos keys tools/convert.py keeps in F32
IGNORED = ("_extra_state", "accum_")  # Cosmos keys tools/convert.py drops
QK_K = 256  # weights per K-quant super-block: 8 sub-blocks of 32


def tiny_cosmos(tiny_models, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The tiny Cosmos of ``demo.tiny_models`` (``tiny_models``: that module) at ``TINY_WIDTH`` channels."""
    config = {**tiny_models.cosmos_unet_config(), "model_channels": TINY_WIDTH}
    return tiny_models.build_tiny_model("cosmos", seed, dtype, unet_config=config)


def _gguf():
    import gguf

    return gguf


def stored_type(key: str, t: torch.Tensor, qtype: str) -> str:
    """The GGML type ``t`` is stored in when the file's type is ``qtype``."""
    gguf = _gguf()
    if t.ndim <= 1 or t.numel() <= QUANTIZATION_THRESHOLD or any(k in key for k in HIGH_PRECISION):
        return "F32"
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return qtype if t.shape[-1] % block == 0 else "F16"


def _f16_at_least(v: torch.Tensor) -> torch.Tensor:
    """``v`` (fp64) rounded to an fp16 value >= v (so 63 steps of it still cover the largest sub-block)."""
    h = (v * (1 + 2**-10)).to(torch.float16)
    return torch.where(h.double() < v, (v * (1 + 2**-8)).to(torch.float16), h)


def _pack_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """GGML's 12-byte K_SCALE_SIZE field from 8 six-bit scales and 8 six-bit mins per super-block: bytes 0-3 and
    4-7 hold scales / mins 0-3 in their low six bits and the top two bits of scales / mins 4-7; bytes 8-11 the
    low four bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    lo_s, hi_s, lo_m, hi_m = sc[:, :4], sc[:, 4:], m[:, :4], m[:, 4:]
    first = lo_s | ((hi_s >> 4) << 6)
    second = lo_m | ((hi_m >> 4) << 6)
    third = (hi_s & 0xF) | ((hi_m & 0xF) << 4)
    return torch.cat([first, second, third], dim=1).to(torch.uint8)


def encode_k(w: torch.Tensor, bits: int) -> np.ndarray:
    """Q4_K (``bits`` 4) or Q5_K (5) blocks of ``w`` (rows, cols), cols a multiple of 256: (rows, cols/256·size)
    uint8. Each super-block: fp16 d and dmin, the packed scales, (Q5_K) 32 bytes of fifth bits, 128 bytes of
    low nibbles; a weight decodes as d·sc_j·q - dmin·m_j with q in [0, 2^bits - 1]. The sub-block's mins are
    rounded up and its scales chosen after them, so every weight lies inside its sub-block's grid: the error is
    at most half a step (d·sc_j / 2)."""
    rows = w.shape[0]
    x = w.detach().double().reshape(-1, 8, 32)  # (super-blocks, sub-blocks, weights)
    qmax = 2**bits - 1
    mins = (-x.amin(-1)).clamp(min=0)  # subtracted: a sub-block's lowest weight (0 when all are positive)
    dmin = _f16_at_least(mins.amax(-1) / 63)
    m = torch.where(dmin[:, None] > 0, torch.ceil(mins / dmin.double().clamp(min=1e-30)[:, None]), 0).clamp(0, 63)
    offset = dmin.double()[:, None] * m
    need = (x.amax(-1) + offset) / qmax  # the step that reaches the sub-block's highest weight
    d = _f16_at_least(need.amax(-1) / 63)
    sc = torch.where(d[:, None] > 0, torch.ceil(need / d.double().clamp(min=1e-30)[:, None]), 0).clamp(0, 63)
    step = (d.double()[:, None] * sc)[..., None]
    q = torch.where(step > 0, torch.round((x + offset[..., None]) / step.clamp(min=1e-30)), 0).clamp(0, qmax)
    q = q.to(torch.int64)
    head = torch.stack([d, dmin], 1).view(torch.uint8).reshape(-1, 4).to(torch.int64)
    parts = [head, _pack_scales(sc.to(torch.int64), m.to(torch.int64)).to(torch.int64)]
    if bits == 5:  # qh: bit k of byte l is the fifth bit of weight l of sub-block k
        fifth = (q >> 4) & 1
        parts.append(sum(fifth[:, k] << k for k in range(8)))
    low = q & 0xF  # bytes 32c..32c+31: sub-block 2c in the low nibble, 2c+1 in the high one
    parts.append(torch.cat([low[:, 2 * c] | (low[:, 2 * c + 1] << 4) for c in range(4)], dim=1))
    blocks = torch.cat(parts, dim=1).to(torch.uint8)
    return blocks.reshape(rows, -1).numpy()


K_BITS = {"Q4_K": 4, "Q5_K": 5}


def quantize(t: torch.Tensor, qtype: str) -> np.ndarray:
    """``t`` in GGML type ``qtype``: gguf-py's quantizer, or ``encode_k`` for the K-quants it cannot write."""
    gguf = _gguf()
    if qtype in K_BITS:
        return encode_k(t.float(), K_BITS[qtype])
    return gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType[qtype])


def write_gguf(sd: dict[str, torch.Tensor], path: str, qtype: str, arch: str = "cosmos") -> dict[str, str]:
    """Write ``sd`` (a diffusion model's state dict) as a GGUF file of type ``qtype`` (F16, BF16, Q8_0, Q4_0,
    Q5_0, Q4_K, Q5_K, ...) at ``path`` (atomically); returns {tensor name: the GGML type it is stored in}."""
    gguf = _gguf()
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    types: dict[str, str] = {}
    for key, t in sd.items():
        if any(k in key for k in IGNORED):
            continue
        types[key] = stored_type(key, t, qtype)
        writer.add_tensor(key, quantize(t, types[key]), raw_dtype=gguf.GGMLQuantizationType[types[key]])
    tmp = f"{path}.{os.getpid()}.partial"  # two hosts may write the cached file at once
    writer.write_header_to_file(path=tmp)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return types


def file_tensors(path: str) -> dict[str, tuple[str, int]]:
    """{tensor name: (GGML type name, bytes in the file)} as gguf-py's reader sees the file."""
    reader = _gguf().GGUFReader(path)
    return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors}
