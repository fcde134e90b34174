"""Data-parallel training with LoRA dropout: 2 gloo ranks under torchrun equal one process.

Each rank draws every dropout mask (element, rank and module dropout) for the whole global batch, from the
same generator state as one process, and applies its own rows (``lora.lowrank.DropoutRNG.global_rows``); a
rank that gets no row of a small group takes the dropout generators from the last rank. So the ranks use
exactly the masks of one process and the comparison has the tolerance of ``test_distributed.py`` (rtol
1e-5 on the losses, atol 1e-5 on the LoRA; the only difference left is the order of the fp32 sums of the
gradient, see that file).

Measured with this file's model, data and settings (6 steps, plain and checkpointed alike): now the losses
differ from one process by <= 8e-8 relative and the LoRA by <= 1.5e-7 absolute, and both ranks' dropout
generators end bit-equal to one process's. Before this change each rank drew masks for its own rows only:
the losses differed by 4.6e-2 relative at the first step (up to 2.5e-1) and the LoRA by 1.1e-1, and
neither rank's dropout generator matched, so ``test_two_ranks_with_lora_dropout_equal_one_process`` fails
on its generator and loss assertions. With the global masks but without the catch-up of a rank left
without rows (the groups of 1 here), rank 0's generator diverges and the losses differ by 5.6e-2.

The same file is the worker ``torchrun`` starts (``__main__`` below), as in ``test_distributed.py``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if __name__ == "__main__":  # under torchrun: make the pure packages importable as the tests do
    sys.path[:0] = [os.path.join(ROOT, "scripts"), HERE]
    import pure_packages

    pure_packages.install()
from lora.config import LoRAConfig  # noqa: E402
from lora.layer import LoRASet  # noqa: E402
from lora.lowrank import DropoutRNG, lora_linear  # noqa: E402
from training import distributed  # noqa: E402
from training.checkpoint import load_state, save_state  # noqa: E402
from training.grad import checkpoint_blocks  # noqa: E402
from training.loop import ModelFns, Sample, train  # noqa: E402
from training.settings import TrainSettings  # noqa: E402

DIM, TOKENS = 8, 3
RTOL, ATOL = 1e-5, 1e-5  # the tolerance of test_distributed.py, for the same reason
# Global batch 4 of 6 samples in 3 groups (one forward per group): groups of 1 leave rank 0 without rows.
SETTINGS = dict(learning_rate=2e-2, lr_schedule="cosine", warmup_steps=2, schedule_steps=12, batch_size=4,
                grad_accum=2, max_grad_norm=0.5, timestep_sampling="logit_normal", dop_multiplier=0.5,
                dop_every_n=2)
LORA = LoRAConfig(rank=4, alpha=4.0, dropout=0.3, rank_dropout=0.25, module_dropout=0.2, seed=7,
                  targets="all")
NO_DROPOUT = LoRAConfig(**{**LORA.to_dict(), "dropout": 0.0, "rank_dropout": 0.0, "module_dropout": 0.0})


class Block(nn.Module):
    """x + gelu(lora(W x)) on (b, tokens, dim) and, flattened, on (b * tokens, dim)."""

    def __init__(self, lora: LoRASet, i: int, g: torch.Generator) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(DIM, DIM, generator=g) / DIM**0.5, requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(DIM, DIM, generator=g) / DIM**0.5, requires_grad=False)
        self.a1, self.a2 = lora.adapters()[f"b{i}.w1"], lora.adapters()[f"b{i}.w2"]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b = h.shape[0]
        z = F.gelu(lora_linear(h, self.w1, None, (self.a1,)))  # (b, tokens, dim)
        return h + lora_linear(z.reshape(b * TOKENS, DIM), self.w2, None, (self.a2,)).reshape(b, TOKENS, DIM)


class DropNet(nn.Module):
    """A modulation linear on (b, dim) and two checkpointable blocks, every linear with a LoRA adapter."""

    def __init__(self, config: LoRAConfig = LORA) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(100)
        shapes = {"vec": (4, DIM), **{f"b{i}.w{j}": (DIM, DIM) for i in range(2) for j in (1, 2)}}
        self.lora = LoRASet(config, shapes)
        with torch.no_grad():  # a non-zero start so the first step's loss already depends on the masks
            for a in self.lora.adapters().values():
                a.up.normal_(0.0, 0.3, generator=g)
            for a in self.lora.adapters().values():
                a.mark_modified()
        self.wv = nn.Parameter(torch.randn(DIM, 4, generator=g) / 2, requires_grad=False)
        self.blocks = nn.ModuleList(Block(self.lora, i, g) for i in range(2))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        s, c = sigma.float(), cond.float()
        vec = lora_linear(torch.stack([s, c, s * c, 1 - s], dim=1), self.wv, None,
                          (self.lora.adapters()["vec"],))  # (b, dim)
        h = x + F.silu(vec)[:, None, :]
        for block in self.blocks:
            h = block(h)
        return h


def drop_fns(net: DropNet) -> ModelFns:
    def predict_base(x_t, sigma, cond):  # as the node glue: multiplier 0, the dropouts still draw
        net.lora.set_multiplier(0.0)
        try:
            return net(x_t, sigma, cond)
        finally:
            net.lora.set_multiplier(1.0)

    expand = lambda s, x0: s.view(-1, *[1] * (x0.ndim - 1))  # noqa: E731
    return ModelFns(predict=net, predict_base=predict_base, sigma_of_u=lambda u: u.float(),
                    noise_latent=lambda s, n, x0: (1 - expand(s, x0)) * x0 + expand(s, x0) * n,
                    target=lambda s, n, x0: n - x0, collate=lambda conds: torch.stack(conds))


def drop_data() -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    return [Sample(latent=torch.randn(TOKENS, DIM, generator=g), cond=torch.tensor(float(i)), group=i % 3,
                   class_cond=torch.tensor(-1.0)) for i in range(6)]


def run(steps: int, checkpointed: bool, state=None, parallel=None, config: LoRAConfig = LORA):
    net = DropNet(config)
    blocks = list(net.blocks) if checkpointed else []
    with checkpoint_blocks(blocks, in_place_adds=False, rng=net.lora.rng):
        return train(net.lora, drop_data(), drop_fns(net), TrainSettings(**SETTINGS), steps=steps, seed=5,
                     state=state, parallel=parallel).state


def _losses(state) -> list[float]:
    return [p["loss"] for p in state.history]


# ---- the worker (one per rank) ----

def worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--checkpointed", action="store_true", help="activation checkpointing of the blocks")
    args = ap.parse_args(argv)
    par = distributed.activate(torch.device("cpu"), timeout_s=60.0)
    try:
        state = run(args.steps, args.checkpointed)
        save_state(os.path.join(args.out, f"final_rank{par.rank}.trainstate"), state)
    finally:
        distributed.deactivate()


# ---- the tests ----

def _torchrun(out: str, *args: str) -> subprocess.CompletedProcess:
    from ports import free_port

    port = free_port()  # for the rendezvous
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), __file__, "--out", out, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _mask_of(rng: DropoutRNG, shape: tuple[int, ...], p: float = 0.5) -> torch.Tensor:
    a = LoRASet(LoRAConfig(rank=2, alpha=2.0, dropout=p, seed=rng.seed), {"x": (4, 4)}).adapters()["x"]
    a._rng = rng
    return a._mask(shape, p, torch.zeros(()))


def test_one_process_draws_the_masks_it_always_drew() -> None:
    """Outside a rows context the mask is one bernoulli draw of the input's shape from the seed + 1 stream."""
    rng, gen = DropoutRNG(7), torch.Generator().manual_seed(8)
    for shape in [(4, 3, 8), (12, 8), (8,)]:
        assert torch.equal(_mask_of(rng, shape), torch.empty(shape).bernoulli_(0.5, generator=gen) / 0.5), shape


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_applies_its_rows_of_the_one_process_mask(world: int) -> None:
    """(b, t, d) inputs, (b * t, d) flattened ones and (b, 1, r) rank masks: rows of the global draw, and
    every rank's generator ends where one process's does."""
    b, t = 5, 3
    for shape, per_row in [((b, t, 8), 1), ((b * t, 8), t), ((b, 1, 4), 1)]:
        one = DropoutRNG(3)
        full = _mask_of(one, shape)
        for r in range(world):
            rows = distributed.DataParallel(r, world).rows(b)
            if rows.start == rows.stop:
                continue
            rng = DropoutRNG(3)
            local = (shape[0] * (rows.stop - rows.start) // b, *shape[1:])
            with rng.global_rows(rows.start, rows.stop, b):
                got = _mask_of(rng, local)
            assert torch.equal(got, full[rows.start * per_row:rows.stop * per_row]), (shape, r)
            assert torch.equal(rng.get_state()["cpu"], one.get_state()["cpu"]), (shape, r)


def test_inputs_that_do_not_scale_with_the_batch_draw_as_one_process() -> None:
    one, rank = DropoutRNG(3), DropoutRNG(3)
    want = _mask_of(one, (1, 3, 8))  # a tensor shared by the batch: (1, ...) on every rank
    with rank.global_rows(2, 4, 4):
        assert torch.equal(_mask_of(rank, (1, 3, 8)), want)
    with pytest.raises(ValueError, match="start < stop"):
        with rank.global_rows(2, 2, 4):
            pass


def test_a_one_rank_group_equals_no_group_bitwise(tmp_path) -> None:
    """world=1: the rows context covers the whole batch, so the run is today's one-process run bit for bit."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = run(3, False, parallel=distributed.DataParallel(rank=0, world=1))
    finally:
        dist.destroy_process_group()
    ref = run(3, False)
    assert _losses(got) == _losses(ref)
    assert torch.equal(got.extra_rng["cpu"], ref.extra_rng["cpu"])
    for name, value in ref.lora.items():
        assert torch.equal(value, got.lora[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_two_ranks_with_lora_dropout_equal_one_process(tmp_path, checkpointed: bool) -> None:
    out = str(tmp_path)
    proc = _torchrun(out, "--steps", "6", *(["--checkpointed"] if checkpointed else []))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0 = load_state(os.path.join(out, "final_rank0.trainstate"))
    rank1 = load_state(os.path.join(out, "final_rank1.trainstate"))
    ref = run(6, checkpointed)
    # The ranks agree exactly with each other, and drew exactly what one process drew ...
    assert _losses(rank0) == _losses(rank1)
    for state in (rank0, rank1):
        assert torch.equal(state.generator, ref.generator)
        assert torch.equal(state.extra_rng["cpu"], ref.extra_rng["cpu"])  # the dropout stream
    for name in rank0.lora:
        assert torch.equal(rank0.lora[name], rank1.lora[name]), name
    # ... so they equal one process within fp32 rounding of the gradient sums.
    assert _losses(rank0) == pytest.approx(_losses(ref), rel=RTOL)
    for name, value in ref.lora.items():
        torch.testing.assert_close(rank0.lora[name], value, rtol=0, atol=ATOL, msg=name)
    # The masks matter: without the dropouts the same run's losses differ far beyond the tolerance.
    plain = run(6, checkpointed, config=NO_DROPOUT)
    assert max(abs(a / b - 1) for a, b in zip(_losses(plain), _losses(ref))) > 1e-2


if __name__ == "__main__":
    worker(sys.argv[1:])
