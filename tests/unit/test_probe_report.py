"""Probe verdicts follow the measured numbers (thresholds from probe.report)."""
from __future__ import annotations

from probe.survival import SurvivalStats
from probe.report import attention_summary, attention_verdict, format_report, lora_verdict


def _layer(rows, ties, bias_std, bias_fix, entropy=0.8, max_logit=3.0):
    return {"calls": 1, "rows": rows, "entropy_ratio": entropy, "max_prob": 0.4, "max_logit": max_logit,
            "bf16_one_fraction": ties, "shift_fraction": ties, "bias_standard": bias_std, "bias_stable": bias_fix}


def _stats(merge, energy=1.0):
    gains = {"merge": merge, "add_bf16": merge, "add_rounded": merge, "fp32_unmerged": 1.0}
    return SurvivalStats(gains=gains, rel_errors=dict.fromkeys(gains, 0.5), merge_changed=0.3, rho=1e-3,
                         ideal_energy=energy)


def test_attention_summary_is_row_weighted():
    s = attention_summary({"a": _layer(100, 0.0, 0.0, 0.0, entropy=0.2), "b": _layer(300, 0.04, -0.4, 0.0, entropy=0.6)})
    assert s["entropy_ratio"] == (0.2 * 100 + 0.6 * 300) / 400
    assert s["bf16_one_fraction"] == 0.03 and s["rows"] == 400


def test_stable_recommended_only_when_it_cuts_the_bias():
    settings = {"backend": "sdpa", "scale": 0.1, "multiplier": 1.0, "softclamp": 0.0}
    helps = attention_verdict(attention_summary({"a": _layer(100, 0.05, -0.5, -0.02)}), settings)
    useless = attention_verdict(attention_summary({"a": _layer(100, 0.05, -0.14, -0.14)}), settings)
    rare = attention_verdict(attention_summary({"a": _layer(100, 0.001, -0.5, 0.0)}), settings)
    assert "consider backend=stable" in helps[0]
    assert "not needed" in useless[0] and "consider backend=stable" not in useless[0]
    assert rare[0].startswith("Ties at the row max are rare (0.1% of rows")


def test_scale_softclamp_and_lora_verdicts():
    settings = {"backend": "sdpa", "scale": 0.2, "multiplier": 2.0, "softclamp": 20.0}
    v = attention_verdict(attention_summary({"a": _layer(10, 0.0, 0.0, 0.0, entropy=0.1, max_logit=5.0)}), settings)
    assert any("2x the default: a temperature change" in line for line in v)
    assert any("near one-hot" in line for line in v)
    assert any("softclamp=20 is below 10x the max logit 5" in line for line in v)
    assert "keeps only 60%" in lora_verdict({"x": _stats(0.6)})[0]
    assert "merging is fine" in lora_verdict({"x": _stats(0.99)})[0]
    assert "zero" in lora_verdict({"x": _stats(0.0, energy=0.0)})[0]
    text = format_report({"x": _stats(0.6)}, {"a": _layer(10, 0.0, 0.0, 0.0)}, settings, 0.5)
    assert "x | 1.00e-03 | 0.600 | 0.600 | 0.600 | 1.000 | 30.0%" in text
