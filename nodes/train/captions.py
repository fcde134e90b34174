"""The empty caption of caption dropout: one CONDITIONING, encoded for every training sample.

``PrecisionTrainLoRA`` takes it as ``empty_conditioning`` (a text encoder's output for ""), because the
pack does not encode captions itself. Each sample gets its own processed copy (the model's extra conds
can depend on the latent's size), which the loop uses instead of the caption when dropout picks it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ...training.loop import Sample
from ...training.settings import TrainSettings
from . import data as train_data

log = logging.getLogger(__name__)
NODE = "PrecisionTrainLoRA"


def _err(message: str) -> ValueError:
    return ValueError(f"{NODE}: input 'empty_conditioning': {message}")


def with_empty_caption(model: Any, samples: list[Sample], empty: list[Any] | None, cfg: TrainSettings,
                       device: torch.device) -> list[Sample]:
    """``samples`` with ``empty_cond`` set when caption dropout is on; unchanged when it is off."""
    if cfg.caption_dropout <= 0:
        if empty:
            log.info("%s: empty_conditioning is connected but caption_dropout is 0; it is unused",
                     NODE)
        return samples
    if not empty:
        raise _err(f"not connected, but settings.caption_dropout={cfg.caption_dropout} > 0 needs it: connect "
                   "CLIPTextEncode (or your text encoder node) with an empty text, or set caption_dropout to 0")
    with torch.inference_mode(False):
        rows = train_data._cond_rows(model, empty, "empty_conditioning")
        if len(rows) != 1:
            raise _err(f"has {len(rows)} conditioning rows; connect exactly one (the encoding of an empty text)")
        return [dataclasses.replace(s, empty_cond=train_data._encode(model, rows[0], s.latent, device,
                                                                         train_data.sample_latent_shapes(s)))
                for s in samples]
