"""Caption dropout (training.caption_dropout + the loop): pure decisions, unchanged stream when off,
chained / resumed runs bit-identical when on, the same drops on two ranks as in one process.

The toy model's cond of sample i is i and its empty caption 100 + i, so the collated conds the model
sees say which samples trained on which caption. This file is also the torchrun worker of the two-rank
test (``__main__`` below), as tests/unit/test_distributed.py is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if __name__ == "__main__":  # under torchrun: make the pure packages importable as the tests do
    sys.path[:0] = [os.path.join(ROOT, "scripts"), HERE]
    import pure_packages

    pure_packages.install()
sys.path.insert(0, HERE)
from train_toy import ToyNet, toy_data, toy_fns  # noqa: E402
from training import distributed  # noqa: E402
from training.caption_dropout import dropped, uniform  # noqa: E402
from training.checkpoint import load_state, save_state  # noqa: E402
from training.loop import Hooks, train  # noqa: E402
from training.settings import TrainSettings  # noqa: E402

DIM, N, SEED = 8, 6, 5
EMPTY = 100.0
SETTINGS = dict(learning_rate=2e-2, batch_size=4, grad_accum=2, max_grad_norm=0.5)


def _data(empty: bool = True, conds_are_empty: bool = False):
    data = toy_data(N, DIM)
    return [dataclasses.replace(s, cond=torch.tensor(EMPTY + i) if conds_are_empty else s.cond,
                                empty_cond=torch.tensor(EMPTY + i) if empty else None)
            for i, s in enumerate(data)]


def _run(p: float, steps: int, data=None, state=None, parallel=None, record: list | None = None):
    """(final state, [(step, cond value)] of every row the model saw)."""
    net = ToyNet(DIM)
    fns, seen, done = toy_fns(net), [] if record is None else record, [0 if state is None else state.step]

    def collate(conds):
        seen.extend((done[0], float(c)) for c in conds)
        return torch.stack(conds)

    def on_step(report):
        done[0] = report.step
        return None

    result = train(net.lora, _data() if data is None else data, dataclasses.replace(fns, collate=collate),
                   TrainSettings(**SETTINGS, caption_dropout=p), steps=steps, seed=SEED, state=state,
                   hooks=Hooks(on_step=on_step), parallel=parallel)
    return result.state, seen


def _same(a, b) -> None:
    assert [p["loss"] for p in a.history] == [p["loss"] for p in b.history]
    assert torch.equal(a.generator, b.generator)
    for name, value in a.lora.items():
        assert torch.equal(value, b.lora[name]), name


def test_the_decision_is_a_pure_function_of_its_place_in_the_run() -> None:
    keys = [(s, st, m, i) for s in (0, 1) for st in range(50) for m in range(2) for i in range(10)]
    values = [uniform(*k) for k in keys]
    assert values == [uniform(*k) for k in keys]  # no hidden state
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)  # every argument changes the draw
    rate = sum(dropped(0.25, *k) for k in keys) / len(keys)
    assert 0.21 < rate < 0.29, rate  # 2000 draws: 3 sigma is about 0.03
    assert not any(dropped(0.0, *k) for k in keys) and all(dropped(1.0, *k) for k in keys)
    assert uniform(2**64 + 3, 0, 0, 0) == uniform(3, 0, 0, 0)  # seeds wrap like ComfyUI's 64-bit widget


def test_off_leaves_the_run_bit_identical() -> None:
    off, seen_off = _run(0.0, 6, data=_data(empty=False))
    with_empty, seen = _run(0.0, 6)
    _same(off, with_empty)
    assert seen == seen_off and all(v < EMPTY for _, v in seen)


def test_on_drops_exactly_the_samples_the_pure_function_names() -> None:
    state, seen = _run(0.4, 8)
    drops = [(step, v) for step, v in seen if v >= EMPTY]
    assert 0 < len(drops) < len(seen)
    # every row the model saw is (step, sample) with the caption chosen by `dropped` for some micro-batch
    for step, v in seen:
        i = int(v - EMPTY) if v >= EMPTY else int(v)
        wanted = [dropped(0.4, SEED, step, m, i) for m in range(SETTINGS["grad_accum"])]
        assert (v >= EMPTY) in wanted, (step, v)
    assert all(p["loss"] is not None for p in state.history)


def test_dropping_every_caption_equals_training_on_the_empty_captions() -> None:
    """p = 1 with empty captions E trains exactly like captions E with dropout off: the loop swaps the cond
    and nothing else (no extra draw from the generator, same groups)."""
    on, _ = _run(1.0, 5)
    ref, _ = _run(0.0, 5, data=_data(empty=False, conds_are_empty=True))
    _same(on, ref)


def test_chained_and_resumed_runs_are_bit_identical_with_dropout_on(tmp_path) -> None:
    one, seen_one = _run(0.3, 10)
    first, seen_a = _run(0.3, 5)
    second, seen_b = _run(0.3, 5, state=first)
    _same(one, second)
    assert seen_a + seen_b == seen_one
    path = save_state(str(tmp_path / "mid.trainstate"), first)
    resumed, _ = _run(0.3, 5, state=load_state(path))
    _same(one, resumed)


def test_dropout_without_an_empty_caption_is_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match=r"caption_dropout=0.2 .*connect empty_conditioning"):
        _run(0.2, 1, data=_data(empty=False))


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_settings_refuse_a_probability_outside_0_1(bad) -> None:
    with pytest.raises(ValueError, match="caption_dropout"):
        TrainSettings(caption_dropout=bad)


def test_settings_round_trip_and_old_states_default_to_off() -> None:
    s = TrainSettings(caption_dropout=0.1)
    assert TrainSettings.from_dict(s.to_dict()).caption_dropout == 0.1
    old = {k: v for k, v in s.to_dict().items() if k != "caption_dropout"}
    assert TrainSettings.from_dict(old).caption_dropout == 0.0


# ---- two ranks (torchrun) ----

def worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    par = distributed.activate(torch.device("cpu"), timeout_s=60)
    try:
        state, seen = _run(0.4, 6, parallel=par)
        save_state(os.path.join(args.out, f"final_rank{par.rank}.trainstate"), state)
        with open(os.path.join(args.out, f"seen_rank{par.rank}.json"), "w") as f:
            json.dump(seen, f)
    finally:
        distributed.deactivate()


@pytest.mark.slow
def test_two_ranks_drop_the_same_samples_as_one_process(tmp_path) -> None:
    from ports import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), __file__, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref, seen_ref = _run(0.4, 6)
    seen = []
    for rank in (0, 1):
        with open(tmp_path / f"seen_rank{rank}.json") as f:
            seen += [tuple(r) for r in json.load(f)]
    assert sorted(seen) == sorted(seen_ref)  # the ranks' rows together are the one process's rows
    assert any(v >= EMPTY for _, v in seen)
    rank0 = load_state(str(tmp_path / "final_rank0.trainstate"))
    # within fp32 rounding of the split reduction (see tests/unit/test_distributed.py)
    assert [p["loss"] for p in rank0.history] == pytest.approx([p["loss"] for p in ref.history], rel=1e-5)


if __name__ == "__main__":
    worker(sys.argv[1:])
