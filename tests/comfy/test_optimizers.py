"""Every optimizer of the registry on the tiny Flux.1 memorisation case (issue 26 acceptance): the loss on fixed
evaluation draws falls, and two chained runs of 5 steps (the second continued from the first's state file,
on a fresh fork of the attached LoRA, as resume_from does) equal one run of 10, bit for bit, on the CPU.
Optional optimizers that are not installed here are listed with the reason instead (a test of its own).

The training path is the node's (fork_lora, training_session, build_samples, model_fns, training.loop) with
the noise fixed to one draw, as in test_train_memorise.py: the (latent, noise) pair can be learned.
"""
from __future__ import annotations


import pytest
import torch

from models import fixed_noise_fns, make_conditioning, make_latent, tiny_flux1

pytestmark = pytest.mark.usefixtures("one_thread")

# A learning rate that moves tiny Flux.1's rank-4 LoRA in 10 steps (the registry's ranges are for real models).
LR = {"prodigy": 1.0, "lion": 3e-3, "sgd": 0.5, "adafactor": 1.0}
DEFAULT_LR = 1e-2
# Prodigy starts at a step size of d0 = 1e-6 and grows its estimate over its first steps: 10 steps barely move it.
LEARN_STEPS = {"prodigy": 30}


@pytest.fixture(scope="module")
def flux(pack_module):
    glue, lora = pack_module("nodes.lora.glue"), pack_module("lora.config")
    model = tiny_flux1()
    with torch.inference_mode():
        attached = glue.attach_lora(model, lora.LoRAConfig(rank=4, alpha=4, targets="attention"))
    return attached, make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)


def _train(pack_module, flux, settings, steps: int, state=None, eval_draws: int = 0):
    """(result, evaluation loss before, after) of ``steps`` steps on a fresh fork of the attached LoRA."""
    tglue, tdata, loop = (pack_module(m) for m in ("nodes.train.glue", "nodes.train.data", "training.loop"))
    attached, latent, cond = flux
    with torch.inference_mode():
        out, lora_set = tglue.fork_lora(attached)
        with tglue.training_session(out, lora_set, settings) as device:
            samples = tdata.build_samples(out, [latent], [cond], None, device)
            base = tglue.model_fns(out, lora_set, settings, device)
            fns, fixed = fixed_noise_fns(base, samples, device)
            before = _eval(fns, samples[0], fixed, eval_draws)
            result = loop.train(lora_set, samples, fns, settings, steps, seed=0, state=state)
            after = _eval(fns, samples[0], fixed, eval_draws)
    return result, before, after


def _eval(fns, sample, noise, draws: int) -> float:
    """Mean loss at ``draws`` fixed sigmas across the schedule (0 = not measured)."""
    if not draws:
        return 0.0
    total, x0 = 0.0, sample.latent[None]
    with torch.no_grad():
        for u in torch.linspace(0.1, 0.9, draws, dtype=torch.float64):
            sigma = fns.sigma_of_u(u[None])
            pred = fns.predict(fns.noise_latent(sigma, noise, x0), sigma, fns.collate([sample.cond]))
            total += float((pred - fns.target(sigma, noise, x0)).pow(2).mean())
    return total / draws


def _available(pack_module) -> list[str]:
    return [n for n, reason in pack_module("training.optim").available().items() if reason is None]


def _optimizers() -> list[str]:
    from training.optim import OPTIMIZERS  # the pure package is importable without ComfyUI

    return list(OPTIMIZERS)


@pytest.mark.parametrize("name", _optimizers())
def test_optimizer_learns_tiny_flux_and_two_chained_runs_equal_one(pack_module, flux, tmp_path, name):
    if name not in _available(pack_module):
        pytest.skip(f"{name}: {pack_module('training.optim').available()[name]} (listed by "
                    "test_missing_optional_optimizers_are_listed_with_the_reason)")
    ckpt = pack_module("training.checkpoint")
    settings = pack_module("training.settings").TrainSettings(optimizer=name, learning_rate=LR.get(name, DEFAULT_LR))
    one, before, after = _train(pack_module, flux, settings, 10, eval_draws=4)
    if name in LEARN_STEPS:
        _, before, after = _train(pack_module, flux, settings, LEARN_STEPS[name], eval_draws=4)
    assert after < 0.9 * before, f"{name}: evaluation loss {before:.4f} -> {after:.4f}"
    first, _, _ = _train(pack_module, flux, settings, 5)
    path = ckpt.save_state(str(tmp_path / "half.trainstate"), first.state)
    second, _, _ = _train(pack_module, flux, settings, 5, state=ckpt.load_state(path))
    assert [p["loss"] for p in second.state.history] == [p["loss"] for p in one.state.history]
    assert one.state.lora.keys() == second.state.lora.keys()
    assert all(torch.equal(one.state.lora[k], second.state.lora[k]) for k in one.state.lora), name


def test_missing_optional_optimizers_are_listed_with_the_reason(pack_module):
    """What is not installed here is named with the package to install, in the settings node's tooltip too."""
    optim, node = pack_module("training.optim"), pack_module("nodes.train.node")
    missing = {n: r for n, r in optim.available().items() if r is not None}
    assert all(optim.OPTIMIZERS[n].package in ("bitsandbytes", "torchao") for n in missing)
    tip = node._optimizer_tip()
    for name, reason in missing.items():
        spec = optim.OPTIMIZERS[name]
        assert reason == f"unavailable: pip install {spec.package}"
        assert f"{name}: {spec.description}; lr {spec.lr} ({reason})" in tip
    assert len(_available(pack_module)) >= 12 - len(missing)
