"""Held-out validation loss (training/validation.py, Train Settings' validate_every_n_steps / validation_fraction):
the curve of one run equals the curve of the same run chained or resumed from its saved state halfway, measuring
it changes nothing the run trains, the held-out samples follow the seed, and every setting that would go
unmeasured is refused by name."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_toy import ToyNet, toy_data, toy_fns  # noqa: E402
from training.checkpoint import load_state, save_state  # noqa: E402
from training.loop import Hooks, train  # noqa: E402
from training.settings import TrainSettings  # noqa: E402
from training.validation import held_out  # noqa: E402

DIM = 8


def _settings(**kw) -> TrainSettings:
    return TrainSettings(**{"learning_rate": 1e-2, "validate_every_n_steps": 2, "validation_fraction": 0.25, **kw})


def _curve(state) -> list[tuple[int, float]]:
    return [(p["step"], p["val_loss"]) for p in state.history if p.get("val_loss") is not None]


def test_one_run_chained_and_resumed_give_the_same_curve(tmp_path):
    data, fns_net = toy_data(8, DIM), ToyNet(DIM)
    whole = train(fns_net.lora, data, toy_fns(fns_net), _settings(), steps=8, seed=5)
    curve = _curve(whole.state)
    assert [s for s, _ in curve] == [2, 4, 6, 8] and all(v > 0 for _, v in curve), curve
    net = ToyNet(DIM)
    half = train(net.lora, data, toy_fns(net), _settings(), steps=4, seed=5)
    chained = train(net.lora, data, toy_fns(net), _settings(), steps=4, seed=5, state=half.state)
    assert _curve(chained.state) == curve  # bit for bit
    path = str(tmp_path / "half.trainstate")
    save_state(path, half.state)
    fresh = ToyNet(DIM)
    resumed = train(fresh.lora, data, toy_fns(fresh), _settings(), steps=4, seed=999, state=load_state(path))
    assert _curve(resumed.state) == curve and torch.equal(fresh.lora.up, fns_net.lora.up)


def test_measuring_changes_nothing_the_run_trains():
    """With a separate validation set, the run with validation equals the run without it (the validation pass
    draws from its own generators, runs in eval mode without gradients); the steps report the loss they measured."""
    data, held = toy_data(4, DIM), toy_data(2, DIM, seed=7)
    plain_net, val_net = ToyNet(DIM), ToyNet(DIM)
    train(plain_net.lora, data, toy_fns(plain_net), TrainSettings(learning_rate=1e-2), steps=6, seed=1)
    seen = []
    hooks = Hooks(on_step=lambda r: seen.append((r.step, r.val_loss)) and None)
    measured = train(val_net.lora, data, toy_fns(val_net), _settings(validation_fraction=0.0, validate_every_n_steps=3),
                     steps=6, seed=1, validation=held, hooks=hooks)
    assert torch.equal(plain_net.lora.up, val_net.lora.up) and torch.equal(plain_net.lora.down, val_net.lora.down)
    assert [s for s, v in seen if v is not None] == [3, 6] and seen[0] == (1, None)
    assert [v for _, v in seen if v is not None] == [v for _, v in _curve(measured.state)]


def test_held_out_samples_follow_the_seed():
    data = list(range(10))
    train_a, val_a = held_out(data, 0.3, seed=4)
    assert len(val_a) == 3 and sorted(train_a + val_a) == data and held_out(data, 0.3, seed=4) == (train_a, val_a)
    assert held_out(data, 0.3, seed=5)[1] != val_a and held_out(data, 0.0, seed=4) == (data, [])
    assert len(held_out(data, 0.01, seed=4)[1]) == 1  # at least one sample when any is asked for
    with pytest.raises(ValueError, match=r"validation_fraction=0.9 holds out 1 of the 1 training samples"):
        held_out([0], 0.9, seed=0)


@pytest.mark.parametrize("kw, given, message", [
    ({"validate_every_n_steps": 0}, False, "validation_fraction=0.25 holds out samples but validate_every_n_steps is 0"),
    ({"validate_every_n_steps": 0, "validation_fraction": 0.0}, True, "a validation set is connected but "
                                                                       "validate_every_n_steps is 0"),
    ({"validation_fraction": 0.0}, False, "validate_every_n_steps=2 needs validation samples"),
    ({}, True, "a validation set is connected and validation_fraction=0.25 holds out training samples too"),
])
def test_unmeasured_or_conflicting_validation_is_refused_before_training(kw, given, message):
    net = ToyNet(DIM)
    before = net.lora.down.clone()
    with pytest.raises(ValueError, match=message):
        train(net.lora, toy_data(4, DIM), toy_fns(net), _settings(**kw), steps=2,
              validation=toy_data(1, DIM, seed=9) if given else None)
    assert torch.equal(net.lora.down, before)


def test_the_fraction_is_checked_by_the_settings():
    with pytest.raises(ValueError, match=r"TrainSettings.validation_fraction=1.0: must be in \[0, 1\)"):
        TrainSettings(validation_fraction=1.0)


def _best_settings(**kw) -> TrainSettings:
    """lr 0.05 on the toy: the validation loss falls to its lowest at step 5 and rises after (measured every step)."""
    return _settings(**{"learning_rate": 5e-2, "validate_every_n_steps": 1, "keep_best_validation": True, **kw})


def _values(net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.lora.parameters()]


def test_keep_best_validation_holds_the_lora_of_the_lowest_validation_loss(tmp_path):
    """keep_best_validation: the LoRA a 10-step run ends with is, bit for bit, the LoRA of the same run stopped at
    the step of its lowest validation loss; the training state continues the last step (as without the option);
    the best survives chaining and resuming from the saved state halfway."""
    data = toy_data(8, DIM)
    net = ToyNet(DIM)
    whole = train(net.lora, data, toy_fns(net), _best_settings(), steps=10, seed=5)
    curve = _curve(whole.state)
    step, loss = min(curve, key=lambda p: p[1])
    assert whole.kept_best == (step, loss) and 1 < step < 10, curve  # a minimum inside the run, not its end
    upto, plain_end = ToyNet(DIM), ToyNet(DIM)
    train(upto.lora, data, toy_fns(upto), _best_settings(keep_best_validation=False), steps=step, seed=5)
    plain = train(plain_end.lora, data, toy_fns(plain_end), _best_settings(keep_best_validation=False), steps=10, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(_values(net), _values(upto)))
    assert not torch.equal(net.lora.up, plain_end.lora.up)
    assert whole.state.train_lora == {} or all(torch.equal(whole.state.train_lora[n], v)
                                               for n, v in plain.state.lora.items())
    assert whole.state.best_step == step and all(torch.equal(whole.state.lora[n], v) for n, v in upto.lora.named_parameters())
    # chained 6 + 4 and resumed from the file at 6: the same best, the same LoRA
    half_net = ToyNet(DIM)
    half = train(half_net.lora, data, toy_fns(half_net), _best_settings(), steps=6, seed=5)
    chained = train(half_net.lora, data, toy_fns(half_net), _best_settings(), steps=4, seed=5, state=half.state)
    path = str(tmp_path / "best.trainstate")
    save_state(path, half.state)
    fresh = ToyNet(DIM)
    resumed = train(fresh.lora, data, toy_fns(fresh), _best_settings(), steps=4, seed=999, state=load_state(path))
    for other, other_net in ((chained, half_net), (resumed, fresh)):
        assert other.kept_best == (step, loss) and _curve(other.state) == curve
        assert all(torch.equal(a, b) for a, b in zip(_values(other_net), _values(upto)))


@pytest.mark.parametrize("kw, message", [
    ({"validate_every_n_steps": 0, "validation_fraction": 0.0},
     r"TrainSettings.keep_best_validation=True: keeps the LoRA at the lowest validation loss, but validate_every_n"),
    ({"ema_decay": 0.9, "ema_save": "as_lora"}, r"but ema_save 'as_lora' saves the EMA as the LoRA; use one"),
    ({"optimizer": "schedulefree_adamw"}, r"the schedule-free optimizer 'schedulefree_adamw' saves its averaged"),
])
def test_keep_best_validation_conflicts_are_refused_by_the_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        _best_settings(**kw)
