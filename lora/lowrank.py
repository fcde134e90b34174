"""The LoRA adapter whose low-rank path accumulates in fp32 and is added before the base output is rounded, and
``lora_linear``, the one layer sum every adapter kind (``lora.adapters``) goes through.

Dtype contract:

- LoRA parameters are stored in fp32 by default (``param_dtype="bf16"`` stores them in bf16; the optimizer
  must then use stochastic rounding or Kahan compensation). They are always *computed* in fp32.
- ``fp32_accumulation=True``: with autocast disabled locally, the base linear produces an fp32 output
  (``lora.linear.base_linear_fp32``), the fp32 delta ``scale * up(down(x))`` is added, and the sum is cast
  **once** to the output dtype (the autocast dtype when autocast is on for the input's device, else
  ``x.dtype``).
- ``fp32_accumulation=False``: the plain path, base and delta computed in the model dtype and added there.
- Saved for backward (fp32 path): a bf16/fp16 input is kept in its own dtype and upcast again in backward
  (``lora.linear.upcast_linear``; exact), so the fp32 path keeps no fp32 copy of a layer's input and saves
  what a plain bf16 LoRA saves (element dropout, when on, still keeps fp32 masked inputs).

Shapes: ``x`` (..., in_features); ``weight`` (out_features, in_features); ``bias`` (out_features,) or None;
output (..., out_features). Fused projections (qkv) are ordinary wide linears here.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import PARAM_DTYPES, LoRAConfig
from .linear import base_linear_fp32, low_precision_dtype, output_dtype, upcast_linear


class DropoutRNG:
    """Explicit per-device generators for the dropouts (never the global seed).

    In a data-parallel run each process computes only its rows of the global batch; ``global_rows`` tells
    the masks so (``mask_shape``): a mask is then drawn for the whole global batch, from the same generator
    state and with the same call one process makes, and the process keeps its own rows. So every process
    applies exactly the rows of the mask one process would draw, and every generator advances exactly as
    one process's does. Outside ``global_rows`` (one process) masks are drawn as they always were.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gens: dict[str, torch.Generator] = {}
        self._rows: tuple[int, int, int] | None = None  # (start, stop, total) batch rows of this process

    @contextlib.contextmanager
    def global_rows(self, start: int, stop: int, total: int) -> Iterator[None]:
        """Within the body the layers see batch rows ``start:stop`` of a global batch of ``total`` rows
        (forward and backward: a recomputation under activation checkpointing must draw the same way)."""
        if not 0 <= start < stop <= total:
            raise ValueError(f"DropoutRNG.global_rows({start}, {stop}, {total}): "
                             "need 0 <= start < stop <= total (a process without rows draws nothing)")
        previous, self._rows = self._rows, (start, stop, total)
        try:
            yield
        finally:
            self._rows = previous

    def mask_shape(self, shape: Sequence[int]) -> tuple[tuple[int, ...], slice | None]:
        """(shape to draw, this process's slice of its first dimension, or None to keep all of it).

        A layer input's first dimension is batch-major: the batch itself (b, ...) or batch x tokens
        flattened (b * t, ...). If it is a multiple k of this process's row count, the global draw has k
        rows per batch row and this process keeps ``k*start:k*stop``. A 1-D input, or a first dimension
        that does not scale with the batch (a shared (1, ...) tensor), is drawn as one process draws it."""
        shape = tuple(shape)
        if self._rows is None or len(shape) < 2:
            return shape, None
        start, stop, total = self._rows
        local = stop - start
        if local == total or shape[0] % local:
            return shape, None
        k = shape[0] // local
        return (k * total, *shape[1:]), slice(k * start, k * stop)

    def get(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._gens:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed + 1)
            self._gens[key] = gen
        return self._gens[key]

    def get_state(self) -> dict[str, torch.Tensor]:
        """Device name -> generator state (copies) of every generator used so far."""
        return {dev: g.get_state().clone() for dev, g in self._gens.items()}

    def set_state(self, states: Mapping[str, torch.Tensor]) -> None:
        """Restore exactly what ``get_state`` returned: a device missing from ``states`` goes back to never
        used (its generator is re-seeded on next use)."""
        for dev in [d for d in self._gens if d not in states]:
            del self._gens[dev]
        for dev, state in states.items():
            self.get(torch.device(dev)).set_state(state.clone())


class LoRAAdapter(nn.Module):
    """One low-rank adapter for a linear layer (out x in), e.g. a fused qkv projection.

    Parameters: ``down`` (rank, in), ``up`` (out, rank), stored in ``param_dtype`` (fp32 default), ``up``
    zero at init so the adapted layer equals the base bit-for-bit. The delta is always computed in fp32
    with autocast disabled and scaled by ``scale`` in fp32. Dropouts act only in ``train()`` mode.
    """

    def __init__(self, in_features: int, out_features: int, config: LoRAConfig, *, rng: DropoutRNG | None = None,
                 init_generator: torch.Generator | None = None, init: bool = True) -> None:
        super().__init__()
        dtype = PARAM_DTYPES[config.param_dtype]
        down = torch.empty(config.rank, in_features, dtype=torch.float32)
        if init:  # init=False: values about to be overwritten (LoRASet.copy)
            bound = 1.0 / math.sqrt(in_features)  # kaiming-uniform(a=sqrt(5)), as nn.Linear and kohya
            down.uniform_(-bound, bound, generator=init_generator)
        self.down = nn.Parameter(down.to(dtype))
        self.up = nn.Parameter(torch.zeros(out_features, config.rank, dtype=dtype))
        self.in_features, self.out_features, self.rank = in_features, out_features, config.rank
        self.scale = config.scale
        self.fp32_accumulation = config.fp32_accumulation
        self.dropout, self.rank_dropout, self.module_dropout = config.dropout, config.rank_dropout, config.module_dropout
        self.multiplier = 1.0
        self._rng = rng or DropoutRNG(config.seed)
        # (the zero-init up Parameter, its version) while up provably holds its init; see delta_is_zero
        self._pristine: tuple[nn.Parameter, int] | None = (self.up, self.up._version)
        self.train(False)  # dropouts only while training: the trainer calls train()

    def delta_is_zero(self) -> bool:
        """True while ``up`` provably still holds its zero init: never modified in place and never used in a
        grad-enabled forward (an optimizer can only change it after one). Lets the layer return the base
        output untouched, bit-equal to the base model."""
        self._note_use()
        if self._pristine is not None and (self._pristine[0] is not self.up or self.up._version != self._pristine[1]):
            self._pristine = None  # written in place, or the Parameter was replaced (load_state_dict(assign=True))
        return self._pristine is not None

    def mark_modified(self) -> None:
        """Call after changing ``up`` in a way autograd cannot see (``.data`` writes)."""
        self._pristine = None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scale={self.scale:g}"

    def _skip(self, device: torch.device) -> bool:
        if not self.training or self.module_dropout <= 0:
            return False
        return bool(torch.rand((), generator=self._rng.get(device), device=device) < self.module_dropout)

    def _mask(self, shape: Sequence[int], p: float, ref: torch.Tensor) -> torch.Tensor:
        # data parallel: the global batch's mask (same call, same generator state as one process), our rows
        full, rows = self._rng.mask_shape(shape)
        keep = torch.empty(full, dtype=torch.float32, device=ref.device).bernoulli_(1.0 - p, generator=self._rng.get(ref.device))
        if rows is not None:
            keep = keep[rows]
        return keep / (1.0 - p)

    def _down(self, h: torch.Tensor, down: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        """Dropout, ``down`` projection, rank dropout: (..., in) -> (..., rank). ``upcast``: an fp32 result
        from an ``h`` in any dtype (fp32 path); without element dropout a bf16/fp16 ``h`` is then kept for
        backward in its own dtype, not as an fp32 copy (``lora.linear.upcast_linear``)."""
        if self.training and self.dropout > 0:
            h = (h.float() if upcast else h) * self._mask(h.shape, self.dropout, h)
            h = F.linear(h, down)
        else:
            h = upcast_linear(h, down) if upcast else F.linear(h, down)
        if self.training and self.rank_dropout > 0:
            shape = (h.shape[0],) + (1,) * (h.dim() - 2) + (h.shape[-1],) if h.dim() > 1 else h.shape
            h = h * self._mask(shape, self.rank_dropout, h)
        return h

    def _low_rank(self, h: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.linear(self._down(h, down), up)

    def _note_use(self) -> None:
        # assigned only once: nn.Module.__setattr__ is slow and this runs twice per layer per forward
        if self._pristine is not None and torch.is_grad_enabled() and self.up.requires_grad:
            self._pristine = None

    def delta_fp32(self, x: torch.Tensor) -> torch.Tensor | None:
        """fp32 delta ``multiplier * scale * up(down(x))``; None when module dropout skips it. x (..., in) → (..., out)."""
        self._note_use()
        if self._skip(x.device):
            return None
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = F.linear(self._down(x, self.down.float(), upcast=True), self.up.float())
            return h * (self.scale * self.multiplier)

    def add_delta_fp32(self, acc: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``acc + delta_fp32(x)`` (``weight``: the base weight, which a LoRA delta does not use) with the scale and the sum fused into the ``up`` GEMM (one addmm instead of
        a GEMM, a scale and an add, forward and backward). acc (..., out) fp32; call with autocast disabled."""
        self._note_use()
        if self.module_dropout > 0 and self._skip(x.device):
            return acc
        down, up = self._factors_fp32()
        h = self._down(x, down, upcast=True)
        out = torch.addmm(acc.reshape(-1, acc.shape[-1]), h.reshape(-1, h.shape[-1]), up.t(),
                          alpha=self.scale * self.multiplier)
        return out.view(acc.shape)

    def linear_fp32(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    low: torch.dtype | None) -> torch.Tensor | None:
        """``base_linear_fp32(x, weight, bias, low) + delta_fp32(x)`` with the delta added into the fresh base
        output in place (an out-of-place ``addmm`` would first copy the whole (tokens, out) output). The base
        output is not needed by any backward here (the base weight is frozen), so the in-place add is safe.

        None where the in-place form does not apply (element or rank dropout active, or a base weight or
        bias that trains, whose backward would need the unmodified output): the caller then uses
        ``add_delta_fp32`` on ``base_linear_fp32``. Call with autocast disabled. x (..., in) → (..., out) fp32.
        """
        if (self.training and (self.dropout > 0 or self.rank_dropout > 0)) or weight.requires_grad or (
                bias is not None and bias.requires_grad):
            return None
        self._note_use()
        x2 = x.reshape(-1, x.shape[-1])
        acc = base_linear_fp32(x2, weight, bias, low)  # a fresh tensor on every path
        if not (self.module_dropout > 0 and self._skip(x.device)):
            down, up = self._factors_fp32()
            h = torch.mm(x2, down.t()) if x2.dtype == torch.float32 else upcast_linear(x2, down)
            acc.addmm_(h, up.t(), alpha=self.scale * self.multiplier)
        return acc.view(*x.shape[:-1], acc.shape[-1])

    def _factors_fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(down, up) as fp32 tensors: the Parameters themselves when stored in fp32 (no cast per call)."""
        if self.down.dtype == torch.float32:
            return self.down, self.up
        return self.down.float(), self.up.float()

    def delta_plain(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        """Delta in the model dtype (autocast applies as to any layer); None when skipped."""
        self._note_use()
        if self._skip(x.device):
            return None
        dt = x.dtype
        return self._low_rank(x, self.down.to(dt), self.up.to(dt)) * (self.scale * self.multiplier)

    kind = "lora"

    def param_split(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(``lora_down`` group, ``lora_up`` group) of LoRA+ (every adapter kind has one)."""
        return [self.down], [self.up]

    def file_tensors(self) -> dict[str, torch.Tensor]:
        """File key suffix -> tensor; ``file_alpha`` is the ``.alpha`` (scale * rank)."""
        return {".lora_down.weight": self.down, ".lora_up.weight": self.up}

    def file_alpha(self) -> float | None:
        return self.scale * self.rank

    def delta_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``multiplier * scale * up @ down`` as fp32 (out, in) (every adapter kind has one; DoRA's needs ``weight``)."""
        return (self.up.float() @ self.down.float()) * (self.scale * self.multiplier)

    def forward_with_base(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Base linear plus this adapter; see the module docstring for the dtype contract."""
        return lora_linear(x, weight, bias, (self,))

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_with_base(x, weight, bias)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                adapters: Iterable[LoRAAdapter]) -> torch.Tensor:
    """``x W^T + b + sum(deltas)``. fp32 path if any adapter asks for it, else the plain model-dtype path.

    x (..., in) in the model/compute dtype; weight (out, in) already in the compute dtype; output (..., out)
    in ``output_dtype(x)``.
    """
    adapters = tuple(a for a in adapters if not a.delta_is_zero())
    if not adapters:
        return F.linear(x, weight, bias)
    if not any(a.fp32_accumulation for a in adapters):
        out = F.linear(x, weight, bias)
        for a in adapters:
            d = a.delta_plain(x, weight)
            if d is not None:
                out = out + d.to(out.dtype)
        return out
    out_dtype = output_dtype(x)
    low = low_precision_dtype(x, weight)
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return _fp32_sum(x, weight, bias, adapters, low, out_dtype)
    return _fp32_sum(x, weight, bias, adapters, low, out_dtype)  # no autocast to switch off (saves its cost)


def _fp32_sum(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, adapters: Sequence[LoRAAdapter],
              low: torch.dtype | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The fp32 path of ``lora_linear``, called with autocast off: fp32 base + fp32 deltas, one final cast.
    The first adapter is fused with the base linear when it can be (``LoRAAdapter.linear_fp32``)."""
    acc, rest = adapters[0].linear_fp32(x, weight, bias, low), adapters[1:]
    if acc is None:
        acc, rest = base_linear_fp32(x, weight, bias, low), adapters
    for a in rest:
        acc = a.add_delta_fp32(acc, x, weight)
    return acc.to(out_dtype)
