"""Regional compile (Train Settings' ``compile`` 'blocks', training/regional_compile.py) on tiny real ComfyUI models.

Through the session the training node runs (``compiled_training`` entered before ``training_session``): each
block of the model's block lists compiled with inductor (the CPU's C++ backend), the LoRA layers eager inside
them. One loss + backward of the pack's predict gives the LoRA gradients eager gives, within a tolerance stated
per dtype (compiled kernels fuse and reorder floating-point work): Flux.1 (in-place residual adds: the saved
copies keep their strides), SDXL's UNet layers, and Flux.1 in bf16 under checkpointing with the block inputs
in host memory and a block swapped. A second step compiles nothing. A compile that fails (a backend that
raises) runs eager, frame by frame, with the reason in the run's report and the LoRA's metadata, through the node.
"""
from __future__ import annotations

import logging
import os
import re
import sys

import pytest
import torch

from models import make_conditioning, make_latent, randomize_lora, tiny_flux1, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import compile_families  # noqa: E402  (bench/compile_families.py: the gradients of one step in the session)
import memory  # noqa: E402  (bench/memory.py: the step's inputs as the training node builds them)

pytestmark = pytest.mark.usefixtures("one_thread")

# compiled vs eager LoRA gradients: max |difference| <= GRADIENT_TOLERANCE[dtype] x max |eager gradient|, per adapter
# tensor (training/regional_compile.py: the bound the run's own check applies).


def _grads(pack_module, build, dtype, compile: str, **plan) -> tuple[dict, object, int]:
    """LoRA gradients of a loss + backward of predict in the training session (three identical steps), the
    compile report and the compiling calls of the third step (the second may compile once more on the CPU:
    ComfyUI's sub-quadratic attention reads the free memory, which dynamo guards on until it marks it dynamic)."""
    glue, tglue = pack_module("nodes.lora.glue"), pack_module("nodes.train.glue")
    cfg = pack_module("lora.config").LoRAConfig(rank=4, alpha=4.0, targets="attention_mlp")
    torch.manual_seed(0)
    model = build(dtype=dtype)
    with torch.inference_mode():
        out, lora_set = tglue.fork_lora(glue.attach_lora(model, cfg))
    randomize_lora(lora_set, 3)
    x0, cond = memory._inputs(out, 32, 8)
    grads, report, again = compile_families.lora_gradients(pack_module, out, x0, cond, compile, steps=3, **plan)
    blocks = pack_module("training.grad").find_block_lists(out.model.diffusion_model, tglue.BLOCK_LISTS)
    assert not any("forward" in b.__dict__ for b in blocks)  # every wrapper removed on exit
    return grads, report, again


def _assert_close(eager: dict, compiled: dict, tolerance: float) -> None:
    assert eager.keys() == compiled.keys() and len(eager) >= 8
    for name, e in eager.items():
        assert e.abs().max() > 0, name  # every factor gets a gradient: the comparison means something
        worst = (compiled[name] - e).abs().max() / e.abs().max()
        assert worst <= tolerance, (name, worst.item())


CASES = {
    "flux1": (tiny_flux1, torch.float32, {}),
    "sdxl": (lambda dtype: tiny_model("sdxl", dtype=dtype), torch.float32, {}),
    "flux1-bf16-ckpt-offload-swap": (tiny_flux1, torch.bfloat16,
                                     dict(gradient_checkpointing=True, offload_block_inputs=True, swap_blocks=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_blocks_give_the_gradients_eager_gives(pack_module, case):
    build, dtype, plan = CASES[case]
    eager, none, _ = _grads(pack_module, build, dtype, "off", **plan)
    compiled, report, again = _grads(pack_module, build, dtype, "blocks", **plan)
    assert none is None
    _assert_close(eager, compiled, pack_module("training.regional_compile").GRADIENT_TOLERANCE[dtype])
    assert not report.fallbacks, report.line()
    blocks = pack_module("training.grad").find_block_lists(
        build(dtype=dtype).model.diffusion_model, pack_module("nodes.train.glue").BLOCK_LISTS)
    assert report.blocks == len(blocks) and report.graphs > 0 and report.compiles > 0
    assert report.breaks["the LoRA layers (run eager)"] > 0  # they stay out of the graphs
    assert again == 0, report.line()  # then the steps run what was compiled


def test_strided_copies_keep_the_strides_only_while_open(pack_module):
    grad = pack_module("training.grad")
    wide = torch.randn(2, 9, 448)
    view = wide[..., 192:]  # a slice of a wider output: strides (4032, 448, 1)
    assert grad._copy(view).stride() == (9 * 256, 256, 1)
    with grad.strided_copies():
        for t in (view, torch.randn(1, 5).expand(4, 5), wide.transpose(1, 2)):
            copy = grad._copy(t)
            assert copy.stride() == t.stride() and torch.equal(copy, t)
            assert copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert grad._copy(view).is_contiguous()


def _train(mods, compile: str, name: str) -> tuple[dict, dict]:
    """Two steps of PrecisionTrainLoRA (as ComfyUI's executor calls it) on tiny Flux.1 with ``compile``: the
    trained LoRA's tensors and its metadata."""
    model = tiny_flux1()
    with torch.inference_mode():
        attached = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=4, alpha=4, targets="attention_mlp"))
        out = mods.train.PrecisionTrainLoRA.execute([attached], [make_latent(model, 1, 32, 32)],
                                                    [make_conditioning(model, 1)], [2], [0], [name],
                                                    settings=[mods.Settings(learning_rate=1e-3, compile=compile)])
    lora_set = mods.glue.get_lora_set(out.result[0])
    return {k: v.clone() for k, v in lora_set.state_dict().items()}, dict(lora_set.info)


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile anything (a test's stand-in for a compiler failure)")


def test_a_compile_failure_runs_eager_with_the_reason_in_the_report(train_mods, pack_module, monkeypatch, caplog):
    mods = train_mods
    monkeypatch.setattr(pack_module("training.regional_compile"), "BACKEND", _failing_backend)
    with caplog.at_level(logging.INFO):
        results = {compile: _train(mods, compile, "compile_fallback") for compile in ("off", "blocks")}
    (eager, eager_info), (fell_back, info) = results["off"], results["blocks"]
    assert all(torch.equal(eager[k], fell_back[k]) for k in eager)  # eager from the first call: the same LoRA
    assert "precision_lora_compile" not in eager_info
    line = info["precision_lora_compile"]
    for kind in ("DoubleStreamBlock", "SingleStreamBlock"):
        assert re.search(rf"{kind}: \d+ parts? runs? eager \(BackendCompilerFailed: .*cannot compile anything", line), line
    assert "0 graphs built" in line
    assert any(re.search(r"compile: \w+Block: \d+ part\(s\) run eager: BackendCompilerFailed", r.getMessage())
               for r in caplog.records)


def test_two_latent_sizes_are_counted_as_recompiles_in_the_report(train_mods, pack_module, monkeypatch):
    """Two buckets (32 and 48 px latents): each block kind sees two input shapes, and the second compiles again
    (then with the varying dimensions dynamic); the report says so. aot_eager: dynamo's accounting without
    inductor's code generation."""
    mods = train_mods
    monkeypatch.setattr(pack_module("training.regional_compile"), "BACKEND", "aot_eager")
    model = tiny_flux1()
    with torch.inference_mode():
        attached = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=4, alpha=4, targets="attention_mlp"))
        latents = [make_latent(model, 1, 32, 32), make_latent(model, 1, 48, 48, seed=1)]
        cond = make_conditioning(model, 1)
        out = mods.train.PrecisionTrainLoRA.execute([attached], latents, [cond, cond], [4], [0], ["compile_buckets"],
                                                    settings=[mods.Settings(learning_rate=1e-3, compile="blocks")])
    line = mods.glue.get_lora_set(out.result[0]).info["precision_lora_compile"]
    assert "2 blocks of 2 kinds (DoubleStreamBlock, SingleStreamBlock)" in line, line
    assert "2 input shapes per block kind; after the second, the varying dimensions are dynamic" in line, line
    recompiles = int(re.search(r"(\d+) recompiles? ", line).group(1))
    assert recompiles >= 2, line  # at least one per block kind for the second size
    assert "runs eager" not in line, line


def test_a_model_without_a_block_list_says_nothing_was_compiled(pack_module, caplog):
    """compile 'blocks' on a model whose blocks the trainer does not find: the run is eager and the report says so
    (a warning at the start, the line in the report), not a silent no-op."""
    rc = pack_module("training.regional_compile")
    with caplog.at_level(logging.WARNING), rc.compiled_blocks([]) as report:
        pass
    assert report.line().startswith("compile: nothing compiled, the run is eager: this model has no block list")
    assert any("nothing compiled" in r.getMessage() for r in caplog.records)


def _off_by_a_percent(gm, example_inputs):
    """A backend that miscompiles without an error: every float output of every graph 1 % too large (inductor did
    the like on tiny Mochi: gradients 2.7x off, bench/compile_families.py)."""
    def run(*args):
        outs = gm(*args)
        return type(outs)(o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in outs) \
            if isinstance(outs, (tuple, list)) else outs * 1.01
    return run


def test_compiled_gradients_beyond_the_tolerance_make_the_run_eager(train_mods, pack_module, monkeypatch):
    """The run's own check (check_compiled_gradients, before the first step): a backend whose graphs compute
    something else is caught by the gradients of the first sample; the run trains eager (the LoRA eager trains, bit
    for bit) and the report names the difference and the tolerance. Without the check this run would train on wrong
    gradients with no error (fails with the check removed, tried)."""
    mods = train_mods
    monkeypatch.setattr(pack_module("training.regional_compile"), "BACKEND", _off_by_a_percent)
    results = {compile: _train(mods, compile, "compile_check") for compile in ("off", "blocks")}
    (eager, _), (checked, info) = results["off"], results["blocks"]
    assert all(torch.equal(eager[k], checked[k]) for k in eager)
    line = info["precision_lora_compile"]
    assert re.search(r"gradients vs eager on the first sample: max difference [0-9.e+-]+ of the largest \(tolerance "
                     r"1e-04\); NOT USED, the run is eager: compiled LoRA gradients differ from eager by ", line), line


def test_the_run_checks_compiled_gradients_and_keeps_them_within_the_tolerance(train_mods, pack_module):
    """With inductor on tiny Flux.1 the check passes: its difference is in the report, and the run trains
    compiled (the LoRA differs from eager's only by fp32 rounding)."""
    _, info = _train(train_mods, "blocks", "compile_checked")
    line = info["precision_lora_compile"]
    worst = float(re.search(r"max difference ([0-9.e+-]+) of the largest \(tolerance 1e-04\)", line).group(1))
    assert worst <= 1e-4 and "NOT USED" not in line, line


def test_a_transposed_block_input_gets_the_gradients_eager_gives(pack_module):
    """Tiny Mochi's patch embedding hands block 0 a transposed tensor that needs no gradient. Compiled with an eager
    (``torch.compiler.disable``d) low-rank layer inside, such a block gave its layers' gradients 2.7x off with no
    error until compiled_blocks made its tensor inputs contiguous (1.8x off without, tried). ComfyUI's own Mochi
    blocks, a plain low-rank layer standing in for the pack's, inductor."""
    import families
    from torch import nn

    rc = pack_module("training.regional_compile")
    torch._dynamo.reset()
    blocks = list(families.build("GenmoMochi").model.diffusion_model.blocks)
    for p in (p for b in blocks for p in b.parameters()):
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    factors = []
    for block in blocks:
        for layer in (block.attn.qkv_x, block.attn.proj_x):
            down = nn.Parameter(torch.randn(4, layer.in_features, generator=g) * 0.1)
            up = nn.Parameter(torch.randn(layer.out_features, 4, generator=g) * 0.1)
            factors += [down, up]

            def forward(x, layer=layer, down=down, up=up):
                return torch.nn.functional.linear(x, layer.weight, layer.bias) + (x @ down.t()) @ up.t()

            layer.forward = torch.compiler.disable(forward)
    first = blocks[0]
    width, heads = first.attn.qkv_x.in_features, first.attn.num_heads
    x = torch.randn(1, width, 16, generator=g).transpose(1, 2)  # (1, 16 tokens, width), transposed as Mochi's
    y = torch.randn(1, 8, first.attn.qkv_y.in_features, generator=g)
    c = torch.randn(1, first.mod_x.in_features, generator=g)
    shape = (1, 16, heads, first.attn.qkv_x.out_features // 3 // heads // 2)
    rope = dict(rope_cos=torch.randn(shape, generator=g), rope_sin=torch.randn(shape, generator=g), crop_y=8)

    def grads() -> list:
        for f in factors:
            f.grad = None
        h, hy = x, y
        for block in blocks:
            h, hy = block(h, c, hy, **rope)
        (h * torch.linspace(0, 1, h.numel()).view_as(h)).sum().backward()
        return [f.grad.clone() for f in factors]

    with torch.inference_mode(False), torch.enable_grad():
        eager = grads()
        with rc.compiled_blocks(blocks) as report:
            compiled = grads()
    assert report.graphs > 0
    worst = max(float((c_ - e).abs().max() / e.abs().max()) for e, c_ in zip(eager, compiled))
    assert worst <= rc.GRADIENT_TOLERANCE[torch.float32], worst
