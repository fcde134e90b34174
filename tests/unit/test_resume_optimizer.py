"""An optimizer built by training.optim keeps the run's settings when it loads another run's state (issue 23
item 1): lr, base lr, betas, eps and weight decay from the settings; moments, step counts and any group key
the settings do not own (e.g. Prodigy's d) from the state."""
from __future__ import annotations

import torch

from training.optim import BASE_LR_KEY, Hyperparams, build_optimizer


def _groups(params, lr):
    return [{"params": [params[0]], "lr": lr}, {"params": [params[1]], "lr": lr * 4}]


def test_loading_a_state_keeps_this_runs_settings_and_the_states_moments():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2, 3))]
    old = build_optimizer(_groups(params, 1e-3), "adamw", Hyperparams((0.9, 0.999), 1e-8, 0.01))
    sum(p.square().sum() for p in params).backward()
    old.step()
    saved = old.state_dict()
    saved["param_groups"][0]["d"] = 0.5  # a key of the optimizer's own, as Prodigy keeps in its groups
    new = build_optimizer(_groups(params, 5e-5), "adamw", Hyperparams((0.8, 0.99), 1e-6, 0.0))
    new.load_state_dict(saved)
    g0, g1 = new.param_groups
    assert (g0["lr"], g0[BASE_LR_KEY], g1[BASE_LR_KEY]) == (5e-5, 5e-5, 2e-4)
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 and g["weight_decay"] == 0.0 for g in (g0, g1))
    assert g0["d"] == 0.5
    for p in params:
        assert torch.equal(new.state[p]["exp_avg"], old.state[p]["exp_avg"])
        assert float(new.state[p]["step"]) == 1.0
