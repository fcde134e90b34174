"""LoKr, LoHa and DoRA adapters with the same fp32 accumulation as the LoRA adapter (``lora.layer``).

Each adapter changes a linear layer's weight W (out, in) by a delta built from its factors; the factor
names are the keys ComfyUI's stock loader reads (``comfy/weight_adapter/lokr.py``, ``loha.py`` and the
``dora_scale`` of ``base.weight_decompose``), so a saved file loads there with nothing left over:

- LoKr: ``dW = scale * kron(w1, w2)``, w1 (a, c) full, w2 (b, d) = ``w2_a @ w2_b`` of rank r (a*b = out,
  c*d = in; ``lokr_factor`` picks a and c). When r would not be smaller than min(b, d), w2 is one full
  matrix and, as in stock ComfyUI, the scale is 1 (alpha is then not used). Never materialised: the
  delta of x is ``w1 @ X @ w2^T`` on x viewed as (..., c, d).
- LoHa: ``dW = scale * (w1_a @ w1_b) * (w2_a @ w2_b)`` (Hadamard product, effective rank up to r^2). The
  product is materialised per forward: one fp32 (out, in) matrix, kept for backward while training.
- DoRA: LoRA factors plus a magnitude m (1, in): ``W' = (W + scale * up @ down) * m / ||W + scale * up @ down||``
  with the norm of every input column (over the output axis), the layout LyCORIS writes and stock
  ComfyUI's ``weight_decompose`` normalises by W' (stock normalises an (out, 1) magnitude by the *original*
  W instead, so that layout is not used). The delta is ``W' - W``, formed in fp32 as
  ``W * (m - n) / n + scale * (up @ down) * m / n``; m starts at ``||W|| + eps`` so it is 0 at init.

Dtype contract (as ``LoRAAdapter``): parameters in ``param_dtype`` (fp32 default), always computed in fp32 with
autocast off; with ``fp32_accumulation`` the delta is added to the fp32 base output and the sum is rounded
once (``lora.lowrank.lora_linear``); without it the delta is computed and added in the model dtype. The
strength (``multiplier``) scales the delta, as stock ComfyUI's ``strength`` does. One factor is zero at init
(the delta is then exactly zero and the layer returns the base output bit for bit). Only module dropout
applies (element and rank dropout are LoRA's; ``LoRAConfig`` rejects them for these adapters).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .config import PARAM_DTYPES, LoRAConfig
from .lowrank import DropoutRNG, LoRAAdapter
from .linear import upcast_linear

EPS = torch.finfo(torch.float32).eps  # what stock adds to the DoRA norm when it patches an fp32 weight


def lokr_factors(dim: int, factor: int) -> tuple[int, int]:
    """Split ``dim`` into (small, large) with small * large = dim: ``factor`` > 0 takes the largest divisor of
    ``dim`` that is <= factor as the small side; -1 the divisor closest to sqrt(dim) from below."""
    limit = math.isqrt(dim) if factor < 0 else min(factor, dim)
    small = max(d for d in range(1, limit + 1) if dim % d == 0)
    return min(small, dim // small), max(small, dim // small)


class _DeltaAdapter(nn.Module):
    """What the three adapters share with ``LoRAAdapter`` for ``lora_linear``: the zero-delta shortcut, module
    dropout, the strength, and the fp32 / plain delta entry points around ``_delta(x, weight, dtype)``."""

    kind = ""

    def __init__(self, in_features: int, out_features: int, config: LoRAConfig, rng: DropoutRNG | None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, config.rank
        self.scale = config.scale
        self.fp32_accumulation = config.fp32_accumulation
        self.module_dropout = config.module_dropout
        self.multiplier = 1.0
        self._rng = rng or DropoutRNG(config.seed)
        self._dtype = PARAM_DTYPES[config.param_dtype]
        self._pristine: tuple[nn.Parameter, int] | None = None

    def _param(self, t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.to(self._dtype))

    def _track_zero(self, zero: nn.Parameter) -> None:
        self._pristine = (zero, zero._version)

    def delta_is_zero(self) -> bool:
        """True while the zero-initialised factor provably holds its init (see ``LoRAAdapter.delta_is_zero``)."""
        self._note_use()
        if self._pristine is not None and (getattr(self, self.zero_name) is not self._pristine[0]
                                           or self._pristine[0]._version != self._pristine[1]):
            self._pristine = None
        return self._pristine is not None

    def mark_modified(self) -> None:
        self._pristine = None

    def _note_use(self) -> None:
        if self._pristine is not None and torch.is_grad_enabled() and self._pristine[0].requires_grad:
            self._pristine = None

    def _skip(self, device: torch.device) -> bool:
        if not self.training or self.module_dropout <= 0:
            return False
        return bool(torch.rand((), generator=self._rng.get(device), device=device) < self.module_dropout)

    def linear_fp32(self, x, weight, bias, low):  # noqa: ANN001 - the LoRAAdapter signature
        return None  # no fused form: lora_linear adds ``add_delta_fp32`` to the fp32 base output

    def add_delta_fp32(self, acc: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``acc + multiplier * delta(x)`` in fp32. acc (..., out) fp32; call with autocast disabled."""
        self._note_use()
        if self._skip(x.device):
            return acc
        d = self._delta(x.reshape(-1, x.shape[-1]), weight, None)
        return acc + d.view(acc.shape) * self.multiplier

    def delta_plain(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        """The delta in the model dtype (x.dtype); None when module dropout skips it."""
        self._note_use()
        if self._skip(x.device):
            return None
        d = self._delta(x.reshape(-1, x.shape[-1]), weight, x.dtype)
        return (d * self.multiplier).view(*x.shape[:-1], self.out_features)

    def _delta(self, x2: torch.Tensor, weight: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
        """x2 (n, in) -> scaled delta (n, out); ``dtype`` None = fp32 (x2 upcast, kept for backward in its own
        dtype), else computed in ``dtype``."""
        raise NotImplementedError

    def delta_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The delta as an fp32 (out, in) weight at the current strength (tests, probes, merges)."""
        eye = torch.eye(self.in_features, dtype=torch.float32, device=next(self.parameters()).device)
        return (self._delta(eye, weight, None) * self.multiplier).t()

    def param_split(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(factors at the base learning rate, the zero-initialised factors: LoRA+'s ``lora_up`` group)."""
        zero = getattr(self, self.zero_name)
        return [p for p in self.parameters() if p is not zero], [zero]

    def file_tensors(self) -> dict[str, torch.Tensor]:
        """Stock ComfyUI key suffix -> tensor (``.alpha`` separately, see ``file_alpha``)."""
        return {f".{name}": p for name, p in self.named_parameters()}

    def file_alpha(self) -> float | None:
        """The ``.alpha`` that makes stock ComfyUI use ``self.scale`` (alpha / rank), None for none."""
        return self.scale * self.rank

    def load_file(self, parts: Mapping[str, torch.Tensor], file_scale: float) -> None:
        """Copy a file's tensors (``file_tensors`` keys) in; the zero-initialised factor absorbs file_scale / scale.
        ValueError naming the tensor on a shape mismatch, before anything is changed."""
        mine = self.file_tensors()
        for key, p in mine.items():
            t = parts.get(key)
            if t is None or tuple(t.shape) != tuple(p.shape):
                got = "missing" if t is None else tuple(t.shape)
                raise ValueError(f"{key[1:]}: the file has {got}, this {self.kind} needs {tuple(p.shape)}")
        zero = getattr(self, self.zero_name)
        with torch.no_grad():
            for key, p in mine.items():
                v = parts[key].float()
                p.copy_((v * (file_scale / self.scale) if p is zero else v).to(p.dtype))
        self.mark_modified()


class LoKrAdapter(_DeltaAdapter):
    """LoKr (Kronecker product): see the module doc. Parameters ``lokr_w1`` (a, c) and ``lokr_w2_a`` (b, r) /
    ``lokr_w2_b`` (r, d), or one full ``lokr_w2`` (b, d) when r >= min(b, d)."""

    kind = "lokr"

    def __init__(self, in_features: int, out_features: int, config: LoRAConfig, *, rng: DropoutRNG | None = None,
                 init_generator: torch.Generator | None = None, init: bool = True,
                 shapes: tuple[tuple[int, int], tuple[int, int], int | None] | None = None) -> None:
        super().__init__(in_features, out_features, config, rng)
        if shapes is None:
            (a, b), (c, d) = lokr_factors(out_features, config.lokr_factor), lokr_factors(in_features, config.lokr_factor)
            shapes = ((a, c), (b, d), config.rank if config.rank < min(b, d) else None)
        (a, c), (b, d), rank = shapes
        self.w1_shape, self.w2_shape = (a, c), (b, d)
        gen = init_generator
        self.lokr_w1 = self._param(_uniform((a, c), c, gen, init))
        if rank is None:  # full w2: stock ComfyUI applies no alpha then
            self.rank, self.scale = min(b, d), 1.0
            self.lokr_w2 = self._param(torch.zeros(b, d))
            self.zero_name = "lokr_w2"
        else:
            self.rank = rank
            self.lokr_w2_a = self._param(torch.zeros(b, rank))
            self.lokr_w2_b = self._param(_uniform((rank, d), d, gen, init))
            self.zero_name = "lokr_w2_a"
        self._track_zero(getattr(self, self.zero_name))
        self.train(False)

    @property
    def decomposed(self) -> bool:
        return hasattr(self, "lokr_w2_a")

    def file_alpha(self) -> float | None:
        return self.scale * self.rank if self.decomposed else None

    def extra_repr(self) -> str:
        return f"w1={self.w1_shape}, w2={self.w2_shape}, rank={self.rank if self.decomposed else 'full'}, scale={self.scale:g}"

    def _delta(self, x2: torch.Tensor, weight: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
        (a, c), (b, d) = self.w1_shape, self.w2_shape
        n = x2.shape[0]
        xs = x2.reshape(n * c, d)
        cast = (lambda p: p.float()) if dtype is None else (lambda p: p.to(dtype))
        first = self.lokr_w2_b if self.decomposed else self.lokr_w2
        if dtype is None:
            t = upcast_linear(xs, cast(first))
        else:
            t = F.linear(xs.to(dtype), cast(first))
        if self.decomposed:
            t = F.linear(t, cast(self.lokr_w2_a))
        y = torch.matmul(cast(self.lokr_w1), t.view(n, c, b))  # (n, a, b): w1 @ X @ w2^T
        return y.reshape(n, a * b) * self.scale


class LoHaAdapter(_DeltaAdapter):
    """LoHa (Hadamard product of two rank-r products): see the module doc. ``hada_w1_a`` / ``hada_w2_a`` (out, r),
    ``hada_w1_b`` / ``hada_w2_b`` (r, in); ``hada_w2_a`` is zero at init."""

    kind = "loha"
    zero_name = "hada_w2_a"

    def __init__(self, in_features: int, out_features: int, config: LoRAConfig, *, rng: DropoutRNG | None = None,
                 init_generator: torch.Generator | None = None, init: bool = True) -> None:
        super().__init__(in_features, out_features, config, rng)
        r, gen = config.rank, init_generator
        # LyCORIS's init: the b factors N(0, 1), w1_a N(0, 0.1), w2_a zero (so the product starts at zero)
        self.hada_w1_a = self._param(_normal((out_features, r), 0.1, gen, init))
        self.hada_w1_b = self._param(_normal((r, in_features), 1.0, gen, init))
        self.hada_w2_a = self._param(torch.zeros(out_features, r))
        self.hada_w2_b = self._param(_normal((r, in_features), 1.0, gen, init))
        self._track_zero(self.hada_w2_a)
        self.train(False)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scale={self.scale:g}"

    def weight_fp32(self) -> torch.Tensor:
        """scale * (w1_a @ w1_b) * (w2_a @ w2_b) as fp32 (out, in)."""
        m1 = self.hada_w1_a.float() @ self.hada_w1_b.float()
        return (m1 * (self.hada_w2_a.float() @ self.hada_w2_b.float())) * self.scale

    def _delta(self, x2: torch.Tensor, weight: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
        dw = self.weight_fp32()
        return upcast_linear(x2, dw) if dtype is None else F.linear(x2.to(dtype), dw.to(dtype))


class DoRAAdapter(LoRAAdapter):
    """DoRA: the LoRA factors plus ``magnitude`` (1, in) (file key ``dora_scale``); see the module doc. Needs the
    base weight: at init for the magnitude (``base_weight``), in every forward for the norm."""

    kind = "dora"

    def __init__(self, in_features: int, out_features: int, config: LoRAConfig, *, rng: DropoutRNG | None = None,
                 init_generator: torch.Generator | None = None, init: bool = True,
                 base_weight: torch.Tensor | None = None) -> None:
        super().__init__(in_features, out_features, config, rng=rng, init_generator=init_generator, init=init)
        if init and base_weight is None:
            raise ValueError("DoRA needs the base weight to start its magnitude at ||W||: pass base_weight")
        mag = torch.zeros(1, in_features) if base_weight is None else _column_norm(base_weight.detach().float().cpu())
        # fp32 whatever param_dtype: a bf16 magnitude would be ~0.4 % off ||W||, a visible jump at the first step
        self.magnitude = nn.Parameter(mag)
        self._mag_version = self.magnitude._version

    def delta_is_zero(self) -> bool:
        if self.magnitude._version != self._mag_version:
            self.mark_modified()
        return super().delta_is_zero()

    def linear_fp32(self, x, weight, bias, low):  # noqa: ANN001 - the LoRAAdapter signature
        return None

    def add_delta_fp32(self, acc: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        self._note_use()
        if self.module_dropout > 0 and self._skip(x.device):
            return acc
        dw = self.delta_weight_fp32(_need(weight))
        return acc + upcast_linear(x, dw) if self.multiplier == 1.0 else acc + upcast_linear(x, dw * self.multiplier)

    def delta_plain(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        self._note_use()
        if self._skip(x.device):
            return None
        return F.linear(x, (self.delta_weight_fp32(_need(weight)) * self.multiplier).to(x.dtype))

    def delta_fp32(self, x: torch.Tensor) -> torch.Tensor | None:
        raise ValueError("a DoRA delta depends on the base weight: use add_delta_fp32(acc, x, weight)")

    def delta_weight_fp32(self, weight: torch.Tensor) -> torch.Tensor:
        """``W' - W`` in fp32 (out, in), strength not applied: ``W (m - n) / n + scale (up @ down) m / n``."""
        w = weight.float()
        lora = (self.up.float() @ self.down.float()) * self.scale
        n = _column_norm(w + lora)
        m = self.magnitude.float()
        return w * ((m - n) / n) + lora * (m / n)

    def delta_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.delta_weight_fp32(_need(weight)) * self.multiplier

    def param_split(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return [self.down, self.magnitude], [self.up]

    def file_tensors(self) -> dict[str, torch.Tensor]:
        return {".lora_down.weight": self.down, ".lora_up.weight": self.up, ".dora_scale": self.magnitude}

    def file_alpha(self) -> float | None:
        return self.scale * self.rank

    def load_file(self, parts: Mapping[str, torch.Tensor], file_scale: float) -> None:
        _DeltaAdapter.load_file(self, parts, file_scale)  # type: ignore[arg-type]

    @property
    def zero_name(self) -> str:
        return "up"


def _need(weight: torch.Tensor | None) -> torch.Tensor:
    if weight is None:
        raise ValueError("DoRA needs the layer's base weight for its norm; none was given")
    return weight


def _column_norm(w: torch.Tensor) -> torch.Tensor:
    """||w[:, j]|| + eps per input column j: (out, in) -> (1, in), as stock ComfyUI's ``weight_decompose``."""
    return w.norm(dim=0, keepdim=True) + EPS


def _uniform(shape: tuple[int, int], fan_in: int, gen: torch.Generator | None, init: bool) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    if init:  # kaiming-uniform(a=sqrt(5)), as nn.Linear, LoRA's down factor and LyCORIS
        bound = 1.0 / math.sqrt(fan_in)
        t.uniform_(-bound, bound, generator=gen)
    return t


def _normal(shape: tuple[int, int], std: float, gen: torch.Generator | None, init: bool) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    if init:
        t.normal_(0.0, std, generator=gen)
    return t


# locon: LoRA on the Linear layers (its Conv2d adapters, lora.locon.LoConAdapter, are built by LoRASet)
ADAPTERS: dict[str, type[nn.Module]] = {"lora": LoRAAdapter, "lokr": LoKrAdapter, "loha": LoHaAdapter, "dora": DoRAAdapter,
                                        "locon": LoRAAdapter}


def make_adapter(n_in: int, n_out: int, config: LoRAConfig, *, rng: DropoutRNG, init_generator: torch.Generator,
                 init: bool, base_weight: torch.Tensor | None = None) -> nn.Module:
    """One adapter of ``config.adapter`` for an (n_out, n_in) linear; ``base_weight`` only DoRA uses (its magnitude)."""
    cls = ADAPTERS[config.adapter]
    if config.adapter == "dora":
        return cls(n_in, n_out, config, rng=rng, init_generator=init_generator, init=init, base_weight=base_weight)
    return cls(n_in, n_out, config, rng=rng, init_generator=init_generator, init=init)
