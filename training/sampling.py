"""Timestep samplers and loss weightings, all defined on the noise fraction ``u`` in (0, 1).

``u`` is where a training sample sits on the model's own noise schedule: ``u = 0`` is the clean latent,
``u = 1`` pure noise. The node glue maps it to the model's sigma with the model's own sampling object,
``sigma = model_sampling.percent_to_sigma(1 - u)``, so the model's schedule and shift are honoured:

- Flux.1 / Flux.2 / SD3 (rectified flow): ``u`` is the unshifted flow time, ``sigma = shift_model(u)``
  (Flux: ``e^1.15 u / (e^1.15 u + 1 - u)``), and ``x_t = (1 - sigma) x0 + sigma * noise``.
- Cosmos-Predict2: the schedule is log-uniform in sigma between sigma_min and sigma_max; the flow time
  is ``sigma / (sigma + 1)``. (Anima, ComfyUI 0.33: rectified flow with shift 3.0, as the first item.)
- eps / v models: ``u`` is the fraction of the model's discrete schedule.

Samplers (z ~ N(0, 1), r ~ U(0, 1), all from an explicit generator):

- ``uniform``: u = r.
- ``logit_normal``: u = sigmoid(mean + std * z) (SD3 / Flux practice; mean 0, std 1 peaks at u = 0.5).
- ``sigmoid``: u = sigmoid(scale * z) (sd-scripts' "sigmoid"; larger scale pushes mass to both ends).
- ``shift``: u = s r / (1 + (s - 1) r), the rectified-flow time shift applied to a uniform draw;
  s > 1 favours high noise, s < 1 low noise, s = 1 is uniform. Applied on top of the model's own shift.
- ``content``: u = r^3, density 1/(3 u^(2/3)), mean 0.25: favours LOW noise (fine detail, texture,
  identity of the content). Note: some trainers use "content" for the opposite end; here the name
  follows this pack's issue and is fixed by the formula.
- ``style``: u = 1 - r^3, mean 0.75: favours HIGH noise (composition, global look).
- ``balanced``: each sample independently is ``content`` or ``style`` with probability 1/2.

Loss weightings (w multiplies each sample's MSE before the batch mean):

- ``none``: w = 1.
- ``bell_shaped``: w(u) = exp(-(u - 0.5)^2 / (2 * 0.25^2)) / Z with Z = the integral of the
  unnormalised bell over [0, 1], so E_{u~U(0,1)}[w] = 1. The normalisation is a constant of the curve,
  never a per-batch mean: dividing by the batch mean would make the weighting a no-op at batch size 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

U_EPS = 1e-4  # keeps u off the schedule's end points (sigma = 0 or infinity)

TIMESTEP_SAMPLERS: dict[str, str] = {
    "uniform": "u ~ U(0,1)",
    "logit_normal": "u = sigmoid(logit_mean + logit_std * z)",
    "sigmoid": "u = sigmoid(sigmoid_scale * z)",
    "shift": "u = s r / (1 + (s - 1) r), r ~ U(0,1); s > 1 favours high noise",
    "content": "u = r^3: favours low noise (mean 0.25)",
    "style": "u = 1 - r^3: favours high noise (mean 0.75)",
    "balanced": "half content, half style (per sample)",
}

LOSS_WEIGHTINGS: dict[str, str] = {
    "none": "w = 1",
    "bell_shaped": "w = exp(-(u-0.5)^2 / (2*0.25^2)) / Z, E_uniform[w] = 1",
}

TARGETS: dict[str, str] = {
    "auto": "velocity for flow-matching models (Flux, Cosmos/Anima, SD3), noise for eps/v models",
    "velocity": "v = noise - x0 (rectified flow; s * noise - x0 where the model scales its noise by s, HiDream O1: 8)",
    "noise": "eps = noise",
}

BELL_CENTER = 0.5
BELL_WIDTH = 0.25


@dataclass(frozen=True)
class Sampler:
    """A timestep sampler by name and the parameters the samplers read (validated by ``TrainSettings``)."""

    name: str
    logit_mean: float
    logit_std: float
    sigmoid_scale: float
    shift: float


def _uniform(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=gen, dtype=torch.float64)


def _normal(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=gen, dtype=torch.float64)


def shift_time(u: torch.Tensor, s: float) -> torch.Tensor:
    """Rectified-flow time shift: s u / (1 + (s - 1) u). Monotone, fixes 0 and 1."""
    return s * u / (1.0 + (s - 1.0) * u)


def _content(n: int, gen: torch.Generator) -> torch.Tensor:
    return _uniform(n, gen) ** 3


def _balanced(n: int, gen: torch.Generator) -> torch.Tensor:
    low = _uniform(n, gen) ** 3
    coin = _uniform(n, gen) < 0.5
    return torch.where(coin, low, 1.0 - low)


def sample_u(sampler: Sampler, n: int, gen: torch.Generator) -> torch.Tensor:
    """Draw ``n`` noise fractions, float64 (n,), in [U_EPS, 1 - U_EPS]. Consumes only ``gen``."""
    name, s = sampler.name, sampler
    draws: dict[str, Callable[[], torch.Tensor]] = {
        "uniform": lambda: _uniform(n, gen),
        "logit_normal": lambda: torch.sigmoid(s.logit_mean + s.logit_std * _normal(n, gen)),
        "sigmoid": lambda: torch.sigmoid(s.sigmoid_scale * _normal(n, gen)),
        "shift": lambda: shift_time(_uniform(n, gen), s.shift),
        "content": lambda: _content(n, gen),
        "style": lambda: 1.0 - _content(n, gen),
        "balanced": lambda: _balanced(n, gen),
    }
    if name not in draws:
        raise ValueError(f"unknown timestep_sampling {name!r}; choose one of {sorted(draws)}")
    return draws[name]().clamp(U_EPS, 1.0 - U_EPS)


def _bell_normaliser() -> float:
    """Integral over [0, 1] of exp(-(u - c)^2 / (2 w^2)) (closed form with erf)."""
    a = math.sqrt(2.0) * BELL_WIDTH
    return 0.5 * math.sqrt(math.pi) * a * (math.erf((1 - BELL_CENTER) / a) + math.erf(BELL_CENTER / a))


def loss_weight(name: str, u: torch.Tensor) -> torch.Tensor:
    """Per-sample weight (same shape/dtype as ``u``) for weighting ``name``."""
    if name == "none":
        return torch.ones_like(u)
    if name == "bell_shaped":
        return torch.exp(-((u - BELL_CENTER) ** 2) / (2 * BELL_WIDTH**2)) / _bell_normaliser()
    raise ValueError(f"unknown loss_weighting {name!r}; choose one of {sorted(LOSS_WEIGHTINGS)}")


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                 cells: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the batch of weight[i] * mean((pred[i] - target[i])^2); pred/target (b, ...), weight (b,).
    ``cells`` (masked loss, ``training.masks.cell_weights``): per-cell weights broadcast over pred (b, 1, ...);
    the mean of sample i is then sum(cells[i] * err[i]) / sum(cells[i]) over its elements.

    Computed in fp32 whatever the input dtype. Returns a 0-d fp32 tensor.
    """
    sq = (pred.float() - target.float()).pow(2)
    if cells is None:
        err = sq.flatten(1).mean(dim=1)
    else:
        w = cells.to(sq).expand_as(sq)
        err = (sq * w).flatten(1).sum(dim=1) / w.flatten(1).sum(dim=1)
    return (err * weight.to(err)).mean()
