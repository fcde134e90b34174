"""A GGUF base in the memory estimate (issue 36 item 4): ``vram_budget_gb``'s planner and ``bench/memory.py`` count it
at its real bytes (GGML's block sizes, training/memory_gguf.py), checked against real GGUF files written by
tests/gguf_models.py and loaded by ComfyUI-GGUF (the real pack, tests/other_packs.py).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import gguf_models
import other_packs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import memory  # noqa: E402  (bench/memory.py)

pytestmark = pytest.mark.usefixtures("one_thread")

TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K"]
SIZE, RANK, TOKENS = 64, 4, 8


@pytest.fixture(scope="module")
def files(pack_module) -> dict[str, str]:
    """qtype -> a tiny Cosmos GGUF file of that type in models/diffusion_models (its name)."""
    import folder_paths

    tiny = pack_module("demo.tiny_models")
    sd = {k: v.to(torch.bfloat16) for k, v in tiny.tiny_state_dict(gguf_models.tiny_cosmos(tiny)).items()}
    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    os.makedirs(folder, exist_ok=True)
    for qtype in TYPES:
        gguf_models.write_gguf(sd, os.path.join(folder, f"gguf_memory_{qtype}.gguf"), qtype)
    return {qtype: f"gguf_memory_{qtype}.gguf" for qtype in TYPES}


def _path(name: str) -> str:
    import folder_paths

    return folder_paths.get_full_path("unet", name)


def _load(name: str):
    gg = other_packs.load_in_process(other_packs.GGUF)
    with torch.inference_mode():
        return gg.nodes.UnetLoaderGGUF().load_unet(name)[0]


def test_the_block_table_is_ggmls(pack_module):
    """training/memory_gguf.py's (weights, bytes) per block equal gguf-py's GGML_QUANT_SIZES for every type."""
    import gguf

    rules = pack_module("training.memory_gguf")
    theirs = {t.name: v for t, v in gguf.GGML_QUANT_SIZES.items()}
    assert {k: theirs[k] for k in rules.GGML_BLOCKS} == rules.GGML_BLOCKS
    assert [rules.bits_per_weight(t) for t in ("Q8_0", "Q4_K", "Q5_K")] == [8.5, 4.5, 5.5]


@pytest.mark.parametrize("qtype", TYPES)
def test_counted_bytes_equal_the_files_tensor_bytes(pack_module, files, qtype):
    """Per tensor of a real GGUF file (gguf-py's reader): the type ``stored_type`` predicts and the bytes
    ``tensor_bytes`` counts; and the loaded model's raw GGUF parameters (``nodes.host.gguf.raw_layout``) hold
    exactly the file's bytes."""
    rules, host = pack_module("training.memory_gguf"), pack_module("nodes.host.gguf")
    tiny = pack_module("demo.tiny_models")
    shapes = {k: tuple(v.shape) for k, v in tiny.tiny_state_dict(gguf_models.tiny_cosmos(tiny)).items()}
    in_file = gguf_models.file_tensors(_path(files[qtype]))
    assert in_file.keys() == shapes.keys()
    for key, (kind, nbytes) in in_file.items():
        predicted = rules.stored_type(shapes[key], qtype, high_precision="pos_embedder" in key)
        assert (predicted, rules.tensor_bytes(shapes[key], predicted)) == (kind, nbytes), key
    layout = host.raw_layout(_load(files[qtype]).model.diffusion_model)
    assert layout and sum(r.nbytes for r in layout.values()) == sum(in_file[k][1] for k in layout)
    assert all(r.nbytes == in_file[k][1] for k, r in layout.items())


def _run_inputs(pack_module, model):
    demo = pack_module("demo.nodes")
    latents = [{"samples": torch.randn(demo.latent_shape(model, SIZE, SIZE, 1))}]
    return latents, [demo.make_conditioning(model, "sks", 0, TOKENS)]


@pytest.fixture
def trackable(monkeypatch):
    """ComfyUI-GGUF's layers under torch's MemTracker (a dispatch mode): they strip their tensor class with
    ``torch.Tensor(t)``, which under any dispatch mode hands back the GGMLTensor itself and calls its ``__init__``
    without the keyword arguments it requires (TypeError). For the real step only, such a call leaves the tensor as it
    is (an alias: no memory moves); every dequantization runs as in training."""
    gg = other_packs.load_in_process(other_packs.GGUF)
    init = gg.ops.GGMLTensor.__init__

    def tolerant(self, *args, **kwargs):
        if "tensor_type" in kwargs:
            init(self, *args, **kwargs)

    monkeypatch.setattr(gg.ops.GGMLTensor, "__init__", tolerant)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_planners_estimate_of_a_gguf_base_counts_its_bytes_and_matches_the_real_step(pack_module, files,
                                                                                        checkpointing, trackable):
    """``vram_budget_gb``'s estimate (a fake twin of THIS model, ``memory_estimate.fake_twin``) of the Q4_K tiny Cosmos
    loaded by ComfyUI-GGUF: its weights are the file's raw bytes (12.8 MB, not the model's 22.7 M weights in fp32)
    and its tracked peak is within 1% of the same step run for real on the loaded model, whose layers ComfyUI-GGUF
    dequantizes per call (equal to the byte here: 55.7 MB plain, 21.1 MB checkpointed); the Q8_0 file's estimate
    is larger by at least its extra bytes."""
    estimate, host = pack_module("nodes.train.memory_estimate"), pack_module("nodes.host.gguf")
    lora = pack_module("lora.config").LoRAConfig(rank=RANK, alpha=float(RANK), targets="attention")
    settings = pack_module("training.settings").TrainSettings(gradient_checkpointing=checkpointing)
    runs = {}
    for qtype in ("Q4_K", "Q8_0"):
        model = _load(files[qtype])
        latents, conds = _run_inputs(pack_module, model)
        x0, cond = pack_module("nodes.train.budget")._batch(model, settings, latents, conds)
        with torch.inference_mode(False):
            mode, twin = estimate.fake_twin(model)
            with mode:
                runs[qtype] = estimate.run_step(twin, x0, cond, lora, settings)
            if qtype == "Q4_K":
                pack_module("nodes.train.glue").normal_weights(model.model.diffusion_model)  # as training does
                real = estimate.run_step(model, x0, cond, lora, settings)
        stored = host.stored_bytes(model.model.diffusion_model)
        counted = estimate.step_cost(runs[qtype]).weights
        assert counted == stored, f"{qtype}: the estimate counts {counted} bytes of weights, the model holds {stored}"
    fake = runs["Q4_K"]
    assert abs(fake["peak"] - real["peak"]) <= 0.01 * real["peak"], (fake["peak"], real["peak"])  # equal, measured
    assert estimate.step_cost(real).weights == estimate.step_cost(fake).weights
    extra = estimate.step_cost(runs["Q8_0"]).weights - estimate.step_cost(fake).weights
    assert extra > 0 and runs["Q8_0"]["peak"] - fake["peak"] >= extra


def test_the_budget_report_names_the_gguf_base_and_caches_each_file_apart(pack_module, files):
    """The planner's line says "GGUF Q4_K base"; a Q8_0 file of the same config is estimated anew (its cache key
    holds the file's types and bytes), not served the Q4_K file's cost."""
    budget = pack_module("nodes.train.budget")
    glue = pack_module("nodes.lora.glue")
    settings = pack_module("training.settings").TrainSettings(vram_budget_gb="8")
    lora = pack_module("lora.config").LoRAConfig(rank=RANK, alpha=float(RANK), targets="attention")
    budget._COSTS.clear()
    lines, peaks = {}, {}
    for qtype in ("Q4_K", "Q8_0"):
        with torch.inference_mode(False):
            model = glue.attach_lora(_load(files[qtype]), lora)
        model.load_device = torch.device("cuda")  # plan as for a GPU (nothing is moved: the estimate is fake)
        latents, conds = _run_inputs(pack_module, model)
        planned, lines[qtype] = budget.plan_budget(model, settings, latents, conds)
        peaks[qtype] = {k: c[0].peak for k, c in budget._COSTS.items()}
    assert lines["Q4_K"].startswith("vram budget 8 GiB: GGUF Q4_K base, no checkpointing: est.")
    assert "GGUF Q8_0 base" in lines["Q8_0"], lines["Q8_0"]
    assert len(peaks["Q8_0"]) == 2 * len(peaks["Q4_K"]), "the Q8_0 file was served the Q4_K file's cached estimate"
    budget._COSTS.clear()


def test_bench_counts_flux1_dev_q4_k_at_ggmls_bytes(pack_module):
    """``bench/memory.py --model flux1-dev --base q4_k`` builds Flux.1-dev (12 B) as ComfyUI-GGUF holds a Q4_K file:
    its weights are the Q4_K bytes of every Linear tensor (4.5 bits a weight; F16 where a row is no multiple of 256,
    F32 for 1-D and small ones) plus the rest in bf16, about 6.2 GiB, against 11.1 GiB in fp8 and 22 GiB in bf16
    (figures: docs/quantized.md)."""
    rules = pack_module("training.memory_gguf")
    gg = other_packs.load_in_process(other_packs.GGUF)
    mode, model = memory.fake_model("flux1-dev", "q4_k")
    _, plain = memory.fake_model("flux1-dev", "bf16")
    dm, plain_dm = model.model.diffusion_model, plain.model.diffusion_model
    modules = dict(dm.named_modules())
    expect = 0
    for name, p in plain_dm.named_parameters():
        owner = modules[name.rpartition(".")[0]]
        kind = rules.stored_type(tuple(p.shape), "Q4_K")
        ggml = isinstance(owner, gg.ops.GGMLOps.Linear) or kind not in rules.FLOAT_TYPES
        expect += rules.tensor_bytes(tuple(p.shape), kind) if ggml else p.numel() * 2
    counted = sum(p.numel() * p.element_size() for p in dm.parameters())
    assert counted == expect and 6.0 * 2**30 < counted < 6.5 * 2**30, counted / 2**30
    weights = {p.tensor_type.name for p in dm.parameters() if hasattr(p, "tensor_type")}
    assert weights == {"Q4_K", "F16", "F32"}, weights


def test_the_planner_never_swaps_a_gguf_base(pack_module, files, monkeypatch):
    """Block swap streams plain tensors (training/swap.py refuses a GGMLTensor): when the only plan within the budget
    swaps blocks, a GGUF base is refused before loading, naming the smallest plan without swap and the fix."""
    budget, plans = pack_module("nodes.train.budget"), pack_module("training.memory_plan")
    cost = plans.StepCost(peak=6 * 2**30, blocks=(2**30,) * 4, weights=5 * 2**30)
    tried = [plans.plan(cost, True, 0), plans.plan(cost, True, 2)]
    monkeypatch.setattr(budget, "choose", lambda *a, **k: (tried[-1], tried))
    monkeypatch.setattr(budget, "_cost_fn", lambda *a, **k: (None, []))
    with torch.inference_mode(False):
        lora = pack_module("lora.config").LoRAConfig(rank=RANK, alpha=float(RANK), targets="attention")
        model = pack_module("nodes.lora.glue").attach_lora(_load(files["Q4_K"]), lora)
    model.load_device = torch.device("cuda")
    latents, conds = _run_inputs(pack_module, model)
    settings = pack_module("training.settings").TrainSettings(vram_budget_gb="6")
    with pytest.raises(ValueError, match=r"no plan fits 6 GiB: the smallest, GGUF Q4_K base, checkpointing, is est\. "
                                         r"7\.\d+ GiB .*load a smaller GGUF type \(block swap cannot stream GGUF "
                                         r"weights, so no plan swaps them\)"):
        budget.plan_budget(model, settings, latents, conds)
