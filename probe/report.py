"""Plain-text report and verdict of the precision probe (pure: plain numbers in, strings out).

Inputs: per LoRA layer a ``SurvivalStats`` (probe.survival); per attention layer the dict of
``ProbeAttentionStats.as_dict()`` (probe.attention); the attention settings as
``{"backend", "scale", "multiplier", "softclamp"}``. Thresholds are named constants so tests and docs
can refer to them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..attention.config import SOFTCLAMP_SAFETY
from .survival import PATHS, SurvivalStats, summarize

MERGE_OK_GAIN = 0.95          # a path keeping >= 95 % of the LoRA's effect is called harmless
TIE_ROWS_WARN = 0.01          # >= 1 % of rows with two bf16(P̄) == 1: the stable fix has something to do
BIAS_GAIN = 0.05             # the stable shift must cut |bias/MAE| by at least this to be recommended
SATURATED_ENTROPY = 0.2       # entropy / ln(keys) below this: near one-hot attention


def attention_summary(layers: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Row-weighted means over layers (entropy ratio, tie fractions, biases); maxima of max_prob/max_logit."""
    rows = sum(float(d["rows"]) for d in layers.values())
    if not layers or rows <= 0:
        return {}
    mean = {key: sum(float(d[key]) * float(d["rows"]) for d in layers.values()) / rows
            for key in ("entropy_ratio", "bf16_one_fraction", "shift_fraction", "bias_standard", "bias_stable")}
    mean["max_prob"] = max(float(d["max_prob"]) for d in layers.values())
    mean["max_logit"] = max(float(d["max_logit"]) for d in layers.values())
    mean["rows"] = rows
    return mean


def lora_verdict(lora: Mapping[str, SurvivalStats]) -> list[str]:
    if not lora:
        return ["No Precision LoRA is attached: attach or load one to measure how much of it bf16 keeps."]
    summary = summarize(lora)
    if not summary:
        return ["The LoRA's delta is zero (freshly attached, lora_up still 0): train it, then probe again."]
    out = []
    merge, add, ours = summary["merge"], summary["add_bf16"], summary["fp32_unmerged"]
    if merge < MERGE_OK_GAIN or add < MERGE_OK_GAIN:
        out.append(f"bf16 keeps only {merge:.0%} of this LoRA's effect when merged and {add:.0%} when its bf16 "
                   f"delta is added to the bf16 output; the fp32-accumulating unmerged path keeps {ours:.0%}. "
                   "Keep this LoRA unmerged with fp32 accumulation on.")
    else:
        out.append(f"This LoRA is large enough for bf16: a merge keeps {merge:.0%} of its effect "
                   f"(fp32 unmerged: {ours:.0%}); merging is fine.")
    return out


def attention_verdict(summary: Mapping[str, float], settings: Mapping[str, object]) -> list[str]:
    if not summary:
        return ["No attention call was seen in the forward."]
    out = []
    ties, shift = summary["bf16_one_fraction"], summary["shift_fraction"]
    bias_std, bias_fix = summary["bias_standard"], summary["bias_stable"]
    if ties >= TIE_ROWS_WARN and abs(bias_std) - abs(bias_fix) >= BIAS_GAIN:
        out.append(f"{ties:.1%} of attention rows have two or more bf16(P̄) == 1 (the Qiu & Yao bias condition); "
                   f"emulated bf16 Ō bias/MAE {bias_std:+.2f} standard vs {bias_fix:+.2f} with the stable shift: "
                   "consider backend=stable for long bf16 training.")
    elif ties >= TIE_ROWS_WARN:
        out.append(f"{ties:.1%} of attention rows have two or more bf16(P̄) == 1, but the stable shift does not "
                   f"reduce the emulated bf16 Ō bias here ({bias_std:+.2f} standard vs {bias_fix:+.2f}): "
                   "backend=stable is not needed on this evidence.")
    else:
        out.append(f"Ties at the row max are rare ({ties:.1%} of rows; the stable shift would fire in {shift:.1%}): "
                   "the stable backend would change little here.")
    multiplier = float(settings.get("multiplier", 1.0))
    if abs(multiplier - 1.0) > 1e-6:
        out.append(f"The softmax scale is {multiplier:g}x the default: a temperature change, not a precision fix. "
                   "Use the same scale at inference (it is recorded in the LoRA's metadata).")
    if summary["entropy_ratio"] < SATURATED_ENTROPY:
        out.append(f"Attention is near one-hot (entropy/ln N = {summary['entropy_ratio']:.2f}); a smaller scale "
                   "multiplier would soften it, at the cost of changing the model's behaviour.")
    clamp = float(settings.get("softclamp", 0.0))
    if clamp > 0 and clamp < SOFTCLAMP_SAFETY * summary["max_logit"]:
        out.append(f"softclamp={clamp:g} is below 10x the max logit {summary['max_logit']:.3g}: it changes the "
                   f"pretrained output; use >= {SOFTCLAMP_SAFETY * summary['max_logit']:.3g} or 0.")
    return out


def lora_table(lora: Mapping[str, SurvivalStats]) -> list[str]:
    lines = ["LoRA delta survival (gain; 1 = full effect, 0 = erased by bf16):",
             "layer | rms(dW)/rms(W) | " + " | ".join(PATHS) + " | merged weights changed"]
    for path, s in lora.items():
        lines.append(f"{path} | {s.rho:.2e} | " + " | ".join(f"{s.gains[p]:.3f}" for p in PATHS)
                     + f" | {s.merge_changed:.1%}")
    summary = summarize(lora)
    if summary:
        lines.append("model (energy-weighted) | - | " + " | ".join(f"{summary[p]:.3f}" for p in PATHS) + " | -")
    return lines


def attention_table(layers: Mapping[str, Mapping[str, float]]) -> list[str]:
    lines = ["Attention (first rows of each head):",
             "layer | entropy/lnN | max p | max logit | rows bf16(P̄)==1 x2 | stable shift fires | "
             "Ō bias/MAE standard | stable"]
    for label, d in layers.items():
        lines.append(f"{label} | {d['entropy_ratio']:.3f} | {d['max_prob']:.3f} | {d['max_logit']:.2f} | "
                     f"{d['bf16_one_fraction']:.1%} | {d['shift_fraction']:.1%} | {d['bias_standard']:+.2f} | "
                     f"{d['bias_stable']:+.2f}")
    return lines


def format_report(lora: Mapping[str, SurvivalStats], attention: Mapping[str, Mapping[str, float]],
                  settings: Mapping[str, object], sigma: float, notes: Sequence[str] = ()) -> str:
    """The whole report: header, verdict first (then ``notes``), then the two tables."""
    head = (f"Precision probe at sigma {sigma:.4g}; attention backend {settings.get('backend')}, "
            f"scale {float(settings.get('scale', 0.0)):.4g} ({float(settings.get('multiplier', 1.0)):g}x default)")
    verdict = lora_verdict(lora) + list(notes) + attention_verdict(attention_summary(attention), settings)
    parts = [head, "", "Verdict:"] + [f"- {v}" for v in verdict] + [""]
    if lora:
        parts += lora_table(lora) + [""]
    parts += attention_table(attention)
    return "\n".join(parts)
