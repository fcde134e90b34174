"""The LoRA module's values and generators as the training loop saves and restores them (no ComfyUI)."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


def load_named(module: nn.Module, values: dict[str, torch.Tensor], what: str) -> None:
    params = dict(module.named_parameters())
    if set(params) != set(values):
        extra, missing = sorted(set(values) - set(params))[:3], sorted(set(params) - set(values))[:3]
        raise ValueError(f"the training state's {what} do not match the attached LoRA "
                         f"(state only: {extra}, LoRA only: {missing}); attach the LoRA the state was trained with")
    for name, p in params.items():
        if tuple(values[name].shape) != tuple(p.shape):
            raise ValueError(f"the training state's '{name}' has shape {tuple(values[name].shape)}, "
                             f"the attached LoRA {tuple(p.shape)}; attach a LoRA with the same rank and targets")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(values[name].to(p.device, p.dtype))


def get_extra_rng(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own generators (a LoRASet's dropout RNG: ``rng.get_state()``), else none."""
    rng = getattr(module, "rng", None)
    return rng.get_state() if hasattr(rng, "get_state") else {}


def dropout_rng(module: nn.Module) -> Any:
    """The module's dropout generators when it has them (a LoRASet's ``rng``), else None."""
    rng = getattr(module, "rng", None)
    return rng if hasattr(rng, "get_state") and hasattr(rng, "set_state") else None


def global_rows(module: nn.Module, start: int, stop: int, total: int) -> Any:
    """Context: the module's dropout masks are drawn for ``total`` rows and rows ``start:stop`` applied
    (``lora.lowrank.DropoutRNG.global_rows``); nothing for a module without one."""
    rng = getattr(module, "rng", None)
    return rng.global_rows(start, stop, total) if hasattr(rng, "global_rows") else contextlib.nullcontext()


def set_extra_rng(module: nn.Module, states: dict[str, torch.Tensor]) -> None:
    rng = getattr(module, "rng", None)
    if hasattr(rng, "set_state"):
        rng.set_state(states)
