"""GGUF bases (city96's ComfyUI-GGUF): the weight one of its layers computes with, and what the base weighs.

ComfyUI-GGUF's *Unet Loader (GGUF)* keeps every weight as a ``GGMLTensor``: the file's raw GGML blocks (``uint8``
rows for the block types Q8_0, Q4_K, BF16, ...; ``float16`` / ``float32`` tensors for F16 / F32) with
``tensor_type`` (the GGML type) and ``tensor_shape`` (the logical shape). Its layers (``GGMLLayer``) dequantize on
every call, in ``cast_bias_weight(input)`` (``get_weight``: dequantize, then apply the weight patches, e.g. stock
LoRAs, that its model patcher keeps on the tensor): a weight exists dequantized while its layer computes (and, in
training, where autograd keeps it for the backward, as for any layer); the base is never dequantized as a whole.

The pack's LoRA forward replaces a layer's ``forward``; ``layer_weight`` calls that same method, so the base output
is computed on exactly the weight the layer's own forward would use, dequantized per call; the stored blocks are
never changed. The pack never imports ComfyUI-GGUF: its tensors and layers are recognised by these attributes.
"""
from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

GGUF_NODE = "UnetLoaderGGUF"  # ComfyUI-GGUF's loader node id
GGUF_LOADER = f"ComfyUI-GGUF's \"Unet Loader (GGUF)\" node ({GGUF_NODE})"


def gguf_file_advice(name: str, node: str, gguf_installed: bool) -> str:
    """What to do with a GGUF file given to the pack's loader: load it with ComfyUI-GGUF's loader (installing it
    first when it is not loaded here); its MODEL trains."""
    install = "" if gguf_installed else ("ComfyUI-GGUF is not loaded in this ComfyUI: install city96's ComfyUI-GGUF "
                                         "into custom_nodes (and the gguf package), restart, then ")
    return (f"{node}: input 'model_name'={name!r} is a GGUF file, which this loader does not read; "
            f"{install}load it with {GGUF_LOADER} and connect its MODEL to Attach LoRA (Precision): a LoRA trains "
            "on a GGUF base (docs/quantized.md)")


def refuse_gguf_file(path: str, node: str, gguf_installed: bool = True) -> None:
    """Raise ValueError naming ComfyUI-GGUF's loader when ``path`` is a GGUF file (by its magic bytes or name)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return  # the loader reports a missing or unreadable file itself
    if magic == b"GGUF" or path.lower().endswith(".gguf"):
        raise ValueError(gguf_file_advice(os.path.basename(path), node, gguf_installed))


def is_gguf(t: object) -> bool:
    """True for ComfyUI-GGUF's ``GGMLTensor`` (raw GGUF blocks plus ``tensor_type`` / ``tensor_shape``)."""
    return type(t).__name__ == "GGMLTensor" or (isinstance(t, torch.Tensor) and hasattr(t, "tensor_type")
                                                  and hasattr(t, "tensor_shape"))


def qtype_name(t: object) -> str:
    """The GGML type of a GGUF tensor by name ("Q4_K", "F16"); "?" when it carries none."""
    qtype = getattr(t, "tensor_type", None)
    return getattr(qtype, "name", None) or ("?" if qtype is None else str(qtype))


def is_gguf_layer(module: torch.nn.Module) -> bool:
    """A ComfyUI-GGUF layer holding a GGUF weight (its ``is_ggml_quantized`` / ``cast_bias_weight`` methods)."""
    return is_gguf(getattr(module, "weight", None)) and all(
        callable(getattr(module, name, None)) for name in ("cast_bias_weight", "get_weight", "is_ggml_quantized"))


def dequantizes(module: torch.nn.Module) -> bool:
    """True for a ComfyUI-GGUF layer whose weight or bias is block-quantized (Q8_0, Q4_K, BF16, ...): its own forward
    dequantizes them in ``cast_bias_weight``. F16 / F32 ones are torch tensors its forward casts as ComfyUI does."""
    return is_gguf_layer(module) and bool(module.is_ggml_quantized())


def layer_weight(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                     Callable[[], None]]:
    """(weight, bias, release) of a block-quantized ComfyUI-GGUF layer (``dequantizes``) for input ``x``: the layer's
    own ``cast_bias_weight``, which dequantizes this one weight into ``x``'s dtype and device (with the weight
    patches its model patcher keeps on it); nothing to release. weight (out, in); bias (out,) or None."""
    weight, bias = module.cast_bias_weight(x)
    return plain(weight), plain(bias), lambda: None


def plain(t: torch.Tensor | None) -> torch.Tensor | None:
    """A GGUF tensor (an F16 / F32 weight cast by ComfyUI stays a GGMLTensor) as a plain ``torch.Tensor`` alias, whose
    subclass would otherwise spread to every result computed from it; anything else as it is."""
    return t.as_subclass(torch.Tensor) if type(t).__name__ == "GGMLTensor" else t


def layer_problem(module: torch.nn.Module) -> str | None:
    """Why the LoRA forward cannot compute on this layer's GGUF weight, or None (a ComfyUI-GGUF layer, or no
    GGUF weight)."""
    weight = getattr(module, "weight", None)
    if not is_gguf(weight) or is_gguf_layer(module):
        return None
    return (f"holds a GGUF ({qtype_name(weight)}) weight in a {type(module).__name__}, not in one of ComfyUI-GGUF's "
            "layers, which dequantize their own weights (the pack's LoRA forward calls them for it)")


@dataclass(frozen=True)
class RawTensor:
    """How a GGUF model stores one parameter: the raw tensor's size and dtype (its real bytes), its GGML type
    and its logical shape."""

    size: tuple[int, ...]
    dtype: torch.dtype
    qtype: object
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.size:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def raw_layout(dm: torch.nn.Module) -> dict[str, RawTensor]:
    """Parameter name -> ``RawTensor`` for every GGUF parameter of ``dm`` (values are not read)."""
    return {name: RawTensor(tuple(p.size()), p.dtype, p.tensor_type, tuple(p.tensor_shape))
            for name, p in dm.named_parameters() if is_gguf(p)}


def stored_bytes(dm: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``dm`` as stored (a GGUF tensor's raw blocks, not its logical size)."""
    tensors = list(dm.parameters()) + list(dm.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def qtype_counts(dm: torch.nn.Module) -> Counter:
    """GGML type name -> how many parameters of ``dm`` are stored in it (an empty Counter: not a GGUF model)."""
    return Counter(qtype_name(p) for p in dm.parameters() if is_gguf(p))


def describe_base(dm: torch.nn.Module) -> str | None:
    """"GGUF Q4_K" (the type most of the base's bytes are in), or None for a model without GGUF weights."""
    by_type: Counter = Counter()
    for p in dm.parameters():
        if is_gguf(p):
            by_type[qtype_name(p)] += p.numel() * p.element_size()
    return f"GGUF {by_type.most_common(1)[0][0]}" if by_type else None


@functools.cache
def _fake_ggml_class() -> type:
    from torch._subclasses.fake_tensor import FakeTensor

    class FakeGGMLTensor(FakeTensor):
        """A fake tensor of raw GGUF blocks that answers ``.shape`` with its logical shape, as a GGMLTensor does
        (ComfyUI reads layer sizes from weight shapes, e.g. Flux's input channels from ``img_in.weight.shape``);
        ``size()`` and ``.data`` stay raw, which is what ComfyUI-GGUF's dequantization reads."""

        @property
        def shape(self) -> torch.Size:  # type: ignore[override]
            return getattr(self, "tensor_shape", None) or self.size()

    return FakeGGMLTensor


def fill_fake(dm: torch.nn.Module, layout: dict[str, RawTensor]) -> int:
    """Give ``dm`` (a model built under the caller's ``FakeTensorMode``, e.g. a fake twin with ComfyUI-GGUF's layers,
    whose Linear weights start as None) a value-less parameter for each entry of ``layout``: the raw size and
    dtype (its real bytes) marked with ``tensor_type`` / ``tensor_shape`` and answering ``.shape`` as a GGMLTensor
    does, so ComfyUI-GGUF's own dequantization runs on it (a GGMLTensor itself cannot wrap a fake tensor).
    Returns the bytes placed."""
    modules = dict(dm.named_modules())
    placed = 0
    for name, raw in layout.items():
        owner, _, attr = name.rpartition(".")
        param = torch.nn.Parameter(torch.empty(raw.size, dtype=raw.dtype), requires_grad=False)
        param.__class__ = _fake_ggml_class()  # a FakeTensor subclass: same layout, only ``shape`` differs
        param.tensor_type, param.tensor_shape = raw.qtype, torch.Size(raw.shape)
        setattr(modules[owner], attr, param)
        placed += raw.nbytes
    return placed
