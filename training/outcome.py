"""How a training call ended, decided in one place (runs that learned nothing used to report success).

A call **fails** when one of these holds (``Outcome.problem`` says which, with the fix):

1. the LoRA holds NaN or inf;
2. the LoRA **exploded**: its largest absolute weight exceeds ``EXPLODED_MAX_ABS`` (1e3). LoRA factors start
   near ``1/sqrt(in_features)`` (down) and 0 (up) and stay of order 1 in healthy runs; a factor of 1e3 makes
   deltas about a thousand times the base model's weights, and products of two such factors (1e6) are
   beyond what fp16 can hold;
3. every optimizer step of the call was skipped: by the NaN guard (non-finite loss or gradients) or because
   ``module_dropout`` dropped every adapter in it (no gradient): nothing was learned,
   whatever the weights look like;
4. the learning guard (``learning_guard`` "stop", ``training.learning``) found factors that do not learn.

Otherwise the call succeeds; skipped steps, steps with every adapter dropped and rollbacks are still counted
in ``summary()``, logged, and recorded in the LoRA's metadata (``precision_lora_outcome``). A skipped step
loses nothing (the LoRA, optimizer state and EMA stay as the last good step left them); a rollback restores
an earlier snapshot and so discards the good steps since it: the summary says how many.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

EXPLODED_MAX_ABS = 1.0e3
FIX = ("lower learning_rate (or loraplus_ratio), keep max_grad_norm > 0, and check the settings and data "
       "(the NaN guard's warnings in the log name each skipped step)")


@dataclass(frozen=True)
class Outcome:
    """``steps``: optimizer steps this call ran; ``skipped``/``rollbacks``: the NaN guard's, in this call;
    ``max_abs``: largest |weight| of the LoRA (nan when it holds NaN); ``problem``: None when the call is ok;
    ``dropped``: steps of this call in which module_dropout dropped every adapter (skipped, not updated);
    ``module_dropout``: the LoRA's module_dropout, for the summary; ``discarded``: good steps of this call that
    rollbacks threw away (training.guard)."""

    steps: int
    skipped: int
    rollbacks: int
    max_abs: float
    problem: str | None = None
    dropped: int = 0
    module_dropout: float = 0.0
    discarded: int = 0

    @property
    def ok(self) -> bool:
        return self.problem is None

    def summary(self) -> str:
        head = "ok" if self.ok else "failed"
        text = (f"{head}: {self.steps} steps, {self.skipped} skipped, {self.rollbacks} rollbacks, "
                f"largest |LoRA weight| {self.max_abs:.3g}")
        if self.dropped:
            text += (f"; {self.dropped} steps had every adapter dropped (module_dropout={self.module_dropout:g}) "
                     "and were skipped")
        if self.rollbacks:
            text += f"; rollbacks discarded {self.discarded} good step{'' if self.discarded == 1 else 's'}"
        return text


@torch.no_grad()
def largest_abs(params: Iterable[torch.Tensor]) -> float:
    """max |w| over ``params`` (nan if any is NaN, inf if any is inf); 0.0 for none."""
    peak = 0.0
    for p in params:
        if p.numel():
            m = float(p.detach().abs().max().float())  # max propagates NaN
            if math.isnan(m):
                return math.nan
            peak = max(peak, m)
    return peak


def judge(params: Iterable[torch.Tensor], steps: int, skipped: int, rollbacks: int, dropped: int = 0,
          module_dropout: float = 0.0, discarded: int = 0, learning: str | None = None) -> Outcome:
    """The outcome of a call that ran ``steps`` optimizer steps on ``params`` (see the module docstring).
    ``learning``: the learning guard's findings when it stopped the run (``learning_guard`` "stop")."""
    peak = largest_abs(params)
    problem = None
    if not math.isfinite(peak):
        problem = f"the trained LoRA holds NaN/inf, so it is not usable; {FIX}"
    elif peak > EXPLODED_MAX_ABS:
        problem = (f"the LoRA exploded: its largest |weight| is {peak:.3g}, above the bound {EXPLODED_MAX_ABS:g} "
                   f"(healthy LoRA weights are of order 1); {FIX}")
    elif steps > 0 and dropped >= steps:
        problem = (f"every one of the {steps} steps had every adapter dropped (module_dropout={module_dropout:g}), "
                   "so nothing was learned; lower module_dropout or train more steps")
    elif steps > 0 and skipped + dropped >= steps:
        why = "non-finite loss or gradients" if not dropped else \
            f"{skipped} with non-finite loss or gradients, {dropped} with every adapter dropped by module_dropout"
        problem = f"every one of the {steps} steps was skipped ({why}), so nothing was learned; {FIX}"
    elif learning:
        problem = (f"the learning guard stopped the run at step {steps} ({learning}); fix what it names, or set "
                   "learning_guard to warn to train on and only report it")
    return Outcome(steps, skipped, rollbacks, peak, problem, dropped, module_dropout, discarded)
