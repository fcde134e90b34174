"""EMA of the LoRA and schedule-free's averaged weights in the pure loop (issue 26 items 1 and 2), on the toy
flow model: what previews, checkpoints and the end of a run hold, against references computed here, and
that chaining / resuming is bit-identical with either."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_toy import ToyNet, toy_data, toy_fns  # noqa: E402
from training.checkpoint import load_state, save_state
from training.loop import Hooks, train
from training.settings import TrainSettings
from training.views import ema_decay_at

DIM = 8
BASE = dict(learning_rate=2e-2, timestep_sampling="uniform", batch_size=2)
SF = TrainSettings(optimizer="schedulefree_adamw", **BASE)


def _values(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _eval_weights(state) -> dict[str, torch.Tensor]:
    """Reference: schedule-free's eval-mode weights, by pytorch_optimizer itself, from the weights training
    continues from (``train_lora``) and the optimizer state."""
    import pytorch_optimizer

    params = {n: torch.nn.Parameter(v.clone()) for n, v in state.train_lora.items()}
    names = ["down", "up"]
    opt = pytorch_optimizer.ScheduleFreeAdamW([{"params": [params[n]], "lr": 1.0} for n in names])
    opt.load_state_dict(state.optimizer)
    opt.eval()
    return {n: p.detach() for n, p in params.items()}


def test_schedule_free_saves_and_previews_its_eval_weights_and_chains_bit_identically(tmp_path):
    data = toy_data(3, DIM)
    one_net = ToyNet(DIM)
    one = train(one_net.lora, data, toy_fns(one_net), SF, steps=10, seed=4)
    # the trained LoRA (what Save LoRA writes) is the eval-mode weights, not the ones training continues from
    reference = _eval_weights(one.state)
    assert all(torch.equal(one.state.lora[n], reference[n]) for n in reference)
    assert all(torch.equal(v, one.state.lora[n]) for n, v in _values(one_net.lora).items())
    assert not torch.equal(one.state.train_lora["up"], one.state.lora["up"])
    # chained through a state file, with a preview hook and checkpoints on the way: the same run
    seen, files = {}, []

    def on_step(report):
        seen[report.step] = _values(two_net.lora)

    def save(state, reason):
        files.append(save_state(str(tmp_path / f"s{state.step}.trainstate"), state))
        return files[-1]

    two_net = ToyNet(DIM)
    every = TrainSettings(**{**SF.to_dict(), "checkpoint_every": 2})
    first = train(two_net.lora, data, toy_fns(two_net), every, steps=5, seed=4, hooks=Hooks(on_step, save))
    fresh = ToyNet(DIM)
    second = train(fresh.lora, data, toy_fns(fresh), SF, steps=6, state=load_state(files[-1]))  # from step 4
    assert [p["loss"] for p in second.state.history] == [p["loss"] for p in one.state.history]
    assert all(torch.equal(one.state.lora[n], second.state.lora[n]) for n in one.state.lora)
    assert files[-1].endswith("s4.trainstate") and first.state.step == 5
    # and in the graph: the first run's output (its LoRA in eval mode) continued by its state
    third = train(two_net.lora, data, toy_fns(two_net), SF, steps=5, state=first.state)
    assert [p["loss"] for p in third.state.history] == [p["loss"] for p in one.state.history]
    assert all(torch.equal(one.state.lora[n], third.state.lora[n]) for n in one.state.lora)
    # a preview at step 4 saw the eval weights the checkpoint of step 4 holds
    at4 = load_state(files[-1])
    assert all(torch.equal(seen[4][n], at4.lora[n]) and torch.equal(at4.lora[n], _eval_weights(at4)[n]) for n in at4.lora)


def _ema_reference(weights: list[dict[str, torch.Tensor]], start: dict[str, torch.Tensor], decay: float,
                   warmup: int) -> dict[str, torch.Tensor]:
    """EMA in float64 from the weights after each step: s <- d s + (1 - d) w, d = ema_decay_at(step)."""
    shadow = {n: v.double() for n, v in start.items()}
    for step, w in enumerate(weights, start=1):
        d = ema_decay_at(step, decay, warmup)
        shadow = {n: d * shadow[n] + (1 - d) * w[n].double() for n in shadow}
    return shadow


@pytest.mark.parametrize("save", ["beside", "as_lora"])
def test_ema_equals_a_reference_ema_of_the_per_step_weights(save):
    s = TrainSettings(**BASE, ema_decay=0.9, ema_warmup=4, ema_save=save)
    net = ToyNet(DIM)
    start = _values(net.lora)
    per_step, ema_files = [], []

    def on_step(report):
        per_step.append(_values(net.lora))  # no ema_preview: the trained weights

    def save_ema(step):
        ema_files.append((step, _values(net.lora)))
        return f"ema_{step}"

    result = train(net.lora, toy_data(2, DIM), toy_fns(net), s, steps=12, seed=2, hooks=Hooks(on_step, save_ema=save_ema))
    reference = _ema_reference(per_step, start, 0.9, 4)
    for n, ref in reference.items():
        torch.testing.assert_close(result.state.ema[n].double(), ref, rtol=1e-6, atol=1e-7)
        assert (result.state.ema[n] - per_step[-1][n]).abs().max() > 1e-4  # the EMA lags the weights
    final = _values(net.lora)
    if save == "as_lora":  # the trained LoRA is the EMA; training continues from the raw weights
        assert all(torch.equal(final[n], result.state.ema[n]) for n in final) and not ema_files
        assert all(torch.equal(result.state.train_lora[n], per_step[-1][n]) for n in final)
    else:
        assert all(torch.equal(final[n], per_step[-1][n]) for n in final) and not result.state.train_lora
        assert [step for step, _ in ema_files] == [12] and result.ema_files == ["ema_12"]
        assert all(torch.equal(ema_files[0][1][n], result.state.ema[n]) for n in final)


def test_ema_resumes_exactly_and_previews_show_it_when_asked(tmp_path):
    s = TrainSettings(**BASE, ema_decay=0.8, ema_save="as_lora", ema_preview=True, ema_on_cpu=True)
    data = toy_data(2, DIM)
    one_net = ToyNet(DIM)
    seen = {}
    one = train(one_net.lora, data, toy_fns(one_net), s, steps=8, seed=5,
                hooks=Hooks(lambda r: seen.__setitem__(r.step, _values(one_net.lora))))
    net = ToyNet(DIM)
    first = train(net.lora, data, toy_fns(net), s, steps=4, seed=5)
    path = save_state(str(tmp_path / "ema.trainstate"), first.state)
    fresh = ToyNet(DIM)
    second = train(fresh.lora, data, toy_fns(fresh), s, steps=4, state=load_state(path))
    assert [p["loss"] for p in second.state.history] == [p["loss"] for p in one.state.history]
    for field in ("lora", "ema", "train_lora"):
        ours, ref = getattr(second.state, field), getattr(one.state, field)
        assert ours.keys() == ref.keys() and all(torch.equal(ours[n], ref[n]) for n in ref), field
    # the preview after the last step saw the EMA (the weights the run ends with)
    assert all(torch.equal(seen[8][n], one.state.ema[n]) for n in seen[8])


def test_ema_settings_are_checked():
    with pytest.raises(ValueError, match=r"ema_decay=1.0: must be in \[0, 1\)"):
        TrainSettings(ema_decay=1.0)
    with pytest.raises(ValueError, match="ema_save='both': unknown; choose one of"):
        TrainSettings(ema_save="both")
    with pytest.raises(ValueError, match="schedule-free already averages"):
        TrainSettings(optimizer="schedulefree_adamw", ema_decay=0.99)
    assert [ema_decay_at(k, 0.99, 4) for k in (1, 2, 4, 9)] == [0.2475, 0.495, 0.99, 0.99]


@pytest.mark.parametrize("extra", [{"optimizer": "schedulefree_adamw"}, {"ema_decay": 0.8, "ema_save": "as_lora"}],
                         ids=["schedule_free", "ema"])
def test_views_of_a_bf16_lora_keep_its_fp32_masters_and_chain_bit_identically(extra):
    """bf16 LoRA parameters with fp32 masters: the saved LoRA is the view (averaged / EMA fp32 values) rounded
    to the nearest bf16, the state keeps the masters and bf16 values training continues from, and 3 + 3 steps
    equal 6 bit for bit (the views' round trips leave the stochastic rounding's generator untouched)."""
    from train_toy import ToyLoRA

    s = TrainSettings(**{**BASE, **extra})
    data = toy_data(2, DIM)

    def net():
        n = ToyNet(DIM)
        n.lora = ToyLoRA(DIM, dtype=torch.bfloat16)
        return n

    one_net = net()
    one = train(one_net.lora, data, toy_fns(one_net), s, steps=6, seed=1)
    two_net = net()
    first = train(two_net.lora, data, toy_fns(two_net), s, steps=3, seed=1)
    second = train(two_net.lora, data, toy_fns(two_net), s, steps=3, state=first.state)
    for field in ("lora", "masters", "train_lora", "ema"):
        ours, ref = getattr(second.state, field), getattr(one.state, field)
        assert ours.keys() == ref.keys() and all(torch.equal(ours[n], ref[n]) for n in ref), field
    state = one.state
    assert all(v.dtype == torch.bfloat16 for v in state.lora.values())
    assert all(v.dtype == torch.float32 for v in state.masters.values()) and state.masters.keys() == state.lora.keys()
    view = state.ema if "ema_decay" in extra else _eval_weights(
        dataclasses.replace(state, train_lora={n: state.masters[n] for n in state.masters}))
    assert all(torch.equal(state.lora[n], view[n].to(torch.bfloat16)) for n in state.lora)
    assert not all(torch.equal(state.lora[n], state.train_lora[n]) for n in state.lora)


def test_on_step_without_previews_sees_the_trained_weights():
    """``views_on_step=False`` (the node sets it when no preview is connected): on_step gets the weights
    training continues from and no view is made; the run is the same."""
    seen, nets = {}, {}
    for flag in (True, False):
        net = nets[flag] = ToyNet(DIM)
        train(net.lora, toy_data(2, DIM), toy_fns(net), SF, steps=3, seed=0,
              hooks=Hooks(lambda r, f=flag: seen.__setitem__(f, _values(nets[f].lora)), views_on_step=flag))
    ref = ToyNet(DIM)
    state = train(ref.lora, toy_data(2, DIM), toy_fns(ref), SF, steps=3, seed=0).state
    assert all(torch.equal(seen[False][n], state.train_lora[n]) for n in state.lora)
    assert all(torch.equal(seen[True][n], state.lora[n]) for n in state.lora)
    assert all(torch.equal(v, state.lora[n]) for n, v in _values(nets[False].lora).items())
