"""Every comfy-kitchen op ComfyUI's code calls is routed or refused while the pack needs gradients (issue 25
item 3).

The list is read at test time from the running ComfyUI's source (``comfy/`` and ``comfy_extras/``): every
``<alias>.<name>`` where ``<alias>`` is ``comfy_kitchen`` imported (``import comfy_kitchen [as ck]``) or
``comfy.quant_ops.ck``, plus the names of ``from comfy_kitchen[.sub] import ...``. Each name must be in
exactly one table of ``nodes/host/comfy_compat.py``: ``KITCHEN_ROPE_OPS`` (routed to comfy-kitchen's own
plain-PyTorch twin), ``KITCHEN_REFUSED_OPS`` (refused with its name, where ComfyUI calls it and the fix when
a tensor that needs gradients reaches it) or ``KITCHEN_NOT_OPS`` (not a tensor op). An op a future ComfyUI
starts calling fails the first test until it is given a route or a refusal. The others check that each
table does what it says, at every place ComfyUI's modules hold comfy-kitchen.
"""
from __future__ import annotations

import inspect
import os
import re
import sys
from collections import defaultdict

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

IMPORT_AS = re.compile(r"^\s*import\s+comfy_kitchen(?:\s+as\s+(\w+))?\s*$", re.M)
FROM_IMPORT = re.compile(r"^\s*from\s+comfy_kitchen((?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]*)", re.M)
QUANT_OPS_CK = re.compile(r"\bquant_ops\.ck\.(\w+)")
BOUND = r"^\s*(\w+)\s*=\s*{alias}\.(\w+)\s*$"


def _kitchen_host():
    """comfy.quant_ops where this ComfyUI uses comfy-kitchen (0.30+), else skip with the host's reason."""
    try:
        import comfy.quant_ops as quant_ops
    except ImportError:
        quant_ops = None
    if quant_ops is None or not hasattr(quant_ops, "ck"):
        pytest.skip("ComfyUI 0.3.75 has no comfy-kitchen ops (they arrived in 0.30): nothing to route or refuse")
    return quant_ops


def _sources():
    import comfy.model_base  # comfy/ has no __init__.py: a module inside it locates the ComfyUI root

    root = os.path.dirname(os.path.dirname(os.path.abspath(comfy.model_base.__file__)))
    for top in ("comfy", "comfy_extras"):
        for folder, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    with open(path, encoding="utf-8") as fh:
                        yield module, fh.read()


def kitchen_uses() -> dict[str, list[str]]:
    """{name of comfy_kitchen that ComfyUI reads: ["module:line", ...]} from the running ComfyUI's source."""
    uses: dict[str, list[str]] = defaultdict(list)

    def add(name: str, module: str, text: str, pos: int) -> None:
        uses[name].append(f"{module}:{text.count(chr(10), 0, pos) + 1}")

    for module, text in _sources():
        aliases = {m.group(1) or "comfy_kitchen" for m in IMPORT_AS.finditer(text)}
        for alias in aliases:
            for m in re.finditer(rf"(?<![\w.]){re.escape(alias)}\.(\w+)", text):
                add(m.group(1), module, text, m.start())
        for m in QUANT_OPS_CK.finditer(text):
            add(m.group(1), module, text, m.start())
        for m in FROM_IMPORT.finditer(text):
            if m.group(1):  # from comfy_kitchen.tensor import (...): classes of a sub-module
                add(m.group(1).split(".")[1], module, text, m.start())
            else:
                for name in re.findall(r"\w+(?:\s+as\s+\w+)?", m.group(2)):
                    add(name.split()[0], module, text, m.start())
    return dict(uses)


def kitchen_holders() -> dict[str, str]:
    """{module: the name under which it imported comfy_kitchen}."""
    return {module: m.group(1) or "comfy_kitchen" for module, text in _sources() for m in IMPORT_AS.finditer(text)}


def bound_copies() -> list[tuple[str, str, str]]:
    """(module, attribute, op) for ``attribute = <kitchen alias>.op`` at a module's top level."""
    found = []
    for module, text in _sources():
        for alias in {m.group(1) or "comfy_kitchen" for m in IMPORT_AS.finditer(text)}:
            for m in re.finditer(BOUND.format(alias=re.escape(alias)), text, re.M):
                found.append((module, m.group(1), m.group(2)))
    return found


@pytest.fixture(scope="module")
def compat(pack_module):
    return pack_module("nodes.host.comfy_compat")


@pytest.fixture(scope="module")
def uses():
    _kitchen_host()
    return kitchen_uses()


def test_every_kitchen_op_comfyui_calls_is_routed_or_refused(compat, uses):
    tables = {"routed": set(compat.KITCHEN_ROPE_OPS), "refused": set(compat.KITCHEN_REFUSED_OPS),
              "not an op": set(compat.KITCHEN_NOT_OPS)}
    # the scan reads what it should: ops of four call styles (quant_ops.ck, module import, alias, bound name)
    assert {"apply_rope", "rms_adaln", "rms_rope", "na3d", "int8_linear", "stochastic_rounding_fp8"} <= set(uses)
    unknown = {n: where for n, where in uses.items() if not any(n in t for t in tables.values())}
    assert not unknown, ("comfy-kitchen names ComfyUI calls that are neither routed nor refused nor known to be "
                         f"no op (add each to a table of nodes/host/comfy_compat.py): {unknown}")
    both = [n for n in uses if sum(n in t for t in tables.values()) > 1]
    assert not both, f"in more than one table: {both}"


def test_an_op_a_future_comfyui_calls_is_caught(compat, monkeypatch):
    """The scan on a made-up module that calls a new op in each style: every one is found, and none is in a
    table, so the first test would fail on such a ComfyUI."""
    fake = ("import comfy.quant_ops\nimport comfy_kitchen as kit\nfrom comfy_kitchen import fused_new_c\n"
            "y = comfy.quant_ops.ck.fused_new_a(x)\nz = kit.fused_new_b(y)\n")
    monkeypatch.setattr(sys.modules[__name__], "_sources", lambda: iter([("comfy.ldm.future.model", fake)]))
    found = kitchen_uses()
    assert found == {"fused_new_a": ["comfy.ldm.future.model:4"], "fused_new_b": ["comfy.ldm.future.model:5"],
                     "fused_new_c": ["comfy.ldm.future.model:3"]}
    tables = (*compat.KITCHEN_ROPE_OPS, *compat.KITCHEN_REFUSED_OPS, *compat.KITCHEN_NOT_OPS)
    assert not set(found) & set(tables)


def test_names_that_are_no_op_are_no_tensor_op(uses, compat):
    import comfy_kitchen

    for name in set(uses) & set(compat.KITCHEN_NOT_OPS):
        value = getattr(comfy_kitchen, name)
        if inspect.ismodule(value) or not callable(value):  # a sub-module, the backend registry
            continue
        params = inspect.signature(value).parameters.values()
        assert all(p.default is not p.empty for p in params), name  # a query that takes no tensor
        assert not isinstance(value(), torch.Tensor), name


# inputs (B, H, L, D) = (1, 2, 4, 8): rotation tables (1, 1, L, D/2, 2, 2), norm scales (D,)
def _rope_inputs(name: str) -> tuple:
    g = torch.Generator().manual_seed(len(name))
    x, y = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(2))
    freqs = torch.randn(1, 1, 4, 4, 2, 2, generator=g)
    scale = torch.rand(8, generator=g) + 0.5
    if name == "rms_adaln":
        return torch.randn(1, 4, 8, generator=g), torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 8, generator=g)
    base = name.removesuffix("_")
    one = base.endswith("1")
    if base.startswith("apply_rope"):
        return (x, freqs) if one else (x, y, freqs)
    return (x, freqs, scale, 1e-6) if one else (x, y, freqs, scale, scale * 0.9, 1e-6)


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def test_routed_ops_run_their_plain_twin_equal_to_the_kitchen_op_with_gradients(compat, uses):
    """Each routed op ComfyUI calls has its plain-PyTorch twin; through the stand-in, with gradients, it gives
    the kitchen op's forward (comfy-kitchen's CPU kernel) and finite gradients."""
    quant_ops = _kitchen_host()
    kitchen = quant_ops.ck
    routed = sorted(set(uses) & set(compat.KITCHEN_ROPE_OPS))
    assert routed
    with compat.model_gradients(), torch.enable_grad():
        router = quant_ops.ck
        assert router is not kitchen
        for name in routed:
            assert hasattr(router._plain, name), f"{name}: no plain-PyTorch twin, the fused kernel would run"
            args = _rope_inputs(name)
            with torch.no_grad():
                expected = _flat(getattr(kitchen, name)(*(a.clone() if torch.is_tensor(a) else a for a in args)))
            if name.endswith("_"):  # in place: ComfyUI calls these only without gradients
                got = _flat(getattr(router, name)(*(a.clone() if torch.is_tensor(a) else a for a in args)))
            else:
                leaf = args[0].clone().requires_grad_(True)
                got = _flat(getattr(router, name)(leaf, *args[1:]))
                sum(o.square().sum() for o in got).backward()
                assert leaf.grad is not None and torch.isfinite(leaf.grad).all() and leaf.grad.abs().sum() > 0, name
            assert len(got) == len(expected), name
            for a, b in zip(got, expected):
                torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-5, msg=name)


def test_refused_ops_name_themselves_wherever_comfyui_holds_them(compat, uses):
    """While training, every module of ComfyUI that holds comfy-kitchen holds the stand-in, whose refused ops
    raise naming the op, where ComfyUI calls it and the fix when a tensor needs gradients, and pass through
    otherwise; every op bound at import (comfy.float's stochastic rounding) is refused in place. All restored."""
    import importlib

    import comfy_kitchen

    quant_ops = _kitchen_host()
    refused = sorted(set(uses) & set(compat.KITCHEN_REFUSED_OPS))
    holders = kitchen_holders()
    assert {"comfy.quant_ops", "comfy.float", "comfy.ldm.joyimage.model"} <= set(holders)
    modules = {name: importlib.import_module(name) for name in holders}
    bound = [(m, attr, op) for m, attr, op in bound_copies() if op in compat.KITCHEN_REFUSED_OPS]
    assert bound, "comfy.float binds stochastic_rounding_fp8 at import: the scan should find it"
    grad = torch.zeros(2, requires_grad=True)
    with compat.model_gradients():
        for module_name, module in modules.items():  # the stand-in, never the module itself
            assert getattr(module, holders[module_name]) is quant_ops.ck is not comfy_kitchen, module_name
        for name in refused:
            op = getattr(quant_ops.ck, name)
            where, fix = compat.KITCHEN_REFUSED_OPS[name]
            with torch.enable_grad(), pytest.raises(RuntimeError) as err:
                op(grad, grad)
            assert f"'{name}'" in str(err.value) and where in str(err.value) and fix in str(err.value)
        for module_name, attr, name in bound:
            stand_in = getattr(sys.modules[module_name], attr)
            assert getattr(stand_in, "precision_lora_refused", None) is getattr(comfy_kitchen, name), attr
            with torch.enable_grad(), pytest.raises(RuntimeError, match=f"'{name}'"):
                stand_in(grad, None, torch.float8_e4m3fn)
        # without gradients the kitchen op itself runs (fp8 rounding of a weight, as ComfyUI's patching does)
        w = torch.randn(4, 4)
        out = quant_ops.ck.stochastic_rounding_fp8(w, torch.randint(0, 256, (4, 4), dtype=torch.uint8),
                                                   torch.float8_e4m3fn)
        assert out.dtype == torch.float8_e4m3fn
    for module_name, attr, name in bound:
        assert getattr(sys.modules[module_name], attr) is getattr(comfy_kitchen, name)
    for module_name, module in modules.items():
        assert getattr(module, holders[module_name]) is comfy_kitchen, module_name
    assert quant_ops.ck is comfy_kitchen
