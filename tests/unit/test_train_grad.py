"""Block checkpointing (training.grad) on a pure-torch toy: same gradients as without it, LoRA dropout included."""
from __future__ import annotations

import torch
from torch import nn

from training.grad import checkpoint_blocks
from lora.config import LoRAConfig
from lora.layer import LoRASet


class Block(nn.Module):
    def __init__(self, lin: nn.Linear, adapter) -> None:
        super().__init__()
        self.lin, self.adapter = lin, adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.adapter.forward_with_base(x, self.lin.weight, self.lin.bias))


def _toy(dropout: float):
    torch.manual_seed(0)
    lins = [nn.Linear(16, 16) for _ in range(3)]
    for lin in lins:
        lin.requires_grad_(False)
    lora = LoRASet(LoRAConfig(rank=4, alpha=4, dropout=dropout, rank_dropout=dropout, seed=5),
                   {f"b{i}": (16, 16) for i in range(3)})
    with torch.no_grad():
        for a in lora.adapters().values():
            a.up.normal_()
    blocks = nn.ModuleList(Block(lin, a) for lin, a in zip(lins, lora.adapters().values()))
    lora.train(True)
    return lora, blocks


def _grads_and_next_mask(checkpointed: bool, dropout: float):
    lora, blocks = _toy(dropout)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with checkpoint_blocks(list(blocks) if checkpointed else [], in_place_adds=False,
                           rng=lora.rng):
        h = x
        for b in blocks:
            h = b(h)
        h.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in lora.named_parameters()}
    # the dropout stream continues as if no block had been recomputed (chaining stays exact)
    after = lora.adapters()["b0"].delta_fp32(x)
    return grads, after


def test_checkpointed_gradients_equal_plain_ones_with_lora_dropout():
    plain, plain_next = _grads_and_next_mask(False, dropout=0.5)
    ckpt, ckpt_next = _grads_and_next_mask(True, dropout=0.5)
    assert plain.keys() == ckpt.keys()
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(ckpt_next, plain_next, rtol=0, atol=0)


class InPlaceBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # adds its residual in place, as Flux's blocks do
        x += torch.tanh(self.adapter.forward_with_base(x, self.lin.weight, self.lin.bias))
        return x


def _offload_grads(offload: bool, in_place: bool, monkeypatch):
    import training.grad as g

    lora, blocks = _toy(dropout=0.25)
    if in_place:
        blocks = nn.ModuleList(InPlaceBlock(b.lin, b.adapter) for b in blocks)
    made: list = []
    pack = g._to_host
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    with monkeypatch.context() as mp, \
            checkpoint_blocks(list(blocks)[:-1], in_place_adds=in_place, rng=lora.rng, offload_inputs=offload):
        mp.setattr(g, "_to_host", lambda t: made.append(pack(t)) or made[-1])
        h = x * 1.0
        for b in blocks:
            h = b(h)
        h.pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in lora.named_parameters()}, x.grad.clone(), made


def test_offloaded_block_inputs_give_bit_identical_gradients(monkeypatch):
    """``offload_inputs``: the kept block inputs wait for backward in host memory (on this CPU a host copy,
    so the path runs); LoRA and input gradients equal the kept-on-device run bit for bit."""
    import training.grad as g

    for in_place in (False, True):
        kept, kept_x, none = _offload_grads(False, in_place, monkeypatch)
        moved, moved_x, made = _offload_grads(True, in_place, monkeypatch)
        assert none == [] and len(made) == 2, made  # two checkpointed blocks, one input each
        assert all(isinstance(m, g._OnHost) and m.host is not None for m in made)
        assert torch.equal(kept_x, moved_x)
        for name in kept:
            assert torch.equal(kept[name], moved[name]), name
        assert any(v.abs().sum() > 0 for v in moved.values())
