"""The pack's one message prefix (nodes/host/errors.py, #34): the pure code raises and logs plain messages; the
prefix is added once where a message leaves the pack: a node's execute (the input gate), the LoRA layers' and
the attention override's forwards when another node runs them (a stock sampler), the HTTP routes, the pack's
log records. Messages of ComfyUI, torch or other packs pass unchanged."""
from __future__ import annotations

import logging

import pytest
import torch

from models import tiny_flux1

PREFIX = "[Precision LoRA] "


@pytest.fixture(scope="module")
def errors(pack_module):
    return pack_module("nodes.host.errors")


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the exception itself is what the tests look at
        return exc
    raise AssertionError("nothing raised")


def test_mark_prefixes_what_the_pack_raised_once_and_nothing_else(errors, pack_module):
    config = pack_module("lora.config").LoRAConfig
    ours = _raised(lambda: config(rank=4, param_dtype="fp7"))  # raised in lora/config.py
    assert str(ours).startswith("LoRAConfig.param_dtype='fp7' is unknown")  # plain where it is raised
    assert errors.mark(ours) is ours and str(ours).startswith(PREFIX + "LoRAConfig.param_dtype='fp7' is unknown")
    errors.mark(ours)
    assert str(ours).count(PREFIX) == 1
    # a pack message quoted inside another, both marked: one prefix, in front
    outer = _raised(lambda: pack_module("lora.layer").LoRASet.param_groups(None, -1.0, 1.0))
    outer.args = (f"while saving: {ours}",)
    assert str(errors.mark(outer)) == PREFIX + "while saving: " + str(ours)[len(PREFIX):]
    # raised by torch's own Python code, by the test's code, or an out-of-memory error: unchanged
    theirs = _raised(lambda: torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 5)))
    text = str(theirs)
    assert str(errors.mark(theirs)) == text and not text.startswith(PREFIX)
    local = _raised(lambda: (_ for _ in ()).throw(ValueError("a test's message")))
    assert str(errors.mark(local)) == "a test's message"
    oom = torch.OutOfMemoryError("CUDA out of memory")
    oom.__traceback__ = ours.__traceback__  # even where the pack called it
    assert str(errors.mark(oom)) == "CUDA out of memory"


def test_a_pack_error_in_a_lora_forward_under_a_stock_sampler_carries_the_prefix(pack_module, monkeypatch):
    """The LoRA layers run inside KSampler (not a pack node): their boundary adds the prefix; an error of
    torch or ComfyUI inside the same forward keeps its own text."""
    glue = pack_module("nodes.lora.glue")
    layer = pack_module("lora.layer")
    model = tiny_flux1()
    with torch.inference_mode():
        out = glue.attach_lora(model, pack_module("lora.config").LoRAConfig(rank=2, alpha=2))
    forward = next(p for p in out.object_patches.values() if isinstance(p, glue.LoRAForward))
    x = torch.randn(1, 3, forward.module.in_features)
    monkeypatch.setattr(glue, "lora_linear", lambda *a: layer.LoRASet.param_groups(None, -1.0, 1.0))
    with pytest.raises(ValueError) as ours:
        forward(x)
    assert str(ours.value) == PREFIX + "param_groups(lr=-1.0, loraplus_ratio=1.0): both must be positive"
    monkeypatch.setattr(glue, "lora_linear", lambda x, w, b, adapters: torch.nn.functional.linear(x, torch.ones(3, 7)))
    with pytest.raises(RuntimeError) as theirs:
        forward(x)
    assert not str(theirs.value).startswith(PREFIX)


def test_a_pack_error_in_the_attention_override_carries_the_prefix(pack_module):
    attention = pack_module("nodes.attention.glue")
    config = pack_module("attention.config").AttentionConfig
    override = attention.PrecisionAttentionOverride(config())
    q = torch.randn(1, 4, 8)

    def comfy_kernel(*args, **kwargs):  # stands for ComfyUI's attention function: its own error passes as is
        raise RuntimeError("ComfyUI's kernel failed")

    with pytest.raises(RuntimeError, match="^ComfyUI's kernel failed$"):
        override(comfy_kernel, q, q, q, 1)
    with pytest.raises(ValueError) as ours:  # the pack's own check, raised in attention/config.py
        override(lambda *a, **k: config(backend="no-such-backend"), q, q, q, 1)
    assert str(ours.value).startswith(PREFIX + "backend='no-such-backend' is unknown; choose one of "), ours.value


def test_the_packs_log_records_carry_the_prefix_once_and_others_do_not(errors, caplog):
    ours = logging.getLogger(f"{errors.PACKAGE}.training.loop")
    other = logging.getLogger("comfy.some_module")
    assert errors.install_log_prefix() >= 1 and errors.install_log_prefix() >= 1  # idempotent
    with caplog.at_level(logging.INFO):
        ours.info("training stopped at step %d (%s)", 3, "stop")
        ours.info(PREFIX + "already prefixed")
        other.info("not the pack's")
    assert [r.getMessage() for r in caplog.records] == [
        PREFIX + "training stopped at step 3 (stop)", PREFIX + "already prefixed", "not the pack's"]
