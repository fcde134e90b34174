"""The optimizer catalogue: how each optimizer the pack offers is built from the run's settings.

``training.optim.OPTIMIZERS`` is this table; the settings node's option list, its tooltip and
docs/optimizers.md are generated from it. The optimizers come from the libraries that maintain them: torch,
``pytorch_optimizer`` (Apache-2.0, torch + numpy only; a requirement of the pack), and the optional extras
``bitsandbytes`` and ``torchao``, imported only inside ``build`` when chosen (``available`` reports a missing
one). The non-commercial-licence optimizers of ``pytorch_optimizer`` (Fromage, Nero: CC BY-NC-SA 4.0) are
left out.

Every ``build(groups, hyper)`` receives param groups that already carry their own ``lr`` (LoRA+ groups
differ) and must not pass a second one. The parameters it sees are fp32 (fp32 LoRA parameters or the fp32
masters of bf16 ones, ``training.masters``), so every optimizer's state and update are fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

PYTORCH_OPTIMIZER = "pytorch_optimizer"


@dataclass(frozen=True)
class Hyperparams:
    """What an optimizer reads besides the groups' learning rates."""

    betas: tuple[float, float]
    eps: float
    weight_decay: float


Build = Callable[[list[dict], Hyperparams], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one optimizer and what to tell users about it.

    ``package``: the optional module it needs (None = torch only). ``lr``: the learning rate to start a LoRA
    with. ``state``: optimizer state per trainable parameter (fp32 masters of bf16 LoRAs not counted).
    ``schedule_free``: the optimizer has ``train()``/``eval()`` modes; previews, checkpoints and the saved
    LoRA use the eval-mode (averaged) weights. ``group_lr``: each parameter group steps with its own ``lr``
    (LoRA+ gives ``lora_up`` a larger one); False where one step size serves every group."""

    build: Build
    package: str | None
    description: str
    lr: str = "1e-4"
    state: str = "8 B (2 fp32 moments)"
    schedule_free: bool = False
    group_lr: bool = True


def kernel(groups: list[dict]) -> dict[str, bool]:
    """``fused=True`` (one kernel for every LoRA matrix: 4x faster than foreach for AdamW on CPU) when every
    parameter is a floating tensor on the CPU or CUDA, else ``foreach=True`` (torch picks neither by
    default on CPU; hundreds of small tensors make the per-tensor loop slow)."""
    params = [p for g in groups for p in g["params"]]
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return {"fused": True} if fused else {"foreach": True}


def _adamw(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay, **kernel(groups))


def _sgd(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, momentum=h.betas[0], weight_decay=h.weight_decay, **kernel(groups))


def _adafactor(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(groups, weight_decay=h.weight_decay)


def _bnb(name: str) -> Build:
    def build(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
        import bitsandbytes as bnb  # optional dependency, imported only when chosen

        return getattr(bnb.optim, name)(groups, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)

    return build


def _torchao(name: str) -> Build:
    def build(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
        import torchao.optim  # optional dependency, imported only when chosen

        return getattr(torchao.optim, name)(groups, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)

    return build


def _po(name: str, **fixed: object) -> Build:
    """A ``pytorch_optimizer`` class given betas, eps and weight decay (``fixed``: its other arguments)."""

    def build(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
        import pytorch_optimizer  # a requirement of the pack, imported only when chosen

        return getattr(pytorch_optimizer, name)(groups, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay,
                                                **fixed)

    return build


def _po_three_betas(name: str, beta3: float, eps: bool) -> Build:
    """Optimizers with a third beta (CAME's confidence EMA, AdEMAMix's slow EMA): beta1, beta2 from the
    settings, the third at the authors' default. ``eps``: the optimizer takes the settings' eps (CAME has
    two constants of its own instead)."""

    def build(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
        import pytorch_optimizer

        cls = getattr(pytorch_optimizer, name)
        extra = {"eps": h.eps} if eps else {}
        return cls(groups, betas=(*h.betas, beta3), weight_decay=h.weight_decay, **extra)

    return build


def _lion(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
    import pytorch_optimizer

    return pytorch_optimizer.Lion(groups, betas=h.betas, weight_decay=h.weight_decay)  # Lion has no eps


def _muon(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
    """Muon orthogonalises the update of every matrix (LoRA factors are r x in and out x r matrices; a
    conv LoRA's 4-d factors are flattened by Muon). ``use_adjusted_lr`` scales the step to AdamW's update
    size (0.2 sqrt(max(rows, cols))), so AdamW's LoRA learning rates carry over. Vectors (none in a LoRA set,
    but any module may train some) go to the AdamW part of the same optimizer in a group of their own."""
    import pytorch_optimizer

    split: list[dict] = []
    for g in groups:
        for use_muon in (True, False):
            params = [p for p in g["params"] if (p.ndim >= 2) == use_muon]
            if params:
                extra = {"momentum": h.betas[0], "use_adjusted_lr": True} if use_muon else {"betas": h.betas, "eps": h.eps}
                split.append({**g, "params": params, "use_muon": use_muon, **extra})
    return pytorch_optimizer.Muon(split, weight_decay=h.weight_decay)


def _adafactor_fixed(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
    """pytorch_optimizer's AdaFactor the way LoRA trainers run it (kohya, OneTrainer): a fixed learning rate
    (``relative_step`` and ``scale_parameter`` off) and an fp32 first moment (beta1; the library's default
    keeps it in bf16). torch's Adafactor always scales the step by the parameter's RMS (at least 1e-3):
    a LoRA's all-zero ``lora_up`` then moves by lr x 1e-3 per step and the LoRA barely starts."""
    import pytorch_optimizer

    return pytorch_optimizer.AdaFactor(groups, betas=h.betas, weight_decay=h.weight_decay, relative_step=False,
                                       scale_parameter=False, momentum_dtype=torch.float32)


def _prodigy(groups: list[dict], h: Hyperparams) -> torch.optim.Optimizer:
    import pytorch_optimizer

    return pytorch_optimizer.Prodigy(groups, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)


# SOAP keeps a Shampoo preconditioner (2 d x d matrices) per factor side of size <= max_precondition_dim.
# A LoRA factor has one small side (the rank) and one large (a layer's width, 3072 in Flux): preconditioning
# that side would hold 2 x 3072^2 fp32 values per factor, hundreds of times the LoRA. With 512 the rank side
# is preconditioned (SOAP's point) and the wide side gets Adam's diagonal second moment.
SOAP_MAX_DIM = 512

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(_adamw, None, "torch AdamW (default)", "1e-4 .. 5e-4"),
    "adamw8bit": OptimizerSpec(_bnb("AdamW8bit"), "bitsandbytes", "bitsandbytes 8-bit AdamW", "1e-4 .. 5e-4",
                               "2 B (8-bit moments)"),
    "paged_adamw8bit": OptimizerSpec(_bnb("PagedAdamW8bit"), "bitsandbytes", "bitsandbytes paged 8-bit AdamW",
                                     "1e-4 .. 5e-4", "2 B (8-bit moments, paged to host)"),
    "paged_adamw": OptimizerSpec(_bnb("PagedAdamW"), "bitsandbytes", "bitsandbytes paged AdamW", "1e-4 .. 5e-4",
                                 "8 B (paged to host)"),
    "adamw8bit_ao": OptimizerSpec(_torchao("AdamW8bit"), "torchao", "torchao 8-bit AdamW (blockwise quantised "
                                  "moments)", "1e-4 .. 5e-4", "~2 B (8-bit moments)"),
    "adamw4bit_ao": OptimizerSpec(_torchao("AdamW4bit"), "torchao", "torchao 4-bit AdamW", "1e-4 .. 5e-4",
                                  "~1 B (4-bit moments)"),
    # pytorch_optimizer's Prodigy steps every group with its d times the first group's lr (prodigyopt refuses groups
    # of different lr): LoRA+ cannot work with it (training.settings refuses loraplus_ratio != 1)
    "prodigy": OptimizerSpec(_prodigy, PYTORCH_OPTIMIZER, "Prodigy: learns its own step size (learning_rate "
                             "is a multiplier: use 1.0; one step size for every group, so no LoRA+)", "1.0",
                             "16 B (moments, initial value, s)", group_lr=False),
    "schedulefree_adamw": OptimizerSpec(_po("ScheduleFreeAdamW"), PYTORCH_OPTIMIZER, "Schedule-free AdamW: "
                                        "no decay schedule needed (use lr_schedule constant); previews and "
                                        "saves use its averaged weights", "1e-4 .. 1e-3",
                                        "8 B (z, second moment)", schedule_free=True),
    "came": OptimizerSpec(_po_three_betas("CAME", 0.9999, eps=False), PYTORCH_OPTIMIZER, "CAME: Adafactor's factored "
                          "memory with a confidence-guided update (beta3 0.9999)", "1e-4 .. 2e-4",
                          "4 B + factored rows/cols (first moment only full size)"),
    "adafactor": OptimizerSpec(_adafactor, None, "torch Adafactor (factored second moment; relative steps "
                               "scaled by each parameter's RMS, so a zero lora_up starts slowly: prefer "
                               "adafactor_fixed; only weight decay is read)", "1e-2 (relative)", "factored rows/cols (~0 B)"),
    "adafactor_fixed": OptimizerSpec(_adafactor_fixed, PYTORCH_OPTIMIZER, "Adafactor with a fixed lr (relative "
                                     "step off) and an fp32 first moment: the LoRA trainers' Adafactor", "1e-4 .. 5e-4",
                                     "4 B + factored rows/cols (first moment)"),
    "lion": OptimizerSpec(_lion, PYTORCH_OPTIMIZER, "Lion: sign updates, one moment (lr 3-10x below AdamW's, "
                          "weight decay 3-10x above; betas 0.9, 0.99 recommended)", "1e-5 .. 5e-5",
                          "4 B (1 moment)"),
    "adopt": OptimizerSpec(_po("ADOPT"), PYTORCH_OPTIMIZER, "ADOPT: Adam that converges for any beta2 "
                           "(0.9999 recommended)", "1e-4 .. 5e-4"),
    "ademamix": OptimizerSpec(_po_three_betas("AdEMAMix", 0.9999, eps=True), PYTORCH_OPTIMIZER,
                              "AdEMAMix: Adam plus a slow gradient EMA (beta3 0.9999, alpha 5)", "5e-5 .. 2e-4",
                              "12 B (3 moments)"),
    "soap": OptimizerSpec(_po("SOAP", max_precondition_dim=SOAP_MAX_DIM), PYTORCH_OPTIMIZER,
                          f"SOAP: Adam in Shampoo's eigenbasis (rank side preconditioned, sides > {SOAP_MAX_DIM} "
                          "diagonal); betas 0.95, 0.95 recommended", "1e-4 .. 3e-4",
                          "8 B + 2 r^2 fp32 per factor (r = rank)"),
    "muon": OptimizerSpec(_muon, PYTORCH_OPTIMIZER, "Muon: orthogonalised momentum per LoRA matrix, step "
                          "scaled to AdamW's (momentum = beta1, 0.95 recommended)", "1e-4 .. 5e-4",
                          "4 B (1 momentum)"),
    "sgd": OptimizerSpec(_sgd, None, "SGD with momentum beta1", "1e-3 .. 1e-2", "4 B (momentum)"),
}
