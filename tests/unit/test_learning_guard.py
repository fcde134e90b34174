"""The learning guard (training/learning.py, Train Settings' learning_guard): each way a run learns nothing while
ending "ok" is named by factor (warn) or ends the run before its LoRA counts as a success (stop); healthy runs
are named nothing. The family table's healthy runs are in tests/comfy/test_families_train.py."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_toy import ToyLoRA, ToyNet, toy_data, toy_fns  # noqa: E402
from training.learning import Finding, LearningGuard, summary  # noqa: E402
from training.loop import train  # noqa: E402
from training.settings import TrainSettings  # noqa: E402

DIM = 8


def _run(net: ToyNet, steps: int = 12, **settings):
    cfg = TrainSettings(**{"learning_rate": 1e-2, "learning_guard_steps": 10, **settings})
    return train(net.lora, toy_data(2, DIM), toy_fns(net), cfg, steps=steps, seed=3)


def _kinds(result) -> dict[str, str]:
    text = result.learning
    return {kind: text for kind in ("never moved", "below resolution", "zero gradients", "non-finite gradients",
                                    "gradient collapse") if f"{kind} (" in text or f"{kind}:" in text}


def test_a_healthy_run_is_named_nothing():
    result = _run(ToyNet(DIM))
    assert result.learning == "learning: ok over 10 steps (every factor that got gradients moved)"
    assert result.outcome.ok and not result.stopped


def test_a_frozen_factor_is_named(monkeypatch):
    """The optimizer never updates lora_down (its group's learning rate is 0): 'never moved', down only."""
    net = ToyNet(DIM)
    groups = net.lora.param_groups

    def frozen_down(lr, ratio=1.0):
        return [dict(g, lr=0.0) if g["name"] == "lora_down" else g for g in groups(lr, ratio)]

    monkeypatch.setattr(net.lora, "param_groups", frozen_down)
    result = _run(net, lr_schedule="constant")
    assert set(_kinds(result)) == {"never moved"}, result.learning
    assert "never moved (1 factor: down)" in result.learning and result.outcome.ok  # warn: reported, run ok


def test_a_zeroed_gradient_hook_is_named():
    net = ToyNet(DIM)
    net.lora.up.register_hook(torch.zeros_like)
    result = _run(net)
    assert set(_kinds(result)) == {"zero gradients"} and "(1 factor: up)" in result.learning, result.learning


def test_bf16_factors_with_a_tiny_learning_rate_are_below_resolution():
    """The fp32 masters move (AdamW steps of ~3e-7, 2.5 fp32 ulps at 1.5), the stored bf16 values do not (their
    ulp there is 2**-7: stochastic rounding moves one with probability ~k x 4e-5 at step k; 32 values x 4 steps:
    under 1 %, and the draws are seeded)."""
    net = ToyNet(DIM)
    net.lora = ToyLoRA(DIM, rank=2)
    with torch.no_grad():
        net.lora.down.data = torch.full_like(net.lora.down.data, 1.5).bfloat16()
        net.lora.up.data = torch.full_like(net.lora.up.data, 1.5).bfloat16()
    result = _run(net, steps=4, learning_rate=3e-7, learning_guard_steps=4)
    assert set(_kinds(result)) == {"below resolution"}, result.learning
    assert "below resolution (2 factors: down, up)" in result.learning and "bfloat16" in result.learning


def test_a_collapsed_gradient_norm_is_named():
    factor = torch.zeros(2, requires_grad=True)
    guard = LearningGuard([factor], [factor], ["x (down)"], window=12)
    for i in range(12):
        guard.optimized[0].grad = torch.full((2,), 1.0 if i < 3 else 1e-9)
        guard.optimized[0].data += 1  # it moves: only the collapse is found
        guard.observe()
    assert guard.due(False)
    found = guard.check()
    assert [f.kind for f in found] == ["gradient collapse"] and "fell from 1.41 " in found[0].detail


def test_stop_ends_the_run_at_the_check_and_the_outcome_fails():
    net = ToyNet(DIM)
    net.lora.up.register_hook(torch.zeros_like)
    result = _run(net, steps=30, learning_guard="stop")
    assert result.stopped and result.reason == "learning" and result.state.step == 10
    assert not result.outcome.ok and "the learning guard stopped the run at step 10 (learning: 1 finding over 10 " \
        "steps: zero gradients (1 factor: up)" in result.outcome.problem


def test_off_checks_nothing_and_a_short_call_is_checked_at_its_end():
    net = ToyNet(DIM)
    net.lora.up.register_hook(torch.zeros_like)
    assert _run(net, learning_guard="off").learning == ""
    short = _run(ToyNet(DIM), steps=3)
    assert short.learning == "learning: ok over 3 steps (every factor that got gradients moved)"
    one = _run(ToyNet(DIM), steps=1)
    assert one.learning == "learning: not checked (fewer than 2 steps)"


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"TrainSettings.learning_guard='maybe': unknown; choose one of"):
        TrainSettings(learning_guard="maybe")
    with pytest.raises(ValueError, match=r"TrainSettings.learning_guard_steps=1: must be an integer >= 2"):
        dataclasses.replace(TrainSettings(), learning_guard_steps=1)


def test_finding_text_lists_at_most_four_names():
    f = Finding("zero gradients", tuple(f"b{i} (up)" for i in range(6)), "why")
    assert f.text() == "zero gradients (6 factors: b0 (up), b1 (up), b2 (up), b3 (up) and 2 more): why"
    assert summary([], 5) == "learning: ok over 5 steps (every factor that got gradients moved)"
