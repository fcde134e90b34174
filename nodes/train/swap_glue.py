"""Block swap inside ComfyUI: which blocks stream, who places the model, and how model management is told.

While a run swaps blocks, the pack owns the placement of the training model (ComfyUI's partial loading
and 0.33's dynamic VRAM would otherwise move the same weights by their own rules):

- ``load_resident``: the model and every clone of it that model management holds are unloaded (to the
  host); the ModelPatcher applies its object patches (the LoRA) without loading weights; every weight
  except the swapped blocks' moves to the load device; model management is told what is resident:
  ``model_loaded_weight_memory`` = the bytes really on the device, ``model_lowvram`` off, registered
  through ``load_models_gpu``, whose ``partially_load`` then sees a loaded model and moves nothing (a
  preview's ``load_models_gpu`` of the same model moves nothing either). A 0.33 dynamic-VRAM patcher is
  not registered (its own loader would bring every weight in); a preview during such a run goes through
  ComfyUI's loader (docs/memory.md: not verified without a GPU).
- ``streaming``: ``training.swap`` streams the swapped blocks' frozen weights through its ring.
- ``unload_resident`` on exit: the model ends on the host, object patches removed, as without swap.

The swapped blocks are the first ``swap_blocks`` of the blocks the session checkpoints (every block but
the last), so a swapped block is always recomputed in backward (``training.swap``'s condition).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

import torch
from torch import nn

import comfy.model_management as mm

from ...training.swap import swap_blocks
from ...training.settings import TrainSettings

log = logging.getLogger(__name__)


def swapped_blocks(checkpointed: Sequence[nn.Module], settings: TrainSettings, family: str) -> list[nn.Module]:
    """The first ``settings.swap_blocks`` of the checkpointed blocks; ValueError naming the node, input,
    value and the largest count this model allows when there are not that many."""
    n = settings.swap_blocks
    if n == 0:
        return []
    if n > len(checkpointed):
        most = len(checkpointed)
        fix = (f"set swap_blocks to at most {most}" if most else
               "this model has no block list to stream; set swap_blocks to 0")
        raise ValueError(f"PrecisionTrainSettings: input 'swap_blocks'={n} but this {family} model "
                         f"has {most} blocks that can be swapped (every checkpointed block; the last block is not "
                         f"checkpointed): {fix}")
    return list(checkpointed[:n])


def _unload_clones(model: Any) -> None:
    """Unload ``model`` and every clone of it (they share its modules) that model management holds."""
    for i in range(len(mm.current_loaded_models) - 1, -1, -1):
        held = mm.current_loaded_models[i].model
        if held is model or (held is not None and model.is_clone(held)):
            mm.current_loaded_models[i].model_unload()
            mm.current_loaded_models.pop(i)


def _move_resident(root: nn.Module, keep: set[int], device: torch.device) -> int:
    """Every parameter and buffer of ``root`` but those in ``keep`` (ids) to ``device``; returns its bytes there."""
    moved = 0
    with torch.inference_mode(False):  # ordinary tensors: autograd may save them
        for module in root.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None or id(t) in keep:
                        continue
                    if t.device != device:
                        if isinstance(t, nn.Parameter):
                            t.data = t.data.to(device)
                        else:
                            table[name] = t.to(device)
                    moved += t.numel() * t.element_size()
    return moved


def load_resident(model: Any, blocks: Sequence[nn.Module]) -> int:
    """Place ``model`` for a swapped run (module docstring) and tell model management; returns the bytes
    resident on the device. ``blocks``' weights stay on the host (``streaming`` moves the frozen ones).

    ValueError when the model carries weight patches (a LoRA applied by a stock loader): ComfyUI bakes those
    into the weights only when it loads the whole model, which a swapped run never does."""
    if model.patches:
        raise ValueError("PrecisionTrainLoRA: input 'settings' has swap_blocks="
                         f"{len(blocks)}, but the model carries {len(model.patches)} weight patches (a LoRA "
                         "applied by a stock LoRA loader), which ComfyUI applies only when it loads the whole "
                         "model: train without that loader (or merge and save it first), or set swap_blocks to 0")
    _unload_clones(model)
    device = model.load_device
    keep = {id(p) for b in blocks for p in b.parameters()}
    streamed = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    mm.free_memory(max(model.model_size() - streamed, 0) * 1.1 + mm.minimum_inference_memory(), device)
    model.patch_model(load_weights=False)  # object patches only (the LoRA); allowed on dynamic patchers too
    resident = _move_resident(model.model, keep, device)
    model.model.device = device
    model.model.model_lowvram = False
    model.model.model_loaded_weight_memory = resident
    if not _dynamic(model):
        # registered as loaded: its partially_load finds a loaded model and moves nothing, now and when a
        # preview samples with it
        mm.load_models_gpu([model])
    log.info("block swap: %d blocks stream from host memory (%.1f MiB), %.1f MiB resident on %s",
             len(blocks), streamed / 2**20, resident / 2**20, device)
    return resident


def _dynamic(model: Any) -> bool:
    return bool(getattr(model, "is_dynamic", lambda: False)())


def unload_resident(model: Any) -> None:
    """Undo ``load_resident``: ComfyUI's own unload when it holds the model, else every weight to the
    offload device and the object patches removed; the same end state as an unload without swap."""
    held = any(lm.model is model for lm in mm.current_loaded_models)
    _unload_clones(model)
    if not held:
        with torch.inference_mode(False):
            model.model.to(model.offload_device)
        model.unpatch_model(device_to=None, unpatch_weights=False)
        model.model.device = model.offload_device
        model.model.model_loaded_weight_memory = 0
    mm.soft_empty_cache()


@contextlib.contextmanager
def streaming(blocks: Sequence[nn.Module], device: torch.device) -> Iterator[Any]:
    """``training.swap.swap_blocks`` for the body (nothing without blocks); yields the executor or None."""
    if not blocks:
        yield None
        return
    with swap_blocks(blocks, device) as swap:
        yield swap
