"""The input gate (nodes/checks/gate.py) of every pack node, driven by each node's own schema.

Issue 13: D4 (validate_inputs(**_) made ComfyUI skip min/max of every input of Patch Attention and
Probe), D5 (NaN passes ComfyUI's range checks: max_grad_norm, dop_multiplier, Load LoRA strength ...),
D7/D10 (NUL, newline, traversal, overlong names in every file-name input).
"""
from __future__ import annotations

import asyncio
import uuid

import pytest

import comfy_harness

# nodes/model/load.py belongs to the ComfyUI-compatibility work; it adopts the gate separately.
NOT_YET_GATED: set[str] = set()


def _nodes():
    product = comfy_harness.pack_module("nodes.extension").PRODUCT_NODES
    return [*product, *comfy_harness.pack_module("demo.nodes").NODES]


def _gate_base():
    return comfy_harness.pack_module("nodes.checks.gate").PrecisionNode


def _inputs(node, kinds):
    types = node.INPUT_TYPES()
    return [(name, entry) for section in ("required", "optional") for name, entry in types.get(section, {}).items()
            if entry[0] in kinds]


def _wrap(node, value):
    return [value] if node.INPUT_IS_LIST else value


def test_every_pack_node_goes_through_the_gate(pack):
    nodes = _nodes()
    assert len(nodes) >= 12
    ungated = sorted(n.__name__ for n in nodes if not issubclass(n, _gate_base()))
    assert set(ungated) <= NOT_YET_GATED, ungated
    for node in nodes:
        if issubclass(node, _gate_base()):
            assert node.NODE == node.define_schema().node_id
            assert getattr(node.execute, "precision_gated", False), node.__name__


def _gated_nodes():
    return [n for n in _nodes() if issubclass(n, _gate_base())]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e308, "abc"])
def test_every_float_input_refuses_non_finite_huge_and_text(pack, bad):
    checked = 0
    for node in _gated_nodes():
        for name, (_kind, info) in _inputs(node, {"FLOAT"}):
            if bad == 1e308 and info.get("max", float("inf")) >= 1e308:
                continue
            message = node.validate_inputs(**{name: _wrap(node, bad)})
            assert isinstance(message, str), (node.NODE, name)
            assert message.startswith(f"[Precision LoRA] {node.NODE}: input '{name}'={bad!r} "), message
            assert "use a value in [" in message
            with pytest.raises(ValueError) as err:  # linked values skip validation: the gate runs again
                node.execute(**{name: _wrap(node, bad)})
            assert str(err.value) == message
            checked += 1
    assert checked >= 20  # Patch Attention, Attach/Load LoRA, Train Settings, Probe, Loss Graph ...


def test_every_int_input_refuses_values_outside_its_range(pack):
    checked = 0
    for node in _gated_nodes():
        for name, (_kind, info) in _inputs(node, {"INT"}):
            for bad in (info["min"] - 1, info["max"] + 1, 2.5):
                message = node.validate_inputs(**{name: _wrap(node, bad)})
                assert isinstance(message, str) and f"{node.NODE}: input '{name}'={bad!r} " in message, message
                checked += 1
    assert checked >= 30


def test_every_combo_refuses_an_unknown_option(pack):
    checked = 0
    for node in _gated_nodes():
        for name, (_kind, info) in _inputs(node, {"COMBO"}):
            message = node.validate_inputs(**{name: _wrap(node, "no_such_option")})
            folder = node.FILE_LIST_INPUTS.get(name)
            why = f"is not in {folder}; put the file there and refresh" if folder else "is not an option; choose one of"
            assert isinstance(message, str) and f"input '{name}'='no_such_option' {why}" in message, message
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("bad, why", [
    ("../../fuzz", "contains '..'"), ("/tmp/fuzz", "is an absolute path"), ("a\x00b", "control character '\\x00'"),
    ("a\nb", "control character '\\n'"), ("n" * 300, "has a part of 300 bytes"),
    # issue 22 item 5
    ("a\x85b", "control character '\\x85' (U+0085)"), ("a\u2028b", "(U+2028 LINE SEPARATOR)"),
    ("a\u200bb", "(U+200B ZERO WIDTH SPACE)"), ("a\u202eb", "(U+202E RIGHT-TO-LEFT OVERRIDE)"),
    ("CON", "a Windows device name"), ("lpt3.txt", "a Windows device name"), ("run.", "ending in a dot or space"),
    (".", "which names a folder"),
])
def test_every_file_name_input_refuses_unsafe_names(pack, bad, why):
    checked = []
    for node in _gated_nodes():
        for name in node.FILE_NAME_INPUTS:
            message = node.validate_inputs(**{name: _wrap(node, bad)})
            assert isinstance(message, str) and f"{node.NODE}: input '{name}'=" in message and why in message, message
            checked.append((node.NODE, name))
    # resume_from has rules of its own (it also takes the absolute path of a checkpoint in a loras folder)
    train = next(n for n in _gated_nodes() if n.NODE == "PrecisionTrainLoRA")
    message = train.validate_inputs(resume_from=_wrap(train, bad))
    assert isinstance(message, str) and "PrecisionTrainLoRA: input 'resume_from'=" in message and why in message, message
    assert set(checked) >= {("PrecisionSaveLoRA", "filename_prefix"), ("PrecisionLossGraph", "filename_prefix"),
                            ("PrecisionTrainLoRA", "name")}


def test_every_string_input_refuses_a_lone_surrogate_naming_node_input_value_and_fix(pack):
    """Issue 22 item 4: a lone UTF-16 surrogate reached an encoder as "'utf-8' codec can't encode ..."."""
    checked = []
    for node in _gated_nodes():
        for name, _entry in _inputs(node, {"STRING"}):
            message = node.validate_inputs(**{name: _wrap(node, "ab\ud800")})
            assert message == (f"[Precision LoRA] {node.NODE}: input '{name}'='ab\\ud800' contains the lone UTF-16 "
                               "surrogate '\\ud800' at character 2, which is not text (a broken copy or client); "
                               "retype the value"), message
            with pytest.raises(ValueError) as err:  # a linked value: the gate again before the node runs
                node.execute(**{name: _wrap(node, "ab\ud800")})
            assert str(err.value) == message
            checked.append((node.NODE, name))
    assert {("PrecisionAttachLoRA", "include"), ("PrecisionAttachLoRA", "exclude"),
            ("PrecisionSaveLoRA", "filename_prefix"), ("PrecisionTrainLoRA", "name"),
            ("PrecisionTrainLoRA", "resume_from")} <= set(checked), checked


def test_comfyui_validation_refuses_nan_it_would_let_through(pack):
    """D5 through ComfyUI's own validation: NaN passes its min/max test, the gate's message comes back."""
    import execution

    prompt = {
        "1": {"class_type": "PrecisionProbe", "inputs": {"model": ["2", 0], "latent": ["3", 0], "conditioning": ["4", 0],
                                                         "noise_level": float("nan"), "seed": 0, "max_rows": 256}},
        "2": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": "none.safetensors",
                                                                      "weight_dtype": "default"}},
        "3": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["2", 0], "width": 64, "height": 64,
                                                              "batch_size": 1, "seed": 0}},
        "4": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["2", 0], "text": "x", "seed": 0,
                                                                    "tokens": 8}},
    }
    ok, errors, _ = asyncio.run(execution.validate_inputs(str(uuid.uuid4()), prompt, "1", {}))
    details = " | ".join(e.get("details", "") for e in errors)
    assert not ok
    assert "PrecisionProbe: input 'noise_level'=nan is not a finite number; use a value in [0.01, 0.99]" in details


def test_the_headless_runner_prints_a_gate_message_once_under_its_input(pack):
    """Issue 22 item 7 for scripts/train.py: ComfyUI's validation files the gate's one message under every input
    of the node; the runner's report shows it once, under the input at fault."""
    import execution

    settings = comfy_harness.pack_module("training.settings").TrainSettings().to_dict()
    prompt = {"1": {"class_type": "PrecisionTrainSettings", "inputs": {**settings, "warmup_steps": -1}}}
    ok, errors, _ = asyncio.run(execution.validate_inputs(str(uuid.uuid4()), prompt, "1", {}))
    assert not ok and len(errors) == len(settings)  # the host's copies, one per input
    text = comfy_harness.pack_module("runner.headless")._validation_text(
        (False, {"message": "invalid"}, [], {"1": {"errors": errors, "class_type": "PrecisionTrainSettings"}}))
    lines = text.splitlines()[1:]
    assert len(lines) == 1, text
    assert "warmup_steps - [Precision LoRA] PrecisionTrainSettings: input 'warmup_steps'=-1 is below the minimum 0" \
        in lines[0], text
