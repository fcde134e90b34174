"""How much of a LoRA's signal survives bf16, measured on one linear layer.

For a layer ``y = x Wᵀ + b`` with a LoRA delta ``ΔW`` (scale and multiplier included), the intended
output change is ``ideal = x ΔWᵀ`` (fp64). Each path below produces a bf16 output; its realised change is
``out − base`` with ``base = bf16(x Wᵀ + b)`` (the bf16 model without the LoRA). The *gain* is the
projection of the realised change on the intended one, ``<real, ideal> / <ideal, ideal>``: 1 = the LoRA
acts at full strength, 0 = bf16 erased it.

Paths:
- ``merge``: ΔW merged into the bf16 weight with round-to-nearest (ComfyUI's merged inference).
- ``add_bf16``: the delta rounded to bf16 and added in bf16 to the rounded base output (the source write-up).
- ``add_rounded``: the fp32 delta added to the already rounded base output, rounded once.
- ``fp32_unmerged``: this pack's fp32-accumulating layer (``lora.lowrank.lora_linear``): base and delta
  summed in fp32 before the one rounding.

Pure torch; never imports ComfyUI.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..lora.lowrank import LoRAAdapter, lora_linear

PATHS = ("merge", "add_bf16", "add_rounded", "fp32_unmerged")


@dataclass(frozen=True)
class SurvivalStats:
    """Gains per path (see module doc), relative errors ‖real − ideal‖ / ‖ideal‖ per path, the fraction of
    weight elements a bf16 merge changes, the layer's rms(ΔW)/rms(W), and ``ideal_energy`` = Σ ideal² (the
    weight of this layer in a model summary)."""

    gains: Mapping[str, float]
    rel_errors: Mapping[str, float]
    merge_changed: float
    rho: float
    ideal_energy: float

    def as_dict(self) -> dict[str, float]:
        return {**{f"gain_{k}": v for k, v in self.gains.items()},
                **{f"rel_err_{k}": v for k, v in self.rel_errors.items()}, "merge_changed": self.merge_changed,
                "rho": self.rho, "ideal_energy": self.ideal_energy}


def projection_gain(real: torch.Tensor, ideal: torch.Tensor) -> float:
    """<real, ideal> / <ideal, ideal> in fp64 (0.0 when ideal is all zero). Same shapes."""
    ideal = ideal.double()
    denom = float((ideal * ideal).sum())
    if denom == 0.0:
        return 0.0
    return float((real.double() * ideal).sum()) / denom


def adapter_delta_weight(adapters: Sequence[LoRAAdapter], weight: torch.Tensor | None = None) -> torch.Tensor:
    """ΔW = Σ multiplier · scale · up @ down over stacked adapters (each kind's ``delta_weight``: LoKr, LoHa and
    DoRA too, DoRA's from ``weight``), (out, in) fp32, detached."""
    with torch.no_grad():
        return sum(a.delta_weight(weight) for a in adapters)


@contextmanager
def _measuring(adapters: Sequence[LoRAAdapter]):
    """Eval mode (no dropouts) and fp32 accumulation while measuring; both restored afterwards."""
    saved = [(a, a.training, a.fp32_accumulation) for a in adapters]
    for a in adapters:
        a.train(False)
        a.fp32_accumulation = True
    try:
        yield
    finally:
        for a, training, fp32 in saved:
            a.train(training)
            a.fp32_accumulation = fp32


def _flat(x: torch.Tensor, max_rows: int) -> torch.Tensor:
    x2 = x.detach().reshape(-1, x.shape[-1])
    return x2[:max_rows] if max_rows > 0 else x2


@torch.no_grad()
def delta_survival(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   adapters: Sequence[LoRAAdapter], max_rows: int = 0) -> SurvivalStats:
    """Gains of every path for one layer, simulated in bf16 whatever the model dtype.

    x (..., in) any float dtype (the layer's real input; the first ``max_rows`` rows when > 0);
    weight (out, in); bias (out,) or None; ``adapters``: the layer's (stacked) adapters, used in eval mode
    and left unchanged.
    """
    xb = _flat(x, max_rows).to(torch.bfloat16)
    wb = weight.detach().to(torch.bfloat16)
    bb = None if bias is None else bias.detach().to(torch.bfloat16)
    adapters = tuple(adapters)
    dw = adapter_delta_weight(adapters, wb)
    base = F.linear(xb, wb, bb)
    ideal = xb.double() @ dw.double().t()
    delta32 = xb.float() @ dw.t()
    merged_w = (wb.float() + dw).to(torch.bfloat16)
    with _measuring(adapters):
        ours = lora_linear(xb, wb, bb, adapters)  # the pack's layer; all-zero adapters give the base layer
    outs = {
        "merge": F.linear(xb, merged_w, bb),
        "add_bf16": base + delta32.to(torch.bfloat16),
        "add_rounded": (base.float() + delta32).to(torch.bfloat16),
        "fp32_unmerged": ours,
    }
    gains = {name: projection_gain(out.double() - base.double(), ideal) for name, out in outs.items()}
    norm = float(ideal.norm())
    errors = {name: float((out.double() - base.double() - ideal).norm()) / norm if norm > 0 else float("inf")
              for name, out in outs.items()}
    rms_w = float(wb.double().pow(2).mean().sqrt())
    rho = float(dw.double().pow(2).mean().sqrt()) / rms_w if rms_w > 0 else float("inf")
    return SurvivalStats(gains=gains, rel_errors=errors, merge_changed=float((merged_w != wb).double().mean()), rho=rho,
                         ideal_energy=float((ideal * ideal).sum()))


def summarize(stats: Mapping[str, SurvivalStats]) -> dict[str, float]:
    """Model-level gains: per path, the layers' gains weighted by their ideal energy (a layer whose LoRA
    changes the output more counts more). Empty input gives an empty dict."""
    total = sum(s.ideal_energy for s in stats.values())
    if not stats or total <= 0:
        return {}
    return {p: sum(s.gains[p] * s.ideal_energy for s in stats.values()) / total for p in PATHS}
