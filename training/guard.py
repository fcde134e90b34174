"""NaN/inf guard: skip bad steps, roll back after ``patience`` bad steps in a row, never save non-finite.

A step is bad when its loss or any gradient is non-finite (checked before the optimizer step: the step is
**skipped**, and the LoRA, the optimizer state and the EMA stay exactly as the last good step left them), or
when a parameter is non-finite after the update (the step is already applied: the last snapshot is restored
at once). ``patience`` bad steps in a row restore the last snapshot (policy "rollback") or end the run with
the state of the last good step (policy "stop"). Snapshots are taken every ``snapshot_every`` steps, so a
**rollback** discards the good steps since its snapshot; ``discarded`` counts them and the log names them.
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
                raise NonFiniteError(f"refusing to write {what}: '{key}' holds NaN/inf")
    elif not all_finite(nested_tensors(obj)):
        raise NonFiniteError(f"refusing to write {what}: it holds NaN/inf")


@dataclass
class Snapshot:
    """Copies (not views) of the guarded tensors (the optimizer's parameters, then the EMA) and of the
    optimizer state at a good step."""

    step: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any]


@dataclass
class NanGuard:
    """Counts bad steps and holds the last good snapshot. ``snapshot_every`` good steps refresh it.

    ``tensors`` (every method): what a snapshot keeps and a rollback restores, in a fixed order: the
    optimizer's parameters, then anything else that follows them (the EMA shadow)."""

    patience: int
    policy: str = "rollback"
    snapshot_every: int = 10
    streak: int = 0
    skipped: int = 0
    rollbacks: int = 0
    discarded: int = 0        # good steps thrown away by rollbacks (those between a snapshot and its restore)
    since_snapshot: int = 0   # good steps since the last snapshot: what a rollback now would discard
    events: list[str] = field(default_factory=list)
    last_good: Snapshot | None = None

    def snapshot(self, step: int, tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Copy ``tensors`` and the optimizer state to the CPU (the old snapshot is dropped first, so there are
        never two; on a GPU the snapshot costs host memory, not device memory)."""
        self.last_good = None
        self.last_good = Snapshot(step, [to_cpu(t) for t in tensors], to_cpu(optimizer.state_dict()))
        self.since_snapshot = 0

    def maybe_snapshot(self, step: int, tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        if self.last_good is None or step - self.last_good.step >= self.snapshot_every:
            self.snapshot(step, tensors, optimizer)

    def good(self) -> None:
        self.streak = 0
        self.since_snapshot += 1

    def bad(self, step: int, why: str, tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer,
            applied: bool = False) -> str:
        """Record bad step ``step`` (0-based). ``applied``: the optimizer already took it, so the snapshot is
        restored now, whatever the streak. Returns "skip" (nothing was changed), "rollback" (the snapshot was
        restored) or "stop" (the policy's end of the run; the state is the last good step's, or the snapshot's
        when this step was applied)."""
        self.streak += 1
        self.skipped += 1
        self._note(f"step {step + 1}: {why}; skipped ({self.streak} in a row)")
        if applied:
            self.roll_back(tensors, optimizer)
        if self.streak < self.patience:
            return "rollback" if applied else "skip"
        if self.policy == "stop":
            return "stop"
        if not applied:
            self.roll_back(tensors, optimizer)
        self.streak = 0
        return "rollback"

    def roll_back(self, tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Restore the last snapshot: the good steps since it are discarded (counted and logged)."""
        snap = self.restore(tensors, optimizer)
        self.rollbacks += 1
        self.discarded += self.since_snapshot
        self._note(f"rolled back to the state after step {snap.step}, discarding the {self.since_snapshot} "
                   "good steps since it")
        self.since_snapshot = 0

    def restore(self, tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> Snapshot:
        """Copy the last snapshot into ``tensors`` and the optimizer; returns it."""
        if self.last_good is None:
            raise NonFiniteError("NaN guard: no good state to roll back to")
        with torch.no_grad():
            for t, saved in zip(tensors, self.last_good.params, strict=True):
                t.copy_(saved)
        # load_state_dict moves the state to the parameters' device; on the CPU it would share the snapshot's
        # tensors (and the optimizer would then update the snapshot in place), so it gets a copy
        optimizer.load_state_dict(to_cpu(self.last_good.optimizer))
        return self.last_good

    def _note(self, msg: str) -> None:
        self.events.append(msg)
        log.warning("NaN guard: %s", msg)
