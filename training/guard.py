"""NaN/inf guard: skip bad steps, roll back after ``patience`` bad steps in a row, never save non-finite.

A step is bad when its loss or any gradient is non-finite (checked before the optimizer step), or when
a parameter is non-finite after it. Bad steps leave the parameters and optimizer untouched where that is
possible (gradients are dropped); ``patience`` bad steps in a row restore the last good snapshot.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from .tensors import nested_tensors, to_cpu

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Raised instead of writing a tensor that holds NaN or inf."""


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True if every floating tensor is finite (one host sync per tensor; tensors may be on any device)."""
    for t in tensors:
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return False
    return True


def assert_finite(obj: Any, what: str) -> None:
    """Raise NonFiniteError if any floating tensor nested in ``obj`` (dict/list/tensor) is non-finite."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if not all_finite(nested_tensors(value)):
                raise NonFiniteError(f"[Precision LoRA] refusing to write {what}: '{key}' holds NaN/inf")
    elif not all_finite(nested_tensors(obj)):
        raise NonFiniteError(f"[Precision LoRA] refusing to write {what}: it holds NaN/inf")


@dataclass
class Snapshot:
    """Copies (not views) of the parameters and the optimizer state at a good step."""

    step: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any]


@dataclass
class NanGuard:
    """Counts bad steps and holds the last good snapshot. ``snapshot_every`` good steps refresh it."""

    patience: int
    policy: str = "rollback"
    snapshot_every: int = 10
    streak: int = 0
    skipped: int = 0
    rollbacks: int = 0
    events: list[str] = field(default_factory=list)
    last_good: Snapshot | None = None

    def snapshot(self, step: int, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Copy parameters and optimizer state to the CPU (the old snapshot is dropped first, so there are
        never two; on a GPU the snapshot costs host memory, not device memory)."""
        self.last_good = None
        self.last_good = Snapshot(step, [to_cpu(p) for p in params], to_cpu(optimizer.state_dict()))

    def maybe_snapshot(self, step: int, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        if self.last_good is None or step - self.last_good.step >= self.snapshot_every:
            self.snapshot(step, params, optimizer)

    def good(self) -> None:
        self.streak = 0

    def bad(self, step: int, why: str, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> str:
        """Record a bad step. Returns "skip", "rollback" (already restored) or "stop"."""
        self.streak += 1
        self.skipped += 1
        msg = f"step {step + 1}: {why}; skipped ({self.streak} in a row)"
        self.events.append(msg)
        log.warning("[Precision LoRA] NaN guard: %s", msg)
        if self.streak < self.patience:
            return "skip"
        if self.policy == "stop":
            self.restore(params, optimizer)
            return "stop"
        self.restore(params, optimizer)
        self.rollbacks += 1
        self.streak = 0
        return "rollback"

    def restore(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        if self.last_good is None:
            raise NonFiniteError("[Precision LoRA] NaN guard: no good state to roll back to")
        with torch.no_grad():
            for p, saved in zip(params, self.last_good.params):
                p.copy_(saved)
        # load_state_dict moves the state to the parameters' device; on the CPU it would share the snapshot's
        # tensors (and the optimizer would then update the snapshot in place), so it gets a copy
        optimizer.load_state_dict(to_cpu(self.last_good.optimizer))
        msg = f"rolled back to the state after step {self.last_good.step}"
        self.events.append(msg)
        log.warning("[Precision LoRA] NaN guard: %s", msg)
