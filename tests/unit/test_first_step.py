"""The first training step's loss and update, in seconds and without ComfyUI (#34): loss weighting, gradient
clipping, the LoRA+ ratio and the ``auto`` backend's scale. Each was once broken in a way only a 2-minute e2e
options test (loss weighting ignored, clipping skipped) or an in-process comfy test (LoRA+ ratio, ``auto``
dropping the scale) noticed; here each is a closed-form check on the toy model of ``train_toy.py``."""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_toy import ToyNet, toy_data, toy_fns  # noqa: E402
from attention.config import AttentionConfig
from attention.dispatch import AttentionDispatcher, HostAttention
from attention.reference import reference_attention
from lora.config import LoRAConfig
from lora.layer import LoRASet
from training.loop import optimizer_parts, train
from training.sampling import loss_weight
from training.settings import TrainSettings

DIM = 8


def _first_step(settings: TrainSettings) -> tuple[float, list[float], dict[str, torch.Tensor]]:
    """(the first step's loss, the sigmas the model saw, each LoRA parameter's change) on one toy sample."""
    net = ToyNet(DIM)
    before = {n: p.detach().clone() for n, p in net.lora.named_parameters()}
    fns = toy_fns(net)
    sigmas: list[float] = []
    predict = fns.predict

    def seen(x_t, sigma, cond):
        sigmas.extend(float(s) for s in sigma)
        return predict(x_t, sigma, cond)

    fns = dataclasses.replace(fns, predict=seen)
    result = train(net.lora, toy_data(1, DIM), fns, settings, steps=1, seed=5)
    moved = {n: p.detach() - before[n] for n, p in net.lora.named_parameters()}
    return result.state.history[0]["loss"], sigmas, moved


def test_bell_shaped_weighting_scales_the_first_loss_by_its_weight_at_the_drawn_timestep():
    """Same seed, same draw: the weighted loss is w(u) times the unweighted one (the toy's sigma is u), w from
    ``training.sampling.loss_weight``; w(u) is far from 1 at this draw, so an ignored weighting fails."""
    base = dict(learning_rate=1e-3, timestep_sampling="uniform")
    plain, (sigma,), _ = _first_step(TrainSettings(**base, loss_weighting="none"))
    bell, (again,), _ = _first_step(TrainSettings(**base, loss_weighting="bell_shaped"))
    assert sigma == again
    w = float(loss_weight("bell_shaped", torch.tensor([sigma], dtype=torch.float64)))
    assert abs(w - 1) > 0.05, w
    # fp32 loss (one rounding of the mean, one of the product) against a float64 weight: 1e-6 relative
    assert math.isclose(bell, plain * w, rel_tol=1e-6), (bell, plain, w)


def test_clipping_bounds_the_first_sgd_update_to_lr_times_the_norm():
    """SGD's first step moves each parameter by lr * g (momentum starts at g), so the update's norm is
    lr * |g|; clipped at a quarter of |g| it is lr * max_grad_norm. Relative 1e-5: fp32 norms of a few dozen
    elements."""
    base = dict(learning_rate=1e-2, timestep_sampling="uniform", optimizer="sgd", weight_decay=0.0)
    _, _, free = _first_step(TrainSettings(**base, max_grad_norm=0.0))
    lr = base["learning_rate"]
    norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in free.values())) / lr
    assert norm > 0
    _, _, clipped = _first_step(TrainSettings(**base, max_grad_norm=norm / 4))
    got = math.sqrt(sum(float(d.double().pow(2).sum()) for d in clipped.values()))
    assert math.isclose(got, lr * norm / 4, rel_tol=1e-5), (got, lr * norm / 4)
    for name in free:  # the direction is kept
        torch.testing.assert_close(clipped[name], free[name] / 4, rtol=1e-5, atol=1e-12)


def test_loraplus_ratio_sets_the_up_groups_learning_rate_of_a_lora_set():
    """The optimizer a run builds over the pack's LoRA set (``optimizer_parts``): every ``lora_up`` factor at
    lr * loraplus_ratio, every ``lora_down`` at lr; AdamW's first step then moves each up element by
    lr * ratio (|m/sqrt(v)| = 1 where its gradient is far above eps)."""
    lora_set = LoRASet(LoRAConfig(rank=2, alpha=2), {"a": (12, 8), "b": (8, 6)})
    _, optimizer = optimizer_parts(lora_set, TrainSettings(learning_rate=1e-3, loraplus_ratio=4.0),
                                   torch.Generator().manual_seed(0))
    names = {id(p): n for n, p in lora_set.named_parameters()}
    rates = {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert rates == {"layers.a.down": 1e-3, "layers.a.up": 4e-3, "layers.b.down": 1e-3, "layers.b.up": 4e-3}
    # through the loop: the toy's up factor moves by lr * ratio per element on the first AdamW step
    for ratio in (1.0, 4.0):
        _, _, moved = _first_step(TrainSettings(learning_rate=1e-3, loraplus_ratio=ratio, weight_decay=0.0,
                                                timestep_sampling="uniform"))
        up = moved["up"].abs()
        assert torch.allclose(up[up > 0], torch.full_like(up[up > 0], 1e-3 * ratio), rtol=1e-3), (ratio, up)


def test_auto_backend_runs_the_hosts_attention_at_the_chosen_scale():
    """Backend ``auto`` runs the host's own function, which applies the model's base scale itself: the
    dispatcher folds the chosen scale into q, so the output is attention at the chosen scale (here 2x the
    default) and not at the host's. Float32 against float64: 2e-6."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))

    def host_fn(q, k, v, mask):  # scales by 1/sqrt(head_dim) itself, as ComfyUI's functions do
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    cfg = AttentionConfig(backend="auto", scale_mode="multiplier", scale_value=2.0)
    out = AttentionDispatcher(cfg).run(q, k, v, host=HostAttention("host", host_fn, True))
    chosen = reference_attention(q.double(), k.double(), v.double(), scale=2.0 / math.sqrt(8))
    default = reference_attention(q.double(), k.double(), v.double(), scale=1.0 / math.sqrt(8))
    assert (out.double() - chosen).abs().max().item() < 2e-6
    assert (out.double() - default).abs().max().item() > 1e-2
