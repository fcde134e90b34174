"""training/regional_compile.py without ComfyUI: a frame that fails to compile runs eager from its own start, so
nothing a block did before the failure is done twice; the report names the part, and the forwards are restored.

A block adds to its input in place, breaks the graph, then computes a sine; the backend compiles the first frame
and fails on any graph with a sine. Re-running the whole block eager after the failure (what a first version did)
added twice: the output and the input's final value would be off by one.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from training import regional_compile


class _Block(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)  # what Flux's blocks do to their residual stream
        torch._dynamo.graph_break()
        return x.sin()


def _fails_on_sine(gm: torch.fx.GraphModule, example_inputs):
    if any(node.target in (torch.sin, torch.ops.aten.sin.default, "sin") for node in gm.graph.nodes):
        raise RuntimeError("no sine here (a test's stand-in for a compiler failure)")
    return gm.forward


def test_a_frame_that_fails_to_compile_runs_eager_once_and_is_reported(monkeypatch):
    monkeypatch.setattr(regional_compile, "BACKEND", _fails_on_sine)
    torch._dynamo.reset()
    blocks = [_Block(), _Block()]
    x = torch.zeros(3)
    with regional_compile.compiled_blocks(blocks) as report:
        out = blocks[1](blocks[0](x.clone()))
        again = blocks[0](torch.zeros(3))
    expected = torch.sin(torch.sin(torch.ones(3)) + 1.0)
    assert torch.equal(out, expected)
    assert torch.equal(again, torch.sin(torch.ones(3)))  # the frame that failed stays eager, still right
    assert report.graphs >= 1  # the first frame (the add) compiled
    line = report.line()
    assert re.search(r"_Block: \d+ parts? runs? eager \(RuntimeError: no sine here|_Block: \d+ parts? runs? eager "
                     r"\(BackendCompilerFailed: .*no sine here", line), line
    assert not any("forward" in b.__dict__ for b in blocks)


def test_blocks_of_one_kind_share_their_compiled_code():
    torch._dynamo.reset()
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(12)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(regional_compile, "BACKEND", "aot_eager")
        with regional_compile.compiled_blocks(blocks) as report:
            h = torch.randn(2, 8, requires_grad=True)  # every block sees the same kind of input
            for b in blocks:
                h = b(h)
    assert report.blocks == 12 and report.kinds == ["Sequential"]
    assert report.graphs == 1 and report.recompiles == 0, report.line()  # one graph for twelve blocks
