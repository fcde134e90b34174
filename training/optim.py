"""Optimizer registry, learning-rate schedules, LoRA+ groups and fp32 master weights.

The learning rate is a pure function of the optimizer step (``lr_multiplier``) written into each param
group before every step, so a schedule has no state of its own: resuming needs only the step count.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import torch

if TYPE_CHECKING:
    from .settings import TrainSettings

BASE_LR_KEY = "precision_base_lr"  # per-group lr before the schedule (LoRA+ groups differ)


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one optimizer; ``package`` is the optional module it needs (None = torch only)."""

    build: Callable[[list[dict], TrainSettings], torch.optim.Optimizer]
    package: str | None
    description: str


def _kernel(groups: list[dict]) -> dict[str, bool]:
    """``fused=True`` (one kernel for every LoRA matrix: 4x faster than foreach for AdamW on CPU) when every
    parameter is a floating tensor on the CPU or CUDA, else ``foreach=True`` (torch picks neither by
    default on CPU; hundreds of small tensors make the per-tensor loop slow)."""
    params = [p for g in groups for p in g["params"]]
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return {"fused": True} if fused else {"foreach": True}


def _adamw(groups: list[dict], s: TrainSettings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=s.learning_rate, betas=(s.beta1, s.beta2), eps=s.eps,
                             weight_decay=s.weight_decay, **_kernel(groups))


def _sgd(groups: list[dict], s: TrainSettings) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=s.learning_rate, momentum=s.beta1, weight_decay=s.weight_decay,
                           **_kernel(groups))


def _adafactor(groups: list[dict], s: TrainSettings) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(groups, lr=s.learning_rate, weight_decay=s.weight_decay)


def _bnb(name: str) -> Callable[[list[dict], TrainSettings], torch.optim.Optimizer]:
    def build(groups: list[dict], s: TrainSettings) -> torch.optim.Optimizer:
        import bitsandbytes as bnb  # optional dependency, imported only when chosen

        cls = getattr(bnb.optim, name)
        return cls(groups, lr=s.learning_rate, betas=(s.beta1, s.beta2), eps=s.eps, weight_decay=s.weight_decay)

    return build


def _prodigy(groups: list[dict], s: TrainSettings) -> torch.optim.Optimizer:
    import prodigyopt  # optional dependency, imported only when chosen

    return prodigyopt.Prodigy(groups, lr=s.learning_rate, betas=(s.beta1, s.beta2), weight_decay=s.weight_decay)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(_adamw, None, "torch AdamW (default)"),
    "adamw8bit": OptimizerSpec(_bnb("AdamW8bit"), "bitsandbytes", "bitsandbytes 8-bit AdamW"),
    "paged_adamw8bit": OptimizerSpec(_bnb("PagedAdamW8bit"), "bitsandbytes", "bitsandbytes paged 8-bit AdamW"),
    "paged_adamw": OptimizerSpec(_bnb("PagedAdamW"), "bitsandbytes", "bitsandbytes paged AdamW"),
    "prodigy": OptimizerSpec(_prodigy, "prodigyopt", "Prodigy (use learning_rate 1.0)"),
    "adafactor": OptimizerSpec(_adafactor, None, "torch Adafactor"),
    "sgd": OptimizerSpec(_sgd, None, "SGD with momentum beta1"),
}


def available() -> dict[str, str | None]:
    """Optimizer name -> None if usable here, else the reason (e.g. the package to install)."""
    out: dict[str, str | None] = {}
    for name, spec in OPTIMIZERS.items():
        missing = spec.package is not None and importlib.util.find_spec(spec.package) is None
        out[name] = f"unavailable: pip install {spec.package}" if missing else None
    return out


def build_optimizer(groups: list[dict], settings: TrainSettings) -> torch.optim.Optimizer:
    """Build the configured optimizer over ``groups`` (each with its own ``lr``, e.g. from LoRA+).

    Raises ValueError naming the optimizer and the fix when it is unknown or its package is missing.
    """
    name = settings.optimizer
    if name not in OPTIMIZERS:
        raise ValueError(f"[Precision LoRA] optimizer {name!r} is unknown; choose one of {sorted(OPTIMIZERS)}")
    reason = available()[name]
    if reason is not None:
        raise ValueError(f"[Precision LoRA] optimizer {name!r} is {reason}, or choose 'adamw'")
    for g in groups:
        g[BASE_LR_KEY] = float(g["lr"])
    return OPTIMIZERS[name].build(groups, settings)


# ---- learning-rate schedules: multiplier(step, settings) with step = optimizer steps already done ----

def _warm(step: int, warmup: int) -> float:
    return (step + 1) / (warmup + 1) if step < warmup else 1.0


def _progress(step: int, s: TrainSettings) -> float:
    span = max(1, s.schedule_steps - s.warmup_steps)
    return min(1.0, max(0.0, (step - s.warmup_steps) / span))


def _constant(step: int, s: TrainSettings) -> float:
    return 1.0


def _constant_warmup(step: int, s: TrainSettings) -> float:
    return _warm(step, s.warmup_steps)


def _linear(step: int, s: TrainSettings) -> float:
    return _warm(step, s.warmup_steps) * (1.0 - _progress(step, s))


def _cosine(step: int, s: TrainSettings) -> float:
    return _warm(step, s.warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * _progress(step, s)))


def _cosine_restarts(step: int, s: TrainSettings) -> float:
    p = _progress(step, s)
    if p >= 1.0:
        return 0.0
    cycle = (p * s.restarts) % 1.0
    return _warm(step, s.warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * cycle))


SCHEDULES: dict[str, Callable[[int, TrainSettings], float]] = {
    "constant": _constant,
    "constant_with_warmup": _constant_warmup,
    "linear": _linear,
    "cosine": _cosine,
    "cosine_with_restarts": _cosine_restarts,
}


def lr_multiplier(step: int, settings: TrainSettings) -> float:
    """Multiplier of the base lr for optimizer step ``step`` (0-based). Warmup ramps (step+1)/(warmup+1);
    decaying schedules reach 0 at ``schedule_steps`` and stay there."""
    return SCHEDULES[settings.lr_schedule](step, settings)


def apply_lr(optimizer: torch.optim.Optimizer, step: int, settings: TrainSettings) -> float:
    """Write the scheduled lr into every group; returns the lr of the first group."""
    mult = lr_multiplier(step, settings)
    for g in optimizer.param_groups:
        g["lr"] = g.get(BASE_LR_KEY, settings.learning_rate) * mult
    return float(optimizer.param_groups[0]["lr"])


# ---- fp32 master weights for LoRA parameters stored in a low-precision dtype ----

def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, gen: torch.Generator) -> None:
    """dst (bf16) <- src (fp32) rounded stochastically: unbiased, E[dst] = src. Noise drawn on CPU."""
    bits = src.detach().float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, dtype=torch.int32).to(bits.device)
    rounded = ((bits + noise) & -65536).view(torch.float32)  # -65536 == 0xFFFF0000: keep the top 16 bits
    dst.copy_(torch.where(torch.isfinite(src), rounded, src.float()).to(dst.dtype))


class MasterWeights:
    """fp32 copies of low-precision trainable parameters; the optimizer updates the copies.

    ``groups`` are rewritten so fp32 parameters stay as they are and each bf16/fp16 parameter is replaced
    by its fp32 master. After ``backward`` call ``pull_grads``; after ``optimizer.step`` call ``push``,
    which writes masters back with stochastic rounding from ``gen`` (part of the saved RNG state).
    """

    def __init__(self, groups: list[dict], gen: torch.Generator) -> None:
        self.gen = gen
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        for g in groups:
            params = []
            for p in g["params"]:
                if p.dtype == torch.float32:
                    params.append(p)
                    continue
                master = torch.nn.Parameter(p.detach().float().clone())
                self.pairs.append((p, master))
                params.append(master)
            g["params"] = params

    @property
    def active(self) -> bool:
        return bool(self.pairs)

    def pull_grads(self) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def push(self) -> None:
        with torch.no_grad():
            for p, m in self.pairs:
                stochastic_round_(p, m, self.gen)

    def load_from_params(self) -> None:
        """Re-seed masters from the (restored) parameters, e.g. after a rollback or resume."""
        with torch.no_grad():
            for p, m in self.pairs:
                m.copy_(p.float())

    def masters(self) -> Iterable[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        return iter(self.pairs)


def optimizer_state_finite(optimizer: torch.optim.Optimizer) -> bool:
    """True if every floating tensor in the optimizer state is finite."""
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                return False
    return True

