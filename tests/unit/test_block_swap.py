"""Block swap (training.swap) on a pure-torch toy: bit-identical gradients, host->slot loads only, a fixed ring.

The ComfyUI-level tests (tiny Flux and Cosmos through the training node, chaining, resume, the settings
error) are tests/comfy/test_block_swap.py.
"""
from __future__ import annotations

import torch
from torch import nn

from lora.config import LoRAConfig
from lora.layer import LoRASet
from training.grad import checkpoint_blocks
from training.swap import ALIGN, frozen_params, swap_blocks

N = 5


class Block(nn.Module):
    def __init__(self, width: int, adapter) -> None:
        super().__init__()
        self.lin, self.norm, self.adapter = nn.Linear(width, width), nn.LayerNorm(width), adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.adapter.forward_with_base(self.norm(x), self.lin.weight, self.lin.bias))


def _toy(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    lora = LoRASet(LoRAConfig(rank=4, alpha=4, dropout=0.2, seed=5), {f"b{i}": (24, 24) for i in range(N)})
    blocks = nn.ModuleList(Block(24, a) for a in lora.adapters().values())
    for b in blocks:
        b.lin.requires_grad_(False)
        b.norm.requires_grad_(False)
        b.lin.to(dtype)
    with torch.no_grad():
        for a in lora.adapters().values():
            a.up.normal_()
    lora.train(True)
    return lora, blocks


def _steps(swapped: int, dtype: torch.dtype = torch.float32, steps: int = 3, offload: bool = False):
    """Three SGD steps; returns (losses, final LoRA values, swap loads, frozen weights after). ``offload``:
    the checkpointed blocks' inputs wait for backward in host memory (``offload_block_inputs``)."""
    lora, blocks = _toy(dtype)
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(1))
    params = list(lora.parameters())
    losses, loads = [], 0
    with swap_blocks(list(blocks)[:swapped], torch.device("cpu")) as swap, \
            checkpoint_blocks(list(blocks)[:-1], in_place_adds=False, rng=lora.rng, offload_inputs=offload):
        for _ in range(steps):
            h = x
            for b in blocks:
                h = b(h.to(dtype)).float()
            loss = h.square().mean()
            loss.backward()  # reentrant checkpointing supports backward(), not autograd.grad
            with torch.no_grad():
                for p in params:
                    p.sub_(0.1 * p.grad)
                    p.grad = None
            losses.append(loss.item())
        loads = swap.loads
    frozen = {f"{i}.{n}": p.detach().clone() for i, b in enumerate(blocks) for n, p in b.named_parameters()
              if not p.requires_grad}
    return losses, {k: v.detach().clone() for k, v in lora.state_dict().items()}, loads, frozen


def test_swap_on_equals_swap_off_bit_for_bit():
    ref_losses, ref_lora, _, ref_frozen = _steps(0)
    for swapped in (1, 2, N - 1):
        losses, lora, loads, frozen = _steps(swapped)
        assert losses == ref_losses, swapped
        assert all(torch.equal(lora[k], ref_lora[k]) for k in ref_lora), swapped
        # the base is only ever read: every frozen weight is unchanged after the run
        assert all(torch.equal(frozen[k], ref_frozen[k]) for k in ref_frozen), swapped
        assert loads > 0


def test_swap_with_the_block_inputs_in_host_memory_equals_neither_bit_for_bit():
    """The planner's plans combine both (checkpointing, block inputs in host memory, N blocks swapped)."""
    ref_losses, ref_lora, _, _ = _steps(0)
    losses, lora, loads, _ = _steps(2, offload=True)
    assert losses == ref_losses and loads > 0
    assert all(torch.equal(lora[k], ref_lora[k]) for k in ref_lora)


def test_bf16_base_streams_bit_for_bit():
    ref_losses, ref_lora, _, _ = _steps(0, torch.bfloat16, steps=2)
    losses, lora, _, _ = _steps(N - 1, torch.bfloat16, steps=2)
    assert losses == ref_losses and all(torch.equal(lora[k], ref_lora[k]) for k in ref_lora)


def test_one_packed_buffer_per_block_a_ring_of_two_slots_and_the_lora_stays_put():
    lora, blocks = _toy()
    lora_storages = {p.data_ptr() for p in lora.parameters()}
    with swap_blocks(list(blocks)[:3], torch.device("cpu")) as swap:
        assert len(swap.packed) == 3 and len(swap.slots) == 2
        # each block's frozen weights live in its one host buffer, at aligned offsets
        for packed, block in zip(swap.packed, blocks):
            base = packed.host.data_ptr()
            ptrs = sorted(p.data_ptr() - base for p in frozen_params(block))
            assert all(0 <= off < packed.host.numel() and off % ALIGN == 0 for off in ptrs)
        slot_ptrs = [s.data_ptr() for s in swap.slots]
        x = torch.randn(2, 24)
        with torch.no_grad():
            for b in blocks:
                x = b(x)
        # the ring was allocated once: the same two buffers after a pass over every block
        assert [s.data_ptr() for s in swap.slots] == slot_ptrs
        # block 2 ran last of the swapped ones: its weights are views into slot 2 % 2 = 0
        w = blocks[2].lin.weight
        assert swap.slots[0].data_ptr() <= w.data_ptr() < swap.slots[0].data_ptr() + swap.slots[0].numel()
        assert {p.data_ptr() for p in lora.parameters()} == lora_storages
    assert not any("forward" in b.__dict__ for b in blocks)
    hosts = [p.host for p in swap.packed]
    w = blocks[2].lin.weight  # after exit: a host view again
    assert hosts[2].data_ptr() <= w.data_ptr() < hosts[2].data_ptr() + hosts[2].numel()


def test_swapped_blocks_load_once_per_pass_with_prefetch():
    """Forward 0..4 then the recomputation 3..0 (checkpointed): each block is copied in once per direction,
    and the turnaround block and its neighbour are still resident (no copy)."""
    lora, blocks = _toy()
    x = torch.randn(2, 24)
    with swap_blocks(list(blocks)[:4], torch.device("cpu")) as swap, \
            checkpoint_blocks(list(blocks)[:-1], in_place_adds=False, rng=lora.rng):
        h = blocks[0](x)
        assert swap.holds == [0, 1]  # block 1 was queued while block 0 computed
        for b in list(blocks)[1:]:
            h = b(h)
        assert swap.loads == 4
        h.square().mean().backward()
        assert swap.loads == 4 + 2  # blocks 3 and 2 were still in the ring; 1 and 0 were copied again
