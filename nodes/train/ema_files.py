"""The EMA LoRA written beside a run's checkpoints (``ema_save`` "beside"; docs/optimizers.md).

The loop puts the EMA weights into the LoRA set (``training.views``) and calls the writer with the step; the
file is ``models/loras/<name>/<name>_step<N>_ema.safetensors`` (a free name: an existing file is never
overwritten), with the keys and metadata of a checkpoint, so every LoRA loader lists and loads it.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from ...lora.file import default_key_style
from ...lora.layer import LoRASet
from ...training.checkpoint import LORA_SUFFIX
from ...training.settings import TrainSettings
from ..model.info import describe_model
from ..lora.glue import write_lora
from .checkpoint_files import free_base, run_folder


def ema_writer(model: Any, lora_set: LoRASet, name: str, cfg: TrainSettings) -> Callable[[int], str] | None:
    """``Hooks.save_ema`` for a run named ``name``, or None when the settings write no EMA file."""
    if cfg.ema_decay <= 0 or cfg.ema_save != "beside":
        return None
    info = describe_model(model)

    def save(step: int) -> str:
        path = free_base(run_folder(name), f"{name}_step{step:06d}_ema") + LORA_SUFFIX
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return write_lora(path, model, info, lora_set, default_key_style(info.family), extra={
            "ss_steps": step, "precision_lora_ema": f"decay {cfg.ema_decay}, warmup {cfg.ema_warmup} steps"})

    return save
