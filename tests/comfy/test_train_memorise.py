"""One-latent memorisation on tiny Cosmos-Predict2 and Flux.1: the loss falls by >= 50 % in 50 steps.

The first test runs the node's path (fork_lora, training_session, build_samples, model_fns, training.loop)
with the noise fixed to one draw, so the (latent, noise) pair can be learned exactly. With fresh noise every
step the LoRA has to learn the velocity as a function of x_t for every draw, which is slower: the second
test runs the unmodified node and measures the loss on fixed evaluation draws. Tiny Cosmos halves it in 50
steps; tiny Flux.1 does not, at any rank (8-32) or learning rate (2e-3 to 2e-2) tried. In an exploratory
check (not kept as a test) both levelled off at about the noise's own variance at every noise level: the
tiny models are random, with no path that carries x_t to the output, so the LoRA learns the target's mean
(-x0) but not its noise part; a pretrained base denoises already.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from models import make_conditioning, make_latent, tiny_cosmos, tiny_flux1

FAMILIES = {"cosmos": tiny_cosmos, "flux1": tiny_flux1}


pytestmark = pytest.mark.usefixtures("one_thread")


def memorise(pack_module, family: str, steps: int, lr: float) -> list[float]:
    glue, tglue, tdata = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.train.data"))
    loop, lora = pack_module("training.loop"), pack_module("lora.config")
    settings = pack_module("training.settings").TrainSettings(learning_rate=lr)
    model = FAMILIES[family]()
    latent, cond = make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)
    with torch.inference_mode():
        attached = glue.attach_lora(model, lora.LoRAConfig(rank=8, alpha=8, targets="attention_mlp"))
        out, lora_set = tglue.fork_lora(attached)
        with tglue.training_session(out, lora_set, settings) as device:
            samples = tdata.build_samples(out, [latent], [cond], None, device)
            fns = tglue.model_fns(out, lora_set, settings, device)
            fixed = torch.randn((1, *samples[0].latent.shape), generator=torch.Generator().manual_seed(3)).to(device)
            base = fns
            fns = dataclasses.replace(base, noise_latent=lambda s, n, x0: base.noise_latent(s, fixed, x0),
                                      target=lambda s, n, x0: base.target(s, fixed, x0))
            result = loop.train(lora_set, samples, fns, settings, steps, seed=0)
    return [p["loss"] for p in result.state.history]


@pytest.mark.parametrize("family, lr", [("cosmos", 2e-3), ("flux1", 2e-3)])
def test_loss_falls_by_half_within_50_steps(pack_module, family, lr):
    losses = memorise(pack_module, family, 50, lr)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last <= 0.5 * first, f"{family}: first-5 mean {first:.4f}, last-5 mean {last:.4f}"


def _eval_loss(pack_module, model, latent, cond, settings, draws: int = 16) -> float:
    """Mean loss of ``model`` on one latent over ``draws`` fixed (noise, sigma) pairs from the settings' sampler."""
    glue, tglue, tdata = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.train.data"))
    sampling = pack_module("training.sampling")
    with torch.inference_mode():
        out, lora_set = tglue.fork_lora(model)
        with tglue.training_session(out, lora_set, settings) as device, torch.no_grad():
            (sample,) = tdata.build_samples(out, [latent], [cond], None, device)
            fns = tglue.model_fns(out, lora_set, settings, device)
            gen, x0, total = torch.Generator().manual_seed(123), sample.latent[None], 0.0
            for _ in range(draws):
                noise = torch.randn(x0.shape, generator=gen).to(x0.device)
                sigma = fns.sigma_of_u(sampling.sample_u(settings.sampler, 1, gen))
                x_t = fns.noise_latent(sigma, noise, x0)
                pred = fns.predict(x_t, sigma, fns.collate([sample.cond]))
                total += float((pred - fns.target(sigma, noise, x0)).pow(2).mean())
    return total / draws


def test_the_node_itself_halves_the_loss_on_fixed_evaluation_draws(pack_module):
    """The unmodified node (fresh noise every step, default sampler) on tiny Cosmos-Predict2: after 50 steps
    the loss on 16 fixed (noise, sigma) draws of the training latent is at most half of what it was before.
    (Tiny Flux.1 does not reach half here, hence the fixed-noise test above for both families.)"""
    glue, train, lora = pack_module("nodes.lora.glue"), pack_module("nodes.train.node"), pack_module("lora.config")
    settings = pack_module("training.settings").TrainSettings(learning_rate=2e-3)
    model = tiny_cosmos()
    latent, cond = make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)
    with torch.inference_mode():
        attached = glue.attach_lora(model, lora.LoRAConfig(rank=8, alpha=8, targets="attention_mlp"))
    before = _eval_loss(pack_module, attached, latent, cond, settings)
    with torch.inference_mode():
        trained, _, losses, steps = train.PrecisionTrainLoRA.execute(
            [attached], [latent], [cond], [50], [0], ["memorise"], settings=[settings]).result[:4]
    after = _eval_loss(pack_module, trained, latent, cond, settings)
    assert steps == 50 and len(losses["loss"]) == 50
    assert after <= 0.5 * before, f"evaluation loss {before:.4f} -> {after:.4f}"
