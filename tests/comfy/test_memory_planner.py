"""#29 item 5, the planner's side: the shipped real workflow, estimated at Flux.1-dev's real size and 1024 px,
gets a plan that fits a 16 GB and a 24 GB card (no weights needed: bench/memory.py's fake-tensor step).

The workflow's settings are read from its API twin (``workflows/api/train_lora.json``, the prompt the page
queues for ``train_lora.json``: tests/e2e/test_workflows.py keeps the two the same); the settings the
estimate assumes (fp32 LoRA, fp32 accumulation, batch 1, no dropout) are checked against it. The plan
comes from ``training.memory_plan.choose`` over the estimator's step costs: as shipped the workflow does
not checkpoint and keeps every block resident, which needs far more than either card.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import memory  # noqa: E402  (bench/memory.py)

# the released Flux.1-dev file (flux1-dev.safetensors) stores bf16 weights: weight_dtype "default" keeps them
FILE_BASES = {"flux1-dev.safetensors": ("flux1-dev", "bf16")}


def _shipped() -> dict[str, dict]:
    with open(os.path.join(ROOT, "workflows", "api", "train_lora.json"), encoding="utf-8") as f:
        prompt = json.load(f)
    return {node["class_type"]: node["inputs"] for node in prompt.values()}


@pytest.mark.slow
def test_the_shipped_workflow_gets_a_plan_that_fits_16_and_24_gb(pack_module, one_thread):
    nodes = _shipped()
    model, base = FILE_BASES[nodes["PrecisionLoadDiffusionModel"]["model_name"]]
    assert nodes["PrecisionLoadDiffusionModel"]["weight_dtype"] == "default"
    lora, settings = nodes["PrecisionAttachLoRA"], nodes["PrecisionTrainSettings"]
    assert (lora["fp32_accumulation"], lora["param_dtype"], lora["dropout"], lora["rank_dropout"]) == (True, "fp32", 0, 0)
    assert (settings["batch_size"], settings["optimizer"], settings["gradient_checkpointing"]) == (1, "adamw", False)
    assert settings["vram_budget_gb"] == "auto"  # Train LoRA plans the run with this planner (nodes/train/budget.py)
    plan_module = pack_module("training.memory_plan")
    runs: dict[tuple[bool, bool], dict] = {}

    def cost(checkpointing: bool, offload: bool = False):
        if (checkpointing, offload) not in runs:
            runs[checkpointing, offload] = memory.tracked(model, 1024, lora["rank"], base, checkpointing,
                                                          lora["targets"], offload)
        return memory.step_cost(runs[checkpointing, offload])

    # as the node plans (nodes/train/budget.py): block inputs in host memory offered before any swap
    plans = {budget: plan_module.choose(cost, budget, offload_cost=lambda: cost(True, True)) for budget in (16, 24)}
    for budget, (plan, tried) in plans.items():
        assert plan is not None and plan.peak_gib <= budget, (budget, tried)
        # as shipped (no checkpointing, nothing swapped) it would not fit: the checkpointed step alone is over
        assert plan.checkpointing and plan.swap_blocks > 0 and tried[0].peak_gib > 24, (budget, tried)
        assert plan.weights_gib < tried[0].weights_gib  # what swap moved out of the device
    assert plans[16][0].swap_blocks > plans[24][0].swap_blocks
    # the inputs in host memory lower the checkpointed peak, so the swap plans build on them
    assert all(plan.offload_inputs for plan, _ in plans.values())
    assert memory.step_cost(runs[True, True]).peak < memory.step_cost(runs[True, False]).peak
    assert sorted(runs) == [(True, False), (True, True)]  # the plain step, larger, needed no estimate
