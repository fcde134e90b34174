"""bench/memory.py: the fake-tensor estimate of a training step against the same step run for real.

The estimate builds the model under FakeTensorMode (shapes only) and tracks the pack's step with torch's
MemTracker; the measurement runs the identical step on a real model of the same config (real weights,
real activations) under the same tracker. Within 10 % is #29's acceptance line; the activation diet is
checked through the estimator too (fp32 LoRA path vs plain bf16 LoRA on the same model).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import memory  # noqa: E402  (bench/memory.py)
import memory_models  # noqa: E402
import memory_step  # noqa: E402
from models import tiny_flux1  # noqa: E402

SIZE, RANK, TOKENS = 64, 4, 8


def _config(pack_module, blocks: int = 2):
    """A Cosmos-Predict2 of real layer shapes (heads of 128) at 256 wide: attention and linears of the
    real kind, small enough to run for real."""
    return pack_module("demo.tiny_models").cosmos_width_config(256, blocks)


def _model(pack_module, blocks: int = 2):
    """The model as the estimator builds it (bf16 weights computed in bf16, as on a GPU; ComfyUI's own CPU
    policy would compute in fp32), with seeded weights when built for real."""
    fit = pack_module("nodes.host.comfy_compat").fit_flux_config
    model = memory_models.build(_config(pack_module, blocks), torch.bfloat16, None, fit)
    model.load_device = None
    return model


def _measured(pack_module, checkpointing: bool, **kw) -> dict:
    model = _model(pack_module)
    pack_module("demo.tiny_models")._init_weights(model.model.diffusion_model, 0)
    return memory.run_step(model, size=SIZE, rank=RANK, checkpointing=checkpointing, tokens=TOKENS, **kw)


def _estimated(pack_module, checkpointing: bool, blocks: int = 2, size: int = SIZE, **kw) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return memory.run_step(_model(pack_module, blocks), size=size, rank=RANK, checkpointing=checkpointing,
                               tokens=TOKENS, **kw)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_within_10_percent_of_the_real_step(pack_module, one_thread, checkpointing):
    real = _measured(pack_module, checkpointing)
    fake = _estimated(pack_module, checkpointing)
    assert real["peak"] > 0 and real["by_kind"]["Activation"] > 0, real
    assert abs(fake["peak"] - real["peak"]) <= 0.10 * real["peak"], (fake["peak"], real["peak"])
    assert fake["lora_bytes"] == real["lora_bytes"] and fake["blocks"] == real["blocks"]
    # AdamW's two moments (and its step counters) exist in the tracked second step
    assert 2 * real["lora_bytes"] <= real["by_kind"]["Optstate"] <= 2 * real["lora_bytes"] + 4096, real["by_kind"]
    assert fake["matmul_flops"] == real["matmul_flops"] > 0 and fake["attention_flops"] == real["attention_flops"] > 0


def test_checkpointing_lowers_the_estimated_activations(pack_module, one_thread):
    plain, ckpt = (_estimated(pack_module, c, blocks=4, size=256) for c in (False, True))
    assert ckpt["peak"] < plain["peak"], (ckpt["peak"], plain["peak"])
    assert ckpt["attention_flops"] > plain["attention_flops"]  # the recomputation's forward


def test_fp32_lora_activations_within_5_percent_of_a_bf16_lora(pack_module, one_thread):
    """#29: fp32 accumulation costs no activation memory (the fp32 path saves bf16 inputs)."""
    kinds = {fp32: _estimated(pack_module, False, size=256, fp32_accumulation=fp32, cuda_kernels=True)["by_kind"]
             for fp32 in (True, False)}
    act = {fp32: k["Activation"] + k["Temp"] for fp32, k in kinds.items()}
    assert act[True] <= 1.05 * act[False], act


def test_the_estimate_follows_a_change_to_the_training_session(pack_module, one_thread, monkeypatch):
    """#34: the planner estimates the session a run trains under, not a copy of it. A context added to the
    session (here: one that makes every forward of the diffusion model hold an extra 8 MiB tensor until the
    step ends) raises the estimate by at least that, and the real training session enters it too."""
    tglue = pack_module("nodes.train.glue")
    extra, held, entered = 8 * 2**20, [], []
    plain = _estimated(pack_module, False)

    original = tglue._prefix_cache_training

    @contextlib.contextmanager
    def heavier(dm):
        entered.append(type(dm).__name__)
        handle = dm.register_forward_pre_hook(lambda module, args: held.append(torch.empty(extra // 4)))
        try:
            with original(dm):
                yield
        finally:
            handle.remove()
            held.clear()

    monkeypatch.setattr(tglue, "_prefix_cache_training", heavier)
    heavy = _estimated(pack_module, False)
    assert entered and held == []
    assert heavy["peak"] >= plain["peak"] + extra, (heavy["peak"], plain["peak"])
    assert heavy["lora_bytes"] == plain["lora_bytes"] and heavy["matmul_flops"] == plain["matmul_flops"]
    # the run's own session enters the same context
    entered.clear()
    model = tiny_flux1()
    glue, cfg = pack_module("nodes.lora.glue"), pack_module("lora.config").LoRAConfig(rank=4, alpha=4)
    with torch.inference_mode():
        out, lora_set = tglue.fork_lora(glue.attach_lora(model, cfg))
        with tglue.training_session(out, lora_set, pack_module("training.settings").TrainSettings()):
            assert entered == [type(out.model.diffusion_model).__name__]


def _saved_by_rms_norm(call) -> list[tuple]:
    """(shape, dtype) of each tensor autograd keeps for one rms_norm call on a fake bf16 (2, 16, 128) input."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved: list[tuple] = []
    with FakeTensorMode(), torch.autograd.graph.saved_tensors_hooks(
            lambda t: (saved.append((tuple(t.shape), t.dtype)), t)[1], lambda t: t):
        x = torch.empty(2, 16, 128, dtype=torch.bfloat16, requires_grad=True)
        out = call(x, torch.empty(128, dtype=torch.bfloat16))
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        out.sum().backward()
        assert x.grad.shape == x.shape
    return saved


def test_cuda_kernels_keep_what_cudas_fused_rms_norm_keeps(pack_module):
    """#39: on the CPU F.rms_norm is composite and keeps two fp32 copies of its input for backward (three when
    the weight trains; the estimate used to count them); CUDA's fused kernel (aten::_fused_rms_norm, whose backward takes the input, the
    weight and the fp32 rstd) keeps the bf16 input and one fp32 value per row. Under ``cuda_kernels`` the estimate
    keeps what CUDA keeps, through F.rms_norm and ComfyUI's own rms_norm (0.3.75 holds its own reference)."""
    import comfy.rmsnorm

    estimate = pack_module("nodes.train.memory_estimate")
    calls = {"F.rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (128,), weight=w, eps=1e-6),
             "comfy.rmsnorm.rms_norm": lambda x, w: comfy.rmsnorm.rms_norm(x, w, 1e-6)}
    for name, call in calls.items():
        cpu = _saved_by_rms_norm(call)
        assert sum(1 for shape, dtype in cpu if shape == (2, 16, 128) and dtype == torch.float32) == 2, (name, cpu)
        with estimate._cuda_kernels(True):
            cuda = _saved_by_rms_norm(call)
        assert sorted(cuda, key=str) == sorted([((2, 16, 128), torch.bfloat16), ((128,), torch.bfloat16),
                                                ((2, 16, 1), torch.float32)], key=str), (name, cuda)
        assert _saved_by_rms_norm(call) == cpu  # restored on exit
    # real tensors run the CPU's op even inside (the model is exact where values exist)
    x, w = torch.randn(2, 16, 128), torch.randn(128)
    with estimate._cuda_kernels(True):
        assert torch.equal(torch.nn.functional.rms_norm(x, (128,), w, 1e-6),
                           torch.nn.functional.rms_norm(x.clone(), (128,), w, 1e-6))
        assert torch.nn.functional.rms_norm(x, (128,), w, 1e-6).grad_fn is None


def test_realsize_runs_the_swapped_step_for_real_and_stock_comfyui_loads_its_lora(pack_module, one_thread):
    """bench/realsize.py's parts on a real-shape model: the real step with a block swapped (training.swap streams
    it, the host and the device being the CPU) trains the LoRA the unswapped step trains, bit for bit; the LoRA
    it saves loads in stock ComfyUI with no key left over; the --plans refusals."""
    import realsize

    runs = {}
    for swap in (0, 1):
        keep: dict = {}
        torch.manual_seed(0)  # the inputs and the step's noise
        _measured(pack_module, True, swap_blocks=swap, keep=keep)
        runs[swap] = keep
    # the swapped block's weights are views of one packed host buffer now (training.swap); unswapped, each its own
    storages = {swap: {p.untyped_storage().data_ptr() for p in pack_module("nodes.train.glue").checkpointed_blocks(
        keep["model"].model.diffusion_model)[0].parameters()} for swap, keep in runs.items()}
    assert len(storages[1]) == 1 and len(storages[0]) > 1, storages
    trained = {k: v.detach().clone() for k, v in runs[1]["lora_set"].state_dict().items()}
    assert trained and all(torch.equal(v, runs[0]["lora_set"].state_dict()[k]) for k, v in trained.items())
    model = _model(pack_module)
    loaded = realsize.stock_load(model, runs[1])
    assert loaded["left_over"] == [] and loaded["patches"] == loaded["adapters"] > 0 and loaded["keys"] == 3 * loaded["adapters"]
    assert realsize.parse_plans("plain, ckpt,offload,swap12") == [
        ("plain", False, False, 0), ("ckpt", True, False, 0), ("offload", True, True, 0), ("swap12", True, False, 12)]
    for bad in ("swap0", "swap", "half", ""):
        with pytest.raises(ValueError, match="--plans"):
            realsize.parse_plans(bad)


def test_the_stock_tracker_refuses_frozen_parameters_and_ours_counts_them():
    from torch.distributed._tools.mem_tracker import MemTracker

    layer = torch.nn.Linear(8, 8).requires_grad_(False)
    with pytest.raises(RuntimeError, match="hook"), MemTracker():
        layer(torch.ones(2, 8))
    tracker = memory_step.FrozenSafeTracker()
    with tracker:
        layer(torch.ones(2, 8))
    # weight 256 B + bias 32 B (CPU storages are counted exactly; CUDA ones rounded up to 512 B)
    assert memory_step._category_bytes(tracker.get_tracker_snapshot("peak"))["Parameter"] == 288


def test_swap_without_checkpointing_is_refused_before_anything_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "memory.py"), "--model", "flux1-dev",
                          "--swap-blocks", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--swap-blocks 4 needs --checkpointing" in out.stderr, out.stderr


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda", "--budget", "16"], "--device cuda measures one plan as given"),
    (["--device", "cuda", "--checkpointing", "--swap-blocks", "3"], "--device cuda measures one plan as given"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--budgets", "8,twelve"], "--budgets '8,twelve': give GiB as numbers"),
    (["--budget", "-4"], "--budget/--budgets: give a positive number of GiB"),
])
def test_command_line_refusals(argv, message, capsys):
    """Refused by the parser (exit 2) before ComfyUI is imported or anything is built."""
    with pytest.raises(SystemExit) as exit_info:
        memory.parse_args(["--model", "flux1-dev", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_device_cuda_is_parsed_and_refused_without_a_gpu(monkeypatch):
    args = memory.parse_args(["--model", "sdxl", "--checkpointing", "--device", "cuda"])
    assert (args.device, args.checkpointing, args.budget_list) == ("cuda", True, [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: no CUDA device here"):
        memory.measured_on_cuda(args, {"tracked_gib": 1.0})


def test_sdxl_conditioning_is_what_its_label_input_is_built_from(pack_module):
    """SDXL's label input (adm_in_channels 2816) is CLIP-G's pooled output (1280) + six size embeddings:
    the estimate's conditioning must give ComfyUI's own encode_adm what it builds that from."""
    mode, model = memory.fake_model("sdxl", "bf16")
    with mode:
        context, extra = memory._conditioning(model, pack_module("demo.nodes"), 77)[0]
        adm = model.model.encode_adm(pooled_output=extra["pooled_output"], width=1024, height=1024)
    assert tuple(context.shape) == (1, 77, 2048) and tuple(adm.shape) == (1, 2816)
