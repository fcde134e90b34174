"""Masked loss (training/masks.py, Train Settings' unmasked_weight, Sample.mask): masks reach the latent grid as
the share of masked pixels under each cell, the loss outside a mask has no gradient at unmasked_weight 0, and on a
model that predicts each latent cell from that cell alone, latents that differ only outside the mask train the same
LoRA bit for bit (with attention, the model reads the whole latent: see training/masks.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training.loop import ModelFns, Sample, train  # noqa: E402
from training.masks import cell_weights, to_grid  # noqa: E402
from training.sampling import weighted_mse  # noqa: E402
from training.settings import TrainSettings  # noqa: E402

C, H, W = 4, 6, 8


def test_masks_reach_the_latent_grid_as_covered_shares():
    mask = torch.zeros(48, 64)
    mask[:, :32] = 1.0   # the left half
    mask[:8, 32:40] = 1.0  # one cell of the right half
    grid = to_grid(mask, (C, H, W))
    assert grid.shape == (1, H, W) and torch.equal(grid[0, :, :4], torch.ones(H, 4))
    assert grid[0, 0, 4] == 1.0 and float(grid[0, 1:, 4:].sum()) == 0.0
    half = torch.zeros(48, 64)
    half[:4, :] = 1.0  # half of the first row of cells
    assert torch.allclose(to_grid(half, (C, H, W))[0, 0], torch.full((W,), 0.5))
    assert to_grid(mask, (C, 3, H, W)).shape == (1, 1, H, W)  # video: every frame
    with pytest.raises(ValueError, match=r"a 64x64 mask does not match a 8x6 latent \(an image of about 64x48 px\)"):
        to_grid(torch.ones(64, 64), (C, H, W))


def test_the_loss_outside_the_mask_has_no_gradient_at_weight_zero():
    pred = torch.randn(2, C, H, W, requires_grad=True)
    target = torch.randn(2, C, H, W)
    m = torch.zeros(1, H, W)
    m[:, :3] = 1.0
    for weight in (0.0, 0.25):
        pred.grad = None
        weighted_mse(pred, target, torch.ones(2), cell_weights([m, None], weight, pred)).backward()
        outside = pred.grad[0, :, 3:]
        assert bool((outside == 0).all()) == (weight == 0.0)
        assert bool((pred.grad[0, :, :3] != 0).all()) and bool((pred.grad[1] != 0).all())  # sample 1: no mask
    ones = cell_weights([torch.ones(1, H, W)] * 2, 0.0, pred)
    torch.testing.assert_close(weighted_mse(pred, target, torch.ones(2), ones), weighted_mse(pred, target, torch.ones(2)))


class CellLoRA(nn.Module):
    """A LoRA on a 1x1 convolution: each latent cell's prediction depends on that cell (and sigma) alone."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.base = nn.Parameter(torch.randn(C, C + 1, generator=g) / 2, requires_grad=False)
        self.down = nn.Parameter(torch.randn(2, C + 1, generator=g) / 2)
        self.up = nn.Parameter(torch.randn(C, 2, generator=g) / 10)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        cells = torch.cat([x, sigma.float().view(b, 1, 1, 1).expand(b, 1, *x.shape[2:])], 1).movedim(1, -1)
        return (cells @ self.base.T + cells @ self.down.T @ self.up.T).movedim(-1, 1)


def _fns(lora: CellLoRA) -> ModelFns:
    expand = lambda s, x: s.view(-1, *[1] * (x.ndim - 1))  # noqa: E731
    return ModelFns(predict=lambda x, s, c: lora(x, s), predict_base=None, sigma_of_u=lambda u: u.float(),
                    noise_latent=lambda s, n, x0: (1 - expand(s, x0)) * x0 + expand(s, x0) * n,
                    target=lambda s, n, x0: n - x0, collate=lambda conds: conds)


def _train(latents: list[torch.Tensor], masks: list, weight: float) -> CellLoRA:
    lora = CellLoRA()
    data = [Sample(latent=x, cond=None, mask=m) for x, m in zip(latents, masks)]
    train(lora, data, _fns(lora), TrainSettings(learning_rate=1e-2, batch_size=2, unmasked_weight=weight,
                                                learning_guard="off"), steps=6, seed=3)
    return lora


def test_latents_that_differ_only_outside_the_mask_train_the_same_lora_at_weight_zero():
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(C, H, W, generator=g) for _ in range(2)]
    mask = torch.zeros(H * 8, W * 8)
    mask[8:40, 16:48] = 1.0
    grid = to_grid(mask, (C, H, W))
    b = [x + (1 - grid) * torch.randn(C, H, W, generator=g) * 3 for x in a]  # other pixels outside the mask only
    assert not torch.equal(a[0], b[0])
    for weight, same in ((0.0, True), (0.5, False)):
        la, lb = _train(a, [grid, grid], weight), _train(b, [grid, grid], weight)
        assert (torch.equal(la.up, lb.up) and torch.equal(la.down, lb.down)) == same, weight
    plain = _train(a, [None, None], 0.0)
    assert not torch.equal(plain.up, _train(a, [grid, grid], 0.0).up)  # the mask changed what trained


def test_masks_that_train_nothing_and_weights_without_masks_are_refused():
    x = [torch.zeros(C, H, W)]
    with pytest.raises(ValueError, match=r"the mask of sample 1 covers no pixel and unmasked_weight is 0"):
        _train(x, [torch.zeros(1, H, W)], 0.0)
    with pytest.raises(ValueError, match=r"unmasked_weight=0.3 weighs the latent outside the samples' masks, but no "
                                         r"sample has a mask"):
        _train(x, [None], 0.3)
    with pytest.raises(ValueError, match=r"TrainSettings.unmasked_weight=1.5: must be in \[0, 1\]"):
        TrainSettings(unmasked_weight=1.5)
