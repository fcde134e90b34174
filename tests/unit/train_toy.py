"""A toy rectified-flow model with a LoRA-like trainable set, for the loop's unit tests (no ComfyUI)."""
from __future__ import annotations

import torch
from torch import nn

from training.loop import ModelFns, Sample


class ToyLoRA(nn.Module):
    """down (r x d) random, up (d x r) zero: identity at init like a real LoRA; LoRA+ groups."""

    def __init__(self, dim: int, rank: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.down = nn.Parameter((torch.randn(rank, dim, generator=g) / dim**0.5).to(dtype))
        self.up = nn.Parameter(torch.zeros(dim, rank, dtype=dtype))
        self.multiplier = 1.0

    def delta(self, h: torch.Tensor) -> torch.Tensor:
        return (h.float() @ self.down.float().T @ self.up.float().T) * self.multiplier

    def param_groups(self, lr: float, loraplus_ratio: float = 1.0) -> list[dict]:
        return [{"params": [self.down], "lr": lr, "name": "lora_down"},
                {"params": [self.up], "lr": lr * loraplus_ratio, "name": "lora_up"}]


class ToyNet(nn.Module):
    """Linear toy: velocity = W2 h + lora(h), h = W1 [x, sigma, cond]; frozen base weights, full-rank LoRA."""

    def __init__(self, dim: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + 100)
        self.w1 = nn.Parameter(torch.randn(dim, dim + 2, generator=g) / dim**0.5, requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(dim, dim, generator=g) / dim**0.5, requires_grad=False)
        self.lora = ToyLoRA(dim, seed=seed)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        flat = x.reshape(b, -1)
        h = torch.cat([flat, sigma.view(b, 1).float(), cond.view(b, 1)], dim=1) @ self.w1.T
        return (h @ self.w2.T + self.lora.delta(h)).reshape(x.shape)


def toy_fns(net: ToyNet, nan_at: set[int] | None = None) -> ModelFns:
    calls = {"n": 0}

    def predict(x_t: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        out = net(x_t, sigma, cond)
        if nan_at and calls["n"] in nan_at:
            out = out * float("nan")
        return out

    def predict_base(x_t: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        old = net.lora.multiplier
        net.lora.multiplier = 0.0
        try:
            return net(x_t, sigma, cond)
        finally:
            net.lora.multiplier = old

    return ModelFns(
        predict=predict,
        predict_base=predict_base,
        sigma_of_u=lambda u: u.float(),
        noise_latent=lambda s, n, x0: (1 - s.view(-1, *[1] * (x0.ndim - 1))) * x0 + s.view(-1, *[1] * (x0.ndim - 1)) * n,
        target=lambda s, n, x0: n - x0,
        collate=lambda conds: torch.stack(conds),
    )


def toy_data(n: int = 1, dim: int = 8, seed: int = 1, class_cond: bool = False) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(latent=torch.randn(dim, generator=g), cond=torch.tensor(float(i)),
                   class_cond=torch.tensor(-1.0) if class_cond else None) for i in range(n)]
