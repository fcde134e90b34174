"""Train Settings' vram_budget_gb (nodes/train/budget.py): the training node's own estimate of a step agrees
with bench/memory.py's, estimates are cached per (model config, settings), plans follow the budget, and
"auto" on a CPU says there is nothing to plan. The server-side runs are in tests/e2e/test_options_train.py."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import memory  # noqa: E402  (bench/memory.py)
import memory_models  # noqa: E402

SIZE, RANK, TOKENS = 64, 4, 8


def _model(pack_module):
    """A Cosmos-Predict2 of real layer shapes at 256 wide, bf16, real weights: the 'loaded' model."""
    config = pack_module("demo.tiny_models").cosmos_width_config(256, 2)
    model = memory_models.build(config, torch.bfloat16, None, pack_module("nodes.host.comfy_compat").fit_flux_config)
    pack_module("demo.tiny_models")._init_weights(model.model.diffusion_model, 0)
    return model


def _run_inputs(pack_module, model):
    demo = pack_module("demo.nodes")
    latents = [{"samples": torch.randn(demo.latent_shape(model, SIZE, SIZE, 1))}]
    return latents, [demo.make_conditioning(model, "sks", 0, TOKENS)]


def _attached(pack_module, model):
    cfg = pack_module("lora.config").LoRAConfig(rank=RANK, alpha=float(RANK), targets="attention")
    with torch.inference_mode(False):
        return pack_module("nodes.lora.glue").attach_lora(model, cfg)


@pytest.fixture
def budget(pack_module):
    mod = pack_module("nodes.train.budget")
    mod._COSTS.clear()
    yield mod
    mod._COSTS.clear()


def test_the_node_estimate_equals_bench_memory(pack_module, budget, one_thread):
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _model(pack_module)
    settings = pack_module("training.settings").TrainSettings(vram_budget_gb="8")
    latents, conds = _run_inputs(pack_module, model)
    cost, _ = budget._cost_fn(_attached(pack_module, model), settings, latents, conds, cuda_kernels=False)
    node = cost(True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        twin = memory_models.build(pack_module("demo.tiny_models").cosmos_width_config(256, 2), torch.bfloat16, None,
                                   pack_module("nodes.host.comfy_compat").fit_flux_config)
        twin.load_device = None
        bench = memory.step_cost(memory.run_step(twin, size=SIZE, rank=RANK, checkpointing=True, tokens=TOKENS))
    assert node.peak > 0 and len(node.blocks) == 1
    assert node == bench, (node, bench)


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_the_estimate_counts_the_lora_sets_the_run_keeps_beside_the_trained_one(pack_module, budget, one_thread):
    """Train LoRA trains a copy of the attached set (fork_lora); the attached one, and a LoRA stacked on the same
    layers, stay on the device through the run: the estimate counts them (StepCost.upstream) and "auto" adds back
    what of them is allocated already (its free memory does not have it)."""
    glue, lora_glue = pack_module("nodes.train.glue"), pack_module("nodes.lora.glue")
    model = _model(pack_module)
    out, trained = glue.fork_lora(_attached(pack_module, model))
    latents, conds = _run_inputs(pack_module, model)
    settings = pack_module("training.settings").TrainSettings(vram_budget_gb="8")
    alone = budget._cost_fn(out, settings, latents, conds, cuda_kernels=False)[0](True)
    assert alone.upstream == _bytes(trained) > 0  # the set it was forked from: a copy of the same size
    # what bench/memory_table.py --replan adds to rows stored before: bench/memory.py --lora-bytes's count
    assert alone.upstream == sum(
        4 * RANK * (i + o) for i, o in lora_glue.plan_targets(model, trained.config).values())
    cfg = pack_module("lora.config").LoRAConfig(rank=2 * RANK, alpha=float(RANK), targets="attention")
    with torch.inference_mode(False):
        loaded = lora_glue._new_lora_set(cfg, lora_glue.plan_targets(model, cfg))
    stacked = lora_glue.install(out, loaded, attachment_key=None)  # the trained set stays the attached one
    assert lora_glue.get_lora_set(stacked) is trained
    both = budget._cost_fn(stacked, settings, latents, conds, cuda_kernels=False)[0](True)
    assert both.upstream == _bytes(trained) + _bytes(loaded) and both.peak == alone.peak  # the step itself: cached
    mp = pack_module("training.memory_plan")
    assert mp.plan(both, True).tracked_gib * mp.GIB == pytest.approx(alone.peak + both.upstream, abs=0.006 * mp.GIB)
    cpu = torch.device("cpu")
    assert budget._paid_lora_bytes(stacked, cpu) == 2 * _bytes(trained) + _bytes(loaded)
    assert budget._paid_lora_bytes(stacked, torch.device("cuda", 0)) == 0  # nothing of them on that device


def test_plans_follow_the_budget_and_estimates_are_cached(pack_module, budget, one_thread, monkeypatch):
    model = _attached(pack_module, _model(pack_module))
    latents, conds = _run_inputs(pack_module, model)
    TrainSettings = pack_module("training.settings").TrainSettings
    calls = []
    real = budget.run_step
    monkeypatch.setattr(budget, "run_step", lambda *a, **k: calls.append(a[4].gradient_checkpointing) or real(*a, **k))
    said = []
    planned, line = budget.plan_budget(model, TrainSettings(vram_budget_gb="8", swap_blocks=0), latents, conds,
                                       say=said.append)
    assert said == [f"vram_budget_gb: estimating this model's training step at its real size on the CPU ({c}) "
                    "before loading it ..." for c in ("checkpointing", "no checkpointing")]
    assert (planned.gradient_checkpointing, planned.swap_blocks) == (False, 0)
    assert line.startswith("vram budget 8 GiB: bf16 base, no checkpointing: est. 0."), line
    # the tiny model's 2 % margin rounds to 0 GiB
    assert " GiB of 8 (under 0.01 GiB more kept free as safety margin); host memory est. " in line, line
    assert calls == [True, False]  # checkpointed first (choose's order), then the plain step
    again, line2 = budget.plan_budget(model, TrainSettings(vram_budget_gb="8.0"), latents, conds, say=said.append)
    assert calls == [True, False] and line2 == line and again.vram_budget_gb == "8.0"  # from the cache
    assert len(said) == 2  # nothing to wait for
    kept, line3 = budget.plan_budget(model, TrainSettings(vram_budget_gb="8", gradient_checkpointing=True),
                                     latents, conds)
    assert kept.gradient_checkpointing and "gradient_checkpointing on kept" in line3 and calls == [True, False]
    with pytest.raises(ValueError) as refused:
        budget.plan_budget(model, TrainSettings(vram_budget_gb="0.5"), latents, conds)
    msg = str(refused.value)
    assert "PrecisionTrainLoRA: input 'vram_budget_gb'='0.5' of PrecisionTrainSettings: no plan fits 0.5 GiB" in msg
    assert "checkpointing, 1 of 1 blocks swapped, is est. 0.8" in msg and "set vram_budget_gb to 0" in msg, msg


def test_offload_block_inputs_on_is_kept_and_estimated_with_it(pack_module, budget, one_thread, monkeypatch):
    """offload_block_inputs set by hand: only plans with it, the estimate runs with it, the report says so."""
    model = _attached(pack_module, _model(pack_module))
    latents, conds = _run_inputs(pack_module, model)
    seen = []
    real = budget.run_step
    monkeypatch.setattr(budget, "run_step", lambda *a, **k: seen.append(
        (a[4].gradient_checkpointing, a[4].offload_block_inputs)) or real(*a, **k))
    settings = pack_module("training.settings").TrainSettings(vram_budget_gb="8", gradient_checkpointing=True,
                                                              offload_block_inputs=True)
    planned, line = budget.plan_budget(model, settings, latents, conds)
    assert seen == [(True, True), (True, False)]  # the plan, then what its block inputs took off the device
    assert planned.offload_block_inputs and planned.gradient_checkpointing and planned.swap_blocks == 0
    assert "bf16 base, checkpointing, block inputs in host memory: est. " in line, line
    assert "(offload_block_inputs on kept)" in line


def test_budget_off_and_auto_on_the_cpu(pack_module, budget):
    model = _attached(pack_module, _model(pack_module))
    TrainSettings = pack_module("training.settings").TrainSettings
    off = TrainSettings(vram_budget_gb="off", gradient_checkpointing=True, swap_blocks=1)
    assert budget.plan_budget(model, off, [], []) == (off, None)
    auto = dataclasses.replace(off, vram_budget_gb="auto")
    same, line = budget.plan_budget(model, auto, [], [])
    assert same == auto and not budget._COSTS
    assert line == ("vram budget auto: the training device is cpu, which has no VRAM to plan for; "
                    "gradient_checkpointing=True and swap_blocks=1 run as set")


@pytest.mark.parametrize("value", ["12GB", "-3", "nan", "inf", "twelve", "0x10"])
def test_malformed_budgets_are_refused_by_the_settings(pack_module, value):
    with pytest.raises(ValueError, match=rf"TrainSettings.vram_budget_gb='{value}': give 0 \(or off\), auto"):
        pack_module("training.settings").TrainSettings(vram_budget_gb=value)


@pytest.mark.parametrize("value, parsed", [("0", None), ("off", None), (" OFF ", None), ("auto", "auto"),
                                           ("12", 12.0), ("0.5", 0.5), ("1e1", 10.0)])
def test_budget_values(pack_module, value, parsed):
    assert pack_module("training.settings").TrainSettings(vram_budget_gb=value).budget == parsed


def test_auto_on_cuda_is_free_plus_what_comfyui_can_free(pack_module, budget, one_thread, monkeypatch):
    """'auto' on a CUDA device (mocked: no GPU needed, the estimate runs on the CPU anyway): free + torch's
    cached + models held on that device - ComfyUI's reserve + the context allowance; then planned."""
    import comfy.model_management as mm

    gib = 2**30
    cuda = torch.device("cuda", 0)

    class Held:
        device, model = cuda, object()

        def model_loaded_memory(self):
            return 3 * gib

    class Elsewhere(Held):
        device = torch.device("cpu")

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 1 * gib)
    monkeypatch.setattr(mm, "current_loaded_models", [Held(), Elsewhere()])
    monkeypatch.setattr(mm, "extra_reserved_memory", lambda: gib // 2)
    assert budget.auto_budget_gib(cuda) == pytest.approx(10 + 1 + 3 - 0.5 + 0.6)
    model = _attached(pack_module, _model(pack_module))
    model.load_device = cuda  # only what the plan reads: nothing is loaded
    latents, conds = _run_inputs(pack_module, model)
    settings = pack_module("training.settings").TrainSettings(vram_budget_gb="auto", swap_blocks=0)
    planned, line = budget.plan_budget(model, settings, latents, conds)
    assert line.startswith("vram budget 14.1 GiB (auto: free on the device + what ComfyUI can free): bf16 base, "
                           "no checkpointing: est. 0."), line
    assert (planned.gradient_checkpointing, planned.swap_blocks) == (False, 0)


def test_the_plans_host_side_is_reported_and_a_plan_over_ram_budget_gb_is_refused(pack_module, budget, one_thread,
                                                                                   monkeypatch):
    """#39: with a VRAM plan the report gives the host memory it keeps beside its VRAM (here the block inputs
    the offload took off the device, the NaN guard's snapshot, the dataset); ram_budget_gb (GiB; "auto": what
    the machine has available; "0": unchecked) refuses a plan over it with both figures."""
    model = _attached(pack_module, _model(pack_module))
    latents, conds = _run_inputs(pack_module, model)
    TrainSettings = pack_module("training.settings").TrainSettings
    offload = TrainSettings(vram_budget_gb="64", gradient_checkpointing=True, offload_block_inputs=True,
                            ram_budget_gb="64")
    planned, line = budget.plan_budget(model, offload, latents, conds)
    assert planned.offload_block_inputs and planned.swap_blocks == 0, line
    costs = {k[-2:]: v[0] for k, v in budget._COSTS.items()}
    # what the offload took off the device (on this CPU "device" nothing leaves it: no block inputs part)
    moved = max(0, costs[(True, False)].activations - costs[(True, True)].activations)
    lora = costs[(True, True)]
    data = latents[0]["samples"].numel() * 4 + sum(
        t.numel() * t.element_size() for t in (conds[0][0][0], *[v for v in conds[0][0][1].values()
                                                                 if isinstance(v, torch.Tensor)]))
    assert budget._tensor_bytes(latents) + budget._tensor_bytes(conds) == data
    host = (f"block inputs {budget.size_text(moved)}, " if moved else "") + "NaN-guard snapshot " \
        f"{budget.size_text(4 * lora.lora_numel + lora.optimizer)}, dataset {budget.size_text(data)}"
    assert line.endswith(f" of 64 GiB ({host})"), line
    off = budget.plan_budget(model, dataclasses.replace(offload, ram_budget_gb="0"), latents, conds)[1]
    assert off.endswith(f" ({host}; ram_budget_gb off)"), off
    with pytest.raises(ValueError) as refused:
        budget.plan_budget(model, dataclasses.replace(offload, ram_budget_gb="0.0001"), latents, conds)
    msg = str(refused.value)
    assert msg.startswith("PrecisionTrainLoRA: input 'ram_budget_gb'='0.0001' of PrecisionTrainSettings: the plan for "
                          "vram_budget_gb='64' (checkpointing, block inputs in host memory, est. 0."), msg
    assert " GiB of VRAM) keeps est. " in msg and f" in host memory ({host}), over the 0.0001 GiB ram_budget_gb " \
        "allows; raise vram_budget_gb" in msg, msg
    monkeypatch.setattr(budget, "available_ram_gib", lambda: 0.0002)
    with pytest.raises(ValueError, match=r"over the 0 GiB \(auto: available on this machine now\) ram_budget_gb "):
        budget.plan_budget(model, dataclasses.replace(offload, ram_budget_gb="auto"), latents, conds)
