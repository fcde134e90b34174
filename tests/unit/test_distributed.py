"""Data-parallel training (training.distributed) on the toy flow model: gloo on the CPU under torchrun.

The same file is the worker that ``torchrun`` starts (``__main__`` below), so the test and the worker
cannot drift apart. Tolerance of the 2-rank vs 1-process comparison: the gradient of the global batch is
the same sum, but one process adds all rows inside one matmul while two ranks add their halves and the
all-reduce adds the two partial sums; fp32 rounding of the two orders differs by ~1e-7 relative per step,
which Adam turns into parameter differences of that order. rtol 1e-5 on the losses and atol 1e-5 on the
LoRA (whose entries are ~1e-1) leaves two orders of magnitude of margin and still fails on any real error
(a wrong shard, a missing reduce or a double-counted row changes the loss at the first step by > 1e-2).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

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
from training.checkpoint import load_state, save_state  # noqa: E402
from training.loop import Hooks, train  # noqa: E402
from training.settings import TrainSettings  # noqa: E402

DIM = 8
RTOL, ATOL = 1e-5, 1e-5
# A global batch of 4 of 5 samples (a sixth held out for the validation loss every second step), 2 micro-batches
# per step, DOP every second step, clipping, warmup: every stream of randomness and every per-step rule the loop has
# is exercised.
SETTINGS = dict(learning_rate=2e-2, lr_schedule="cosine", warmup_steps=2, schedule_steps=12, batch_size=4,
                grad_accum=2, max_grad_norm=0.5, timestep_sampling="logit_normal", dop_multiplier=0.5,
                dop_every_n=2, validate_every_n_steps=2, validation_fraction=0.2)


def _settings(**extra) -> TrainSettings:
    return TrainSettings(**{**SETTINGS, **extra})


def _data():
    return toy_data(6, DIM, class_cond=True)


def _losses(state) -> list[float]:
    return [p["loss"] for p in state.history]


def _validation(state) -> list[tuple[int, float]]:
    return [(p["step"], p["val_loss"]) for p in state.history if p.get("val_loss") is not None]


# ---- the worker (one per rank) ----

def worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--die-at", type=int, default=0, help="rank 1 kills itself after this step")
    ap.add_argument("--cancel-at", type=int, default=0, help="rank 1 asks for a cancel after this step")
    args = ap.parse_args(argv)
    par = distributed.activate(torch.device("cpu"), timeout_s=float(os.environ.get("TEST_DIST_TIMEOUT", 60)))
    net = ToyNet(DIM)
    if par.rank:  # a different LoRA init on rank 1: the loop's broadcast from rank 0 must undo it
        with torch.no_grad():
            net.lora.down.add_(1.0)

    def save(state, reason):
        return save_state(os.path.join(args.out, f"ck_{state.step:03d}.trainstate"), state)

    def on_step(report):
        if args.die_at and par.rank == 1 and report.step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.cancel_at and par.rank == 1 and report.step == args.cancel_at:
            distributed.request_cancel()  # what the runner's Ctrl-C handler does
        return None

    try:
        result = train(net.lora, _data(), toy_fns(net), _settings(checkpoint_every=args.checkpoint_every),
                       steps=args.steps, seed=5, hooks=Hooks(on_step=on_step, save_checkpoint=save))
        save_state(os.path.join(args.out, f"final_rank{par.rank}.trainstate"), result.state)
        with open(os.path.join(args.out, f"reason_rank{par.rank}.txt"), "w") as f:
            f.write(result.reason)
    finally:
        distributed.deactivate()


# ---- the tests ----

def _torchrun(out: str, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, "--out", out, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _free_port() -> int:
    from ports import free_port

    return free_port()


def _one_process(steps: int, state=None):
    net = ToyNet(DIM, seed=0)
    return train(net.lora, _data(), toy_fns(net), _settings(), steps=steps, seed=5, state=state).state


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist"))
    proc = _torchrun(out, "--steps", "6", "--checkpoint-every", "3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_rows_split_every_row_once_in_order() -> None:
    for n in range(0, 9):
        for world in (1, 2, 3, 4):
            rows = [list(range(n))[distributed.DataParallel(r, world).rows(n)] for r in range(world)]
            assert sum(rows, []) == list(range(n)), (n, world)
            assert max(map(len, rows)) - min(map(len, rows)) <= 1


def test_buckets_keep_order_and_respect_the_limit() -> None:
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64), torch.zeros(1)]
    buckets = distributed._buckets(ts, limit=80)  # 80 bytes = 20 fp32 values
    assert [[t.numel() for t in b] for b in buckets] == [[10, 10], [30], [5], [1]]
    assert [t for b in buckets for t in b] == ts


def test_one_rank_group_equals_no_group_bitwise(tmp_path) -> None:
    """world=1 runs every collective (broadcast, bucketed reduce, agreed requests) as an identity."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        par = distributed.DataParallel(rank=0, world=1, bucket_bytes=64)  # several buckets
        net = ToyNet(DIM)
        got = train(net.lora, _data(), toy_fns(net), _settings(), steps=4, seed=5, parallel=par).state
    finally:
        dist.destroy_process_group()
    ref = _one_process(4)
    assert _losses(got) == _losses(ref)
    for name, value in ref.lora.items():
        assert torch.equal(value, got.lora[name]), name


@pytest.mark.slow
def test_two_ranks_equal_one_process_of_the_same_global_batch(two_ranks) -> None:
    rank0 = load_state(os.path.join(two_ranks, "final_rank0.trainstate"))
    rank1 = load_state(os.path.join(two_ranks, "final_rank1.trainstate"))
    ref = _one_process(6)
    # The ranks agree exactly with each other (same reduced gradient, same optimizer, same generators) ...
    assert _losses(rank0) == _losses(rank1)
    assert torch.equal(rank0.generator, rank1.generator)
    for name in rank0.lora:
        assert torch.equal(rank0.lora[name], rank1.lora[name]), name
    # ... and with one process within fp32 rounding (see the module docstring).
    assert _losses(rank0) == pytest.approx(_losses(ref), rel=RTOL)
    assert [p["dop"] is None for p in rank0.history] == [p["dop"] is None for p in ref.history]
    assert torch.equal(rank0.generator, ref.generator)  # the same randomness was drawn
    # The held-out validation loss: every rank measures the same curve, and one process measures it too.
    assert _validation(rank0) == _validation(rank1) and [s for s, _ in _validation(rank0)] == [2, 4, 6]
    assert [v for _, v in _validation(rank0)] == pytest.approx([v for _, v in _validation(ref)], rel=RTOL)
    for name, value in ref.lora.items():
        torch.testing.assert_close(rank0.lora[name], value, rtol=0, atol=ATOL)
    assert float(ref.lora["up"].abs().max()) > 1e-2  # it trained: the comparison is not between zeros
    # Only rank 0 wrote checkpoints.
    assert sorted(f for f in os.listdir(two_ranks) if f.startswith("ck_")) == ["ck_003.trainstate", "ck_006.trainstate"]


@pytest.mark.slow
def test_a_two_rank_checkpoint_continues_in_one_process(two_ranks) -> None:
    ck = load_state(os.path.join(two_ranks, "ck_003.trainstate"))
    two = load_state(os.path.join(two_ranks, "final_rank0.trainstate"))
    resumed = _one_process(3, state=ck)
    resumed_again = _one_process(3, state=load_state(os.path.join(two_ranks, "ck_003.trainstate")))
    assert _losses(resumed) == _losses(resumed_again)  # a continuation is deterministic
    assert _losses(resumed)[:3] == _losses(two)[:3]  # the history carries over
    assert _losses(resumed)[3:] == pytest.approx(_losses(two)[3:], rel=RTOL)
    assert _losses(resumed) == pytest.approx(_losses(_one_process(6)), rel=RTOL)


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_and_leaves_the_last_checkpoint_intact(tmp_path) -> None:
    out = str(tmp_path)
    start = time.monotonic()
    proc = _torchrun(out, "--steps", "8", "--checkpoint-every", "2", "--die-at", "5",
                     env={"TEST_DIST_TIMEOUT": "20"})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "Signals.SIGKILL" in text or "exitcode  : -9" in text, text[-3000:]  # torchrun names the dead rank
    assert elapsed < 120, f"the surviving rank hung for {elapsed:.0f}s"
    assert not os.path.exists(os.path.join(out, "final_rank0.trainstate"))
    written = sorted(f for f in os.listdir(out) if f.startswith("ck_"))
    assert written == ["ck_002.trainstate", "ck_004.trainstate"], written  # no half-written step-6 file either
    last = load_state(os.path.join(out, written[-1]))
    assert last.step == 4
    assert _losses(_one_process(4, state=last)) == pytest.approx(_losses(_one_process(8)), rel=RTOL)


@pytest.mark.slow
def test_a_cancel_on_one_rank_ends_every_rank_at_the_same_step_with_a_checkpoint(tmp_path) -> None:
    out = str(tmp_path)
    proc = _torchrun(out, "--steps", "8", "--cancel-at", "3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert open(os.path.join(out, f"reason_rank{rank}.txt")).read() == "interrupt"
        assert load_state(os.path.join(out, f"final_rank{rank}.trainstate")).step == 3
    assert sorted(f for f in os.listdir(out) if f.startswith("ck_")) == ["ck_003.trainstate"]  # rank 0's only


def test_torchrun_is_available() -> None:
    """The slow tests start ranks with ``python -m torch.distributed.run`` (torchrun), shipped with torch."""
    assert shutil.which("torchrun") or __import__("importlib").util.find_spec("torch.distributed.run")


if __name__ == "__main__":
    worker(sys.argv[1:])
