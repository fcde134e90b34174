"""A resumed run trains with the settings chosen now (issue 23 item 1): the optimizer state of the run it
continues carries the old learning rate, betas, eps and weight decay in its groups; the new ones win, every
change is reported, and a changed optimizer type is refused naming both."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from models import cosmos_with_lora

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(train_mods):
    return train_mods


def _setup(mods):
    return cosmos_with_lora(mods)


def _run(mods, m, latent, cond, steps, settings, name="resume_settings", **kw):
    args = {"settings": [settings], **{k: [v] for k, v in kw.items()}}
    with torch.inference_mode():
        return mods.train.PrecisionTrainLoRA.execute([m], [latent], [cond], [steps], [0], [name], **args).result[:4]


def _checkpoint(mods, m, latent, cond, settings) -> str:
    """Run 2 steps with a checkpoint at step 2; its name as the LoRA lists show it."""
    import comfy_harness
    import folder_paths

    server = comfy_harness.server()
    before = len(server.events)
    _run(mods, m, latent, cond, 2, settings)
    done = [d for e, d, _ in server.events[before:] if e == "precision_lora.train_done"][-1]
    root = os.path.abspath(folder_paths.get_folder_paths("loras")[0])
    return os.path.relpath(done["checkpoint"], root).replace(os.sep, "/")


def test_resume_trains_at_the_new_learning_rate_and_says_what_changed(mods, caplog):
    m, latent, cond = _setup(mods)
    old = mods.Settings(learning_rate=1e-4, checkpoint_every=2)
    name = _checkpoint(mods, m, latent, cond, old)
    new = mods.Settings(learning_rate=5e-5, beta2=0.99, weight_decay=0.0, eps=1e-6, loraplus_ratio=4.0,
                        lr_schedule="linear", schedule_steps=10, checkpoint_every=2)
    with caplog.at_level(logging.INFO):
        _, state, _, steps = _run(mods, m, latent, cond, 3, new, resume_from=name)
    assert steps == 5
    resumed = state.history[2:]
    # the lr the optimizer used in each continued step: the new base lr times the new schedule at that step
    expected = [5e-5 * (1.0 - s / 10) for s in (2, 3, 4)]
    assert [p["lr"] for p in resumed] == pytest.approx(expected, rel=1e-12)
    groups = state.optimizer["param_groups"]
    assert [g["precision_base_lr"] for g in groups] == pytest.approx([5e-5, 2e-4])  # lora_up at 4x (LoRA+)
    assert all(tuple(g["betas"]) == (0.9, 0.99) and g["eps"] == 1e-6 and g["weight_decay"] == 0.0 for g in groups)
    lines = [r.getMessage() for r in caplog.records if "resume: " in r.getMessage()]
    for change in ("learning_rate 0.0001 -> 5e-05", "beta2 0.999 -> 0.99", "weight_decay 0.01 -> 0.0",
                   "eps 1e-08 -> 1e-06", "lr_schedule 'constant' -> 'linear'", "loraplus_ratio 1.0 -> 4.0"):
        assert any(f"resume: {change}" in line for line in lines), (change, lines)
    assert not any("checkpoint_every" in line for line in lines)  # unchanged settings are not listed


def test_resume_with_unchanged_settings_continues_bit_identically(mods):
    m, latent, cond = _setup(mods)
    settings = mods.Settings(learning_rate=1e-3, checkpoint_every=2)
    _, ref, _, _ = _run(mods, m, latent, cond, 4, settings, name="resume_ref")
    name = _checkpoint(mods, m, latent, cond, settings)
    _, state, _, _ = _run(mods, m, latent, cond, 2, settings, resume_from=name)
    assert state.losses() == ref.losses()
    assert all(torch.equal(state.lora[k], ref.lora[k]) for k in ref.lora)


def test_a_changed_optimizer_is_refused_naming_both(mods):
    m, latent, cond = _setup(mods)
    name = _checkpoint(mods, m, latent, cond, mods.Settings(learning_rate=1e-4, checkpoint_every=2))
    sgd = mods.Settings(optimizer="sgd", learning_rate=1e-4)
    with pytest.raises(ValueError, match=r"PrecisionTrainLoRA: input 'resume_from'='resume_settings/.+' continues a "
                                         r"run trained with optimizer 'adamw', but the settings choose 'sgd'.*set "
                                         r"optimizer to 'adamw'"):
        _run(mods, m, latent, cond, 1, sgd, resume_from=name)
    a_model, a_state, _, _ = _run(mods, m, latent, cond, 1, mods.Settings())
    with pytest.raises(ValueError, match=r"input 'training_state' continues a run trained with optimizer 'adamw', "
                                         r"but the settings choose 'sgd'"):
        _run(mods, a_model, latent, cond, 1, sgd, training_state=a_state)
