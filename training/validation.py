"""Held-out validation loss: is the LoRA learning the data, or only its training samples?

Train Settings' ``validate_every_n_steps`` (0 = off) measures, after every N-th optimizer step, the denoising
loss of samples the run does not train on: a validation set given to Train LoRA (``validation_latents`` +
``validation_conditioning``), or ``validation_fraction`` of the training samples held out, chosen by the run's
seed (``held_out``). Each pass is deterministic, so two runs with the same settings, a run resumed halfway and
a chained run give the same curve: the LoRA in eval mode (no dropout), no gradients, and for each sample the
timesteps ``VALIDATION_U`` (fractions of the noise schedule, through the model's own ``sigma_of_u``) with noise
drawn from a generator seeded by the sample's index alone, never from the run's generator (the training draws
are the same with validation on or off). The loss is the run's own (``loop.denoising_loss``, with its loss
weighting), averaged over samples and timesteps. Cost: one forward of ``len(VALIDATION_U)`` rows per validation
sample per pass. Pure torch, no ComfyUI.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .masks import cell_weights

VALIDATION_U = (0.2, 0.4, 0.6, 0.8)
NOISE_SEED = 0x5EED_0000  # + the sample's index: the validation noise of sample i


def held_out(data: Sequence[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(training samples, held-out samples): ``round(fraction x n)`` of ``data`` (at least 1 when fraction > 0),
    chosen by ``seed``; both keep the data's order. ValueError when nothing would be left to train on."""
    n = len(data)
    if fraction <= 0:
        return list(data), []
    k = max(1, round(fraction * n))
    if k >= n:
        raise ValueError(f"validation_fraction={fraction:g} holds out {k} of the {n} training samples, leaving none "
                         "to train on; give more samples, a smaller validation_fraction, or a validation set")
    picked = set(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()[:k])
    return [d for i, d in enumerate(data) if i not in picked], [d for i, d in enumerate(data) if i in picked]


@torch.no_grad()
def validation_loss(module: torch.nn.Module, samples: Sequence[Any], fns: Any, weighting: str,
                    loss: Callable[..., tuple[torch.Tensor, torch.Tensor]], unmasked_weight: float = 0.0) -> float:
    """The mean denoising loss of ``samples`` (``loop.Sample``) at ``VALIDATION_U`` with fixed noise (module
    docstring); ``fns``: the run's ``loop.ModelFns``; ``loss``: the run's (``loop.denoising_loss``); a masked
    sample's loss is masked as in training (``training.masks``)."""
    was = module.training
    module.train(False)
    try:
        total = 0.0
        for i, sample in enumerate(samples):
            rows = len(VALIDATION_U)
            x0 = sample.latent.unsqueeze(0).expand(rows, *sample.latent.shape).to(fns.device, torch.float32)
            gen = torch.Generator().manual_seed(NOISE_SEED + i)
            noise = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(fns.device)
            u = torch.tensor(VALIDATION_U, dtype=torch.float64)
            cells = cell_weights([sample.mask] * rows, unmasked_weight, x0)
            value, _ = loss(fns, fns.predict, x0, noise, u, fns.sigma_of_u(u), fns.collate([sample.cond] * rows),
                            weighting, cells)
            total += float(value)
        return total / max(1, len(samples))
    finally:
        module.train(was)
