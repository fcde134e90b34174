"""Timestep samplers (defined on the noise fraction u), loss weighting, and the settings' validation."""
from __future__ import annotations

import math
import re

import pytest
import torch

from training.sampling import (LOSS_WEIGHTINGS, TIMESTEP_SAMPLERS, U_EPS, _bell_normaliser, loss_weight, sample_u,
                               shift_time, weighted_mse)
from training.settings import TrainSettings

N = 200_000


def _draw(name: str, **kw) -> torch.Tensor:
    return sample_u(TrainSettings(timestep_sampling=name, **kw).sampler, N, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name, mean, tol", [
    ("uniform", 0.5, 0.005),
    ("logit_normal", 0.5, 0.005),
    ("content", 0.25, 0.005),   # E[r^3] = 1/4: low noise
    ("style", 0.75, 0.005),     # high noise
    ("balanced", 0.5, 0.005),
    ("sigmoid", 0.5, 0.005),
])
def test_sampler_means(name, mean, tol):
    u = _draw(name)
    assert u.dtype == torch.float64 and u.shape == (N,)
    assert float(u.min()) >= U_EPS and float(u.max()) <= 1 - U_EPS
    assert abs(float(u.mean()) - mean) < tol


def test_logit_normal_matches_its_definition():
    u = _draw("logit_normal", logit_mean=1.0, logit_std=0.5)
    z = torch.logit(u)
    assert abs(float(z.mean()) - 1.0) < 0.01 and abs(float(z.std()) - 0.5) < 0.01


@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_sigmoid_matches_its_definition(scale):
    """u = sigmoid(scale * z): logit(u) is normal with std ``scale`` (a mean of 0.5 alone holds for any law
    symmetric about 0.5), and P(u < 0.1) = Phi(logit(0.1) / scale), which grows with the scale."""
    u = _draw("sigmoid", sigmoid_scale=scale)
    z = torch.logit(u)
    assert abs(float(z.mean())) < 0.01 * scale and abs(float(z.std()) - scale) < 0.01 * scale
    expected = 0.5 * (1 + math.erf(math.log(0.1 / 0.9) / scale / math.sqrt(2)))
    assert abs(float((u < 0.1).double().mean()) - expected) < 0.005


def test_shift_sampler_is_the_time_shift_of_a_uniform_draw():
    u = _draw("shift", shift=3.0)
    r = torch.rand(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(u, shift_time(r, 3.0).clamp(U_EPS, 1 - U_EPS))
    # median of the shifted draw = shift(0.5) = 0.75: favours high noise
    assert abs(float(u.median()) - 0.75) < 0.005
    assert float(shift_time(torch.tensor([0.0, 1.0]), 5.0).sum()) == 1.0


def test_balanced_is_half_content_half_style():
    u = _draw("balanced")
    assert abs(float((u < 0.5).double().mean()) - 0.5) < 0.01
    low = u[u < 0.5]
    assert float(low.mean()) < 0.2  # the content half is concentrated near 0


def test_sampler_consumes_only_its_generator():
    torch.manual_seed(123)
    a = _draw("uniform")
    torch.manual_seed(456)
    assert torch.equal(a, _draw("uniform"))


def test_bell_shaped_weight_has_unit_mean_over_uniform_u_and_is_not_a_noop_at_batch_1():
    u = torch.linspace(0, 1, 100_001, dtype=torch.float64)
    w = loss_weight("bell_shaped", u)
    assert float(w.mean()) == pytest.approx(1.0, rel=1e-4)
    assert float(loss_weight("bell_shaped", torch.tensor([0.5], dtype=torch.float64))) == pytest.approx(
        1 / _bell_normaliser())
    assert float(loss_weight("bell_shaped", torch.tensor([0.05], dtype=torch.float64))) < 0.5
    pred, target = torch.ones(1, 4), torch.zeros(1, 4)
    weighted = weighted_mse(pred, target, loss_weight("bell_shaped", torch.tensor([0.9], dtype=torch.float64)))
    assert float(weighted) == pytest.approx(math.exp(-(0.4**2) / (2 * 0.25**2)) / _bell_normaliser())
    assert float(weighted_mse(pred, target, loss_weight("none", torch.tensor([0.9])))) == 1.0


def test_registries_and_errors():
    assert set(TIMESTEP_SAMPLERS) == {"uniform", "logit_normal", "sigmoid", "shift", "content", "style", "balanced"}
    assert set(LOSS_WEIGHTINGS) == {"none", "bell_shaped"}
    with pytest.raises(ValueError, match="unknown loss_weighting 'cubic'"):
        loss_weight("cubic", torch.zeros(1))


@pytest.mark.parametrize("field, value, message", [
    ("timestep_sampling", "cosine", "timestep_sampling='cosine': unknown; choose one of"),
    ("batch_size", 0, "batch_size=0: must be an integer >= 1"),
    ("grad_accum", 1.5, "grad_accum=1.5: must be an integer >= 1"),
    ("max_grad_norm", -1.0, "max_grad_norm=-1.0: must be >= 0"),
    ("shift", 0.0, "shift=0.0: must be > 0"),
    ("beta2", 1.0, "beta2=1.0: must be in [0, 1)"),
    ("loraplus_ratio", 0.0, "loraplus_ratio=0.0: must be > 0"),
    ("nan_policy", "ignore", "nan_policy='ignore': unknown"),
])
def test_settings_validate_names_field_value_and_fix(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainSettings(**{field: value}).validate()


def test_settings_round_trip():
    s = TrainSettings(optimizer="sgd", lr_schedule="cosine", warmup_steps=5, dop_multiplier=0.5)
    assert TrainSettings.from_dict({**s.to_dict(), "future_field": 1}) == s
