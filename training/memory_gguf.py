"""What a GGUF base weighs: bytes per weight by GGML type, from GGML's block sizes (pure arithmetic, no ComfyUI).

A GGML type stores its weights in blocks along each row: ``block`` weights in ``size`` bytes (ggml-common.h; gguf-py's
``GGML_QUANT_SIZES`` lists the same numbers). Q8_0: 32 weights in an fp16 scale + 32 int8 = 34 bytes (8.5 bits a
weight); Q4_K: 256 weights in two fp16 scales, 12 bytes of 6-bit sub-block scales and mins and 128 bytes of 4-bit
quants = 144 bytes (4.5 bits); F16 / BF16 2 bytes, F32 4.

Which type each tensor of a file gets follows ComfyUI-GGUF's ``tools/convert.py`` and its patched ``llama-quantize``
(``stored_type``): 1-D tensors and tensors of at most 1024 weights stay F32, a tensor whose rows the type's blocks do
not divide falls back to F16, every other one is in the file's type. Released files mix types (``Q4_K_S`` keeps a
few layers in Q5_K, ...); the memory planner therefore reads a loaded model's real layout (``nodes.host.gguf``),
``bench/memory.py`` builds a uniform one from these rules.
"""
from __future__ import annotations

import math

import torch

# GGML type -> (weights per block, bytes per block)
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q5_1": (32, 24), "Q5_0": (32, 22), "Q4_1": (32, 20), "Q4_0": (32, 18), "IQ4_NL": (32, 18),
    "Q6_K": (256, 210), "Q5_K": (256, 176), "Q4_K": (256, 144), "Q3_K": (256, 110), "Q2_K": (256, 84),
    "IQ4_XS": (256, 136),
}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16}  # stored as torch tensors of the logical shape
QUANTIZATION_THRESHOLD = 1024  # tensors of at most this many weights stay F32 (tools/convert.py)


def _known(qtype: str) -> tuple[int, int]:
    if qtype not in GGML_BLOCKS:
        raise ValueError(f"GGML type {qtype!r} is unknown; known: {', '.join(GGML_BLOCKS)}")
    return GGML_BLOCKS[qtype]


def bits_per_weight(qtype: str) -> float:
    """Q8_0 8.5, Q4_K 4.5, F16 16."""
    block, size = _known(qtype)
    return 8 * size / block


def stored_type(shape: tuple[int, ...], qtype: str, high_precision: bool = False) -> str:
    """The GGML type a tensor of ``shape`` gets in a file of type ``qtype`` (module docstring); ``high_precision``:
    a key the converter keeps in F32 (Cosmos' ``pos_embedder``, ...)."""
    block, _ = _known(qtype)
    if len(shape) <= 1 or math.prod(shape) <= QUANTIZATION_THRESHOLD or high_precision:
        return "F32"
    return qtype if shape[-1] % block == 0 else "F16"


def raw_size(shape: tuple[int, ...], qtype: str) -> tuple[tuple[int, ...], torch.dtype]:
    """(size, dtype) of the tensor ComfyUI-GGUF's loader holds for a ``shape`` tensor stored in ``qtype``: F32 / F16
    as themselves; block types as uint8 rows of whole blocks (ValueError when the blocks do not divide a row)."""
    if qtype in FLOAT_TYPES:
        return tuple(shape), FLOAT_TYPES[qtype]
    block, size = _known(qtype)
    if shape[-1] % block:
        raise ValueError(f"a row of {shape[-1]} weights does not split into {qtype} blocks of {block}")
    return (*shape[:-1], shape[-1] // block * size), torch.uint8


def tensor_bytes(shape: tuple[int, ...], qtype: str) -> int:
    """Bytes of a ``shape`` tensor stored in ``qtype``."""
    block, size = _known(qtype)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return rows * (shape[-1] if shape else 1) // block * size
