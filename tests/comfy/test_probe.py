"""PrecisionProbe on tiny Flux.1: statistics equal independent computations, the output is bit-identical
with and without the probe, and the node works in a ComfyUI graph."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attention.stats import measure_call
from comfy_harness import node_class, pack_module, run_graph
from models import make_conditioning, make_latent, tiny_cosmos, tiny_flux1

MULTIPLIER = 1.5


def _lora_model(up_std: float):
    """Tiny Flux.1 + rank-4 LoRA with non-zero ``up`` + sdpa attention at 1.5x the default scale."""
    lg, ag = pack_module("nodes.lora.glue"), pack_module("nodes.attention.glue")
    LoRAConfig = pack_module("lora.config").LoRAConfig
    AttentionConfig = pack_module("attention.config").AttentionConfig
    model = lg.attach_lora(tiny_flux1(), LoRAConfig(rank=4, alpha=4.0))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for adapter in lg.get_lora_set(model).adapters().values():
            adapter.up.copy_(torch.randn(adapter.up.shape, generator=gen) * up_std)
            adapter.mark_modified()
    cfg = AttentionConfig(backend="sdpa", scale_mode="multiplier", scale_value=MULTIPLIER)
    return ag.patch_attention(model, cfg)


class Capture:
    """Test-side spy on the attention dispatcher's ``run``: records (q, k, layout) of each call."""

    def __init__(self, dispatcher):
        self.dispatcher, self.original, self.calls = dispatcher, dispatcher.run, []

    def __enter__(self):
        def run(q, k, v, **kwargs):
            self.calls.append((q.detach().clone(), k.detach().clone(), kwargs.get("layout", "bhld")))
            return self.original(q, k, v, **kwargs)

        self.dispatcher.run = run
        return self

    def __exit__(self, *exc):
        del self.dispatcher.run  # the instance attribute goes; the class method is back


def _independent_gains(x: np.ndarray, w: np.ndarray, b: np.ndarray, dw: np.ndarray) -> dict[str, float]:
    """Merge and bf16-add gains from numpy fp64 sums over torch bf16 roundings done here."""
    bf = lambda a: torch.from_numpy(a).to(torch.bfloat16)  # noqa: E731
    xb, wb, bb = bf(x), bf(w), bf(b)
    base = (xb.double() @ wb.double().T + bb.double()).to(torch.bfloat16).double().numpy()
    xd = xb.double().numpy()
    ideal = xd @ dw.T
    merged = (wb.double().numpy() + dw.astype(np.float32).astype(np.float64))
    merged_b = torch.from_numpy(merged).to(torch.bfloat16).double().numpy()
    out_merge = torch.from_numpy(xd @ merged_b.T + bb.double().numpy()).to(torch.bfloat16).double().numpy()
    delta_b = torch.from_numpy(xd @ dw.T).to(torch.bfloat16).double().numpy()
    out_add = torch.from_numpy(base + delta_b).to(torch.bfloat16).double().numpy()
    out_ours = torch.from_numpy(xd @ wb.double().numpy().T + bb.double().numpy() + ideal).to(torch.bfloat16).double().numpy()
    e = float((ideal * ideal).sum())
    return {name: float(((o - base) * ideal).sum()) / e
            for name, o in (("merge", out_merge), ("add_bf16", out_add), ("fp32_unmerged", out_ours))}


def test_probe_output_bit_identical_and_lora_gains_match_direct_computation():
    pg = pack_module("nodes.probe.glue")
    model = _lora_model(up_std=3e-4)
    latent, cond = make_latent(model), make_conditioning(model)
    path = "double_blocks.0.img_attn.proj"
    module = dict(model.model.diffusion_model.named_modules())[path]
    seen = []
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    try:
        with torch.inference_mode():
            plain, _sigma = pg.model_forward(model, latent, cond, 0.5, 7)
    finally:
        handle.remove()
    with torch.inference_mode():
        result = pg.probe_model(model, latent, cond, noise_level=0.5, seed=7, max_rows=4096)
    assert torch.equal(result.output, plain)
    adapter = pack_module("nodes.lora.glue").get_lora_set(model).adapters()[path]
    dw = (adapter.up.detach().double() @ adapter.down.detach().double()).cpu().numpy() * adapter.scale
    x = seen[0].reshape(-1, seen[0].shape[-1]).double().cpu().numpy()
    expected = _independent_gains(x, module.weight.detach().double().cpu().numpy(),
                                  module.bias.detach().double().cpu().numpy(), dw)
    got = result.lora[path].gains
    assert got["merge"] == pytest.approx(expected["merge"], rel=1e-6)
    assert got["add_bf16"] == pytest.approx(expected["add_bf16"], rel=1e-6)
    assert got["fp32_unmerged"] == pytest.approx(expected["fp32_unmerged"], abs=0.02)
    # At rms(dW)/rms(W) ~ 1e-3 bf16 really loses signal while the fp32 path keeps it; docs/lora.md shows the numbers.
    assert result.lora[path].rho < 3e-3
    assert got["merge"] < 0.6 and got["fp32_unmerged"] > got["merge"] + 0.3
    assert set(result.lora) == set(pack_module("nodes.lora.glue").get_lora_set(model).paths())


def test_probe_attention_stats_match_independent_measurement():
    pg = pack_module("nodes.probe.glue")
    model = _lora_model(up_std=3e-4)
    latent, cond = make_latent(model), make_conditioning(model)
    override = model.model_options["transformer_options"]["optimized_attention_override"]
    with Capture(override.dispatcher) as capture, torch.inference_mode():
        result = pg.probe_model(model, latent, cond, noise_level=0.5, seed=1, max_rows=4096)
    assert len(result.attention) == len(capture.calls) == 2  # one double and one single block
    for (q, k, layout), stats in zip(capture.calls, result.attention.values()):
        scale = MULTIPLIER / math.sqrt(q.shape[-1])
        ref = measure_call(q, k, scale=scale, layout=layout)
        assert stats.rows == ref.rows
        assert stats.entropy_ratio == pytest.approx(ref.entropy_ratio, rel=1e-5)
        assert stats.max_logit == pytest.approx(ref.max_logit, rel=1e-5)
        assert stats.bf16_one_rows == ref.bf16_one_rows and stats.shift_rows == ref.shift_rows
        qb, kb = (t.transpose(1, 2) if layout == "blhd" else t for t in (q, k))
        p = torch.softmax(qb.double() @ kb.double().transpose(-1, -2) * scale, dim=-1)
        assert stats.max_prob == pytest.approx(float(p.max()), rel=1e-5)


def _graph(tmp_name: str, noise_level: float = 0.5) -> dict:
    return {
        "1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": tmp_name, "weight_dtype": "default"}},
        "2": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["1", 0], "width": 64, "height": 64,
                                                              "batch_size": 1, "seed": 0}},
        "3": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["1", 0], "text": "a", "seed": 0, "tokens": 8}},
        "4": {"class_type": "PrecisionProbe", "inputs": {"model": ["1", 0], "latent": ["2", 0], "conditioning": ["3", 0],
                                                         "noise_level": noise_level, "seed": 0, "max_rows": 64}},
    }


def test_probe_node_in_graph_reports_text_ui_and_chart(pack):
    import folder_paths

    from models import write_model_file

    name = "probe_tiny_flux1.safetensors"
    write_model_file("flux1_dev", f"{folder_paths.get_folder_paths('diffusion_models')[0]}/{name}")
    run = run_graph(_graph(name), outputs=["4"])
    assert run["success"], run["messages"]
    report, chart = run["outputs"]["4"][0][0], run["outputs"]["4"][1][0]
    assert "No Precision LoRA is attached" in report
    assert "00 double.0" in report and "01 single.0" in report
    head_dim = 64 // 2  # tiny Flux.1: hidden 64, 2 heads
    assert f"backend auto, scale {1 / math.sqrt(head_dim):.4g} (1x default)" in report
    assert chart.dim() == 4 and chart.shape[0] == 1 and chart.shape[-1] == 3
    assert float(chart.min()) < 0.5 < float(chart.max())  # bars drawn on the light background
    assert run["ui"]["4"]["text"] == [report]


def test_probe_validate_inputs_names_input_and_range(pack):
    """D4 (issue 13): validate_inputs(**_) made ComfyUI skip min/max of every Probe input (seed=-1 was
    accepted) and noise_level='abc' raised a TypeError inside validation."""
    node = node_class("PrecisionProbe")
    message = node.validate_inputs(noise_level=1.5, max_rows=256)
    assert "input 'noise_level'=1.5 is above the maximum 0.99; use a value in [0.01, 0.99]" in message
    assert "input 'seed'=-1 is below the minimum 0" in node.validate_inputs(noise_level=0.5, seed=-1, max_rows=256)
    assert "input 'noise_level'='abc' is not a number" in node.validate_inputs(noise_level="abc")
    assert node.validate_inputs(noise_level=0.5, max_rows=256) is True


def test_probe_says_when_a_lora_is_merged_as_comfy_patches(pack):
    model = tiny_flux1().clone()
    key = "diffusion_model.double_blocks.0.img_attn.proj.weight"
    weight = model.model.state_dict()[key]
    assert model.add_patches({key: (torch.full_like(weight, 1e-3),)}, 1.0) == [key]
    node = node_class("PrecisionProbe")
    with torch.inference_mode():
        out = node.execute([model], [make_latent(model)], [make_conditioning(model)], [0.5], [0], [64])
    report = out.result[0]
    assert "1 weights carry ComfyUI patches" in report and "No Precision LoRA is attached" in report


def test_latent_or_conditioning_of_another_model_is_named(pack):
    """D7 (issue 13): a latent from another model failed with "too many values to unpack", a conditioning
    with "mat1 and mat2 shapes cannot be multiplied"."""
    node = node_class("PrecisionProbe")
    cosmos, flux = tiny_cosmos(), tiny_flux1()
    with pytest.raises(ValueError, match=r"^\[Precision LoRA\] PrecisionProbe: input 'latent' has shape \(1, 16, 8, 8\) "
                                         r"but this model \(cosmos_predict2\) expects \(B, C, T, H, W\) with C=16"):
        node.execute([cosmos], [make_latent(flux)], [make_conditioning(cosmos)], [0.5], [0], [64])
    with pytest.raises(ValueError, match=r"^\[Precision LoRA\] PrecisionProbe: input 'conditioning' has context shape "
                                         r"\(1, 8, 1024\) but this model \(flux1\) expects \(B, tokens, 64\)"):
        node.execute([flux], [make_latent(flux)], [make_conditioning(cosmos)], [0.5], [0], [64])
    with pytest.raises(ValueError, match=r"^\[Precision LoRA\] PrecisionProbe: input 'conditioning' item 1 has context "
                                         r"shape \(1, 8, 1024\) .* \(expected width 64, got width 1024\); Flux.1 needs "
                                         r"CLIP-L \+ T5-XXL \(DualCLIPLoader, type flux\)"):
        node.execute([flux], [make_latent(flux)], [make_conditioning(flux), make_conditioning(cosmos)], [0.5], [0], [64])


def test_probe_fed_dataset_lists_runs_once_with_one_report(pack):
    """Issue 14: a 3-image dataset list into the Probe ran it once per item (6 reports); it now takes the
    lists whole, probes the first LATENT with its conditioning and says so in its one report."""

    node = node_class("PrecisionProbe")
    assert node.define_schema().is_input_list is True
    model = tiny_flux1()
    latents = [make_latent(model, seed=i) for i in range(3)]
    conds = [make_conditioning(model, text=f"caption {i}") for i in range(3)]
    with torch.inference_mode():
        out = node.execute([model], latents, conds, [0.5], [0], [64])
        first = node.execute([model], latents[:1], conds[:1], [0.5], [0], [64])
    assert len(out.result) == 2 and isinstance(out.result[0], str)
    assert "probed the first of 3 LATENTs (with its conditioning)" in out.result[0]
    assert "probed the first" not in first.result[0]
    # the same forward as probing the first item alone: the report differs only by the note
    assert [line for line in out.result[0].splitlines() if "probed the first" not in line] == \
        first.result[0].splitlines()
