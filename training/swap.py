"""Block swap for training: frozen base blocks live on the host and stream to the device one block at a time.

The base model is frozen, so a block's weights only ever travel host -> device; nothing is copied back.
Built the way the trainers that fit Flux on 8-16 GB cards build it (docs/memory.md, Block swap):

- **Packed host blocks.** Each swapped block's frozen parameters are packed once into one host buffer
  (``uint8``, tensors at ``ALIGN``-byte offsets), pinned when CUDA is present, so a load is one ``copy_``.
  Between loads every parameter is a view into that buffer (an ordinary host tensor).
- **A fixed ring of device slots**, allocated once (``slots`` buffers of the largest block's size): block
  ``i`` always loads into slot ``i % slots``, so the caching allocator never sees a block's weights come
  and go. A loaded block's parameters are views into its slot.
- **A side stream with events** (CUDA): before block ``i`` runs, the compute stream waits on the event of
  its load; the next block in the direction of travel (forward: ``i+1``; backward's recomputation:
  ``i-1``) is then queued on the copy stream, which first waits on an event recorded on the compute
  stream, i.e. until every kernel queued so far (the slot's previous user included) is done.
  On the CPU the same code runs synchronously: the "copy" goes into the slot buffers on the host.
- **Only checkpointed blocks.** A block that autograd keeps activations of would keep views into a slot
  that the next load overwrites; under reentrant checkpointing a swapped block saves nothing in the
  forward and its recomputation runs (and is consumed by its backward) before the next block's starts.
  The caller guarantees it (``training.settings`` refuses swap without gradient checkpointing; the glue
  swaps only blocks it checkpoints). Trainable parameters (the LoRA) are never swapped.

``swap_blocks(blocks, device)`` wraps each block's ``forward`` (an instance attribute, removed on exit)
so the loop reads the same with and without swap; enter it *before* ``grad.checkpoint_blocks`` so the
recomputation passes through the wrapper too.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

import torch
from torch import nn

ALIGN = 512  # byte offset of each tensor in a packed block: keeps every view as aligned as a fresh allocation


@dataclasses.dataclass
class _Entry:
    param: nn.Parameter
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


@dataclasses.dataclass
class _Packed:
    host: torch.Tensor          # uint8 (pinned when CUDA is present)
    entries: list[_Entry]
    nbytes: int


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _view(buffer: torch.Tensor, e: _Entry) -> torch.Tensor:
    return buffer[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)


def frozen_params(block: nn.Module) -> list[nn.Parameter]:
    """The block's parameters that do not require grad (its base weights), each once, in module order."""
    seen: set[int] = set()
    out = []
    for p in block.parameters():
        if not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def pack_block(block: nn.Module, pin: bool) -> _Packed:
    """Copy the block's frozen parameters into one host buffer and point each parameter at its view there.

    Values, dtypes and shapes are unchanged; the parameters' previous storage is released when nothing
    else holds it. ValueError for a weight that is not a plain tensor (it cannot be packed byte for byte)."""
    params = frozen_params(block)
    entries, offset = [], 0
    for p in params:
        if type(p.data) is not torch.Tensor:
            raise ValueError(f"block swap: a weight of type {type(p.data).__name__} cannot be "
                             "streamed; set swap_blocks to 0 for this model")
        nbytes = p.numel() * p.element_size()
        entries.append(_Entry(p, offset, nbytes, p.dtype, p.shape))
        offset += _aligned(nbytes)
    host = torch.empty(max(offset, ALIGN), dtype=torch.uint8, pin_memory=pin)
    for e in entries:
        view = _view(host, e)
        view.copy_(e.param.data)
        e.param.data = view
    return _Packed(host, entries, offset)


class BlockSwap:
    """Streams the frozen weights of ``blocks`` (in execution order) through a ring of ``slots`` device
    buffers; ``before(i)`` makes block ``i`` resident and queues the next one. See the module docstring.

    ``device`` cpu: no pinning, no streams, synchronous copies (the same code path, testable on a CPU)."""

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device, slots: int = 2) -> None:
        if slots < 2:
            raise ValueError(f"block swap: slots={slots}: need at least 2 (one computes, one loads)")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        pin = torch.cuda.is_available()
        with torch.inference_mode(False):  # views of inference tensors could not be saved for backward
            self.packed = [pack_block(b, pin) for b in blocks]
            size = max((p.nbytes for p in self.packed), default=0)
            self.slots = [torch.empty(max(size, ALIGN), dtype=torch.uint8, device=self.device)
                          for _ in range(min(slots, max(len(blocks), 1)))]
        self.holds: list[int | None] = [None] * len(self.slots)   # block index each slot holds
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.ready: list[Any] = [torch.cuda.Event() if self.cuda else None for _ in self.slots]
        self.previous: int | None = None
        self.loads = 0  # copies issued (for tests and the report)

    @property
    def host_bytes(self) -> int:
        return sum(p.nbytes for p in self.packed)

    @property
    def slot_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def _load(self, i: int) -> None:
        """Queue block ``i``'s copy into its slot and point its parameters there."""
        s = i % len(self.slots)
        if self.holds[s] == i:
            return
        evicted = self.holds[s]
        if evicted is not None:  # its parameters go back to their host views (kernels in flight hold the slot)
            for e in self.packed[evicted].entries:
                e.param.data = _view(self.packed[evicted].host, e)
        packed = self.packed[i]
        src, dst = packed.host[:packed.nbytes], self.slots[s][:packed.nbytes]
        if self.stream is not None:
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(free)  # the slot's previous user is done once everything queued so far is
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
            self.ready[s].record(self.stream)
        else:
            dst.copy_(src)
        for e in packed.entries:
            e.param.data = _view(self.slots[s], e)
        self.holds[s] = i
        self.loads += 1

    def _direction(self, i: int) -> int:
        if i == 0:
            return 1
        if i == len(self.packed) - 1:  # the turnaround: the recomputation comes back down
            return -1
        return 1 if self.previous is None or i > self.previous else -1

    def before(self, i: int) -> None:
        """Block ``i`` is about to run: make it resident (wait for its copy), then queue the next block."""
        with torch.inference_mode(False):
            self._load(i)
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_event(self.ready[i % len(self.slots)])
            nxt = i + self._direction(i)
            if 0 <= nxt < len(self.packed):
                self._load(nxt)
        self.previous = i

    def close(self) -> None:
        """Wait for queued copies, point every parameter at its host view again, release the slots."""
        if self.stream is not None:
            self.stream.synchronize()
        with torch.inference_mode(False):
            for packed in self.packed:
                for e in packed.entries:
                    e.param.data = _view(packed.host, e)
        self.holds = [None] * len(self.slots)
        self.slots = []


def _wrapped(forward: Any, swap: BlockSwap, index: int) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        swap.before(index)
        return forward(*args, **kwargs)

    return run


@contextlib.contextmanager
def swap_blocks(blocks: Sequence[nn.Module], device: torch.device, slots: int = 2) -> Iterator[BlockSwap]:
    """Stream the frozen weights of ``blocks`` (execution order; all must be checkpointed by the caller)
    for the body. On exit the parameters are host tensors (views of the packed buffers: their values are
    unchanged) and each block's ``forward`` is what it was."""
    swap = BlockSwap(blocks, device, slots)
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for i, block in enumerate(blocks):
            previous = block.__dict__.get("forward")
            block.forward = _wrapped(block.forward, swap, i)  # type: ignore[method-assign]
            patched.append((block, previous))
        yield swap
    finally:
        for block, previous in reversed(patched):
            if previous is None:
                del block.forward
            else:
                block.forward = previous  # type: ignore[method-assign]
        swap.close()
