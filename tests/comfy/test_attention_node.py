"""PrecisionPatchAttention as ComfyUI sees it: schema, validation messages, execution and info output."""
from __future__ import annotations

import math

import pytest

import comfy_harness

NODE = "PrecisionPatchAttention"


@pytest.fixture(scope="module")
def node(pack):
    return comfy_harness.node_class(NODE)


@pytest.fixture(scope="module")
def pure(pack_module):
    return pack_module("attention.config"), pack_module("attention.backends"), pack_module("nodes.attention.glue")


def test_schema_inputs_have_tooltips_bounds_and_pure_defaults(node, pure):
    config, backends, _ = pure
    schema = node.GET_SCHEMA() if hasattr(node, "GET_SCHEMA") else node.define_schema()
    inputs = {i.id: i for i in schema.inputs}
    defaults = config.AttentionConfig()
    assert list(inputs) == ["model", "backend", "scale_mode", "scale_value", "stable_beta", "softclamp", "fp32_softmax"]
    assert all(i.tooltip for i in inputs.values())
    assert inputs["backend"].options == ["auto", *backends.BACKENDS]
    assert inputs["scale_mode"].options == list(config.SCALE_MODES)
    for name in ("scale_value", "stable_beta", "softclamp"):
        widget = inputs[name]
        assert None not in (widget.min, widget.max, widget.step)
        assert widget.default == getattr(defaults, name)
    assert (inputs["stable_beta"].min, inputs["stable_beta"].max) == config.STABLE_BETA_RANGE
    assert inputs["fp32_softmax"].default is defaults.fp32_softmax
    assert schema.category == "precision_lora/attention"


GOOD = dict(backend="auto", scale_mode="multiplier", scale_value=2.0, stable_beta=2.0, softclamp=0.0, fp32_softmax=False)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"backend": "warp"}, "input 'backend'='warp' is not an option; choose one of ['auto', 'sdpa', 'math', 'stable'"),
        ({"backend": "flash"}, "backend='flash' is unavailable here: package 'flash-attn' is not installed"),
        ({"backend": "xformers"}, "package 'xformers' is not installed (pip install xformers)"),
        ({"scale_value": 0.0}, "scale_value=0.0 is invalid for scale_mode='multiplier'"),
        ({"scale_value": float("nan")}, "input 'scale_value'=nan is not a finite number; use a value in [0, 100]"),
        ({"scale_value": float("inf")}, "input 'scale_value'=inf is not a finite number"),
        # D4 (issue 13): validate_inputs(**_) made ComfyUI skip min/max for every input of this node
        ({"scale_value": 150.0}, "input 'scale_value'=150.0 is above the maximum 100; use a value in [0, 100]"),
        ({"scale_value": "abc"}, "input 'scale_value'='abc' is not a number (got str)"),
        ({"softclamp": -2.0, "backend": "math"}, "input 'softclamp'=-2.0 is below the minimum 0"),
        ({"softclamp": 30.0}, "choose backend math or stable, or set softclamp to 0"),
        ({"stable_beta": 12.0}, "input 'stable_beta'=12.0 is above the maximum 8"),
    ],
)
def test_validate_inputs_names_node_input_value_and_fix(node, change, fragment):
    message = node.validate_inputs(**{**GOOD, **change})
    assert isinstance(message, str)
    assert message.startswith(f"[Precision LoRA] {NODE}: ")
    assert fragment in message


def test_validate_inputs_accepts_good_values(node):
    assert node.validate_inputs(**GOOD) is True
    assert node.validate_inputs(**{**GOOD, "backend": "stable", "softclamp": 50.0}) is True


def test_execute_patches_a_clone_and_reports_the_resolved_scale(node, pure):
    from models import tiny_flux1

    config, _, glue = pure
    model = tiny_flux1()  # hidden 64, 2 heads: head_dim 32
    out = node.execute(model, **GOOD)
    patched, info = out.result if hasattr(out, "result") else out
    assert glue.get_attention_config(patched) == config.AttentionConfig(scale_mode="multiplier", scale_value=2.0)
    assert glue.get_attention_config(model) is None
    assert f"softmax scale: {2 / math.sqrt(32):.6g} for head_dim 32 (2 x default {1 / math.sqrt(32):.6g})" in info
    assert "use the same scale at inference" in info


def test_execute_raises_the_same_clear_error_when_validation_is_skipped(node):
    from models import tiny_flux1

    with pytest.raises(ValueError, match=r"\[Precision LoRA\] PrecisionPatchAttention: input 'scale_value'=-1.0 is "
                                         r"below the minimum 0; use a value in \[0, 100\]"):
        node.execute(tiny_flux1(), **{**GOOD, "scale_value": -1.0})
    with pytest.raises(ValueError, match=r"PrecisionPatchAttention: scale_value=0.0 is invalid for scale_mode"):
        node.execute(tiny_flux1(), **{**GOOD, "scale_value": 0.0})
