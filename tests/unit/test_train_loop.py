"""The pure training loop on a toy flow model: learning, chaining, resume, guard, DOP, accumulation."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_toy import ToyNet, toy_data, toy_fns  # noqa: E402
from training.checkpoint import load_state, save_state
from training.loop import Hooks, StepReport, train
from training.settings import TrainSettings

DIM = 8
FAST = TrainSettings(learning_rate=3e-2, timestep_sampling="uniform")


def _losses(result) -> list[float]:
    return [p["loss"] for p in result.state.history]


def test_loss_falls_on_one_sample_memorisation() -> None:
    net = ToyNet(DIM)
    fixed = TrainSettings(learning_rate=1e-2, timestep_sampling="logit_normal", logit_std=1e-3)  # sigma ~ 0.5
    result = train(net.lora, toy_data(1, DIM), toy_fns(net), fixed, steps=200, seed=0)
    losses = _losses(result)
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20


def test_two_chained_runs_equal_one_run_bitwise() -> None:
    data = toy_data(3, DIM)
    s = TrainSettings(learning_rate=1e-2, lr_schedule="cosine", warmup_steps=2, schedule_steps=10, batch_size=2)
    one_net = ToyNet(DIM)
    one = train(one_net.lora, data, toy_fns(one_net), s, steps=10, seed=7)
    two_net = ToyNet(DIM)
    first = train(two_net.lora, data, toy_fns(two_net), s, steps=5, seed=7)
    second = train(two_net.lora, data, toy_fns(two_net), s, steps=5, seed=999, state=first.state)
    assert _losses(second) == _losses(one)
    for name, value in one.state.lora.items():
        assert torch.equal(value, second.state.lora[name]), name


def test_resume_from_saved_state_file_continues_identical_losses(tmp_path) -> None:
    data = toy_data(2, DIM)
    ref_net = ToyNet(DIM)
    ref = train(ref_net.lora, data, toy_fns(ref_net), FAST, steps=8, seed=3)
    net = ToyNet(DIM)
    saved: list[str] = []

    def save(state, reason):
        return save_state(str(tmp_path / f"ck_{state.step}.trainstate"), state)

    train(net.lora, data, toy_fns(net), FAST.__class__(**{**FAST.to_dict(), "checkpoint_every": 4}), steps=4,
          seed=3, hooks=Hooks(save_checkpoint=lambda st, r: saved.append(save(st, r)) or saved[-1]))
    fresh = ToyNet(DIM)  # new process stand-in: LoRA re-initialised, everything comes from the file
    resumed = train(fresh.lora, data, toy_fns(fresh), FAST, steps=4, state=load_state(saved[-1]))
    assert _losses(resumed) == _losses(ref)


def test_checkpoint_state_is_a_trainstate_and_an_earlier_state_pt_is_still_found(tmp_path) -> None:
    """ComfyUI lists every .pt file in a loras folder as a LoRA, so the state is written as .trainstate; a
    .state.pt of earlier versions beside a LoRA is still read when no .trainstate is there."""
    from training.checkpoint import find_state, state_candidates, write_checkpoint

    net = ToyNet(DIM)
    state = train(net.lora, toy_data(1, DIM), toy_fns(net), FAST, steps=2, seed=3).state
    lora = write_checkpoint(str(tmp_path / "run_step2"), state, lambda p: (open(p, "wb").close(), p)[1])
    assert sorted(os.listdir(tmp_path)) == ["run_step2.safetensors", "run_step2.trainstate"]
    new = str(tmp_path / "run_step2.trainstate")
    assert find_state(lora) == new
    os.replace(new, str(tmp_path / "run_step2.state.pt"))  # what an earlier version wrote
    assert find_state(lora) == str(tmp_path / "run_step2.state.pt")
    old = load_state(find_state(lora))
    assert old.step == 2 and all(torch.equal(v, old.lora[k]) for k, v in state.lora.items())
    save_state(new, state)
    assert find_state(lora) == new  # the current suffix first
    assert state_candidates("a/x.state.pt") == ["a/x.state.pt"] and find_state(str(tmp_path / "none.safetensors")) is None


def test_stop_action_saves_checkpoint_and_ends_early() -> None:
    net = ToyNet(DIM)
    seen: list[tuple[int, str]] = []
    hooks = Hooks(on_step=lambda r: "interrupt" if r.local_step == 3 else None,
                  save_checkpoint=lambda st, reason: seen.append((st.step, reason)) or f"ck{st.step}")
    result = train(net.lora, toy_data(1, DIM), toy_fns(net), FAST, steps=10, hooks=hooks)
    assert (result.stopped, result.reason, result.state.step) == (True, "interrupt", 3)
    assert seen == [(3, "interrupt")] and result.checkpoints == ["ck3"]


def test_reports_count_optimizer_steps_with_accumulation() -> None:
    net = ToyNet(DIM)
    reports: list[StepReport] = []
    s = TrainSettings(grad_accum=3, learning_rate=1e-3)
    train(net.lora, toy_data(2, DIM), toy_fns(net), s, steps=4, hooks=Hooks(on_step=lambda r: reports.append(r)))
    assert [(r.step, r.local_step, r.total) for r in reports] == [(1, 1, 4), (2, 2, 4), (3, 3, 4), (4, 4, 4)]
    assert all(r.loss is not None and math.isfinite(r.loss) and r.lr == pytest.approx(1e-3) for r in reports)


def test_accumulation_of_two_equals_batch_of_two_gradient() -> None:
    """With one sample, accumulating 2 micro-steps averages two draws: check against a manual mean."""
    torch.manual_seed(0)
    net = ToyNet(DIM)
    with torch.no_grad():
        net.lora.up.normal_()
    s = TrainSettings(grad_accum=2, learning_rate=1e-3, optimizer="sgd", beta1=0.0, weight_decay=0.0,
                      max_grad_norm=0.0, timestep_sampling="uniform")
    before = {n: p.detach().clone() for n, p in net.lora.named_parameters()}
    train(net.lora, toy_data(1, DIM), toy_fns(net), s, steps=1, seed=5)
    # manual: same generator sequence, same two draws, gradient averaged
    ref = ToyNet(DIM)
    with torch.no_grad():
        for n, p in ref.lora.named_parameters():
            p.copy_(before[n])
    gen = torch.Generator().manual_seed(5)
    fns, data = toy_fns(ref), toy_data(1, DIM)
    total = 0.0
    for _ in range(2):
        torch.randperm(1, generator=gen)
        noise = torch.randn((1, DIM), generator=gen)
        u = torch.rand(1, generator=gen, dtype=torch.float64).clamp(1e-4, 1 - 1e-4)
        x0 = data[0].latent[None]
        xt = fns.noise_latent(u.float(), noise, x0)
        total = total + ((fns.predict(xt, u.float(), torch.stack([data[0].cond])) - (noise - x0)) ** 2).mean() / 2
    total.backward()
    for n, p in ref.lora.named_parameters():
        torch.testing.assert_close(before[n] - 1e-3 * p.grad, dict(net.lora.named_parameters())[n].detach())


def test_injected_nan_is_skipped_and_rolled_back(tmp_path) -> None:
    net = ToyNet(DIM)
    s = TrainSettings(learning_rate=1e-2, nan_patience=2, checkpoint_every=1, timestep_sampling="uniform")
    written: list[str] = []

    def save(state, reason):
        return save_state(str(tmp_path / f"s{state.step}.trainstate"), state)

    hooks = Hooks(save_checkpoint=lambda st, r: written.append(save(st, r)) or written[-1])
    result = train(net.lora, toy_data(1, DIM), toy_fns(net, nan_at={4, 5, 6}), s, steps=8, hooks=hooks)
    skipped = [p["step"] for p in result.state.history if p["skipped"]]
    assert skipped == [4, 5, 6] and result.state.skipped == 3 and result.state.rollbacks == 1
    assert all(torch.isfinite(v).all() for v in result.state.lora.values())
    for path in written:
        assert all(torch.isfinite(v).all() for v in load_state(path).lora.values())


def test_nan_in_parameters_is_never_written(tmp_path) -> None:
    from training.guard import NonFiniteError

    net = ToyNet(DIM)
    result = train(net.lora, toy_data(1, DIM), toy_fns(net), FAST, steps=1)
    result.state.lora["up"][0, 0] = float("inf")
    target = tmp_path / "bad.trainstate"
    with pytest.raises(NonFiniteError, match="'lora' holds NaN/inf"):
        save_state(str(target), result.state)
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_nan_policy_stop_ends_run_with_last_good_weights() -> None:
    net = ToyNet(DIM)
    s = TrainSettings(learning_rate=1e-2, nan_policy="stop", nan_patience=2)
    result = train(net.lora, toy_data(1, DIM), toy_fns(net, nan_at={3, 4}), s, steps=6)
    assert (result.stopped, result.reason, result.state.step) == (True, "nan", 4)
    assert all(torch.isfinite(v).all() for v in result.state.lora.values())


def test_dop_term_zero_at_init_positive_after_training() -> None:
    net = ToyNet(DIM)
    s = TrainSettings(learning_rate=3e-2, dop_multiplier=1.0, timestep_sampling="uniform")
    result = train(net.lora, toy_data(1, DIM, class_cond=True), toy_fns(net), s, steps=20)
    dops = [p["dop"] for p in result.state.history]
    assert dops[0] == 0.0
    assert dops[-1] > 1e-8


def test_dop_every_n_only_on_those_steps() -> None:
    net = ToyNet(DIM)
    s = TrainSettings(dop_multiplier=1.0, dop_every_n=3)
    result = train(net.lora, toy_data(1, DIM, class_cond=True), toy_fns(net), s, steps=6)
    assert [p["dop"] is not None for p in result.state.history] == [True, False, False, True, False, False]


def test_bf16_lora_uses_fp32_masters_and_resumes_exactly() -> None:
    data = toy_data(1, DIM)
    s = TrainSettings(learning_rate=1e-3, timestep_sampling="uniform")

    def bf16_net() -> ToyNet:
        net = ToyNet(DIM)
        net.lora.to(torch.bfloat16)
        return net

    one = bf16_net()
    ref = train(one.lora, data, toy_fns(one), s, steps=6, seed=1)
    two = bf16_net()
    a = train(two.lora, data, toy_fns(two), s, steps=3, seed=1)
    assert a.state.masters and all(v.dtype == torch.float32 for v in a.state.masters.values())
    b = train(two.lora, data, toy_fns(two), s, steps=3, state=a.state)
    assert _losses(b) == _losses(ref)
    assert two.lora.up.dtype == torch.bfloat16 and not torch.equal(two.lora.up.float(), torch.zeros_like(two.lora.up.float()))


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps=0: must be an integer > 0"),
    ({"data": []}, "the dataset is empty"),
    # settings are built inside the check: bad settings raise when they are built, before train() runs
    ({"settings": lambda: TrainSettings(learning_rate=0.0)}, "learning_rate=0.0: must be > 0"),
    ({"settings": lambda: TrainSettings(optimizer="fromage")}, "optimizer='fromage': unknown"),
    ({"settings": lambda: TrainSettings(dop_multiplier=1.0)}, "needs a class conditioning"),
])
def test_bad_input_raises_before_anything_changes(kwargs, message) -> None:
    net = ToyNet(DIM)
    before = {n: p.detach().clone() for n, p in net.lora.named_parameters()}
    args = {"data": toy_data(1, DIM), "settings": TrainSettings, "steps": 3, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        train(net.lora, args["data"], toy_fns(net), args["settings"](), steps=args["steps"])
    assert all(torch.equal(before[n], p) for n, p in net.lora.named_parameters())


def test_state_from_other_optimizer_is_rejected() -> None:
    net = ToyNet(DIM)
    first = train(net.lora, toy_data(1, DIM), toy_fns(net), TrainSettings(), steps=1)
    with pytest.raises(ValueError, match="made with optimizer 'adamw' but settings choose 'sgd'"):
        train(net.lora, toy_data(1, DIM), toy_fns(net), TrainSettings(optimizer="sgd"), steps=1, state=first.state)


class Cancelled(Exception):
    pass


def test_interrupt_inside_a_forward_checkpoints_the_last_complete_step_and_resumes_exactly() -> None:
    data = toy_data(2, DIM)
    ref_net = ToyNet(DIM)
    ref = train(ref_net.lora, data, toy_fns(ref_net), FAST, steps=6, seed=4)
    net = ToyNet(DIM)
    fns = toy_fns(net)
    calls = {"n": 0}

    def predict(x, sigma, cond):
        calls["n"] += 1
        if calls["n"] == 4:  # inside optimizer step 4
            raise Cancelled()
        return fns.predict(x, sigma, cond)

    import dataclasses

    saved = []
    hooks = Hooks(save_checkpoint=lambda st, reason: saved.append((st, reason)) or "ck",
                  is_interrupt=lambda exc: isinstance(exc, Cancelled))
    result = train(net.lora, data, dataclasses.replace(fns, predict=predict), FAST, steps=6, seed=4, hooks=hooks)
    assert (result.stopped, result.reason, result.state.step) == (True, "interrupt", 3)
    state, reason = saved[-1]
    assert reason == "interrupt" and state.step == 3 and all(p.grad is None for p in net.lora.parameters())
    fresh = ToyNet(DIM)
    resumed = train(fresh.lora, data, toy_fns(fresh), FAST, steps=3, state=state)
    assert _losses(resumed) == _losses(ref)


def test_other_exceptions_propagate() -> None:
    net = ToyNet(DIM)
    fns = toy_fns(net)

    def broken(x, sigma, cond):
        raise RuntimeError("boom")

    import dataclasses

    hooks = Hooks(is_interrupt=lambda exc: isinstance(exc, Cancelled))
    with pytest.raises(RuntimeError, match="boom"):
        train(net.lora, toy_data(1, DIM), dataclasses.replace(fns, predict=broken), FAST, steps=2, hooks=hooks)


def test_final_state_is_a_copy_unless_handed_over_and_checkpoints_are_copies() -> None:
    data = toy_data(1, DIM)
    kept = ToyNet(DIM)
    seen: list = []
    hooks = Hooks(save_checkpoint=lambda st, reason: seen.append(st) or "mem")
    every = TrainSettings(learning_rate=3e-2, timestep_sampling="uniform", checkpoint_every=1)
    first = train(kept.lora, data, toy_fns(kept), every, steps=2, hooks=hooks)
    values = {n: v.clone() for n, v in first.state.lora.items()}
    train(kept.lora, data, toy_fns(kept), FAST, steps=2, state=first.state)  # the same module trained again
    assert all(torch.equal(values[n], v) for n, v in first.state.lora.items()), "the returned state changed"
    assert not torch.equal(seen[0].lora["up"], seen[1].lora["up"]), "a mid-run checkpoint aliases the LoRA"
    assert torch.equal(seen[1].lora["up"], values["up"])

    shared = ToyNet(DIM)
    out = train(shared.lora, data, toy_fns(shared), every, steps=2, hand_over=True)
    params = dict(shared.lora.named_parameters())
    assert all(v.data_ptr() == params[n].data_ptr() for n, v in out.state.lora.items())  # no second copy
    assert all(torch.equal(values[n], v) for n, v in out.state.lora.items())  # same values as the copying run


def test_guard_snapshot_is_a_cpu_copy_that_survives_later_steps() -> None:
    from training.guard import NanGuard

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    guard = NanGuard(patience=1)
    guard.snapshot(1, [p], opt)
    saved_avg = opt.state[p]["exp_avg"].clone()
    for _ in range(2):  # restore, then train on: the snapshot itself must not move
        guard.restore([p], opt)
        assert torch.equal(p.detach(), guard.last_good.params[0]) and guard.last_good.params[0].device.type == "cpu"
        assert torch.equal(opt.state[p]["exp_avg"], saved_avg)
        p.grad = torch.full((3,), 5.0)
        opt.step()
    assert guard.last_good.params[0].data_ptr() != p.data_ptr()


def test_total_norm_is_torchs_total_norm_and_flags_non_finite() -> None:
    from training.loop import _total_norm

    g = torch.Generator().manual_seed(0)
    same = [torch.randn(8, 5, generator=g), torch.randn(7, generator=g), torch.randn(3, 8, generator=g)]
    mixed = same[:2] + [same[2].double()]
    for tensors in (same, mixed):
        torch.testing.assert_close(_total_norm(tensors).double(), torch.nn.utils.get_total_norm(tensors).double())
    assert float(_total_norm([])) == 0.0
    bad = [t.clone() for t in same]
    bad[1][3] = float("inf")
    assert not bool(torch.isfinite(_total_norm(bad)))
    bad[1][3] = float("nan")
    assert not bool(torch.isfinite(_total_norm(bad)))
