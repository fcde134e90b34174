"""Is it learning? The learning guard (Train Settings' ``learning_guard``: off / warn / stop).

A run can end "ok" and have learned nothing: an adapter whose factors never moved (a frozen factor, gradients
zeroed by a hook, updates below what a bf16 parameter can store), or gradients that collapsed to nothing. No
loss curve shows it; the guard looks for it over the first ``learning_guard_steps`` optimizer steps of each
call of ``train`` (or all of a shorter call, from 2 steps) and names, by module and factor:

- ``never moved``: a trainable factor still holds its initial values, although gradients reached it (the optimizer changed nothing: a frozen factor, a learning rate of 0 for its group);
- ``below resolution``: the same, for a factor stored in bf16/fp16 whose fp32 master did move: each update is
  smaller than the stored dtype can hold (raise the learning rate, store the LoRA in fp32);
- ``zero gradients``: every gradient the factor received in the window was exactly 0 while the adapter's other
  factor learned (a hook or a detached path cuts it off from the loss). An adapter none of whose factors got a
  non-zero gradient is a note, not a finding: its output does not reach the loss (the last block's text-query
  projection of a model without single-stream blocks), which looks the same as an adapter cut off whole;
- ``non-finite gradients``: every gradient it received was NaN/inf (the NaN guard skipped those steps);
- ``gradient collapse``: the total gradient norm over the window's last quarter is under ``COLLAPSE`` of its
  first quarter's (from 8 steps);
- ``recomputation differs`` (with gradient checkpointing, on the first checkpointed step, at once: it does not wait
  for the window): a checkpointed block's recomputed outputs differ from its forward's beyond a dtype-aware
  tolerance (``training.grad.RecomputeCheck``), so backward differentiates other activations than the loss saw.

Pure torch, no ComfyUI. Costs one ``_foreach_norm`` and one host sync per step inside the window, nothing after.
A LoRA up factor starts at zero, so its down factor gets no gradient on the first step: a finding needs the
whole window, never one step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

LEARNING_GUARDS = {
    "warn": "name adapters that do not learn (factors that never moved, zero or non-finite gradients, updates "
            "below the stored dtype's resolution, gradient-norm collapse) in the report, the log and the metadata",
    "stop": "as warn, and end the run with an error at the check, before the LoRA is saved as a success",
    "off": "no check",
}
COLLAPSE = 1e-4  # last quarter's median gradient norm under this fraction of the first quarter's
MIN_STEPS, COLLAPSE_STEPS = 2, 8


@dataclass(frozen=True)
class Finding:
    kind: str                # "never moved", "below resolution", "zero gradients", "non-finite gradients", "gradient collapse"
    modules: tuple[str, ...]  # the adapters (module paths) it names; () for the run as a whole
    detail: str = ""

    def text(self, limit: int = 4) -> str:
        if not self.modules:
            return f"{self.kind}: {self.detail}"
        names = ", ".join(self.modules[:limit]) + (f" and {len(self.modules) - limit} more" if len(self.modules) > limit else "")
        what = "block" if self.kind == "recomputation differs" else "factor"
        return f"{self.kind} ({len(self.modules)} {what}{'s' if len(self.modules) != 1 else ''}: {names})" + (
            f": {self.detail}" if self.detail else "")


def _signature(tensors: list[torch.Tensor]) -> list[tuple[float, float]]:
    """(sum, 2-norm) of each tensor in float64, on the host: equal before and after means unchanged (one sync)."""
    if not tensors:
        return []
    with torch.no_grad():  # accumulated in float64 without a float64 copy of each tensor
        sums = torch.stack([t.detach().sum(dtype=torch.float64) for t in tensors])
        norms = torch.stack([torch.linalg.vector_norm(t.detach(), dtype=torch.float64) for t in tensors])
        both = torch.stack([sums, norms], 1).cpu().tolist()
    return [(a, b) for a, b in both]


@dataclass
class LearningGuard:
    """Watches one ``train`` call. ``stored``: the module's trainable parameters (what is saved); ``optimized``:
    what the optimizer updates, one per stored parameter (the same tensor, or its fp32 master); ``modules``:
    each stored parameter's name as findings give it (its module path and factor: "blocks.0.attn.q (down)")."""

    stored: list[torch.Tensor]
    optimized: list[torch.Tensor]
    modules: list[str]
    window: int
    mode: str = "warn"
    observed: int = 0
    findings: list[Finding] | None = None  # None until the check ran
    _start: list[tuple[float, float]] = field(default_factory=list)
    _start_opt: list[tuple[float, float]] = field(default_factory=list)
    _nonzero: list[bool] = field(default_factory=list)
    _finite: list[bool] = field(default_factory=list)
    _seen: list[bool] = field(default_factory=list)
    _norms: list[float] = field(default_factory=list)
    extra: list[Finding] = field(default_factory=list)  # found before the window's check (recomputation)
    unused: list[str] = field(default_factory=list)  # adapters no gradient reached at all (a note, see check)

    def __post_init__(self) -> None:
        if self.mode not in LEARNING_GUARDS:
            raise ValueError(f"learning_guard={self.mode!r}: choose one of {sorted(LEARNING_GUARDS)}")
        n = len(self.stored)
        self._start, self._start_opt = _signature(self.stored), _signature(self.optimized)
        self._nonzero, self._finite, self._seen = [False] * n, [False] * n, [False] * n

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.findings is None

    def observe(self) -> None:
        """After backward (gradients on ``optimized``), before the optimizer step or the NaN guard's skip."""
        if not self.active:
            return
        have = [i for i, p in enumerate(self.optimized) if p.grad is not None]
        if have:
            with torch.no_grad():
                norms = torch.stack(torch._foreach_norm([self.optimized[i].grad.float() for i in have])).cpu().tolist()
            for i, norm in zip(have, norms):
                self._seen[i] = True
                if math.isfinite(norm):
                    self._finite[i] = True
                    self._nonzero[i] = self._nonzero[i] or norm > 0
            finite = [x for x in norms if math.isfinite(x)]
            self._norms.append(math.sqrt(sum(x * x for x in finite)) if finite else float("nan"))
        self.observed += 1

    def due(self, last_step_of_call: bool) -> bool:
        """Whether to check now: the window is full, or the call ends with at least ``MIN_STEPS`` observed."""
        return self.active and (self.observed >= self.window or (last_step_of_call and self.observed >= MIN_STEPS))

    def recomputation(self, differences: list[tuple[str, float, float]]) -> Finding | None:
        """The finding for the recomputation check's differences, once (None when none, or said already)."""
        if self.mode == "off" or not differences or any(f.kind == "recomputation differs" for f in self.extra):
            return None
        worst = max(differences, key=lambda d: d[1])
        finding = Finding("recomputation differs", tuple(name for name, _, _ in differences),
                          f"under gradient checkpointing the recomputed outputs differ from the forward's (largest "
                          f"relative difference {worst[1]:.3g}, tolerance {worst[2]:.3g}): the gradients are not the "
                          "loss's; a block that is not deterministic, or a host round trip / swapped weight that "
                          "changed; turn gradient_checkpointing off to confirm")
        self.extra.append(finding)
        return finding

    def check(self) -> list[Finding]:
        """The findings (empty: learning), once per call. Judged per factor (an adapter's down and up apart: a
        frozen lora_A beside a moving lora_B is the classic case)."""
        moved = [a != b for a, b in zip(_signature(self.stored), self._start)]
        moved_opt = [a != b for a, b in zip(_signature(self.optimized), self._start_opt)]
        by: dict[str, list[str]] = {}
        adapters: dict[str, list[int]] = {}
        for i, name in enumerate(self.modules):
            adapters.setdefault(_adapter(name), []).append(i)
        # every factor of an adapter with zero gradients and unmoved: its output does not reach the loss (the last
        # block's text-query projection of a model without single-stream blocks), or all of it is cut off; the two
        # look the same, so it is a note, not a finding
        # (judged by the gradients, not by whether the values moved: decoupled weight decay moves a factor whose
        # gradients are all zero)
        unused = {a for a, idx in adapters.items()
                  if all(self._seen[i] and self._finite[i] and not self._nonzero[i] for i in idx)}
        self.unused = sorted(unused)
        for i, name in enumerate(self.modules):
            if not self._seen[i] or _adapter(name) in unused:
                continue  # no gradient ever (module dropout, a layer outside this forward): nothing to judge
            if not self._finite[i]:
                kind = "non-finite gradients"
            elif not self._nonzero[i]:
                kind = "zero gradients"
            elif moved[i]:
                continue
            elif moved_opt[i] and self.stored[i].dtype in (torch.bfloat16, torch.float16):
                kind = "below resolution"
            else:
                kind = "never moved"
            by.setdefault(kind, []).append(name)
        details = {
            "never moved": f"gradients reached them but the optimizer changed nothing in {self.observed} steps "
                           "(a frozen factor or a learning rate of 0 for its group)",
            "below resolution": f"their fp32 masters moved but the stored {self._low_dtype()} values did not in "
                                f"{self.observed} steps: each update is below that dtype's resolution; raise "
                                "learning_rate or store the LoRA in fp32",
            "zero gradients": f"every gradient in {self.observed} steps was exactly 0 (a hook or a detached path "
                              "cuts them off from the loss)",
            "non-finite gradients": f"every gradient in {self.observed} steps was NaN/inf (the NaN guard skipped "
                                    "them); lower learning_rate, check the data",
        }
        findings = [*self.extra, *(Finding(kind, tuple(mods), details[kind]) for kind, mods in by.items())]
        collapse = self._collapse()
        if collapse:
            findings.append(collapse)
        self.findings = findings
        return findings

    def _low_dtype(self) -> str:
        low = {str(p.dtype).replace("torch.", "") for p in self.stored if p.dtype in (torch.bfloat16, torch.float16)}
        return "/".join(sorted(low)) or "low-precision"

    def _collapse(self) -> Finding | None:
        norms = [x for x in self._norms if math.isfinite(x)]
        if len(norms) < COLLAPSE_STEPS:
            return None
        q = len(norms) // 4
        first, last = sorted(norms[:q])[q // 2], sorted(norms[-q:])[q // 2]
        if first > 0 and last < COLLAPSE * first:
            return Finding("gradient collapse", (), f"the gradient norm fell from {first:.3g} (median of the first "
                           f"{q} steps) to {last:.3g} (last {q}): the LoRA no longer learns; check the learning "
                           "rate schedule and the loss")
        return None


def _adapter(name: str) -> str:
    """The adapter a factor's name belongs to: "blocks.0.attn.q (down)" -> "blocks.0.attn.q"; a plain parameter
    name -> its module ("lora.down" -> "lora"; "down" -> "")."""
    if name.endswith(")") and " (" in name:
        return name.rsplit(" (", 1)[0]
    return name.rsplit(".", 1)[0] if "." in name else ""


def summary(findings: list[Finding] | None, observed: int, unused: list[str] = ()) -> str:
    """The metadata / report line: "learning: ok over 20 steps ..." or the findings; ``unused``: adapters no
    gradient reached at all, noted after."""
    if findings is None:
        return f"learning: not checked (fewer than {MIN_STEPS} steps)"
    note = ""
    if unused:
        names = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        note = (f"; note: {len(unused)} adapter{'s' if len(unused) != 1 else ''} got no gradient at all in {observed} "
                f"steps, so their output does not reach the loss ({names}): they train nothing (exclude them from "
                "the targets to save their memory)")
    if not findings:
        return f"learning: ok over {observed} steps (every factor that got gradients moved){note}"
    return f"learning: {len(findings)} finding{'s' if len(findings) != 1 else ''} over {observed} steps: " + "; ".join(
        f.text() for f in findings) + note
