"""Autograd inside ComfyUI nodes: re-enable it, survive in-place residual adds, checkpoint blocks.

- ComfyUI runs every node under ``torch.inference_mode()``; ``autograd_enabled()`` is the one place that
  turns autograd back on (``inference_mode(False)`` + ``enable_grad()``).
- Flux/Chroma blocks add residuals in place (``img += ...``). Autograd then either raises "modified by
  an inplace operation" or, under non-reentrant checkpointing, silently computes wrong gradients.
  ``clone_saved_tensors()`` installs ``saved_tensors_hooks`` whose pack hook clones every saved
  activation that is not a Parameter, so a later in-place write cannot change what backward reads.
  It cannot rescue inference tensors (autograd rejects them before any hook runs): inputs and weights
  made under inference mode must be cloned once with ``clone_if_inference`` before the forward.
- ``checkpoint_blocks()`` wraps each block's ``forward`` in reentrant activation checkpointing. What it
  keeps per block is the block's inputs as they are (no copies: a tensor shared by every block, Flux's
  rotary ``pe``, is kept once; only one input is made to require grad when none does, so ``pe`` and
  ``vec`` get no gradient graph). The recomputation runs the block on copies of its inputs (it adds
  residuals to them in place) and copies only the saved tensors that share storage with those inputs
  (the residual stream the block modifies in place); everything else it saves is kept as it is.
  Every tensor kept without a copy has its version checked at unpack: an in-place write after the save
  raises instead of giving wrong gradients (autograd skips its own check when hooks are installed).
  Forwards are restored on exit. ``offload_inputs`` keeps the kept inputs that carry gradient in host
  memory until backward (the block inputs of Flux.1-dev at 1024 px are ~1.5 GiB of its peak).
- ``RecomputeCheck``: backward's gradients come from the recomputed activations, not the forward's; if the two
  differ (a non-deterministic block, a host round trip or a swapped weight that is not what the forward read),
  the gradients belong to another function than the loss, silently (torch's determinism check compares only
  shapes, dtypes and devices). Inside ``checkpoint_blocks`` each block's recomputed outputs are compared with
  its forward's once (the first checkpointed step), by their float64 sum and 2-norm, within ``RECOMPUTE_ULPS``
  of the output dtype's epsilon (relative); the learning guard (``training.learning``) reports what differs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator, Protocol, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
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


def _hook(fn: Any) -> Any:
    """A saved-tensor hook: bookkeeping in Python, never compiled. A compiled block's graph saves its tensors
    through the hooks open around it; without this, dynamo would compile each hook as a frame of its own (again
    for every new shape)."""
    return torch.compiler.disable(fn)


_STRIDED: list[int] = [0]  # open strided_copies contexts


@contextlib.contextmanager
def strided_copies() -> Iterator[None]:
    """The body's saved-tensor copies (``clone_saved_tensors``, the checkpointed recomputation's streams) keep
    the original's strides: a compiled backward reads its saved tensors with the strides it was traced with, and
    a contiguous clone of a strided view (a slice of a wider output) would not match them. Outside it, copies are
    contiguous clones: a strided copy of a slice with gaps allocates the whole extent of its strides."""
    _STRIDED[0] += 1
    try:
        yield
    finally:
        _STRIDED[0] -= 1


def _copy(t: torch.Tensor) -> torch.Tensor:
    if not _STRIDED[0] or t.is_contiguous() or t.numel() == 0:
        return t.clone()
    # the span of storage the view reads (gaps and overlaps included), copied, viewed with the same strides
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.as_strided((extent,), (1,), t.storage_offset()).clone().as_strided(t.shape, t.stride())


@_hook
def _pack(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, nn.Parameter):
        return t
    return _copy(t)


@_hook
def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _Kept:
    """A tensor saved for backward without a copy, with its version counter at save time."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version


@_hook
def _keep(t: torch.Tensor) -> Any:
    return t if isinstance(t, nn.Parameter) else _Kept(t)


@_hook
def _checked(saved: Any) -> torch.Tensor:
    """Unpack: a kept tensor must not have been written in place since it was saved."""
    if isinstance(saved, _Kept):
        if saved.tensor._version != saved.version:
            raise RuntimeError(
                "a tensor saved for backward inside a checkpointed block was modified in place "
                f"after it was saved (shape {list(saved.tensor.shape)}, {saved.tensor.dtype}); this model's blocks "
                "write in place to something other than their inputs: train without gradient_checkpointing")
        return saved.tensor
    return saved


def _copy_streams(inputs: Sequence[torch.Tensor]) -> Any:
    """Saved-tensor hooks that copy what shares storage with ``inputs`` (what the block adds to in place)
    and keep everything else without a copy (version-checked)."""
    streams = frozenset(t.untyped_storage()._cdata for t in inputs)

    @_hook
    def pack(t: torch.Tensor) -> Any:
        return _copy_or_keep(t, streams)

    return torch.autograd.graph.saved_tensors_hooks(pack, _checked)


def _copy_or_keep(t: torch.Tensor, streams: frozenset) -> Any:
    if isinstance(t, nn.Parameter):
        return t
    return _copy(t) if t.untyped_storage()._cdata in streams else _Kept(t)


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


def _prepare_inputs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The block inputs checkpointing keeps, without copies. Reentrant checkpointing keeps the graph only
    when an input requires grad: when none does (the first block), the first float input is made to
    (a detached view, same storage); inputs that need no gradient (Flux's ``pe``, ``vec``) stay as they
    are, so the recomputation builds no gradient graph for them."""
    if any(t.requires_grad for t in tensors):
        return tensors
    out = list(tensors)
    for i, t in enumerate(out):
        if t.is_floating_point():
            out[i] = t.detach().requires_grad_(True)
            break
    return out


class RNGState(Protocol):
    """Explicit generators a block draws from (``lora.lowrank.DropoutRNG``)."""

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


class _OnHost:
    """A checkpointed block's input kept in host memory until backward: the host copy (None for a fake
    tensor: the estimate only needs it off the device) and what the device copy made again looks like."""

    __slots__ = ("host", "device", "shape", "dtype", "requires_grad")

    def __init__(self, host: torch.Tensor | None, t: torch.Tensor) -> None:
        self.host, self.device, self.shape, self.dtype = host, t.device, t.shape, t.dtype
        self.requires_grad = t.requires_grad


@_hook
def _to_host(t: torch.Tensor) -> Any:
    """Pack: an input that carries gradient goes to (pinned, on CUDA) host memory, copied on the current
    stream (ordered before any reuse of its device memory); the rest (Flux's shared ``pe``, ``vec``) is kept
    as ``_keep`` keeps it. On a CPU device the copy is host to host: the path runs, nothing is saved."""
    if isinstance(t, nn.Parameter) or not t.requires_grad:
        return _keep(t)
    if isinstance(t, FakeTensor):
        return _OnHost(None, t)
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    host.copy_(t.detach(), non_blocking=t.is_cuda)
    return _OnHost(host, t)


@_hook
def _from_host(saved: Any) -> torch.Tensor:
    """Unpack: the host copy back on its device (a leaf with the input's requires_grad, which the
    recomputation's ``detach_variable`` reads)."""
    if not isinstance(saved, _OnHost):
        return _checked(saved)
    if saved.host is None:
        t = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
    else:
        t = saved.host.to(saved.device, non_blocking=saved.host.is_pinned(), copy=True)
    return t.requires_grad_(saved.requires_grad)


RECOMPUTE_ULPS = 16  # relative tolerance of the recomputation check, in epsilons of the output's dtype


def _outputs(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _outputs(v)]
    return []


@torch.no_grad()
def _summary(value: Any) -> list[tuple[float, float, torch.dtype, int]]:
    """(float64 sum, float64 2-norm, dtype, numel) of each floating output tensor: one host sync."""
    ts = [t for t in _outputs(value) if t.is_floating_point() and not isinstance(t, FakeTensor)]
    if not ts:
        return []
    both = torch.stack([torch.stack([t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64)])
                        for t in ts]).cpu().tolist()
    return [(a, b, t.dtype, t.numel()) for (a, b), t in zip(both, ts)]


@dataclasses.dataclass
class RecomputeCheck:
    """The recomputation check of one ``checkpoint_blocks`` (module docstring). ``differences``: (block name,
    relative difference, tolerance) of each block whose recomputed outputs differ from its forward's."""

    names: dict[int, str] = dataclasses.field(default_factory=dict)
    checked: set[int] = dataclasses.field(default_factory=set)
    pending: dict[int, list] = dataclasses.field(default_factory=dict)
    differences: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)

    def forward(self, key: int, outputs: Any) -> None:
        if key not in self.checked and key not in self.pending:
            self.pending[key] = _summary(outputs)

    def recomputed(self, key: int, outputs: Any) -> None:
        seen = self.pending.pop(key, None)
        if seen is None or key in self.checked:
            return
        self.checked.add(key)
        again = _summary(outputs)
        worst, tol = 0.0, 0.0
        for (s0, n0, dtype, numel), (s1, n1, _, _) in zip(seen, again):
            scale = max(n0, 1e-30)  # |sum| <= norm x sqrt(numel): the sum's difference is scaled to match
            tol = max(tol, RECOMPUTE_ULPS * torch.finfo(dtype).eps)
            worst = max(worst, abs(n1 - n0) / scale, abs(s1 - s0) / (scale * max(1.0, numel ** 0.5)))
        if len(seen) != len(again) or worst > tol:
            self.differences.append((self.names.get(key, f"block {key}"), worst, tol))


_ACTIVE_CHECKS: list[RecomputeCheck] = []


def recompute_check() -> RecomputeCheck | None:
    """The recomputation check of the innermost ``checkpoint_blocks`` now open, if any."""
    return _ACTIVE_CHECKS[-1] if _ACTIVE_CHECKS else None


def _checkpointed(forward: Any, in_place_adds: bool, rng: RNGState | None, offload_inputs: bool = False,
                  check: RecomputeCheck | None = None, key: int = 0) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        tensors, template = _split(args, kwargs)
        tensors = _prepare_inputs(tensors)
        # torch replays only the global RNG; explicit generators (LoRA dropout) are replayed here: the
        # recomputation draws the forward's masks, then the generators continue where the forward left them
        at_forward = None if rng is None else rng.get_state()
        calls = []

        def call(ts: Sequence[torch.Tensor]) -> Any:
            if not in_place_adds:  # blocks without in-place residual adds need neither clone
                a, k = _rebuild(template, ts)
                return forward(*a, **k)
            # The block adds to its inputs in place: it runs on copies (the kept inputs stay as they were),
            # and of what it saves only what shares storage with them is copied.
            copies = [t.clone() for t in ts]
            a, k = _rebuild(template, copies)
            with _copy_streams(copies):
                return forward(*a, **k)

        def body(*ts: torch.Tensor) -> Any:
            calls.append(len(calls))
            if len(calls) == 1 or rng is None:
                out = call(ts)
            else:
                now = rng.get_state()
                rng.set_state(at_forward)
                try:
                    out = call(ts)
                finally:
                    rng.set_state(now)
            if check is not None and key not in check.checked:
                (check.forward if len(calls) == 1 else check.recomputed)(key, out)
            return out

        # the inputs are kept as they are (an enclosing clone_saved_tensors would copy each, pe included)
        hooks = (_to_host, _from_host) if offload_inputs else (_keep, _checked)
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            return checkpoint(body, *tensors, use_reentrant=True, preserve_rng_state=True)

    return run



@contextlib.contextmanager
def checkpoint_blocks(blocks: Sequence[nn.Module], in_place_adds: bool = True,
                      rng: RNGState | None = None, offload_inputs: bool = False) -> Iterator[int]:
    """Reentrant activation checkpointing on each module of ``blocks`` for the body; yields the count.

    ``in_place_adds``: the blocks add residuals in place (e.g. Flux), so the recomputation runs on copies
    of the block inputs and copies the saved tensors that share their storage; False (blocks that add out
    of place) skips the copies.
    ``rng``: explicit generators the blocks draw from (LoRA dropout): the recomputation replays their
    draws, which torch's ``preserve_rng_state`` does not, and leaves them where the forward left them.
    ``offload_inputs``: the kept inputs that carry gradient (the residual streams, the bulk of what
    checkpointing keeps) wait for backward in host memory (``_to_host``), not on the device.
    While open, ``recompute_check()`` is its ``RecomputeCheck`` (each block compared once).
    Blocks must return a tensor or a tuple of tensors. Instance ``forward`` attributes are set and removed
    again on exit, so the shared model is unchanged afterwards.
    """
    patched: list[tuple[nn.Module, Any]] = []
    check = RecomputeCheck()
    _ACTIVE_CHECKS.append(check)
    try:
        for i, block in enumerate(blocks):
            previous = block.__dict__.get("forward")
            check.names[i] = f"checkpointed block {i} ({type(block).__name__})"
            block.forward = _checkpointed(block.forward, in_place_adds, rng, offload_inputs,  # type: ignore[method-assign]
                                          check, i)
            patched.append((block, previous))
        yield len(patched)
    finally:
        _ACTIVE_CHECKS.remove(check)
        for block, previous in reversed(patched):
            if previous is None:
                del block.forward
            else:
                block.forward = previous  # type: ignore[method-assign]


# UNets (SD1.x/SDXL): ComfyUI runs the layers of each TimestepEmbedSequential itself
# (``forward_timestep_embed``), never the sequential's own forward, so their blocks are those layers.
UNET_GROUPS = ("input_blocks", "middle_block", "output_blocks")


def find_block_lists(root: nn.Module, names: Sequence[str] = ()) -> list[nn.Module]:
    """Blocks to checkpoint: children of the named ModuleLists of ``root`` or, without names, of every
    direct-child ModuleList (Flux: double_blocks + single_blocks; Cosmos: blocks). When none of the
    names is there, a UNet's layers: those inside ``input_blocks``, ``middle_block``, ``output_blocks``
    (SD1.x/SDXL), in execution order."""
    lists = [getattr(root, n) for n in names if isinstance(getattr(root, n, None), nn.ModuleList)]
    if not names:
        lists = [m for m in root.children() if isinstance(m, nn.ModuleList) and len(m) >= 1]
    if names and not lists:
        groups = [getattr(root, n, None) for n in UNET_GROUPS]
        sequences = [seq for g in groups if g is not None
                     for seq in (g if isinstance(g, nn.ModuleList) else [g])]
        return [layer for seq in sequences for layer in seq.children()]
    return [b for lst in lists for b in lst]
