"""One-latent memorisation on tiny Cosmos-Predict2 and Flux.1: the loss falls by >= 50 % in 50 steps.

The training path is the node's (fork_lora, training_session, build_samples, model_fns, training.loop)
with one change that makes it a memorisation task: the noise is one fixed draw, so the (latent, noise)
pair can be learned exactly (with fresh noise every step the velocity target keeps an irreducible part).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from models import make_conditioning, make_latent, tiny_cosmos, tiny_flux1

FAMILIES = {"cosmos": tiny_cosmos, "flux1": tiny_flux1}


pytestmark = pytest.mark.usefixtures("one_thread")


def memorise(pack_module, family: str, steps: int, lr: float) -> list[float]:
    glue, tglue, tdata = (pack_module(m) for m in ("nodes.lora_glue", "nodes.train_glue", "nodes.train_data"))
    loop, lora = pack_module("training.loop"), pack_module("training.lora")
    settings = pack_module("training.settings").TrainSettings(learning_rate=lr)
    model = FAMILIES[family]()
    latent, cond = make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)
    with torch.inference_mode():
        attached = glue.attach_lora(model, lora.LoRAConfig(rank=8, alpha=8, targets="attention_mlp"))
        out, lora_set = tglue.fork_lora(attached)
        with tglue.training_session(out, lora_set, settings) as device:
            samples = tdata.build_samples(out, [latent], [cond], None, device)
            fns = tglue.model_fns(out, lora_set, settings, device)
            fixed = torch.randn((1, *samples[0].latent.shape), generator=torch.Generator().manual_seed(3))
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
