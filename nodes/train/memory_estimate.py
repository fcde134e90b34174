"""One training step of the pack at a model's real size, estimated on the CPU under fake tensors.

The core of ``bench/memory.py`` (docs/memory.md), here so the training node can plan a VRAM budget
(``budget.py``). ``run_step`` attaches a LoRA of the given config as ``PrecisionAttachLoRA`` does, forks the
copy it trains as ``PrecisionTrainLoRA`` does (``glue.fork_lora``: the attached set stays on the device, its
bytes are the run's ``upstream_bytes``), runs the pack's training step twice (``training.memory_step``: the
loop's loss, backward, optimizer with its fp32
masters, under the session's own ``glue.step_context``: checkpointing, freezing, the attention reach, as a
run applies them) under torch's ``MemTracker`` and returns the tracked
peak by kind, the FLOPs and each swappable block's weight bytes. ``fake_twin`` builds the model a
ModelPatcher holds again from its own ``model_config`` (unet_config, weight and compute dtypes) under
``FakeTensorMode``: shapes and dtypes, no memory, no weights read. ``step_cost`` turns a run into
``training.memory_plan.StepCost``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

import comfy.model_patcher

from ...lora import linear
from ...lora.config import LoRAConfig
from ...training import grad, loop, memory_step
from ...training.memory_plan import StepCost
from ...training.settings import TrainSettings
from ..host import gguf
from ..lora.glue import attach_lora, get_lora_set
from .glue import checkpointed_blocks, fork_lora, model_fns, step_context


def sdpa_override(counter: dict) -> Any:
    """An ``optimized_attention_override`` that runs ComfyUI's PyTorch-SDPA attention and counts the
    attention FLOPs of each call (4·B·H·Lq·Lk·D, forward) into ``counter``."""
    import comfy.ldm.modules.attention as attention

    def override(func: Any, q: Any, k: Any, v: Any, heads: int, *args: Any, **kwargs: Any) -> Any:
        b, lq, lk = q.shape[0], q.shape[-2], k.shape[-2]
        if not kwargs.get("skip_reshape", False):
            lq, lk = q.shape[1], k.shape[1]
        d = q.shape[-1] if kwargs.get("skip_reshape", False) else q.shape[-1] // heads
        counter["flops"] = counter.get("flops", 0) + 4 * b * heads * lq * lk * d
        counter["calls"] = counter.get("calls", 0) + 1
        kwargs.pop("transformer_options", None)
        return attention.attention_pytorch(q, k, v, heads, *args, **kwargs)

    return override


def patched_forwards(model: Any) -> list[tuple[Any, str, bool]]:
    """Install the clone's object patches (the LoRA forwards) on the modules, as ``patch_model`` does;
    returns what to undo."""
    import comfy.utils

    undo = []
    for key, patch in model.object_patches.items():
        owner_path, attr = key.rsplit(".", 1)
        owner = comfy.utils.get_attr(model.model, owner_path)
        undo.append((owner, attr, attr in owner.__dict__))
        setattr(owner, attr, patch)
    return undo


def fake_twin(model: Any) -> tuple[Any, Any]:
    """(FakeTensorMode, a ModelPatcher of the same class and config as ``model``'s, built under it):
    ``model.model.model_config`` as loaded (its unet_config with the weight dtype, its compute dtype and
    quantization options), weights fake; a GGUF model's weights as its raw blocks (``nodes.host.gguf.fill_fake``:
    their real bytes, dequantized per call by ComfyUI-GGUF's layers as in training). Nothing of the real model is
    read or moved."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    layout = gguf.raw_layout(model.model.diffusion_model)
    with mode:
        twin = model.model.model_config.get_model({}, "")
        if layout:  # a GGUF base (ComfyUI-GGUF's layers): each weight at its raw blocks' real bytes
            gguf.fill_fake(twin.diffusion_model, layout)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(twin, load_device=cpu, offload_device=cpu)
    patcher.load_device = None  # the LoRA set stays where it is made (Module.to cannot swap fake parameters)
    return mode, patcher


class _FusedRMSNorm(torch.autograd.Function):
    """``F.rms_norm`` as CUDA runs it, for fake tensors: ``aten::_fused_rms_norm``, one kernel whose backward
    (``_fused_rms_norm_backward(grad, input, normalized_shape, rstd, weight, output_mask)``, torch's own signature)
    reads the input, the weight and the fp32 reciprocal RMS of each row, so those are what autograd keeps. On the
    CPU the op is composite: it upcasts the input to fp32 and keeps two fp32 copies of it (8 bytes an element
    beside a bf16 input's 2; three with a weight that trains). Only shapes and dtypes: the estimate has no values."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, dims: int) -> torch.Tensor:
        rstd = x.new_empty(tuple(x.shape[:x.ndim - dims]) + (1,) * dims, dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, _ = ctx.saved_tensors
        dx = torch.empty_like(x, memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
        return dx, dw, None


def _fused_rms_norm(cpu_rms_norm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``F.rms_norm``'s signature: fake tensors as CUDA's fused kernel keeps them (``_FusedRMSNorm``), anything
    else as ``cpu_rms_norm``."""
    from torch._subclasses.fake_tensor import FakeTensor

    def rms_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                 eps: float | None = None) -> torch.Tensor:
        if not isinstance(input, FakeTensor):
            return cpu_rms_norm(input, normalized_shape, weight, eps)
        return _FusedRMSNorm.apply(input, weight, len(tuple(normalized_shape)))

    return rms_norm


@contextlib.contextmanager
def _cuda_kernels(on: bool):
    """The kernels whose memory differs on CUDA, as CUDA runs them (fake tensors only; docs/memory.md, "What is
    counted"): the fp32-output base GEMM (``mm`` with ``out_dtype``: no fp32 copies of the operands; the CPU path
    upcasts them, a temporary a GPU never makes) and ``F.rms_norm`` (``_FusedRMSNorm``; ComfyUI 0.3.75's
    ``comfy.rmsnorm`` holds its own reference to it)."""
    import comfy.rmsnorm

    cpu_gemm, cpu_rms = linear._gemm_fp32_out, torch.nn.functional.rms_norm
    held = getattr(comfy.rmsnorm, "rms_norm_torch", None)
    if on:
        linear._gemm_fp32_out = lambda a, b_t: torch.mm(a, b_t, out_dtype=torch.float32)
        torch.nn.functional.rms_norm = _fused_rms_norm(cpu_rms)
        if held is not None:
            comfy.rmsnorm.rms_norm_torch = _fused_rms_norm(held)
    try:
        yield
    finally:
        linear._gemm_fp32_out = cpu_gemm
        torch.nn.functional.rms_norm = cpu_rms
        if held is not None:
            comfy.rmsnorm.rms_norm_torch = held


def run_step(model: Any, x0: torch.Tensor, conds: list, lora: LoRAConfig, settings: TrainSettings, *,
             steps: int = 2, cuda_kernels: bool = False, device: Any = None,
             on_second_step: Callable[[], None] | None = None, keep: dict | None = None) -> dict:
    """Track ``steps`` training steps of ``model`` (fake or real tensors: whatever the model holds) with a
    LoRA of config ``lora`` attached, on the batch ``x0`` (B, ...) with one processed cond per row
    (``conds``), checkpointing and optimizer as ``settings`` say; returns bytes by kind, the peak, the five
    largest saved tensors, FLOPs and each swappable block's weight bytes. ``device``: where the model's
    inputs are (default cpu); ``on_second_step``: called before the tracked steps. ``settings.swap_blocks`` (real
    tensors only: a fake weight cannot be packed): that many checkpointed blocks stream to ``device`` as in a run
    (``training.swap``). ``keep``: receives the trained copy (``"model"``, ``"lora_set"``) for the caller to save."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(False):
        with_lora = attach_lora(model, lora)
        attached, lora_set = fork_lora(with_lora)  # as the node trains: a copy; the attached set stays
        upstream = get_lora_set(with_lora)
        counter: dict = {}
        attached.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
            sdpa_override(counter)
        dm = attached.model.diffusion_model
        fns = model_fns(attached, lora_set, settings, device or torch.device("cpu"))
        cond = fns.collate(conds)
        masters, optimizer = loop.optimizer_parts(lora_set, settings, torch.Generator().manual_seed(0))
        undo = patched_forwards(attached)
        try:
            blocks = checkpointed_blocks(dm, settings.gradient_checkpointing)
            swapped = blocks[:settings.swap_blocks]
            with _cuda_kernels(cuda_kernels), step_context(attached, lora_set, settings, blocks, swapped,
                                                     device or torch.device("cpu")):
                lora_set.train(True)

                def predict(*args: Any) -> Any:  # notes the forward's attention FLOPs (no recomputation)
                    out = fns.predict(*args)
                    counter.setdefault("forward", counter.get("flops", 0))
                    return out

                step = memory_step.make_step(predict, x0, cond, fns, settings, optimizer, masters)
                flops = FlopCounterMode(display=False)
                with flops:  # a first step outside the tracker: FLOPs, attention calls, optimizer state
                    step()
                # forward + recomputation (counted as called) + backward: 2.5x the forward's (five matmuls of the
                # size of the forward's two: dV, dP, dS->dQ, dS->dK and the recomputed scores; FlashAttention 2)
                attention = counter.get("flops", 0) + int(2.5 * counter.get("forward", 0))
                if on_second_step is not None:
                    on_second_step()
                tracker, census = memory_step.tracked_steps(step, [dm, lora_set], optimizer, steps - 1, grad)
            if keep is not None:
                keep.update(model=attached, lora_set=lora_set)
        finally:
            for owner, attr, had in undo:
                if not had:
                    owner.__dict__.pop(attr, None)
    mem = memory_step.summarize(tracker, census)
    return {"peak": mem.peak, "by_kind": mem.by_kind, "largest_saved": mem.largest_saved,
            "matmul_flops": int(flops.get_total_flops()), "attention_flops": int(attention),
            "lora_bytes": sum(p.numel() * p.element_size() for p in lora_set.parameters()),
            "lora_numel": sum(p.numel() for p in lora_set.parameters()),
            "upstream_bytes": sum(p.numel() * p.element_size() for p in upstream.parameters()),
            "blocks": block_bytes(dm)}


def block_bytes(dm: Any) -> list[int]:
    """Weight bytes of each block the pack would checkpoint/swap, in execution order: every block but the last
    (the training session checkpoints ``[:-1]``, and ``swap_blocks`` streams checkpointed blocks only)."""
    blocks = checkpointed_blocks(dm)
    return [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]


def step_cost(run: dict) -> StepCost:
    """``training.memory_plan.StepCost`` of a tracked run."""
    kinds = run["by_kind"]
    return StepCost(peak=run["peak"], blocks=tuple(run["blocks"]),
                    weights=kinds.get("Parameter", 0) + kinds.get("Buffer", 0) - run["lora_bytes"],
                    lora=run["lora_bytes"] + kinds.get("Gradient", 0), optimizer=kinds.get("Optstate", 0),
                    activations=kinds.get("Activation", 0) + kinds.get("Temp", 0), lora_numel=run.get("lora_numel", 0),
                    upstream=run.get("upstream_bytes", 0))
