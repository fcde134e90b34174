"""training.memory_plan: a plan's estimate from a step's costs, and the cheapest plan within a budget."""
from __future__ import annotations

import pytest

from training import memory_plan as mp

G = mp.GIB


@pytest.fixture
def no_allowances(monkeypatch):
    monkeypatch.setattr(mp, "CUDA_CONTEXT_GIB", 0.0)
    monkeypatch.setattr(mp, "WORKSPACE_GIB", 0.0)
    monkeypatch.setattr(mp, "FRAGMENTATION", 0.0)
    monkeypatch.setattr(mp, "SAFETY_MARGIN", 0.0)


def _costs(plain_gib: float, ckpt_gib: float, blocks=(1, 1, 1, 1)):
    asked: list[bool] = []

    def cost(checkpointing: bool) -> mp.StepCost:
        asked.append(checkpointing)
        peak = ckpt_gib if checkpointing else plain_gib
        return mp.StepCost(peak=int(peak * G), blocks=tuple(int(b * G) for b in blocks), weights=int(sum(blocks) * G))

    return cost, asked


def test_a_plan_is_the_peak_minus_swapped_blocks_plus_the_ring_plus_allowances():
    cost = mp.StepCost(peak=10 * G, blocks=(G, 2 * G, G, G), weights=5 * G)
    p = mp.plan(cost, True, 2)  # blocks 0 and 1 (3 GiB) leave; 2 slots of the largest block (2 GiB) stay
    assert (p.tracked_gib, p.swapped_gib, p.ring_gib, p.weights_gib) == (11.0, 3.0, 4.0, 6.0)
    assert p.overhead_gib == round(mp.CUDA_CONTEXT_GIB + mp.WORKSPACE_GIB + mp.FRAGMENTATION * 11, 2)
    assert p.peak_gib == round(11 + p.overhead_gib, 2)
    assert p.describe() == "checkpointing, 2 of 4 blocks swapped"
    assert mp.plan(cost, False).describe() == "no checkpointing" and mp.plan(cost, True).ring_gib == 0


def test_the_lora_sets_kept_beside_the_trained_one_count_on_the_device():
    """Train LoRA trains a copy of the attached set; the attached one stays on the device (StepCost.upstream)."""
    cost = mp.StepCost(peak=10 * G, blocks=(G, 2 * G, G, G), weights=5 * G)
    kept = mp.StepCost(peak=10 * G, blocks=(G, 2 * G, G, G), weights=5 * G, upstream=G // 4)
    for swap in (0, 2):
        a, b = mp.plan(cost, True, swap), mp.plan(kept, True, swap)
        assert (b.tracked_gib - a.tracked_gib, b.upstream_gib, a.upstream_gib) == (0.25, 0.25, 0.0)
        assert b.peak_gib == round(b.tracked_gib * (1 + mp.FRAGMENTATION) + mp.CUDA_CONTEXT_GIB + mp.WORKSPACE_GIB, 2)


def test_a_plan_fits_only_with_the_safety_margin_free():
    """A plan whose estimate is within the budget but not its safety margin does not fit; the next plan is taken."""
    cost = mp.StepCost(peak=10 * G, blocks=(G, G, G, G), weights=5 * G)
    first = mp.plan(cost, True)
    assert first.margin_gib == round(mp.SAFETY_MARGIN * first.tracked_gib, 2) > 0
    at_estimate = first.peak_gib + first.margin_gib / 2
    assert not first.fits(at_estimate) and first.fits(first.peak_gib + first.margin_gib)
    chosen, tried = mp.choose(lambda ck: cost, at_estimate, checkpointing_only=True)
    # 1 and 2 swapped blocks free nothing (the ring: 1, then 2 slots of a 1 GiB block); 3 frees 1 GiB
    assert tried[0] == first and [t.swap_blocks for t in tried] == [0, 1, 2, 3] and chosen == tried[-1]
    assert chosen.peak_gib + chosen.margin_gib <= at_estimate


def test_the_cheapest_plan_that_fits(no_allowances):
    cost, asked = _costs(10, 6)
    plan, tried = mp.choose(cost, 12)
    assert plan.describe() == "no checkpointing" and plan.peak_gib == 10 and asked == [True, False]
    plan, _ = mp.choose(cost, 8)
    assert plan.describe() == "checkpointing" and plan.peak_gib == 6
    plan, _ = mp.choose(cost, 5)  # 6 - 3 swapped + 2 ring slots = 5
    assert plan.describe() == "checkpointing, 3 of 4 blocks swapped" and plan.peak_gib == 5
    plan, tried = mp.choose(cost, 3)
    assert plan is None and min(t.peak_gib for t in tried) == 4  # every block swapped: 6 - 4 + 2
    assert [t.swap_blocks for t in tried] == [0, 1, 2, 3, 4]


def test_the_plain_step_is_not_estimated_when_the_checkpointed_one_does_not_fit(no_allowances):
    cost, asked = _costs(10, 6)
    mp.choose(cost, 5)
    assert asked == [True]
    cost, asked = _costs(10, 6)
    plan, _ = mp.choose(cost, 12, checkpointing_only=True)
    assert plan.describe() == "checkpointing" and asked == [True]


def test_allowances_count_against_the_budget():
    cost, _ = _costs(10, 6)
    # checkpointed: 6 GiB tracked + 0.85 (context, workspaces) + 5 % = 7.15 > 7; 1 swapped: 6 - 1 + a ring of one
    # slot (training.swap allocates one for a single block); 2 swapped: 6 - 2 + 2; 3 swapped: 6 - 3 + 2 ring
    plan, tried = mp.choose(cost, 7)
    assert [t.peak_gib for t in tried] == [7.15, 7.15, 7.15, 6.1]
    assert plan.swap_blocks == 3 and plan.peak_gib == round(5 * 1.05 + 0.85, 2)


@pytest.mark.parametrize("args, message", [
    ((True, 5), "swap_blocks=5: the model has 4 blocks"),
    ((False, 1), "swap_blocks=1 needs gradient checkpointing"),
])
def test_impossible_plans_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        mp.plan(mp.StepCost(peak=G, blocks=(1, 1, 1, 1)), *args)


def test_a_budget_must_be_positive():
    cost, _ = _costs(10, 6)
    with pytest.raises(ValueError, match="budget 0 GiB: give a positive number"):
        mp.choose(cost, 0)


def _offload(gib: float, blocks=(1, 1, 1, 1)):
    asked: list[bool] = []

    def cost() -> mp.StepCost:
        asked.append(True)
        return mp.StepCost(peak=int(gib * G), blocks=tuple(int(b * G) for b in blocks), weights=int(sum(blocks) * G))

    return cost, asked


def test_block_inputs_in_host_memory_come_after_checkpointing_and_before_swap(no_allowances):
    cost, asked = _costs(10, 6)
    offload, off_asked = _offload(5)
    plan, tried = mp.choose(cost, 8, offload_cost=offload)
    assert plan.describe() == "checkpointing" and off_asked == []  # not estimated when not needed
    plan, tried = mp.choose(cost, 5.5, offload_cost=offload)
    assert plan.describe() == "checkpointing, block inputs in host memory" and plan.peak_gib == 5
    assert [t.describe() for t in tried] == ["checkpointing", "checkpointing, block inputs in host memory"]
    plan, tried = mp.choose(cost, 4, offload_cost=offload)  # 5 - 3 swapped + 2 ring = 4: swap builds on it
    assert plan.describe() == "checkpointing, block inputs in host memory, 3 of 4 blocks swapped"
    assert plan.offload_inputs and plan.peak_gib == 4
    plan, _ = mp.choose(cost, 4)  # without the offer: 6 - 4 + 2 = 4 needs every block swapped
    assert plan.describe() == "checkpointing, 4 of 4 blocks swapped"


def test_block_inputs_in_host_memory_that_lower_nothing_are_left_out_unless_asked_for(no_allowances):
    cost, _ = _costs(10, 6)
    same, _ = _offload(6)
    plan, tried = mp.choose(cost, 5, offload_cost=same)
    assert plan.describe() == "checkpointing, 3 of 4 blocks swapped" and not any(t.offload_inputs for t in tried)
    cost, asked = _costs(10, 6)
    plan, tried = mp.choose(cost, 8, checkpointing_only=True, offload_cost=same, offload_only=True)
    assert plan.describe() == "checkpointing, block inputs in host memory" and asked == []
    with pytest.raises(ValueError, match="block inputs in host memory need gradient checkpointing"):
        mp.plan(mp.StepCost(peak=G, blocks=(1,)), False, 0, True)


def test_the_host_side_of_a_plan_counts_what_it_keeps_in_host_memory():
    """#39: block inputs (what the offload took off the device), the swapped blocks' weights, the EMA on the
    CPU, the NaN guard's fp32 snapshot (LoRA, its EMA, the optimizer state) and the dataset, each once."""
    ckpt = mp.StepCost(peak=1000, blocks=(100, 200, 300), activations=500, optimizer=80, lora_numel=10)
    moved = mp.StepCost(peak=700, blocks=(100, 200, 300), activations=200, optimizer=80, lora_numel=10)
    offload_two = mp.plan(moved, True, 2, True)
    host = mp.host_cost(offload_two, moved, ckpt, ema=True, ema_on_cpu=True, dataset=7)
    assert host == mp.HostCost(block_inputs=300, swapped=300, ema=40, guard=80 + 80, dataset=7)
    assert host.total == 300 + 300 + 40 + 160 + 7
    assert host.describe() == ("block inputs 0.3 KiB, swapped blocks 0.3 KiB, EMA 0 KiB, NaN-guard snapshot 0.2 KiB, "
                               "dataset 0 KiB")
    plain = mp.host_cost(mp.plan(ckpt, True), ckpt, None, ema=True, ema_on_cpu=False)
    assert plain == mp.HostCost(guard=160)  # nothing swapped or offloaded; the EMA stays on the device
    big = mp.HostCost(swapped=6 * mp.GIB + mp.GIB // 4, guard=3 * 2**20)
    assert big.describe() == "swapped blocks 6.25 GiB, NaN-guard snapshot 3 MiB"
