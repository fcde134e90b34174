"""Autograd inside ComfyUI nodes: re-enable it, survive in-place residual adds, checkpoint blocks.

- ComfyUI runs every node under ``torch.inference_mode()``; ``autograd_enabled()`` is the one place that
  turns autograd back on (``inference_mode(False)`` + ``enable_grad()``).
- Flux/Chroma blocks add residuals in place (``img += ...``). Autograd then either raises "modified by
  an inplace operation" or, under non-reentrant checkpointing, silently computes wrong gradients.
  ``clone_saved_tensors()`` installs ``saved_tensors_hooks`` whose pack hook clones every saved
  activation that is not a Parameter, so a later in-place write cannot change what backward reads.
  It cannot rescue inference tensors (autograd rejects them before any hook runs): inputs and weights
  made under inference mode must be cloned once with ``clone_if_inference`` before the forward.
- ``checkpoint_blocks()`` wraps each block's ``forward`` in reentrant activation checkpointing with
  cloned tensor inputs (a block input is modified in place by the next residual add, so the saved input
  must be a copy), under the same hooks during recomputation. Forwards are restored on exit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator, Protocol, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Leave any enclosing ``inference_mode`` and enable grad for the body."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def clone_if_inference(t: torch.Tensor) -> torch.Tensor:
    """A normal tensor with the same values: ``t`` itself unless it is an inference tensor (then cloned).

    Must be called outside inference mode for the clone to be a normal tensor.
    """
    return t.clone() if t.is_inference() else t


def _pack(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, nn.Parameter):
        return t
    return t.clone()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def clone_saved_tensors() -> Iterator[None]:
    """Every tensor autograd saves in the body is stored as a private clone (Parameters excepted).

    Costs one copy per saved activation; it is what makes in-place residual adds safe for backward.
    """
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """Template of ``value`` with every tensor (inside tuples, lists, dicts, dataclasses) replaced by a slot."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, (tuple, list)):
        items = [_flatten(v, tensors) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _flatten(v, tensors) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _DataclassTemplate(value, {f.name: _flatten(getattr(value, f.name), tensors)
                                          for f in dataclasses.fields(value)})
    return value


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index


class _DataclassTemplate:
    def __init__(self, original: Any, fields: dict[str, Any]) -> None:
        self.original, self.fields = original, fields


def _fill(template: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(template, _Slot):
        return tensors[template.index]
    if isinstance(template, (tuple, list)):
        items = [_fill(v, tensors) for v in template]
        return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)
    if isinstance(template, dict):
        return {k: _fill(v, tensors) for k, v in template.items()}
    if isinstance(template, _DataclassTemplate):
        return dataclasses.replace(template.original, **{k: _fill(v, tensors) for k, v in template.fields.items()})
    return template


def _split(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any]:
    """Every tensor in args/kwargs (nested containers included: Flux.2 passes modulation dataclasses in
    tuples) and a template to rebuild the call. A tensor left inside the template would tie the
    recomputed graph to the outer one ("backward through the graph a second time")."""
    tensors: list[torch.Tensor] = []
    template = (_flatten(list(args), tensors), _flatten(dict(kwargs), tensors))
    return tensors, template


def _rebuild(template: Any, tensors: Sequence[torch.Tensor]) -> tuple[list, dict]:
    args, kwargs = template
    return _fill(args, tensors), _fill(kwargs, tensors)


def _prepare_input(t: torch.Tensor) -> torch.Tensor:
    """Private copy of a block input (a later in-place write to the caller's tensor cannot reach the copy
    checkpointing saves); float inputs require grad so reentrant checkpointing keeps the graph."""
    if not t.is_floating_point() or t.requires_grad:
        return t.clone()
    return t.detach().clone().requires_grad_(True)


class RNGState(Protocol):
    """Explicit generators a block draws from (``lora.layer.DropoutRNG``)."""

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


def _checkpointed(forward: Any, in_place_adds: bool, rng: RNGState | None) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        tensors, template = _split(args, kwargs)
        tensors = [_prepare_input(t) for t in tensors]
        # torch replays only the global RNG; explicit generators (LoRA dropout) are replayed here: the
        # recomputation draws the forward's masks, then the generators continue where the forward left them
        at_forward = None if rng is None else rng.get_state()
        calls = []

        def call(ts: Sequence[torch.Tensor]) -> Any:
            if not in_place_adds:  # blocks without in-place residual adds need neither clone
                a, k = _rebuild(template, ts)
                return forward(*a, **k)
            # Recomputation sees detached leaf inputs; the block adds to them in place, so give it clones.
            a, k = _rebuild(template, [t.clone() for t in ts])
            with clone_saved_tensors():
                return forward(*a, **k)

        def body(*ts: torch.Tensor) -> Any:
            calls.append(len(calls))
            if len(calls) == 1 or rng is None:
                return call(ts)
            now = rng.get_state()
            rng.set_state(at_forward)
            try:
                return call(ts)
            finally:
                rng.set_state(now)

        return checkpoint(body, *tensors, use_reentrant=True, preserve_rng_state=True)

    return run



@contextlib.contextmanager
def checkpoint_blocks(blocks: Sequence[nn.Module], in_place_adds: bool = True,
                      rng: RNGState | None = None) -> Iterator[int]:
    """Reentrant activation checkpointing on each module of ``blocks`` for the body; yields the count.

    ``in_place_adds``: the blocks add residuals in place (e.g. Flux), so the recomputation clones block
    inputs and saved tensors; False (blocks that add out of place) skips the copies.
    ``rng``: explicit generators the blocks draw from (LoRA dropout): the recomputation replays their
    draws, which torch's ``preserve_rng_state`` does not, and leaves them where the forward left them.
    Blocks must return a tensor or a tuple of tensors. Instance ``forward`` attributes are set and removed
    again on exit, so the shared model is unchanged afterwards.
    """
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for block in blocks:
            previous = block.__dict__.get("forward")
            block.forward = _checkpointed(block.forward, in_place_adds, rng)  # type: ignore[method-assign]
            patched.append((block, previous))
        yield len(patched)
    finally:
        for block, previous in reversed(patched):
            if previous is None:
                del block.forward
            else:
                block.forward = previous  # type: ignore[method-assign]


def find_block_lists(root: nn.Module, names: Sequence[str] = ()) -> list[nn.Module]:
    """Blocks to checkpoint: children of the named ModuleLists of ``root`` or, without names, of every
    direct-child ModuleList (Flux: double_blocks + single_blocks; Cosmos: blocks)."""
    lists = [getattr(root, n) for n in names if isinstance(getattr(root, n, None), nn.ModuleList)]
    if not names:
        lists = [m for m in root.children() if isinstance(m, nn.ModuleList) and len(m) >= 1]
    return [b for lst in lists for b in lst]
