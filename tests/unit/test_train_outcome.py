"""training.outcome: one place decides whether a training call succeeded.

Issue 13, D3: runs that learned nothing reported success (67 of 80 steps skipped and 20 rollbacks with
LoRA weights at 1.4e10; logit_mean=NaN or scale_value=1e308 made every step skipped).
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_toy import ToyNet, toy_data, toy_fns  # noqa: E402
from training.loop import train
from training.outcome import EXPLODED_MAX_ABS, judge
from training.settings import TrainSettings

DIM = 8
UNIFORM = dict(timestep_sampling="uniform")


def test_a_diverging_run_is_judged_exploded_not_successful():
    """D3: the issue's settings (SGD, lr 10, no clipping, LoRA+ 100) blow the LoRA up between rollbacks."""
    net = ToyNet(DIM)
    s = TrainSettings(optimizer="sgd", learning_rate=10.0, max_grad_norm=0.0, loraplus_ratio=100.0, **UNIFORM)
    result = train(net.lora, toy_data(2, DIM), toy_fns(net), s, steps=30)
    out = result.outcome
    assert not out.ok and out.skipped > 0 and out.rollbacks > 0
    assert out.max_abs > EXPLODED_MAX_ABS
    assert out.problem.startswith(f"the LoRA exploded: its largest |weight| is {out.max_abs:.3g}, above the bound 1000")
    assert "lower learning_rate" in out.problem and out.summary().startswith("failed: 30 steps, ")


def test_every_step_skipped_fails_even_with_untouched_weights():
    """D3: with a NaN every step the guard keeps the initial weights (finite, small): still nothing learned."""
    net = ToyNet(DIM)
    result = train(net.lora, toy_data(1, DIM), toy_fns(net, nan_at=set(range(1, 100))),
                   TrainSettings(learning_rate=1e-2, **UNIFORM), steps=5)
    out = result.outcome
    assert (out.steps, out.skipped, out.ok) == (5, 5, False)
    assert out.problem.startswith("every one of the 5 steps was skipped (non-finite loss or gradients)")
    assert math.isfinite(out.max_abs) and out.max_abs < 10


def test_nan_policy_stop_after_only_bad_steps_fails():
    net = ToyNet(DIM)
    s = TrainSettings(learning_rate=1e-2, nan_policy="stop", nan_patience=2, **UNIFORM)
    result = train(net.lora, toy_data(1, DIM), toy_fns(net, nan_at={1, 2}), s, steps=6)
    assert result.reason == "nan" and not result.outcome.ok and result.outcome.steps == 2


def test_some_skipped_steps_are_reported_but_the_run_succeeds():
    net = ToyNet(DIM)
    s = TrainSettings(learning_rate=1e-2, nan_patience=2, **UNIFORM)
    result = train(net.lora, toy_data(1, DIM), toy_fns(net, nan_at={4, 5, 6}), s, steps=8)
    assert result.outcome.ok and result.outcome.problem is None
    assert result.outcome.summary().startswith("ok: 8 steps, 3 skipped, 1 rollbacks, largest |LoRA weight| ")


def test_a_chained_call_is_judged_on_its_own_steps():
    net = ToyNet(DIM)
    s = TrainSettings(learning_rate=1e-2, **UNIFORM)
    first = train(net.lora, toy_data(1, DIM), toy_fns(net), s, steps=3)
    assert first.outcome.ok
    second = train(net.lora, toy_data(1, DIM), toy_fns(net, nan_at=set(range(1, 100))), s, steps=4,
                   state=first.state)
    assert (second.outcome.steps, second.outcome.skipped, second.outcome.ok) == (4, 4, False)


@pytest.mark.parametrize("values, problem", [
    ([torch.tensor([0.5, -EXPLODED_MAX_ABS])], None),  # the bound itself is allowed
    ([torch.tensor([0.5]), torch.tensor([-EXPLODED_MAX_ABS * 1.01])], "the LoRA exploded"),
    ([torch.tensor([float("nan"), 1.0])], "the trained LoRA holds NaN/inf"),
    ([torch.tensor([float("inf")])], "the trained LoRA holds NaN/inf"),
    ([torch.zeros(0)], None),
])
def test_judge_bounds(values, problem):
    out = judge(values, steps=3, skipped=0, rollbacks=0)
    assert (out.problem is None) == (problem is None)
    if problem is not None:
        assert out.problem.startswith(problem)


def test_steps_with_every_adapter_dropped_are_counted_and_fail_only_when_nothing_trained():
    """Issue 22 item 3: module_dropout steps without a gradient are skipped and named in the summary."""
    w = [torch.ones(2)]
    some = judge(w, steps=300, skipped=0, rollbacks=0, dropped=290, module_dropout=0.99)
    assert some.ok and some.summary().endswith(
        "; 290 steps had every adapter dropped (module_dropout=0.99) and were skipped")
    every = judge(w, steps=4, skipped=0, rollbacks=0, dropped=4, module_dropout=0.99)
    assert not every.ok and "every one of the 4 steps had every adapter dropped (module_dropout=0.99)" in every.problem
    mixed = judge(w, steps=4, skipped=1, rollbacks=0, dropped=3, module_dropout=0.5)
    assert not mixed.ok and "(1 with non-finite loss or gradients, 3 with every adapter dropped" in mixed.problem
    assert "had every adapter dropped" not in judge(w, steps=4, skipped=0, rollbacks=0).summary()
