"""LoCon: a LoRA on a Conv2d, with the same fp32 accumulation as the LoRA adapter on a Linear (``lora.lowrank``).

A Conv2d of weight W (out, in, kh, kw) gets ``dW = scale * up @ down`` with ``down`` (rank, in, kh, kw) and
``up`` (out, rank, 1, 1): the layouts stock ComfyUI's LoRA loader reads for a conv weight (it flattens both
to matrices, multiplies and reshapes to W's shape), so a saved file loads there with nothing left over. The
delta of an input is never materialised as a weight: ``conv(conv(x, down, stride, padding, dilation), up)``,
the down conv with the layer's geometry, the up conv 1x1.

The parameters are stored flat, ``down`` (rank, in * kh * kw) and ``up`` (out, rank), so this is a
``LoRAAdapter`` (init, LoRA+ groups, strength, zero-delta shortcut, ``load_factors``) whose file tensors are
the 4-D views. Dtype contract as ``LoRAAdapter``: with ``fp32_accumulation`` the base conv is computed with an
fp32 output (operands upcast: the products of bf16/fp16 values are exact in fp32), the fp32 delta is added to
it and the sum is rounded once (``lora_conv2d``); without it the delta is computed and added in the model
dtype. Only module dropout applies (``LoRAConfig`` rejects element and rank dropout for adapter 'locon').
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .config import LoRAConfig
from .linear import output_dtype
from .lowrank import DropoutRNG, LoRAAdapter


class ConvGeometry(NamedTuple):
    """What a Conv2d's forward passes besides its weight and bias (``nn.Conv2d``'s attributes)."""

    stride: tuple[int, int]
    padding: tuple[int, int] | str
    dilation: tuple[int, int]
    groups: int


class LoConAdapter(LoRAAdapter):
    """LoRA for a Conv2d of ``in_channels`` -> ``out_channels`` and kernel (kh, kw); see the module doc."""

    kind = "lora"  # its file keys are LoRA's (lora_down / lora_up / alpha)

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple[int, int], config: LoRAConfig, *,
                 rng: DropoutRNG | None = None, init_generator: torch.Generator | None = None, init: bool = True) -> None:
        kh, kw = kernel
        super().__init__(in_channels * kh * kw, out_channels, config, rng=rng, init_generator=init_generator, init=init)
        self.in_channels, self.kernel = in_channels, (kh, kw)

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """(in_channels, out_channels, kh, kw): the shape ``LoRASet`` builds this adapter from."""
        return (self.in_channels, self.out_features, *self.kernel)

    def extra_repr(self) -> str:
        return (f"conv in={self.in_channels}, out={self.out_features}, kernel={self.kernel}, rank={self.rank}, "
                f"scale={self.scale:g}")

    def conv_factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(down (rank, in, kh, kw), up (out, rank, 1, 1)) in ``dtype``."""
        down = self.down.view(self.rank, self.in_channels, *self.kernel).to(dtype)
        return down, self.up.view(self.out_features, self.rank, 1, 1).to(dtype)

    def file_tensors(self) -> dict[str, torch.Tensor]:
        down, up = self.conv_factors(self.down.dtype)
        return {".lora_down.weight": down, ".lora_up.weight": up}

    def _conv_delta(self, x: torch.Tensor, geo: ConvGeometry, dtype: torch.dtype) -> torch.Tensor:
        down, up = self.conv_factors(dtype)
        h = F.conv2d(x.to(dtype), down, None, geo.stride, geo.padding, geo.dilation)
        return F.conv2d(h, up) * (self.scale * self.multiplier)

    def add_conv_delta_fp32(self, acc: torch.Tensor, x: torch.Tensor, geo: ConvGeometry) -> torch.Tensor:
        """``acc + delta(x)`` in fp32; acc (n, out, h', w') fp32. Call with autocast disabled."""
        self._note_use()
        if self._skip(x.device):
            return acc
        return acc + self._conv_delta(x, geo, torch.float32)

    def conv_delta_plain(self, x: torch.Tensor, geo: ConvGeometry) -> torch.Tensor | None:
        """The delta in the model dtype (x.dtype); None when module dropout skips it."""
        self._note_use()
        if self._skip(x.device):
            return None
        return self._conv_delta(x, geo, x.dtype)

    def delta_fp32(self, x: torch.Tensor) -> torch.Tensor | None:
        raise ValueError("a LoCon delta is a convolution: use "
                         "lora_conv2d(x, weight, bias, geometry, adapters)")

    def add_delta_fp32(self, acc: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.delta_fp32(x)  # type: ignore[return-value]  # raises: not a linear layer

    def linear_fp32(self, x, weight, bias, low):  # noqa: ANN001 - the LoRAAdapter signature
        return self.delta_fp32(x)

    def delta_plain(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.delta_fp32(x)


def lora_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geo: ConvGeometry,
                adapters: Iterable[LoConAdapter]) -> torch.Tensor:
    """``conv2d(x, W, b) + sum(deltas)``: the fp32 path (base conv with an fp32 output, fp32 deltas, one final
    rounding) if any adapter asks for it, else the plain model-dtype path. x (n, in, h, w); weight already in
    the compute dtype; output in ``output_dtype(x)``."""
    adapters = tuple(a for a in adapters if not a.delta_is_zero())
    if not adapters:
        return F.conv2d(x, weight, bias, geo.stride, geo.padding, geo.dilation, geo.groups)
    if not any(a.fp32_accumulation for a in adapters):
        out = F.conv2d(x, weight, bias, geo.stride, geo.padding, geo.dilation, geo.groups)
        for a in adapters:
            d = a.conv_delta_plain(x, geo)
            if d is not None:
                out = out + d.to(out.dtype)
        return out
    out_dtype = output_dtype(x)
    with torch.autocast(device_type=x.device.type, enabled=False):
        acc = F.conv2d(x.float(), weight.float(), None if bias is None else bias.float(), geo.stride, geo.padding,
                       geo.dilation, geo.groups)
        for a in adapters:
            acc = a.add_conv_delta_fp32(acc, x, geo)
        return acc.to(out_dtype)


def conv_width(shape: tuple[int, ...]) -> int:
    """The rank limit of a layer shape (in, out) or (in, out, kh, kw): min(in * kh * kw, out)."""
    return min(shape[0] * math.prod(shape[2:]), shape[1])
