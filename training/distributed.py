"""Data parallelism for the training loop on ``torch.distributed``: pure torch, no ComfyUI.

Every rank holds the whole (frozen) base model and the same LoRA. Each step every rank draws the whole
global batch's randomness (data order, noise, timesteps) from the same seeded generator, so the generators
never diverge, and computes the forward and backward of its own contiguous share of the rows only
(``rows``). LoRA dropout masks follow the same rule inside the layers: each is drawn for the whole global
batch and the rank keeps its rows (``lora.lowrank.DropoutRNG.global_rows``); a rank that gets no row of a
group takes the dropout generators' state from the last rank (``from_last``), which always has one. ``reduce`` then sums the LoRA gradients and the loss parts over the ranks, so every rank
applies the same update: the gradient of the global batch, as one process would have computed it, up to
the order of fp32 additions (one process sums all rows inside one matmul; here each rank sums its rows and
the all-reduce adds the partial sums). The parameters, the optimizer state and the generators therefore
stay equal on all ranks, checkpoints of rank 0 are ordinary training states and a single process can
continue them (and the reverse).

The loop (``training.loop.train``) takes a ``DataParallel`` as its ``parallel`` argument, or uses the one
``activate`` registered for this process (the headless runner does that under ``torchrun``, so the training
node needs no extra input). Only rank 0 writes checkpoints; stop and checkpoint requests from any rank
apply to all.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# 25 MiB, torch DDP's default bucket: big enough that the per-call latency is paid a handful of times,
# small enough that the flat copy next to the gradients stays a small share of memory.
BUCKET_BYTES = 25 * 1024 * 1024
# A rank that died is noticed by the others at their next collective; without a timeout they would wait
# forever (gloo) or until NCCL's own default.
DEFAULT_TIMEOUT_S = 300.0
# Codes of the per-step requests, larger wins when ranks disagree (stop and cancel beat checkpoint).
_ACTIONS = {None: 0, "checkpoint": 1, "stop": 2, "interrupt": 3}
_CODES = {v: k for k, v in _ACTIONS.items()}


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel run. ``group``: the process group (None = the default one)."""

    rank: int
    world: int
    group: object = None
    bucket_bytes: int = BUCKET_BYTES

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` rows; shares differ by at most one row and may be empty."""
        return slice(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` (in place) with rank 0's values: every rank starts from the same LoRA even
        if a rank initialised its copy differently."""
        with torch.no_grad():
            for bucket in _buckets(list(tensors), self.bucket_bytes):
                flat = torch.cat([t.detach().reshape(-1).float() for t in bucket])
                dist.broadcast(flat, 0, group=self.group)
                _unflatten_into(flat, bucket)

    def reduce(self, params: Sequence[torch.Tensor], scalars: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Sum the gradients of ``params`` over the ranks, in place, bucketed; returns ``scalars`` summed.

        A parameter without a gradient on every rank keeps ``grad=None`` (as in one process, where the
        optimizer then skips it); one with a gradient on some rank gets the sum, zeros standing in for the
        ranks without one."""
        params = list(params)
        device = params[0].device if params else torch.device("cpu")
        head = torch.stack([s.detach().float().to(device).reshape(()) for s in scalars]
                           + [torch.tensor(float(p.grad is not None), device=device) for p in params]) \
            if scalars or params else torch.zeros(0, device=device)
        dist.all_reduce(head, group=self.group)
        out, has = list(head[:len(scalars)].cpu()), head[len(scalars):].tolist()
        with torch.no_grad():
            live = [p for p, h in zip(params, has) if h > 0]
            for p in live:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            for bucket in _buckets([p.grad for p in live], self.bucket_bytes):
                if len(bucket) == 1:
                    dist.all_reduce(bucket[0], group=self.group)
                    continue
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat, group=self.group)
                _unflatten_into(flat, bucket)
        return out

    def from_last(self, obj: Any) -> Any:
        """``obj`` as the last rank holds it, on every rank (small picklable values: generator states).

        The last rank is never without rows (``rows``: its share of n >= 1 rows is not empty), so after a
        group too small for every rank to get a row, its generators are the ones that advanced."""
        src = self.world - 1 if self.group is None else dist.get_global_rank(self.group, self.world - 1)
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def agree(self, action: str | None) -> str | None:
        """The request every rank follows this step: the strongest any rank made (stop > checkpoint)."""
        code = torch.tensor([_ACTIONS.get(action, 0)], dtype=torch.int64)
        if _backend(self.group) == "nccl":
            code = code.cuda()
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=self.group)
        return _CODES[int(code.item())]

    def wrap(self, hooks: Any) -> Any:
        """``training.loop.Hooks`` (not imported: the loop imports this module) for this rank: requests agreed over all ranks; only rank 0 writes checkpoints."""
        on_step = hooks.on_step

        def agreed(report):
            action = on_step(report) if on_step is not None else None
            if action not in _ACTIONS:
                return action  # the loop rejects it with a clear error on this rank
            return self.agree("interrupt" if _cancel_requested else action)

        save = hooks.save_checkpoint if self.is_main else (None if hooks.save_checkpoint is None else _no_write)
        save_ema = getattr(hooks, "save_ema", None) if self.is_main else None  # the EMA file: rank 0 too
        return replace(hooks, on_step=agreed, save_checkpoint=save, save_ema=save_ema)


def _no_write(state, reason: str) -> str:
    return ""  # ranks other than 0 hold the same state and write nothing


def _backend(group) -> str:
    return str(dist.get_backend(group))


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-device, same-dtype tensors of at most ``limit`` bytes (one tensor larger
    than the limit is a bucket of its own)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if last and size + nbytes <= limit and last[0].device == t.device and last[0].dtype == t.dtype:
            last.append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


# ---- the process's run: set up from torchrun's environment ----

_active: DataParallel | None = None
# Set by ``request_cancel`` (a signal handler): every rank then ends at the same step boundary. A cancel
# that aborted one rank in the middle of a step would leave the others waiting in an all-reduce.
_cancel_requested = False


def request_cancel() -> None:
    """Ask every rank to end the run after the current step (with a checkpoint, as a cancel in the UI)."""
    global _cancel_requested
    _cancel_requested = True


def active() -> DataParallel | None:
    """The data-parallel run ``activate`` registered in this process, or None (a single-process run)."""
    return _active


def launched_by_torchrun() -> bool:
    """True when this process is one of several that ``torchrun`` (or another launcher) started."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def activate(device: torch.device, timeout_s: float | None = None) -> DataParallel:
    """Join the process group that ``torchrun`` describes in the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): NCCL for a CUDA device, gloo otherwise. Collectives fail after
    ``timeout_s`` (default ``PRECISION_LORA_DIST_TIMEOUT`` or 300 s) instead of hanging when a rank died.
    Registers the run for ``active()``. Idempotent."""
    global _active
    if _active is not None:
        return _active
    if timeout_s is None:
        timeout_s = float(os.environ.get("PRECISION_LORA_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    _active = DataParallel(rank=dist.get_rank(), world=dist.get_world_size())
    log.info("data parallel: rank %d of %d (%s)", _active.rank, _active.world, backend)
    return _active


def deactivate() -> None:
    """Leave the process group (at the end of a run, also after an error)."""
    global _active, _cancel_requested
    _active, _cancel_requested = None, False
    if dist.is_initialized():
        dist.destroy_process_group()
