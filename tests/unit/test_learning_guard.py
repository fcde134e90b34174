"""The learning guard (training/learning.py, Train Settings' learning_guard): each way a run learns nothing while
ending "ok" is named by factor (warn) or ends the run before its LoRA counts as a success (stop); healthy runs
are named nothing. The family table's healthy runs are in tests/comfy/test_families_train.py."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_toy import ToyLoRA, ToyNet, toy_data, toy_fns  # noqa: E402
from training.grad import checkpoint_blocks  # noqa: E402
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
    """lora_down's gradients zeroed by a hook while lora_up learns."""
    net = ToyNet(DIM)
    with torch.no_grad():
        net.lora.up.fill_(0.1)  # up learns from step 1; down's gradient would be non-zero from step 1 too
    net.lora.down.register_hook(torch.zeros_like)
    result = _run(net)
    assert set(_kinds(result)) == {"zero gradients"} and "(1 factor: down)" in result.learning, result.learning


def test_an_adapter_no_gradient_reaches_is_a_note_not_a_finding():
    """Both factors without a gradient (as the last block's text query of a model without single-stream blocks,
    whose text outputs are dropped): the line notes it, the run is ok and 'stop' does not stop."""
    net = ToyNet(DIM)
    for factor in (net.lora.down, net.lora.up):
        factor.register_hook(torch.zeros_like)
    result = _run(net, learning_guard="stop")
    assert result.learning.startswith("learning: ok over 10 steps (every factor that got gradients moved); note: 1 "
                                      "adapter got no gradient at all in 10 steps"), result.learning
    assert result.outcome.ok and not result.stopped


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
    with torch.no_grad():
        net.lora.up.fill_(0.1)
    net.lora.down.register_hook(torch.zeros_like)
    result = _run(net, steps=30, learning_guard="stop")
    assert result.stopped and result.reason == "learning" and result.state.step == 10
    assert not result.outcome.ok and "the learning guard stopped the run at step 10 (learning: 1 finding over 10 " \
        "steps: zero gradients (1 factor: down)" in result.outcome.problem


def test_off_checks_nothing_and_a_short_call_is_checked_at_its_end():
    net = ToyNet(DIM)
    net.lora.down.register_hook(torch.zeros_like)
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


# ---- the recomputation check (training.grad.RecomputeCheck) under gradient checkpointing ----

class _Block(nn.Module):
    """tanh(h W); ``drift`` > 0 makes each call's output differ by that fraction (a non-deterministic block)."""

    def __init__(self, dim: int, seed: int, drift: float = 0.0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(dim, dim, generator=g) / dim**0.5, requires_grad=False)
        self.drift, self.calls = drift, 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(h @ self.w.T) * (1 + self.drift * self.calls)


class _Blocks(nn.Module):
    def __init__(self, dim: int, drift: float = 0.0) -> None:
        super().__init__()
        self.lora = ToyLoRA(dim)
        self.blocks = nn.ModuleList([_Block(dim, 1, drift), _Block(dim, 2), _Block(dim, 3)])

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = x + self.lora.delta(x) + sigma.view(-1, 1) + cond.view(-1, 1)
        for block in self.blocks:
            h = block(h)
        return h


def _checkpointed_run(drift: float, mode: str = "warn", offload: bool = False, steps: int = 6):
    net = _Blocks(DIM, drift)
    fns = dataclasses.replace(toy_fns(ToyNet(DIM)), predict=net, predict_base=None)
    cfg = TrainSettings(learning_rate=1e-2, learning_guard=mode, learning_guard_steps=4, gradient_checkpointing=True,
                        offload_block_inputs=offload)
    with checkpoint_blocks(net.blocks[:-1], in_place_adds=False, offload_inputs=offload):
        return train(net.lora, toy_data(2, DIM), fns, cfg, steps=steps, seed=3)


@pytest.mark.parametrize("offload", [False, True])
def test_exact_recomputation_is_named_nothing(offload):
    """Checkpointing, with the block inputs on the host or not: the recomputation is the forward, bit for bit."""
    result = _checkpointed_run(0.0, offload=offload)
    assert result.learning == "learning: ok over 4 steps (every factor that got gradients moved)", result.learning


def test_a_non_deterministic_block_under_checkpointing_is_named_at_once():
    result = _checkpointed_run(1e-3)
    assert "recomputation differs (1 block: checkpointed block 0 (_Block)): " in result.learning, result.learning
    # the drift: the recomputation is the block's second call, 1.002 / 1.001 - 1 of the forward's output
    assert "largest relative difference 0.000999, tolerance 1.91e-06" in result.learning and result.outcome.ok  # warn
    stopped = _checkpointed_run(1e-3, mode="stop")
    assert stopped.stopped and stopped.reason == "learning" and stopped.state.step == 1  # the first step
    assert "recomputation differs" in stopped.outcome.problem
