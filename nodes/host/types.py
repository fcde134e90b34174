"""Custom ComfyUI socket types of the training nodes.

- ``TRAINING_STATE`` carries a ``training.checkpoint.TrainingState`` (a detached CPU snapshot: LoRA values,
  optimizer, generators, step, loss history, settings) from one ``PrecisionTrainLoRA`` to the next.
- ``TRAIN_SETTINGS`` carries a frozen ``training.settings.TrainSettings``.
- ``PREVIEW_SETTINGS`` carries a frozen ``nodes.train.preview.PreviewSettings`` (prompt, VAE, sampler, size, when)
  from ``PrecisionPreviewSettings`` to ``PrecisionTrainLoRA``'s ``preview``.
- ``LOSS_MAP`` is ComfyUI's own loss-history type (``{"loss": [float, ...]}``), so ComfyUI's
  ``LossGraphNode`` and ``PrecisionLossGraph`` both accept it.
"""
from __future__ import annotations

from .comfy_io import io

TrainingStateType = io.Custom("TRAINING_STATE")
TrainSettingsType = io.Custom("TRAIN_SETTINGS")
LossMapType = io.Custom("LOSS_MAP")
PreviewSettingsType = io.Custom("PREVIEW_SETTINGS")

__all__ = ["LossMapType", "PreviewSettingsType", "TrainSettingsType", "TrainingStateType"]
