"""The NaN guard loses nothing (issue 38): a skipped step leaves the LoRA, the optimizer state, the EMA and the
fp32 masters exactly as the previous good step left them (compared bit for bit with a run that ended there), the
steps after continue from that state, ``stop`` keeps it, and a rollback says how many good steps it discarded.

The toy model (train_toy.py) runs one forward per step here (one sample, batch 1, no accumulation, no DOP), so
the n-th call of ``predict`` belongs to optimizer step n. Poisons: the prediction is NaN (non-finite loss), or
the loss is finite and a hook makes one gradient entry inf (the gradient half of the loop's pre-step check).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_toy import ToyNet, toy_data, toy_fns

from training import loop
from training.checkpoint import TrainingState
from training.loop import Hooks, ModelFns, train
from training.settings import TrainSettings

DIM = 8
K = 4  # the poisoned step (1-based); the guard's only snapshot before it is the one at step 0
BASE = {"learning_rate": 1e-2, "timestep_sampling": "uniform"}


def _poisoned(fns: ModelFns, at: set[int], kind: str) -> ModelFns:
    calls = {"n": 0}

    def predict(x_t: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        out = fns.predict(x_t, sigma, cond)
        if calls["n"] not in at:
            return out
        if kind == "loss":
            return out * float("nan")

        def one_inf(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g.view(-1)[0] = float("inf")
            return g

        out.register_hook(one_inf)
        return out

    return dataclasses.replace(fns, predict=predict)


def _net(bf16: bool) -> ToyNet:
    net = ToyNet(DIM)
    if bf16:
        net.lora.to(torch.bfloat16)
    return net


def _run(settings: TrainSettings, steps: int, bf16: bool = False, poison: set[int] | frozenset[int] = frozenset(),
         kind: str = "loss", at: int = 0,
         state: TrainingState | None = None) -> tuple[loop.RunResult, list[TrainingState]]:
    """(result, [the state right after step ``at``]) of a toy run; ``at`` 0 captures nothing."""
    net = _net(bf16)
    captured: list[TrainingState] = []
    hooks = Hooks(on_step=lambda r: "checkpoint" if r.step == at else None,
                  save_checkpoint=lambda st, reason: captured.append(st) or "memory")
    result = train(net.lora, toy_data(1, DIM), _poisoned(toy_fns(net), set(poison), kind), settings, steps, seed=5,
                   state=state, hooks=hooks)
    return result, captured


def assert_same(a: object, b: object, where: str = "state") -> None:
    """Equal bit for bit: tensors by torch.equal (dtype too), containers entry by entry, numbers by ==."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        assert same, f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), f"{where}: {a!r} != {b!r}"


def assert_same_training(a: TrainingState, b: TrainingState) -> None:
    """What training continues from: LoRA, fp32 masters, optimizer state (every tensor, step count and group
    value), EMA, and the trained weights behind a view."""
    for part in ("lora", "masters", "optimizer", "ema", "train_lora"):
        assert_same(getattr(a, part), getattr(b, part), part)


ROWS = {
    "adamw": {},
    "adamw_bf16_masters": {"bf16": True},
    "adamw_ema_warmup": {"settings": {"ema_decay": 0.9, "ema_warmup": 3}},
    "prodigy": {"settings": {"optimizer": "prodigy", "learning_rate": 1.0}},
    "sgd_momentum_no_clip": {"settings": {"optimizer": "sgd", "beta1": 0.9, "max_grad_norm": 0.0}},
}


@pytest.mark.parametrize("kind", ["loss", "gradient"])
@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_skipped_step_leaves_everything_as_the_previous_good_step_and_training_continues_from_there(row, kind):
    """The run poisoned at step K, captured right after it, equals a run of K - 1 steps bit for bit; its next
    two steps equal those two steps continued from the K - 1 run (given the poisoned run's generators, which
    the skipped step consumed: its batch and noise are not drawn again)."""
    spec = ROWS[row]
    settings = TrainSettings(**{**BASE, **spec.get("settings", {})})
    bf16 = spec.get("bf16", False)
    poisoned, (after_skip,) = _run(settings, K + 2, bf16, {K}, kind, at=K)
    reference, _ = _run(settings, K - 1, bf16)
    assert [p["skipped"] for p in poisoned.state.history] == [False] * (K - 1) + [True, False, False]
    assert after_skip.step == K  # the run's position counts the skipped step (its draws are used up)
    assert_same_training(after_skip, reference.state)
    assert (poisoned.outcome.skipped, poisoned.outcome.rollbacks, poisoned.outcome.discarded) == (1, 0, 0)
    assert float(after_skip.lora["up"].float().abs().max()) > 0  # the good steps moved the LoRA
    resumed = dataclasses.replace(reference.state, step=after_skip.step, generator=after_skip.generator,
                                  extra_rng=after_skip.extra_rng)
    continued, _ = _run(settings, 2, bf16, state=resumed)
    assert [p["loss"] for p in continued.state.history[-2:]] == [p["loss"] for p in poisoned.state.history[-2:]]
    assert_same_training(continued.state, poisoned.state)


def test_stop_keeps_the_state_of_the_last_good_step():
    """nan_policy stop after nan_patience bad steps in a row: the run ends with the state the last good step
    left, not an older snapshot (that would discard the good steps since it)."""
    settings = TrainSettings(**BASE, nan_policy="stop", nan_patience=2, ema_decay=0.5)
    stopped, _ = _run(settings, 8, poison={K, K + 1})
    reference, _ = _run(settings, K - 1)
    assert (stopped.reason, stopped.state.step) == ("nan", K + 1)
    assert_same_training(stopped.state, reference.state)
    assert (stopped.outcome.rollbacks, stopped.outcome.discarded) == (0, 0)


@pytest.mark.parametrize("poison, steps, snapshot_step, discarded", [
    ({K, K + 1}, K + 3, 0, K - 1),  # back to the snapshot taken at the start: steps 1..K-1 are lost
    ({12, 13}, 15, 10, 1),           # back to the snapshot after step 10: step 11 is lost
])
def test_a_rollback_restores_its_snapshot_and_reports_the_good_steps_it_discarded(poison, steps, snapshot_step,
                                                                                   discarded):
    """nan_patience 2: the second bad step in a row restores the last snapshot (taken every 10 steps). What it
    restores is compared bit for bit with a run that ended at the snapshot; the count is in the summary."""
    settings = TrainSettings(**BASE, nan_patience=2, ema_decay=0.5)
    rolled, (after,) = _run(settings, steps, poison=poison, at=max(poison))
    reference, _ = _run(settings, snapshot_step) if snapshot_step else (None, None)
    out = rolled.outcome
    assert (out.skipped, out.rollbacks, out.discarded) == (2, 1, discarded)
    plural = "" if discarded == 1 else "s"
    assert out.summary().endswith(f"; rollbacks discarded {discarded} good step{plural}"), out.summary()
    if reference is not None:  # the LoRA, optimizer and EMA are the snapshot's, bit for bit
        assert_same_training(after, reference.state)
    else:  # the snapshot taken before step 1: the LoRA as attached, the EMA equal to it, no optimizer state
        attached = {n: p.detach() for n, p in ToyNet(DIM).lora.named_parameters()}
        assert_same(after.lora, attached, "lora")
        assert_same(after.ema, attached, "ema")
        assert after.optimizer["state"] == {}


def test_an_update_that_overflows_is_rolled_back_and_counted_as_a_rollback(monkeypatch):
    """Finite gradients whose update leaves a parameter non-finite (an overflow inside the optimizer): the step
    is already applied, so the guard restores its snapshot at once. That is a rollback, counted and reported
    with the good steps it discarded, never a plain "skipped" step."""
    build, steps_taken = loop.build_optimizer, {"n": 0}

    def overflowing(groups, name, hyper):
        opt = build(groups, name, hyper)
        real_step = opt.step

        def step(*args, **kwargs):
            out = real_step(*args, **kwargs)
            steps_taken["n"] += 1
            if steps_taken["n"] == K:
                with torch.no_grad():
                    opt.param_groups[0]["params"][0].view(-1)[0] = float("inf")
            return out

        opt.step = step
        return opt

    monkeypatch.setattr(loop, "build_optimizer", overflowing)
    settings = TrainSettings(**BASE, nan_patience=3)
    result, (after,) = _run(settings, K + 1, at=K)
    out = result.outcome
    assert (out.skipped, out.rollbacks, out.discarded) == (1, 1, K - 1)
    assert "1 skipped, 1 rollbacks" in out.summary() and out.summary().endswith(f"discarded {K - 1} good steps")
    assert not float(after.lora["up"].abs().max()) and all(torch.isfinite(v).all() for v in after.lora.values())
