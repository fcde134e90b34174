"""Optimizer registry (the catalogue is ``training.optimizers``) and learning-rate schedules.

The learning rate has one form: each param group's base rate (``BASE_LR_KEY``, LoRA+ groups differ),
recorded once when the optimizer is built from the groups' ``lr``. Before every step the schedule's
multiplier (``lr_multiplier``, a pure function of the optimizer step) scales it into the group's ``lr``,
so a schedule has no state of its own: resuming needs only the step count.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .optimizers import OPTIMIZERS, Hyperparams, OptimizerSpec

__all__ = ["OPTIMIZERS", "Hyperparams", "OptimizerSpec", "available", "build_optimizer", "describe", "markdown_table",
           "schedule_free", "keep_settings_on_load", "SCHEDULES", "Schedule", "lr_multiplier", "apply_lr"]

BASE_LR_KEY = "precision_base_lr"  # per-group lr before the schedule (LoRA+ groups differ)
# Group keys that come from the run's settings. A resumed run loads the optimizer state of the run it continues,
# which carries the old values of these; the settings chosen now win (docs/training.md). Keys an optimizer keeps
# as state of its own in its groups (Prodigy's d estimate) are not among them and continue as saved.
SETTING_KEYS = ("lr", BASE_LR_KEY, "betas", "eps", "weight_decay", "momentum")


def schedule_free(name: str) -> bool:
    """True when optimizer ``name`` has train/eval modes (``OptimizerSpec.schedule_free``)."""
    return OPTIMIZERS[name].schedule_free


def group_lr(name: str) -> bool:
    """True when optimizer ``name`` steps each parameter group with its own lr (``OptimizerSpec.group_lr``)."""
    return OPTIMIZERS[name].group_lr


def describe() -> list[str]:
    """One line per optimizer for tooltips and logs: name, what it is for, recommended LoRA lr, whether it is
    installed here."""
    av = available()
    return [f"{n}: {spec.description}; lr {spec.lr}" + (f" ({av[n]})" if av[n] else "")
            for n, spec in OPTIMIZERS.items()]


def markdown_table() -> str:
    """The optimizer table of docs/optimizers.md, from the registry (a test keeps the two equal)."""
    rows = ["| optimizer | what it is for | LoRA learning rate | state per parameter | needs |",
            "|---|---|---|---|---|"]
    for name, spec in OPTIMIZERS.items():
        rows.append(f"| `{name}` | {spec.description} | {spec.lr} | {spec.state} | {spec.package or 'torch'} |")
    return "\n".join(rows)


def available() -> dict[str, str | None]:
    """Optimizer name -> None if usable here, else the reason (e.g. the package to install)."""
    out: dict[str, str | None] = {}
    for name, spec in OPTIMIZERS.items():
        missing = spec.package is not None and importlib.util.find_spec(spec.package) is None
        out[name] = f"unavailable: pip install {spec.package}" if missing else None
    return out


def build_optimizer(groups: list[dict], name: str, hyper: Hyperparams) -> torch.optim.Optimizer:
    """Build optimizer ``name`` over ``groups``, each with its own ``lr`` (e.g. LoRA+ groups).

    Raises ValueError naming the optimizer and the fix when it is unknown or its package is missing.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is unknown; choose one of {sorted(OPTIMIZERS)}")
    reason = available()[name]
    if reason is not None:
        raise ValueError(f"optimizer {name!r} is {reason}, or choose 'adamw'")
    for g in groups:
        if "lr" not in g:
            raise ValueError("every optimizer group needs its own 'lr' (the base learning rate)")
        g[BASE_LR_KEY] = float(g["lr"])
    optimizer = OPTIMIZERS[name].build(groups, hyper)
    keep_settings_on_load(optimizer)
    return optimizer


def keep_settings_on_load(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.load_state_dict`` keep this run's ``SETTING_KEYS`` in every group: the moments and
    step counts come from the loaded state, the learning rate, betas, eps and weight decay from the settings
    the optimizer was built with. Groups pair up by position (the LoRA set's groups are always lora_down,
    lora_up; ``load_state_dict`` refuses a different number or size of groups)."""
    chosen = [{k: g[k] for k in SETTING_KEYS if k in g} for g in optimizer.param_groups]

    def keep(opt: torch.optim.Optimizer) -> None:
        for group, mine in zip(opt.param_groups, chosen):
            group.update(mine)

    optimizer.register_load_state_dict_post_hook(keep)


# ---- learning-rate schedules: multiplier(step, schedule) with step = optimizer steps already done ----

@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule by name and the step counts it reads (validated by ``TrainSettings``)."""

    name: str
    warmup_steps: int
    schedule_steps: int  # horizon of decaying schedules
    restarts: int        # cosine_with_restarts cycles


def _warm(step: int, warmup: int) -> float:
    return (step + 1) / (warmup + 1) if step < warmup else 1.0


def _progress(step: int, s: Schedule) -> float:
    span = max(1, s.schedule_steps - s.warmup_steps)
    return min(1.0, max(0.0, (step - s.warmup_steps) / span))


def _constant(step: int, s: Schedule) -> float:
    return 1.0


def _constant_warmup(step: int, s: Schedule) -> float:
    return _warm(step, s.warmup_steps)


def _linear(step: int, s: Schedule) -> float:
    return _warm(step, s.warmup_steps) * (1.0 - _progress(step, s))


def _cosine(step: int, s: Schedule) -> float:
    return _warm(step, s.warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * _progress(step, s)))


def _cosine_restarts(step: int, s: Schedule) -> float:
    p = _progress(step, s)
    if p >= 1.0:
        return 0.0
    cycle = (p * s.restarts) % 1.0
    return _warm(step, s.warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * cycle))


SCHEDULES: dict[str, Callable[[int, Schedule], float]] = {
    "constant": _constant,
    "constant_with_warmup": _constant_warmup,
    "linear": _linear,
    "cosine": _cosine,
    "cosine_with_restarts": _cosine_restarts,
}


def lr_multiplier(step: int, schedule: Schedule) -> float:
    """Multiplier of the base lr for optimizer step ``step`` (0-based). Warmup ramps (step+1)/(warmup+1);
    decaying schedules reach 0 at ``schedule_steps`` and stay there."""
    return SCHEDULES[schedule.name](step, schedule)


def apply_lr(optimizer: torch.optim.Optimizer, multiplier: float) -> float:
    """Write base lr x ``multiplier`` into every group; returns the lr of the first group."""
    for g in optimizer.param_groups:
        g["lr"] = g[BASE_LR_KEY] * multiplier
    return float(optimizer.param_groups[0]["lr"])
