"""Training state (what continues a run) and its atomic checkpoint files.

A ``TrainingState`` is a detached CPU snapshot: LoRA values, fp32 masters, optimizer state, generator
states, step, loss history and settings. It flows between chained ``PrecisionTrainLoRA`` nodes and is
what a checkpoint stores, so "continue in the graph" and "resume from a file" are the same code path.

Checkpoint = two files written atomically (temp file + ``os.replace``), state first, LoRA last:
``<base>.trainstate`` (``torch.save`` of ``TrainingState.to_dict()``, loads with ``weights_only=True``) and
``<base>.safetensors`` (the LoRA, written by the caller-supplied writer in the ``PrecisionSaveLoRA``
format). Non-finite tensors are refused (``NonFiniteError``) before anything is written.

Earlier versions named the state ``<base>.state.pt``. ComfyUI lists every ``.pt`` file in a model folder, so
those states showed up in every LoRA list beside their checkpoints; ``.trainstate`` is no model extension of
ComfyUI, so the lists show the LoRA only. Old states are still read (``state_candidates``), never written.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .files import atomic_write
from .guard import assert_finite

log = logging.getLogger(__name__)

STATE_SUFFIX = ".trainstate"
LEGACY_STATE_SUFFIX = ".state.pt"  # what earlier versions wrote; read only
STATE_SUFFIXES = (STATE_SUFFIX, LEGACY_STATE_SUFFIX)
LORA_SUFFIX = ".safetensors"
FORMAT_VERSION = 1


@dataclass
class TrainingState:
    """Everything needed to continue a run bit-exactly. All tensors are on the CPU and owned by this object,
    except that the final state of ``train(..., hand_over=True)`` shares the LoRA values with the trained
    LoRA set (which nothing trains again) instead of holding a second copy.

    ``lora``: trainable parameter name -> value in its stored dtype; ``masters``: fp32 masters of
    low-precision parameters (empty when the LoRA is fp32); ``generator``: the loop's CPU generator state
    (data order, timesteps, noise); ``extra_rng``: other generators (LoRA dropout), device -> state;
    ``history``: one dict per optimizer step {"step", "loss", "lr", "sigma", "dop", "skipped"};
    ``ema``: the fp32 EMA shadow by parameter name (empty without EMA); ``train_lora``: when ``lora`` holds
    other weights than the ones training continues from (schedule-free's averaged weights, an EMA saved as
    the LoRA: ``training.views``), the values to continue from, else empty. ``masters`` are always the
    values to continue from. ``best``/``best_step``: with ``keep_best_validation``, the optimizer's fp32 values at
    the step with the lowest validation loss so far (``training.views.Best``), by parameter name, and that step.
    """

    step: int
    seed: int
    settings: dict[str, Any]
    lora: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    generator: torch.Tensor
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    extra_rng: dict[str, torch.Tensor] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    rollbacks: int = 0
    ema: dict[str, torch.Tensor] = field(default_factory=dict)
    train_lora: dict[str, torch.Tensor] = field(default_factory=dict)
    best: dict[str, torch.Tensor] = field(default_factory=dict)
    best_step: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["format_version"] = FORMAT_VERSION
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingState:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"step", "seed", "settings", "lora", "optimizer", "generator"} - set(data)
        if missing:
            raise ValueError(f"training state is missing {sorted(missing)}; not a Precision LoRA checkpoint")
        return cls(**{k: v for k, v in data.items() if k in names})

    def losses(self) -> list[float]:
        """Finite losses in step order (the ``LOSS_MAP`` list)."""
        return [float(p["loss"]) for p in self.history if p.get("loss") is not None]



def save_state(path: str, state: TrainingState) -> str:
    """Write ``state`` atomically to ``path`` (``*.trainstate``). Refuses non-finite tensors. Returns path."""
    data = state.to_dict()
    assert_finite({"lora": data["lora"], "masters": data["masters"], "optimizer": data["optimizer"]["state"],
                   "ema": data["ema"], "train_lora": data["train_lora"], "best": data["best"]},
                  f"training state {os.path.basename(path)}")
    atomic_write(path, lambda tmp: torch.save(data, tmp))
    return path


def load_state(path: str) -> TrainingState:
    """Read a ``*.trainstate`` (or older ``*.state.pt``) file (``weights_only=True``: no code runs). Clear errors on bad files."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"training state file not found: {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated / foreign files
        raise ValueError(f"cannot read training state {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a Precision LoRA training state")
    return TrainingState.from_dict(data)


def write_checkpoint(base: str, state: TrainingState, write_lora: Callable[[str], str]) -> str:
    """Write ``<base>.trainstate`` then the LoRA via ``write_lora(<base>.safetensors)``; returns the LoRA path.

    ``write_lora`` must write atomically (``lora.file.save_lora_file`` does). Nothing is written
    if the state holds a non-finite tensor.
    """
    save_state(base + STATE_SUFFIX, state)
    path = write_lora(base + LORA_SUFFIX)
    log.info("checkpoint at step %d: %s", state.step, path)
    return path


FACTOR_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".lora_A.weight", ".lora_B.weight",
                   # the trainable tensors of the other adapter kinds (lora/adapters.py), in stock ComfyUI's keys
                   ".lokr_w1", ".lokr_w2", ".lokr_w2_a", ".lokr_w2_b", ".hada_w1_a", ".hada_w1_b", ".hada_w2_a",
                   ".hada_w2_b", ".dora_scale")


def _digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's shape, dtype and bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{tuple(t.shape)}|{t.dtype}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def state_lora_mismatch(state: TrainingState, file_tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``state`` is not the training state of the LoRA file holding ``file_tensors``, or None.

    A state and its LoRA are written together from the same values, so the file's factors (``lora_down``/
    ``lora_up`` or ``lora_A``/``lora_B``, in whatever key style) are the state's LoRA values cast to the file's
    dtype. Compared as a multiset of per-tensor digests (shape, dtype, bytes): no key mapping needed, and one
    changed bit anywhere is a mismatch. ``.alpha`` and other keys are not compared."""
    factors = [t for k, t in file_tensors.items() if k.endswith(FACTOR_SUFFIXES)]
    if not factors:
        return "the LoRA file holds no lora_down/lora_up factors"
    if len(factors) != len(state.lora):
        return f"the state holds {len(state.lora)} LoRA tensors, the LoRA file {len(factors)} factors"
    dtype = factors[0].dtype
    ours = collections.Counter(_digest(v.detach().float().to(dtype)) for v in state.lora.values())
    theirs = collections.Counter(_digest(t.flatten(1) if t.dim() > 2 else t) for t in factors)  # LoCon: flat in the state
    if ours != theirs:
        differ = sum((ours - theirs).values())
        return f"their LoRA values differ ({differ} of {len(factors)} tensors)"
    return None


def state_stem(path: str) -> str | None:
    """``path`` without its state suffix (either one), or None when it names no state file."""
    for suffix in STATE_SUFFIXES:
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return None


def state_path_for(lora_path: str) -> str:
    """The state file a checkpoint's LoRA file gets (current suffix); a state path (either suffix) as it is."""
    return state_candidates(lora_path)[0]


def state_candidates(lora_path: str) -> list[str]:
    """The state files that may belong to a LoRA file, in the order to read them: the current suffix, then
    the one earlier versions wrote. A path that already names a state file is the only candidate."""
    if state_stem(lora_path) is not None:
        return [lora_path]
    root = lora_path[: -len(LORA_SUFFIX)] if lora_path.endswith(LORA_SUFFIX) else lora_path
    return [root + suffix for suffix in STATE_SUFFIXES]


def state_beside(lora_path: str) -> str:
    """The training state file that belongs to the LoRA file ``lora_path``: same folder, same stem."""
    return state_candidates(lora_path)[0]


def find_state(lora_path: str) -> str | None:
    """The first of ``state_candidates(lora_path)`` that is a file, or None."""
    return next((p for p in state_candidates(lora_path) if os.path.isfile(p)), None)


def settings_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, value in the state, value now) for every setting that differs, in the order of ``now``. A
    setting the state does not record (written by an earlier version) is not a change."""
    return [(k, before[k], v) for k, v in now.items() if k in before and before[k] != v]


def describe_changes(changes: list[tuple[str, Any, Any]]) -> list[str]:
    """``"learning_rate 0.0001 -> 5e-05"`` per change."""
    return [f"{name} {old!r} -> {new!r}" if isinstance(new, str) else f"{name} {old} -> {new}"
            for name, old, new in changes]
