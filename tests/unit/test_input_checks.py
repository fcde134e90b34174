"""training.checks: the one number check every user input goes through (file names: test_file_names.py).

Issue 13: D5 (NaN passes range checks).
"""
from __future__ import annotations

import math

import pytest

from training.checks import number_problem, show
from training.settings import TrainSettings

NUMBERS = [
    # value, lo, hi, integer, expected phrase (None = accepted)
    (0.5, 0.0, 1.0, False, None),
    (0, 0, 10, True, None),
    (float("nan"), 0.0, 1000.0, False, "is not a finite number; use a value in [0, 1000]"),
    (float("inf"), None, None, False, "is not a finite number; use a finite number"),
    (-float("inf"), 0.0, None, False, "is not a finite number; use a value >= 0"),
    (150.0, 0.0, 100.0, False, "is above the maximum 100; use a value in [0, 100]"),
    (-1, 0, 2**31 - 1, True, "is below the minimum 0"),
    (2.5, 0, 10, True, "is not an integer"),
    ("abc", 0.01, 0.99, False, "is not a number (got str); use a value in [0.01, 0.99]"),
    (True, 0, 1, False, "is not a number (got bool)"),
    (None, 0, 1, True, "is not an integer (got NoneType)"),
    (10**30, 0, 2**64 - 1, True, "is above the maximum"),
]


@pytest.mark.parametrize("value, lo, hi, integer, expected", NUMBERS, ids=[repr(n[0])[:20] for n in NUMBERS])
def test_number_problem(value, lo, hi, integer, expected):
    got = number_problem(value, lo, hi, integer=integer)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got


def test_show_shortens_long_values_and_says_how_long():
    assert show("abc") == "'abc'"
    long = show("x" * 5000)
    assert len(long) < 100 and "(5000 characters)" in long


@pytest.mark.parametrize("field", ["max_grad_norm", "dop_multiplier", "weight_decay", "logit_mean", "learning_rate",
                                   "shift", "loraplus_ratio"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_train_settings_refuse_non_finite_floats(field, bad):
    """D5: max_grad_norm=NaN used to disable clipping silently, dop_multiplier=NaN DOP, weight_decay=NaN
    reached torch as a raw error."""
    with pytest.raises(ValueError, match=rf"TrainSettings\.{field}={bad!r}: is not a finite number"):
        TrainSettings(**{field: bad}).validate()


def test_train_settings_still_accept_their_defaults_and_zero_where_meaningful():
    TrainSettings().validate()
    TrainSettings(max_grad_norm=0.0, dop_multiplier=0.0, weight_decay=0.0).validate()
    assert math.isfinite(TrainSettings().learning_rate)


# ---- issue 22, item 7: one entry per problem in ComfyUI's answer (nodes/checks/gate_errors.py) ------------

def _gate_errors():
    import importlib

    from pure_packages import PACK

    return importlib.import_module(f"{PACK}.nodes.checks.gate_errors")


def _copies(message: str, names: list[str]) -> list[dict]:
    """What ComfyUI makes of one validate_inputs message: a copy under every input."""
    return [{"type": "custom_validation_failed", "message": "Custom validation failed for node",
             "details": f"{n} - {message}", "extra_info": {"input_name": n}} for n in names]


INPUTS = ["model", "rank", "include", "exclude", "seed"]
COLLAPSED = [
    ("[Precision LoRA] PrecisionAttachLoRA: input 'seed'=-1 is below the minimum 0; use ...", "seed"),
    ("[Precision LoRA] PrecisionAttachLoRA: include regex '(' is invalid (...): fix the regular expression", "include"),
    ("[Precision LoRA] X: input 'exclude'='a' and input 'include'='a' select nothing; change one", "exclude"),
    ("[Precision LoRA] X: the model and its rank ...", "model"),  # bare names: the earliest one
    ("[Precision LoRA] X: nothing named here", "model"),  # none named: the first input
]


@pytest.mark.parametrize("message, name", COLLAPSED)
def test_a_pack_message_filed_under_every_input_is_kept_once_under_its_input(message, name):
    (one,) = _gate_errors().collapse(_copies(message, INPUTS))
    assert one["extra_info"]["input_name"] == name
    assert one["details"] == f"{name} - {message}" and one["type"] == "custom_validation_failed"


def test_collapse_leaves_host_entries_and_other_packs_alone_and_keeps_distinct_messages():
    host = {"type": "required_input_missing", "message": "Required input is missing", "details": "rank",
            "extra_info": {"input_name": "rank"}}
    other = _copies("[Other Pack] bad", ["model", "rank"])
    ours = _copies("[Precision LoRA] N: input 'rank'=0 is below the minimum 1; use ...", INPUTS)
    theirs = _copies("[Precision LoRA] N: input 'seed'=-1 is below the minimum 0; use ...", INPUTS)
    out = _gate_errors().collapse([host, *other, *ours, *theirs])
    assert out[:3] == [host, *other]
    assert [e["extra_info"]["input_name"] for e in out[3:]] == ["rank", "seed"]
    body = {"error": {}, "node_errors": {"7": {"errors": ours, "class_type": "N"}}}
    assert len(_gate_errors().collapse_response(body)["node_errors"]["7"]["errors"]) == 1


def test_offload_block_inputs_needs_checkpointing_and_a_bool():
    """offload_block_inputs without gradient_checkpointing is refused naming the input and the fix (only a
    checkpointed block's inputs wait for backward); a non-bool too; with checkpointing it is accepted."""
    with pytest.raises(ValueError, match=r"offload_block_inputs=True: needs gradient_checkpointing on .* turn "
                                         r"gradient_checkpointing on or set offload_block_inputs to false"):
        TrainSettings(offload_block_inputs=True)
    with pytest.raises(ValueError, match="offload_block_inputs='yes': must be true or false"):
        TrainSettings(offload_block_inputs="yes", gradient_checkpointing=True)
    assert TrainSettings(offload_block_inputs=True, gradient_checkpointing=True).offload_block_inputs is True
