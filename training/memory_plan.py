"""Memory plans for a training step: the cheapest way to fit a memory budget, from the step's costs.

Pure arithmetic (no torch, no ComfyUI). Its input is what one training step needs, as ``bench/memory.py``
estimates it at real size (``StepCost``: the tracked peak, and the weight bytes of every block in
execution order), with and without gradient checkpointing. A plan is (checkpointing, block inputs in host
memory, blocks swapped);
its estimate is the tracked peak minus the swapped blocks' weights plus the ring of device slots the swap
streams them through (``training.swap``: ``RING_SLOTS`` buffers, one for a single swapped block, of the largest
swapped block), plus the LoRA sets the run keeps on the device beside the one it trains (``StepCost.upstream``:
Train LoRA trains a copy of the attached set, which stays where Attach LoRA put it), plus what no tensor
tracker sees, on its own line: the CUDA context, cuBLAS/attention workspaces, and a fragmentation margin.
A plan fits a budget when its estimate plus a safety margin (``SAFETY_MARGIN`` of the tracked figure, kept free
for the estimator's own error) is within it.

``choose`` takes the cheapest plan within a budget, cheapest meaning least extra work per step: no
checkpointing, then checkpointing, then (when offered) checkpointing with the block inputs in host memory,
then that with 1, 2, ... blocks swapped (swap needs
checkpointing: the recomputation re-reads the streamed blocks). Costs are asked for lazily, checkpointed
first: when the checkpointed step does not fit, the plain one (which keeps every activation the
checkpointed one keeps, and more) is not estimated at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

GIB = 2**30
# Allowances for what no tensor tracker sees (docs/memory.md says where each figure comes from).
CUDA_CONTEXT_GIB = 0.6
WORKSPACE_GIB = 0.25  # cuBLAS (cublasLt) + attention workspaces, about 2 streams' worth
FRAGMENTATION = 0.05  # of the tracked peak: reserved minus allocated in the caching allocator
RING_SLOTS = 2  # training.swap's default ring of device slots
# Kept free under a budget, of the tracked figure: the estimate's own error. An independent estimator agreed with
# bench/memory.py within 1.7 % on every checkpointed configuration; the fake-tensor run equals the real one on a
# small model (tests/comfy/test_memory_estimator.py). docs/memory.md, "Safety margin".
SAFETY_MARGIN = 0.02


@dataclass(frozen=True)
class StepCost:
    """One estimated training step, in bytes: ``peak`` tracked (weights, LoRA, gradients, optimizer
    state, activations); ``blocks`` the weight bytes of each swappable block in execution order;
    ``weights`` the base's resident weights and buffers; ``lora`` the LoRA's parameters and gradients."""

    peak: int
    blocks: tuple[int, ...]
    weights: int = 0
    lora: int = 0
    optimizer: int = 0
    activations: int = 0
    lora_numel: int = 0  # the LoRA's parameter count (its fp32 copies on the host: the NaN guard, EMA on the CPU)
    upstream: int = 0  # device bytes of LoRA sets the run keeps but does not train (the set it forks from)


@dataclass(frozen=True)
class HostCost:
    """What a run keeps in host (system) memory for its plan, in bytes, by part: the checkpointed blocks'
    inputs waiting for backward in pinned memory (``block_inputs``: what the offload took off the device),
    the host side of the swapped blocks, the EMA shadow on the CPU, the NaN guard's snapshot (fp32 values of
    the LoRA, its EMA and the optimizer state, CPU copies), and the run's dataset as ComfyUI hands it over."""

    block_inputs: int = 0
    swapped: int = 0
    ema: int = 0
    guard: int = 0
    dataset: int = 0

    @property
    def total(self) -> int:
        return self.block_inputs + self.swapped + self.ema + self.guard + self.dataset

    def describe(self) -> str:
        """"swapped blocks 6.01 GiB, NaN-guard snapshot 0.3 GiB, ..." (the parts that are not zero)."""
        parts = [("block inputs", self.block_inputs), ("swapped blocks", self.swapped), ("EMA", self.ema),
                 ("NaN-guard snapshot", self.guard), ("dataset", self.dataset)]
        return ", ".join(f"{name} {size_text(n)}" for name, n in parts if n) or "nothing"


def host_cost(plan: Plan, cost: StepCost, ckpt: StepCost | None = None, ema: bool = False, ema_on_cpu: bool = False,
              dataset: int = 0) -> HostCost:
    """The host side of ``plan`` (``cost``: the step it was estimated from; ``ckpt``: the checkpointed step
    without the block inputs in host memory, for an offload plan)."""
    inputs = max(0, ckpt.activations - cost.activations) if plan.offload_inputs and ckpt is not None else 0
    fp32 = 4 * cost.lora_numel
    return HostCost(block_inputs=inputs, swapped=sum(cost.blocks[:plan.swap_blocks]),
                    ema=fp32 if ema and ema_on_cpu else 0,
                    guard=fp32 * (2 if ema else 1) + cost.optimizer, dataset=dataset)


@dataclass(frozen=True)
class Plan:
    """A plan and its estimate (GiB; ``peak_gib`` includes ``overhead_gib``)."""

    checkpointing: bool
    swap_blocks: int
    blocks: int
    peak_gib: float
    tracked_gib: float
    weights_gib: float
    swapped_gib: float
    ring_gib: float
    overhead_gib: float
    offload_inputs: bool = False  # the checkpointed blocks' inputs wait for backward in host memory
    upstream_gib: float = 0.0  # in tracked_gib: the LoRA sets kept on the device beside the trained one
    margin_gib: float = 0.0  # kept free beyond peak_gib: SAFETY_MARGIN of the tracked figure

    def fits(self, budget_gib: float) -> bool:
        """Whether the estimate and the safety margin are within ``budget_gib``."""
        return self.peak_gib + self.margin_gib <= budget_gib + 1e-9  # both figures rounded to 0.01 GiB

    def describe(self) -> str:
        """"checkpointing, block inputs in host memory, 14 of 56 blocks swapped" (the words the reports use)."""
        text = "checkpointing" if self.checkpointing else "no checkpointing"
        text += ", block inputs in host memory" if self.offload_inputs else ""
        return text + (f", {self.swap_blocks} of {self.blocks} blocks swapped" if self.swap_blocks else "")


def _gib(n: float) -> float:
    return round(n / GIB, 2)


def size_text(n: float) -> str:
    """``n`` bytes as the reports write a host-memory figure: "1.25 GiB", "3.4 MiB" below 0.01 GiB, "5.2 KiB"
    below 0.1 MiB."""
    if n >= 0.01 * GIB:
        return f"{_gib(n):g} GiB"
    return f"{round(n / 2**20, 1):g} MiB" if n >= 0.1 * 2**20 else f"{round(n / 1024, 1):g} KiB"


BUDGET_HELP = "give 0 (or off), auto (the training device's free memory), or a positive number of GiB such as 12"


def parse_budget(text: str) -> float | str | None:
    """Train Settings' ``vram_budget_gb``: None for "0"/"off"/"" (no planning), "auto", or a positive
    number of GiB. ValueError (the fix in the message) for anything else: "12GB", "-3", "nan"."""
    value = text.strip().lower() if isinstance(text, str) else None
    if value in ("", "0", "off", "0.0"):
        return None
    if value == "auto":
        return "auto"
    try:
        gib = float(value) if value is not None else float("nan")
    except ValueError:
        gib = float("nan")
    if not (gib > 0 and gib < float("inf")):
        raise ValueError(BUDGET_HELP)
    return gib


def ring_bytes(blocks: tuple[int, ...], swap_blocks: int) -> int:
    """Device bytes of ``training.swap``'s ring for the first ``swap_blocks`` of ``blocks`` (weight bytes in execution
    order): min(RING_SLOTS, swapped) slots, each the size of the largest swapped block."""
    return min(RING_SLOTS, swap_blocks) * max(blocks[:swap_blocks]) if swap_blocks else 0


def plan(cost: StepCost, checkpointing: bool, swap_blocks: int = 0, offload_inputs: bool = False) -> Plan:
    """The estimate of one plan from the step's cost (``cost`` measured with that checkpointing setting, and
    with the block inputs in host memory for ``offload_inputs``)."""
    blocks = cost.blocks
    if offload_inputs and not checkpointing:
        raise ValueError("memory plan: block inputs in host memory need gradient checkpointing (only a "
                         "checkpointed block's inputs wait for backward)")
    if swap_blocks and not checkpointing:
        raise ValueError(f"memory plan: swap_blocks={swap_blocks} needs gradient checkpointing (the backward "
                         "would need every block's weights resident)")
    if not 0 <= swap_blocks <= len(blocks):
        raise ValueError(f"memory plan: swap_blocks={swap_blocks}: the model has {len(blocks)} blocks")
    swapped, ring = sum(blocks[:swap_blocks]), ring_bytes(blocks, swap_blocks)
    tracked = cost.peak + cost.upstream - swapped + ring
    overhead = (CUDA_CONTEXT_GIB + WORKSPACE_GIB) * GIB + FRAGMENTATION * tracked
    return Plan(checkpointing, swap_blocks, len(blocks), _gib(tracked + overhead), _gib(tracked),
                _gib(cost.weights - swapped + ring), _gib(swapped), _gib(ring), _gib(overhead), offload_inputs,
                _gib(cost.upstream), _gib(SAFETY_MARGIN * tracked))


def choose(cost: Callable[[bool], StepCost], budget_gib: float, checkpointing_only: bool = False,
           offload_cost: Callable[[], StepCost] | None = None,
           offload_only: bool = False) -> tuple[Plan | None, list[Plan]]:
    """The cheapest plan that fits ``budget_gib`` (``Plan.fits``: its estimate and the safety margin within it), and
    every plan looked at (in order).

    ``cost(checkpointing)``: the step's cost with or without gradient checkpointing (called at most once
    each, and only when needed). ``checkpointing_only``: plans without checkpointing are not considered.
    ``offload_cost()``: the checkpointed step's cost with the block inputs in host memory; when given, that
    plan comes after plain checkpointing and before any swap (a host copy of each block's input is far less
    traffic than streaming a block's weights), and swap plans build on it (unless it lowers nothing: then
    plain checkpointing's plans go on); ``offload_only`` (the user turned it on): only plans with it. None when even every block swapped does not fit (the last plan looked at is
    then the smallest)."""
    if budget_gib <= 0:
        raise ValueError(f"memory plan: budget {budget_gib} GiB: give a positive number of GiB")
    if offload_only and offload_cost is None:
        raise ValueError("memory plan: offload_only needs offload_cost")
    tried: list[Plan] = []
    ckpt = None
    if not offload_only:
        ckpt = cost(True)
        first = plan(ckpt, True, 0)
        tried.append(first)
        if first.fits(budget_gib):
            if not checkpointing_only:
                plain = plan(cost(False), False, 0)
                tried.insert(0, plain)
                if plain.fits(budget_gib):
                    return plain, tried
            return first, tried
    offload = offload_cost is not None
    if offload:
        moved = offload_cost()
        offload = offload_only or moved.peak < ckpt.peak  # a host copy that lowers nothing is pure cost
        if offload:
            ckpt = moved
            tried.append(plan(ckpt, True, 0, True))
            if tried[-1].fits(budget_gib):
                return tried[-1], tried
    for n in range(1, len(ckpt.blocks) + 1):
        tried.append(plan(ckpt, True, n, offload))
        if tried[-1].fits(budget_gib):
            return tried[-1], tried
    return None, tried
