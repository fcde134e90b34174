"""One training step of the pack, tracked: the tensors of a real ComfyUI model + the pack's LoRA, optimizer,
checkpointing and loss, counted by torch's ``MemTracker`` (on fake tensors for real sizes, or on real ones).

Used by the training node's memory planner (``nodes/train/memory_estimate.py``) and ``bench/memory.py``
(fake tensors, real sizes), and by its validation test (real tensors, small models: the same step measured). The step is the loop's (``training/loop.py``: ``_loss_backward`` then
``MasterWeights.pull_grads``, ``optimizer.step``, ``zero_grad``, ``push``) without the parts that read
values back (NaN guard, gradient clipping's norm, loss logging), which a fake tensor cannot give.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType


class FrozenSafeTracker(MemTracker):
    """``MemTracker`` that installs its gradient hooks only on parameters that train.

    The stock tracker calls ``register_hook`` on every Parameter of every module it sees, which raises
    for frozen ones (the whole base model here). Frozen parameters are still counted (as parameters);
    trainable ones get the stock hooks, so their gradients are counted as gradients."""

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True):
        frozen = [p for p in module.parameters() if not p.requires_grad]
        for p in frozen:  # the stock method skips parameters that already have a handle entry
            self._param_to_grad_hook_handles.setdefault(p, _NoHandles())
        try:
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
        finally:
            for p in frozen:
                if isinstance(self._param_to_grad_hook_handles.get(p), _NoHandles):
                    del self._param_to_grad_hook_handles[p]


    def _update_peak_stats(self, peak_state: Any) -> None:
        """Only the device-wide peak (what the estimate reports). The stock method also keeps each active
        module's local peak with a deep copy of the snapshot on every rise: most of the time of a fake
        real-size step went there."""
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        """The stock hook refuses a root module called again (a training loop's next step); here the
        per-module statistics start over instead (the device-wide peak, what we report, is kept)."""
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:
            self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)


class _NoHandles(tuple):
    """A stand-in "hooks already installed" entry for a frozen parameter (removed again right after)."""

    def __new__(cls) -> "_NoHandles":
        return super().__new__(cls, (_Noop(), _Noop()))


class _Noop:
    def remove(self) -> None:
        pass


@dataclass
class StepMemory:
    """Peak of one tracked training step (the second: optimizer state exists), in bytes, by category."""

    peak: int
    by_kind: dict[str, int]
    largest_saved: list[dict] = field(default_factory=list)  # the five largest tensors saved for backward
    flops: int = 0


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage (MemTracker counts CPU storages exactly; CUDA ones rounded up to 512 B)."""
    n = t.untyped_storage().nbytes()
    return (n + 511) // 512 * 512 if t.is_cuda else n


def _category_bytes(snapshot: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for dev_snap in snapshot.values():
        for key, value in dev_snap.items():
            name = key.value if isinstance(key, _MemRefType) else str(key)
            out[name] = out.get(name, 0) + int(value)
    return out


@contextlib.contextmanager
def saved_tensor_census(into: list[dict], grad_module: Any = None, exclude: frozenset = frozenset()) -> Iterator[None]:
    """Record every tensor autograd saves in the body (storage bytes, shape, dtype), one
    entry per storage; the five largest are what the report names. ``grad_module``: the pack's
    ``training.grad``, whose own saved-tensor hooks (the innermost hook wins) are wrapped for the body so
    what they store is recorded too. ``exclude``: storages (``_cdata``) not to
    count, the weights (a saved ``weight.t()`` view is the weight, not an activation)."""
    seen: set[int] = set()

    def note(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            key, nbytes = st._cdata, st.nbytes()
        except (NotImplementedError, RuntimeError):
            return t
        if key not in seen and key not in exclude:
            seen.add(key)
            into.append({"bytes": int(nbytes), "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")})
        return t

    def stored(packed: Any) -> Any:  # what the pack's hook keeps: a copy, or the tensor itself (``_Kept``)
        note(getattr(packed, "tensor", packed))
        return packed

    # the pack's own hooks (training.grad: copies of in-place-modified tensors, kept inputs); the innermost
    # hook wins, so each is wrapped for the body and what it stores is recorded
    wrapped = {name: getattr(grad_module, name) for name in ("_pack", "_keep", "_copy_or_keep")
               if grad_module is not None and hasattr(grad_module, name)}
    for name, inner in wrapped.items():
        setattr(grad_module, name, lambda *a, _inner=inner: stored(_inner(*a)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            yield
    finally:
        for name, inner in wrapped.items():
            setattr(grad_module, name, inner)


def tracked_steps(step: Callable[[], None], modules: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                  steps: int = 2, grad_module: Any = None) -> tuple[MemTracker, list[dict]]:
    """Run ``step`` ``steps`` times under the tracker; the peak is over all of them (the last one has the
    optimizer state from the first). Returns the tracker and the census of saved tensors of the last step."""
    tracker = FrozenSafeTracker()
    tracker.track_external(*modules, optimizer)
    census: list[dict] = []
    weights = frozenset(p.untyped_storage()._cdata for m in modules for p in m.parameters())
    with tracker:
        for i in range(steps):
            tracker.reset_mod_stats()  # the tracker refuses a root module called again otherwise
            if i == steps - 1:
                with saved_tensor_census(census, grad_module, weights):
                    step()
            else:
                step()
    return tracker, census


def summarize(tracker: MemTracker, census: list[dict], flops: int = 0) -> StepMemory:
    snap = tracker.get_tracker_snapshot("peak")
    kinds = _category_bytes(snap)
    peak = kinds.pop("Total", sum(kinds.values()))
    largest = sorted(census, key=lambda e: -e["bytes"])[:5]
    return StepMemory(peak=peak, by_kind=kinds, largest_saved=largest, flops=flops)


def make_step(predict: Callable[..., torch.Tensor], x0: torch.Tensor, cond: Any, fns: Any, settings: Any,
              optimizer: torch.optim.Optimizer, masters: Any) -> Callable[[], None]:
    """The loop's step for one fixed sample at a fixed sigma (values do not change the memory): its loss
    (``loop.denoising_loss``, the one every run computes) and backward, then the masters and optimizer as
    ``loop._Run.one_step`` drives them, less what reads values back (module docstring)."""
    from .loop import denoising_loss

    def step() -> None:
        noise = torch.randn_like(x0)
        u = torch.full((x0.shape[0],), 0.5, dtype=torch.float64, device=x0.device)
        sigma = torch.full((x0.shape[0],), 0.5, dtype=torch.float32, device=x0.device)
        loss, _ = denoising_loss(fns, predict, x0, noise, u, sigma, cond, settings.loss_weighting)
        (loss / settings.grad_accum).backward()
        masters.pull_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        masters.push()

    return step
