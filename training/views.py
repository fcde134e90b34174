"""Weights other than the ones being trained: an EMA of the LoRA, schedule-free's averaged weights.

Two things make the LoRA users look at differ from the LoRA the optimizer steps:
- ``Ema``: an fp32 shadow of the optimizer's parameters (fp32 LoRA values or the fp32 masters of a bf16
  LoRA), updated after every optimizer step, on the training device or on the CPU;
- a schedule-free optimizer (``OptimizerSpec.schedule_free``) trains at an interpolation ``y`` of its
  iterates and evaluates at their average ``x`` (its ``eval()`` mode).

``WeightViews`` puts such weights into the module for a while (a preview, a checkpoint, the end of a run)
and then puts back the exact values that were there, bit for bit, so a run with previews and checkpoints
trains the same LoRA as one without (switching schedule-free back with ``train()`` would not: its
interpolation rounds). A checkpoint taken inside a view holds the view's LoRA (the file users load) and the
values to continue training from (``WeightViews.raw``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

EMA_SAVE: dict[str, str] = {
    "beside": "the LoRA is the trained weights; each checkpoint and the run's end also write the EMA LoRA "
              "beside it (<name>_ema.safetensors)",
    "as_lora": "the LoRA output, checkpoints and Save LoRA hold the EMA weights",
}


def ema_decay_at(step: int, decay: float, warmup: int) -> float:
    """Decay of the update after optimizer step ``step`` (1-based): ``decay``, ramped linearly from 0 over the
    first ``warmup`` steps (``decay * min(1, step / warmup)``), so early weights do not dominate the average."""
    if warmup <= 0:
        return decay
    return decay * min(1.0, step / warmup)


class Ema:
    """fp32 exponential moving average of ``params``: ``shadow <- d * shadow + (1 - d) * param`` after every
    optimizer step, ``d = ema_decay_at(step, decay, warmup)``. ``on_cpu``: the shadow lives in host memory
    (one device-to-host copy of the LoRA per step) instead of beside the parameters."""

    def __init__(self, params: list[torch.Tensor], decay: float, warmup: int, on_cpu: bool) -> None:
        self.params, self.decay, self.warmup = params, decay, warmup
        self.shadow = [p.detach().to("cpu" if on_cpu else p.device, torch.float32, copy=True) for p in params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        weight = 1.0 - ema_decay_at(step, self.decay, self.warmup)
        values = [p.detach().to(s.device, torch.float32) for s, p in zip(self.shadow, self.params)]
        torch._foreach_lerp_(self.shadow, values, weight)

    def values(self) -> list[torch.Tensor]:
        return self.shadow

    def load(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for s, v in zip(self.shadow, values):
                s.copy_(v)


class Best:
    """``keep_best_validation``: host copies of the optimizer's parameters (fp32 values or the fp32 masters) at the
    step with the lowest validation loss so far. A tie keeps the earlier step."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self.step, self.loss = 0, float("inf")

    @torch.no_grad()
    def offer(self, params: list[torch.Tensor], step: int, loss: float) -> bool:
        """Keep ``params`` when ``loss`` is below the best so far; True when kept."""
        if not loss < self.loss:
            return False
        if self.values:
            for v, p in zip(self.values, params):
                v.copy_(p)
        else:
            self.values = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
        self.step, self.loss = step, loss
        return True


class WeightViews:
    """Swap view weights into ``module`` and back. ``params``: the optimizer's parameters; ``pairs``: (module
    parameter, its fp32 master) for low-precision LoRAs (a view rounds the master to nearest for the module).

    ``save``: what checkpoints and the run's end hold: "eval" (schedule-free), "ema" (EMA saved as the LoRA)
    or None; ``preview``: the same for previews. "best" (``Best``) is what the run's end holds with
    ``keep_best_validation``."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                 pairs: list[tuple[torch.Tensor, torch.Tensor]], ema: Ema | None, save: str | None,
                 preview: str | None) -> None:
        self.module, self.optimizer, self.params, self.pairs = module, optimizer, params, pairs
        self.ema, self.save, self.preview = ema, save, preview
        self.best: Best | None = None  # keep_best_validation: the weights at the lowest validation loss so far
        self.raw: dict[str, torch.Tensor] | None = None  # module values to continue from, while in a view
        self.raw_masters: dict[int, torch.Tensor] = {}    # id(master) -> its value, while in a view
        self._saved: tuple[list[torch.Tensor], list[torch.Tensor], list[object]] | None = None

    @contextlib.contextmanager
    def view(self, kind: str | None) -> Iterator[None]:
        """Inside: ``kind`` ("eval", "ema" or None = nothing changes) in the module; afterwards the exact
        values before. Views do not nest: inside one, another is a no-op."""
        if kind is None or self._saved is not None:
            yield
            return
        self.enter(kind)
        try:
            yield
        finally:
            self.leave()

    @torch.no_grad()
    def enter(self, kind: str) -> None:
        """Put view ``kind`` in the module (and keep it there: the end of a run stays in its save view)."""
        named = list(self.module.named_parameters())
        self._saved = ([p.detach().clone() for p in self.params], [p.detach().clone() for _, p in named],
                       [g.get("train_mode") for g in self.optimizer.param_groups])
        self.raw = {n: v for (n, _), v in zip(named, self._saved[1])}
        self.raw_masters = {id(p): v for p, v in zip(self.params, self._saved[0])}
        if kind == "eval":
            self.optimizer.eval()  # type: ignore[attr-defined]  # schedule-free: params <- averaged x
        elif kind in ("ema", "best"):
            values = self.ema.values() if kind == "ema" else self.best.values  # type: ignore[union-attr]
            for p, s in zip(self.params, values):
                p.copy_(s)
        else:
            raise ValueError(f"unknown weights view {kind!r}; expected 'eval', 'ema' or 'best'")
        for p, m in self.pairs:
            p.copy_(m.to(p.dtype))

    @torch.no_grad()
    def leave(self) -> None:
        assert self._saved is not None
        params, module_values, modes = self._saved
        for p, v in zip(self.params, params):
            p.copy_(v)
        for (_, p), v in zip(self.module.named_parameters(), module_values):
            p.copy_(v)
        for g, mode in zip(self.optimizer.param_groups, modes):
            if mode is not None:
                g["train_mode"] = mode
        self._saved, self.raw, self.raw_masters = None, None, {}

    def optimizer_state(self) -> dict:
        """The optimizer's state dict as training continues from it (train mode, even inside an eval view)."""
        state = self.optimizer.state_dict()
        if self._saved is not None:
            for g, mode in zip(state["param_groups"], self._saved[2]):
                if mode is not None:
                    g["train_mode"] = mode
        return state


def view_kinds(schedule_free: bool, ema_on: bool, ema_save: str, ema_preview: bool) -> tuple[str | None, str | None]:
    """(save view, preview view) for a run's settings."""
    if schedule_free:
        return "eval", "eval"
    save = "ema" if ema_on and ema_save == "as_lora" else None
    return save, "ema" if ema_on and ema_preview else None
