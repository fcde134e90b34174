"""fp32 master weights for LoRA parameters stored in a low-precision dtype (``param_dtype="bf16"``).

The optimizer updates fp32 copies; after each step the copies are written back to the bf16 parameters
with stochastic rounding, so updates below bf16's resolution still move the parameters on average.
"""
from __future__ import annotations

from typing import Iterator

import torch


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, gen: torch.Generator) -> None:
    """dst (bf16) <- src (fp32) rounded stochastically: unbiased, E[dst] = src. Noise drawn on CPU."""
    bits = src.detach().float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=gen, dtype=torch.int32).to(bits.device)
    rounded = ((bits + noise) & -65536).view(torch.float32)  # -65536 == 0xFFFF0000: keep the top 16 bits
    dst.copy_(torch.where(torch.isfinite(src), rounded, src.float()).to(dst.dtype))


class MasterWeights:
    """fp32 copies of low-precision trainable parameters; the optimizer updates the copies.

    ``groups`` are rewritten so fp32 parameters stay as they are and each bf16/fp16 parameter is replaced
    by its fp32 master. After ``backward`` call ``pull_grads``; after ``optimizer.step`` call ``push``,
    which writes masters back with stochastic rounding from ``gen`` (part of the saved RNG state).
    """

    def __init__(self, groups: list[dict], gen: torch.Generator) -> None:
        self.gen = gen
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        for g in groups:
            params = []
            for p in g["params"]:
                if p.dtype == torch.float32:
                    params.append(p)
                    continue
                master = torch.nn.Parameter(p.detach().float().clone())
                self.pairs.append((p, master))
                params.append(master)
            g["params"] = params

    def pull_grads(self) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def push(self) -> None:
        with torch.no_grad():
            for p, m in self.pairs:
                stochastic_round_(p, m, self.gen)

    def masters(self) -> Iterator[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(low-precision parameter, its fp32 master) pairs."""
        return iter(self.pairs)
