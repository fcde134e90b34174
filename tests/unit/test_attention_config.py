"""AttentionConfig: validation messages, scale resolution, metadata round trip."""
from __future__ import annotations

import math

import pytest

from attention.config import METADATA_KEYS, AttentionConfig


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"backend": "nope"}, "backend='nope' is unknown; choose one of auto, sdpa, math, stable, flash, sage, xformers (usable here: auto, sdpa, math, stable"),
        ({"scale_mode": "weird"}, "scale_mode='weird' is unknown"),
        ({"scale_mode": "absolute", "scale_value": 0.0}, "scale_value=0.0 is invalid for scale_mode='absolute'"),
        ({"scale_mode": "absolute", "scale_value": -0.1}, "must be a finite number > 0"),
        ({"scale_mode": "multiplier", "scale_value": float("nan")}, "scale_value=nan is invalid"),
        ({"scale_mode": "multiplier", "scale_value": float("inf")}, "scale_value=inf is invalid"),
        ({"stable_beta": 1.0}, "stable_beta=1.0 is out of range; use a value in [1.5, 8.0]"),
        ({"stable_beta": 9.0}, "stable_beta=9.0 is out of range"),
        ({"softclamp": -1.0}, "softclamp=-1.0 is invalid; use 0 (off) or a finite value > 0"),
        ({"softclamp": float("nan"), "backend": "math"}, "softclamp=nan is invalid"),
        ({"softclamp": 50.0, "backend": "sdpa"}, "choose backend math or stable, or set softclamp to 0"),
        ({"softclamp": 50.0}, "backend='auto' never exposes"),
        ({"fp32_softmax": True, "backend": "sage"}, "fp32_softmax=True is not possible with backend='sage'"),
    ],
)
def test_validate_rejects_with_a_message_naming_field_and_value(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        AttentionConfig(**kwargs).validate()
    assert fragment in str(info.value)


def test_resolve_scale_modes():
    assert AttentionConfig().resolve_scale(128) == pytest.approx(1 / math.sqrt(128), rel=1e-15)
    assert AttentionConfig(scale_mode="absolute", scale_value=0.125).resolve_scale(64) == 0.125
    assert AttentionConfig(scale_mode="multiplier", scale_value=2.0).resolve_scale(16) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="head_dim=0 is invalid"):
        AttentionConfig().resolve_scale(0)


def test_is_default_only_for_stock_behaviour():
    assert AttentionConfig().is_default()
    assert AttentionConfig(scale_mode="multiplier", scale_value=1.0).is_default()
    assert not AttentionConfig(scale_mode="multiplier", scale_value=1.5).is_default()
    assert not AttentionConfig(backend="sdpa").is_default()
    assert not AttentionConfig(collect_stats=True).is_default()
    assert not AttentionConfig(fp32_softmax=True).is_default()


def test_metadata_round_trip_and_resolved_scale():
    cfg = AttentionConfig(backend="stable", scale_mode="multiplier", scale_value=1.5, stable_beta=3.0,
                          softclamp=50.0, fp32_softmax=True)
    md = cfg.to_metadata(128)
    assert set(md) == set(METADATA_KEYS)
    assert all(isinstance(value, str) for value in md.values())
    assert float(md["ss_attn_softmax_scale"]) == pytest.approx(1.5 / math.sqrt(128), rel=1e-15)
    assert md["ss_attn_mode"] == "stable"
    back = AttentionConfig.from_metadata(md)
    assert back == cfg


def test_from_metadata_without_attention_keys_is_none():
    assert AttentionConfig.from_metadata({"ss_network_dim": "16"}) is None


def test_from_metadata_with_only_the_resolved_scale_gives_an_absolute_scale():
    cfg = AttentionConfig.from_metadata({"ss_attn_softmax_scale": "0.1"})
    assert cfg == AttentionConfig(scale_mode="absolute", scale_value=0.1)


@pytest.mark.parametrize(
    "md, fragment",
    [
        ({"ss_attn_softmax_scale": "abc"}, "ss_attn_softmax_scale='abc' is not a number"),
        ({"ss_attn_mode": "warp"}, "LoRA metadata holds invalid attention settings: backend='warp' is unknown"),
        ({"ss_attn_fp32_softmax": "maybe"}, "ss_attn_fp32_softmax='maybe' is not a boolean"),
        ({"ss_attn_scale_mode": "absolute", "ss_attn_scale_value": "-2"}, "scale_value=-2.0 is invalid"),
    ],
)
def test_from_metadata_rejects_bad_values(md, fragment):
    with pytest.raises(ValueError) as info:
        AttentionConfig.from_metadata(md)
    assert fragment in str(info.value)


def test_replace_validates():
    cfg = AttentionConfig().replace(backend="math", softclamp=30.0)
    assert (cfg.backend, cfg.softclamp) == ("math", 30.0)
    with pytest.raises(ValueError, match="stable_beta=20"):
        cfg.replace(stable_beta=20)
