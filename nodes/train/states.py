"""What a Train LoRA run continues from and what it leaves behind: the state it resumes (and what changed
since), the kohya-style training metadata of its LoRA, and its checkpoints when the run exploded.

- ``continued_state``: the state of ``training_state`` or ``resume_from`` (checked against its LoRA file,
  ``checkpoint_files.check_pair``), and the settings that differ from that run's as report lines. Every
  changed setting takes effect (the optimizer keeps the new lr/betas/eps/weight decay when it loads the old
  state: ``training.optim.keep_settings_on_load``); a changed optimizer is refused naming both.
- ``training_metadata``: ``ss_learning_rate``, ``ss_optimizer``, ``ss_max_train_steps``, ``ss_resolution``,
  ``ss_caption_dropout_rate``... (strings), the keys kohya's sd-scripts write and LoRA readers look for.
- ``set_aside_exploded``: checkpoints of a run that ends exploded whose own weights are exploded are renamed
  out of the LoRA lists (``<stem>.safetensors.exploded``, their state too), so no loader offers them.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from ...training.checkpoint import TrainingState, describe_changes, load_state, settings_changes, state_candidates
from ...training.outcome import EXPLODED_MAX_ABS, largest_abs
from ...training.settings import TrainSettings
from .checkpoint_files import ResumePick, check_pair, resolve_resume

log = logging.getLogger(__name__)
NODE = "PrecisionTrainLoRA"
EXPLODED_SUFFIX = ".exploded"


@dataclass(frozen=True)
class Continuation:
    """The state a run continues (None: a new run), where it came from, and the settings changed since."""

    state: TrainingState | None
    pick: ResumePick | None
    changes: tuple[str, ...]


def continued_state(training_state: TrainingState | None, resume: str, cfg: TrainSettings) -> Continuation:
    pick = None
    if resume:
        pick = resolve_resume(resume)
        training_state = load_state(pick.state)
        check_pair(resume, pick, training_state)
    return Continuation(training_state, pick, tuple(resume_changes(training_state, cfg, resume)))


def resume_changes(state: TrainingState | None, cfg: TrainSettings, resume: str) -> list[str]:
    """The settings that differ from the state's run, as report lines (``"resume: learning_rate 0.0001 ->
    5e-05"``); each takes effect in the continued run. A changed optimizer cannot (its state is another
    optimizer's): refused naming both."""
    if state is None:
        return []
    source = f"input 'resume_from'={resume!r}" if resume else "input 'training_state'"
    changes = settings_changes(state.settings, cfg.to_dict())
    for name, old, new in changes:
        if name == "optimizer":
            raise ValueError(f"{NODE}: {source} continues a run trained with optimizer {old!r}, but "
                             f"the settings choose {new!r}: an optimizer state cannot be carried over to another "
                             f"optimizer; set optimizer to {old!r} to continue, or start a new run")
    lines = [f"resume: {line}" for line in describe_changes(changes)]
    for line in lines:
        log.info("%s: %s (takes effect from step %d)", NODE, line, state.step + 1)
    return lines


# ---- kohya-style training metadata ----

def _resolution(sizes: dict[str, int]) -> str | None:
    """kohya's ``ss_resolution`` ``"(width, height)"`` of the most common training size (``"512x768 px"``)."""
    if not sizes:
        return None
    found = re.fullmatch(r"(\d+)x(\d+) px", max(sizes, key=lambda k: sizes[k]))
    return f"({found.group(1)}, {found.group(2)})" if found else None


def _optimizer_text(cfg: TrainSettings) -> str:
    return (f"{cfg.optimizer}(betas=({cfg.beta1}, {cfg.beta2}), eps={cfg.eps}, weight_decay={cfg.weight_decay})")


def training_metadata(cfg: TrainSettings, sizes: dict[str, int], samples: int, total_steps: int,
                      seed: int) -> dict[str, str]:
    """The ``ss_*`` training keys of kohya's sd-scripts for a run with ``cfg`` on ``samples`` samples (sizes as
    the dataset report counts them) that ends at ``total_steps``; all values strings."""
    md: dict[str, Any] = {
        "ss_learning_rate": cfg.learning_rate,
        "ss_unet_lr": cfg.learning_rate,
        "ss_text_encoder_lr": 0.0,  # the pack trains the diffusion model only
        "ss_optimizer": _optimizer_text(cfg),
        "ss_lr_scheduler": cfg.lr_schedule,
        "ss_lr_warmup_steps": cfg.warmup_steps,
        "ss_max_train_steps": total_steps,
        "ss_steps": total_steps,
        "ss_num_train_images": samples,
        "ss_batch_size_per_device": cfg.batch_size,
        "ss_total_batch_size": cfg.batch_size * cfg.grad_accum,
        "ss_gradient_accumulation_steps": cfg.grad_accum,
        "ss_max_grad_norm": cfg.max_grad_norm,
        "ss_caption_dropout_rate": cfg.caption_dropout,
        "ss_timestep_sampling": cfg.timestep_sampling,
        "ss_sigmoid_scale": cfg.sigmoid_scale,
        "ss_discrete_flow_shift": cfg.shift,
        "ss_weighting_scheme": cfg.loss_weighting,
        "ss_loraplus_lr_ratio": cfg.loraplus_ratio,
        "ss_training_seed": seed,
        "ss_gradient_checkpointing": cfg.gradient_checkpointing,
    }
    resolution = _resolution(sizes)
    if resolution is not None:
        md["ss_resolution"] = resolution
    return {k: str(v) for k, v in md.items()}


# ---- checkpoints of an exploded run ----

def _exploded(path: str) -> bool:
    from ...lora.file import read_lora_file

    try:
        tensors, _ = read_lora_file(path)
    except ValueError:
        return True  # NaN/inf in the file: no loader should offer it either
    factors = [t for k, t in tensors.items() if not k.endswith(".alpha")]
    return not largest_abs(factors) <= EXPLODED_MAX_ABS


def set_aside_exploded(checkpoints: list[str]) -> tuple[list[str], list[str]]:
    """Rename each checkpoint (and its state) whose weights are exploded to ``<name>.exploded``, which no LoRA
    list shows; returns (the renamed LoRA paths, the checkpoints left as they were)."""
    moved, kept = [], []
    for path in checkpoints:
        if not os.path.isfile(path) or not _exploded(path):
            kept.append(path)
            continue
        for file in (path, *state_candidates(path)):
            if os.path.isfile(file):
                os.replace(file, file + EXPLODED_SUFFIX)
        moved.append(path)
        log.warning("%s: checkpoint %s has exploded weights; renamed to %s so no LoRA list "
                    "offers it", NODE, path, os.path.basename(path) + EXPLODED_SUFFIX)
    return moved, kept


def exploded_note(moved: list[str], kept: list[str]) -> str:
    """What the failed run's error adds about its checkpoints."""
    if not moved:
        return ""
    names = ", ".join(os.path.basename(p) + EXPLODED_SUFFIX for p in moved)
    note = (f"; {len(moved)} checkpoint{'s' if len(moved) != 1 else ''} of this run with exploded weights "
            f"{'were' if len(moved) != 1 else 'was'} renamed out of the LoRA lists ({names} in "
            f"{os.path.dirname(moved[0])}; delete them)")
    healthy = [p for p in kept if os.path.isfile(p)]
    if healthy:
        note += f"; the last healthy checkpoint is {healthy[-1]}: resume from it with a lower learning_rate"
    return note
