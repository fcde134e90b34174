"""Train Settings' ``vram_budget_gb``: the memory planner picks gradient checkpointing, block inputs in host
memory and swap_blocks.

Before the model is loaded onto the device, ``plan_budget`` estimates one training step of THIS model (a
fake twin built from its own ``model_config``: ``memory_estimate.fake_twin``) with THIS run's LoRA config,
largest latent, conditioning, batch size and optimizer, at its real size on the CPU, and takes the
cheapest plan within the budget (``training.memory_plan.choose``: no checkpointing, checkpointing, then
checkpointing with the block inputs in host memory, then that with 1, 2, ... blocks swapped). Estimates are cached in-process per (model config, settings, input shapes),
so a second run of the same graph plans at once.

Who wins: with a budget set, the plan decides ``swap_blocks`` (a value set by hand is replaced, and the
report says so); ``gradient_checkpointing`` on is kept (only plans with checkpointing are considered),
off lets the plan turn it on; ``offload_block_inputs`` likewise (on: only plans with it).

"auto": the training device's free memory as CUDA reports it (``torch.cuda.mem_get_info``) plus what
ComfyUI could free for the run: its caching allocator's reserved-but-unused memory and the weights of the
models model management holds on that device (the training session unloads them), plus the CUDA context
allowance (this process has paid it already; the estimate counts it), minus ComfyUI's own reserve
(``extra_reserved_memory``). A CPU (or other non-CUDA) device has no VRAM to plan for: the report says so
and the settings run as set.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Callable

import torch

import comfy.model_management as mm

from ...training.memory_plan import (CUDA_CONTEXT_GIB, GIB, WORKSPACE_GIB, HostCost, Plan, StepCost, choose,
                                     host_cost, size_text)
from ...training.settings import TrainSettings
from ..host import gguf
from ..lora.glue import get_lora_set
from ..model.data_checks import is_minimax_h3, is_packed
from .data import build_samples
from .glue import kept_lora_bytes
from .memory_estimate import fake_twin, run_step, step_cost

log = logging.getLogger(__name__)
_COSTS: dict[tuple, tuple[StepCost, str]] = {}  # (model config, LoRA, settings, input shapes, checkpointing) -> cost
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8 e5m2"}


def auto_budget_gib(device: torch.device) -> float:
    """What "auto" means on a CUDA ``device`` (module docstring), in GiB."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    held = sum(lm.model_loaded_memory() for lm in mm.current_loaded_models
               if lm.device == device and lm.model is not None)  # 0.33 holds dead models as None
    return (free + cached + held - mm.extra_reserved_memory()) / GIB + CUDA_CONTEXT_GIB


def plan_budget(model: Any, cfg: TrainSettings, latents: list, conditioning: list,
                say: Callable[[str], None] = lambda text: None) -> tuple[TrainSettings, str | None]:
    """``cfg`` with the plan's checkpointing, block inputs in host memory and swap_blocks, and the report line; ``(cfg, None)`` when the
    budget is off. ValueError with the numbers when no plan fits (before anything heavy is loaded).
    ``say``: shows progress (the node's text) before each estimate that is not cached."""
    budget = cfg.budget
    if budget is None:
        return cfg, None
    device = torch.device(model.load_device)
    auto = budget == "auto"
    if auto:
        if device.type != "cuda":
            return cfg, (f"vram budget auto: the training device is {device.type}, which has no VRAM to plan for; "
                         f"gradient_checkpointing={cfg.gradient_checkpointing} and swap_blocks={cfg.swap_blocks} "
                         "run as set")
        budget = round(auto_budget_gib(device) + _paid_lora_bytes(model, device) / GIB, 2)
    cost, notes = _cost_fn(model, cfg, latents, conditioning, device.type == "cuda", say)
    plan, tried = choose(cost, budget, checkpointing_only=cfg.gradient_checkpointing,
                         offload_cost=lambda: cost(True, offload=True), offload_only=cfg.offload_block_inputs)
    what = f"vram budget {budget:g} GiB" + (" (auto: free on the device + what ComfyUI can free)" if auto else "")
    base = base_name(model)
    if plan is not None and plan.swap_blocks and base.startswith("GGUF"):  # training.swap streams plain tensors only
        plan, tried = None, [p for p in tried if not p.swap_blocks]
    if plan is None:
        least = tried[-1]
        raise ValueError(
            f"PrecisionTrainLoRA: input 'vram_budget_gb'={cfg.vram_budget_gb!r} of "
            f"PrecisionTrainSettings: no plan fits {budget:g} GiB: the smallest, {base} base, {least.describe()}, is est. "
            f"{least.peak_gib} GiB (of which {CUDA_CONTEXT_GIB + WORKSPACE_GIB:g} GiB CUDA context and workspaces) "
            f"+ {_gib_text(least.margin_gib)} safety margin; "
            f"raise vram_budget_gb, lower the resolution, rank or batch size, {_smaller_base(base)}"
            "or set vram_budget_gb to 0 to train without planning")
    line = f"{what}: {base} base, {plan.describe()}: est. {plan.peak_gib} GiB of {budget:g}" + _margin_text(plan)
    if cfg.swap_blocks and cfg.swap_blocks != plan.swap_blocks:
        line += f" (the plan replaces swap_blocks={cfg.swap_blocks})"
    if cfg.gradient_checkpointing:
        line += " (gradient_checkpointing on kept: only plans with checkpointing considered)"
    if cfg.offload_block_inputs:
        line += " (offload_block_inputs on kept)"
    line += _ram_check(cfg, plan, host_side(cfg, plan, cost, latents, conditioning))
    planned = dataclasses.replace(cfg, gradient_checkpointing=plan.checkpointing, swap_blocks=plan.swap_blocks,
                                  offload_block_inputs=plan.offload_inputs)
    return planned, line + "".join(notes)


def _margin_text(plan: Plan) -> str:
    """" (with 0.14 GiB of LoRA sets kept beside the trained one; 0.23 GiB more kept free as safety margin)"."""
    kept = f"with {plan.upstream_gib:g} GiB of LoRA sets kept beside the trained one; " if plan.upstream_gib else ""
    return f" ({kept}{_gib_text(plan.margin_gib)} more kept free as safety margin)"


def _gib_text(gib: float) -> str:
    """A plan's figure (rounded to 0.01 GiB) as the reports write it; 0 as "under 0.01 GiB"."""
    return f"{gib:g} GiB" if gib else "under 0.01 GiB"


def _paid_lora_bytes(model: Any, device: torch.device) -> int:
    """Device bytes the estimate counts that are allocated already, so not in "auto"'s free memory: the trained
    LoRA set, the set it was forked from (a copy of the same tensors on the same device: ``glue.fork_lora``) and
    adapters stacked with it (``glue.kept_lora_bytes``) when they are on ``device``."""
    lora_set = get_lora_set(model)
    trained = sum(p.numel() * p.element_size() for p in lora_set.parameters() if p.device == device)
    return 2 * trained + kept_lora_bytes(model, lora_set, device)


def host_side(cfg: TrainSettings, plan: Plan, cost: Callable[..., StepCost], latents: list,
              conditioning: list) -> HostCost:
    """What ``plan`` keeps in host memory (``training.memory_plan.host_cost``), from the estimates ``cost``
    made (an offload plan's block inputs: what the offload took off the device) and this run's data."""
    step = cost(plan.checkpointing, offload=plan.offload_inputs)
    return host_cost(plan, step, cost(True) if plan.offload_inputs else None, ema=cfg.ema_decay > 0,
                     ema_on_cpu=cfg.ema_on_cpu, dataset=_tensor_bytes(latents) + _tensor_bytes(conditioning))


def available_ram_gib() -> float:
    """What ``ram_budget_gb`` "auto" means: the memory this machine has available now (``psutil``), in GiB."""
    import psutil

    return psutil.virtual_memory().available / GIB


def _ram_check(cfg: TrainSettings, plan: Plan, host: HostCost) -> str:
    """The report's host-memory part ("; host memory est. ..."); ValueError with both figures when the plan's
    host side is over ``ram_budget_gb``."""
    ram = cfg.ram_budget
    est = size_text(host.total)
    if ram is None:
        return f"; host memory est. {est} ({host.describe()}; ram_budget_gb off)"
    auto = ram == "auto"
    if auto:
        ram = round(available_ram_gib(), 2)
    what = f"{ram:g} GiB" + (" (auto: available on this machine now)" if auto else "")
    if host.total > ram * GIB:
        raise ValueError(
            f"PrecisionTrainLoRA: input 'ram_budget_gb'={cfg.ram_budget_gb!r} of PrecisionTrainSettings: the plan "
            f"for vram_budget_gb={cfg.vram_budget_gb!r} ({plan.describe()}, est. {plan.peak_gib} GiB of VRAM) keeps "
            f"est. {est} in host memory ({host.describe()}), over the {what} ram_budget_gb allows; raise "
            "vram_budget_gb (fewer blocks swapped) or ram_budget_gb, lower the resolution, rank or batch size, turn "
            "ema_on_cpu off, or set ram_budget_gb to 0 to train without this check")
    return f"; host memory est. {est} of {what} ({host.describe()})"


def _tensor_bytes(value: Any, depth: int = 0) -> int:
    """Bytes of the tensors in ``value`` (LATENT dicts, CONDITIONING lists and their option dicts)."""
    if isinstance(value, torch.Tensor):
        if getattr(value, "is_nested", False):
            return sum(t.numel() * t.element_size() for t in value.unbind())
        return value.numel() * value.element_size()
    if depth > 6:
        return 0
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, depth + 1) for v in value)
    return 0


PLANNED = ("gradient_checkpointing", "offload_block_inputs", "swap_blocks")  # what a plan decides


@dataclasses.dataclass(frozen=True)
class PlanStep:
    """The memory planner's step of one run: the settings as the user set them (``chosen``: the training
    state keeps them, so a resumed run compares what was chosen with what is chosen), the settings the
    training session runs with (``session``: the plan's checkpointing, block inputs in host memory and
    swap_blocks) and the report line (None: no budget)."""

    chosen: TrainSettings
    session: TrainSettings
    line: str | None

    def planned(self) -> dict[str, dict[str, Any]]:
        """Each setting the plan decided: ``{"set": what the user set, "planned": what the session runs}``;
        empty when nothing was planned (no budget, or "auto" on a device without VRAM)."""
        if self.session is self.chosen:
            return {}
        return {name: {"set": getattr(self.chosen, name), "planned": getattr(self.session, name)} for name in PLANNED}

    def metadata(self) -> dict[str, str]:
        """The LoRA metadata of the plan: its report line and, as JSON, what it decided."""
        if self.line is None:
            return {}
        planned = self.planned()
        return {"precision_lora_vram_plan": self.line,
                **({"precision_lora_planned": json.dumps(planned, sort_keys=True)} if planned else {})}


def plan_step(model: Any, cfg: TrainSettings, latents: list, conditioning: list,
              say: Callable[[str], None] = lambda text: None) -> PlanStep:
    """``plan_budget`` as a named step that keeps the user's settings apart from the plan's."""
    session, line = plan_budget(model, cfg, latents, conditioning, say)
    return PlanStep(cfg, session, line)


def _cost_fn(model: Any, cfg: TrainSettings, latents: list, conditioning: list, cuda_kernels: bool,
             say: Callable[[str], None] = lambda text: None):
    """``cost(checkpointing, offload=False)`` for ``choose`` (estimated lazily, cached) and the notes its
    estimates add to the report (filled as ``choose`` asks)."""
    lora_set = get_lora_set(model)
    lora, stacked = lora_set.config, kept_lora_bytes(model, lora_set)
    with torch.inference_mode(False):
        x0, conds = _batch(model, cfg, latents, conditioning)
    base = (_config_key(model), repr(lora), tuple(x0.shape), _shapes(conds[0]), cfg.optimizer, cfg.loss_weighting,
            cfg.grad_accum, cfg.learning_rate, cfg.loraplus_ratio, cuda_kernels)
    notes: list[str] = []

    def cost(checkpointing: bool, offload: bool = False) -> StepCost:
        key = (*base, checkpointing, offload)
        if key not in _COSTS:
            what = ("checkpointing" if checkpointing else "no checkpointing") + (
                ", block inputs in host memory" if offload else "")
            say(f"vram_budget_gb: estimating this model's training step at its real size on the CPU "
                f"({what}) before loading it ...")
            _COSTS[key] = _estimate(model, lora, cfg, x0, conds, checkpointing, cuda_kernels, offload)
        cost_, note = _COSTS[key]
        if note and note not in notes:
            notes.append(note)
        return dataclasses.replace(cost_, upstream=cost_.upstream + stacked)  # stacked: this model's, not cached

    return cost, notes


def _estimate(model: Any, lora: Any, cfg: TrainSettings, x0: torch.Tensor, conds: list, checkpointing: bool,
              cuda_kernels: bool, offload: bool = False) -> tuple[StepCost, str]:
    """The step's cost at ``checkpointing`` (block inputs in host memory for ``offload``) and a note for the
    report ("" when the estimate is as asked)."""
    settings = dataclasses.replace(cfg, gradient_checkpointing=checkpointing, swap_blocks=0, vram_budget_gb="0",
                                   offload_block_inputs=offload and checkpointing)
    log.info("PrecisionTrainLoRA: vram_budget_gb: estimating one training step of this model at "
             "its real size on the CPU (fake tensors, %s; about 15 s for Flux.1-dev at 1024 px)",
             "checkpointing" if checkpointing else "no checkpointing")
    began, note = time.monotonic(), ""
    try:
        try:
            run = _fake_run(model, x0, conds, lora, settings, cuda_kernels)
        except Exception as exc:  # an optimizer that reads values (fake tensors have none)
            if settings.optimizer == "adamw" or _reads_values(exc):
                raise
            note = (f" (optimizer {settings.optimizer} cannot run on fake tensors: estimated with adamw's two fp32 "
                    f"moments instead; {type(exc).__name__})")
            run = _fake_run(model, x0, conds, lora, dataclasses.replace(settings, optimizer="adamw"), cuda_kernels)
    except Exception as exc:
        if not _reads_values(exc):
            raise
        raise ValueError(
            f"PrecisionTrainLoRA: input 'vram_budget_gb'={cfg.vram_budget_gb!r} of "
            f"PrecisionTrainSettings: this model's forward ({type(model.model).__name__}) reads tensor values as Python "
            "numbers (MiniMax H3: the sigma), which the planner's value-less fake tensors cannot give, so its "
            "training step cannot be estimated; set vram_budget_gb to 0 and set gradient_checkpointing / "
            "swap_blocks by hand") from exc
    log.info("PrecisionTrainLoRA: vram_budget_gb: estimated in %.1f s (tracked peak %.2f GiB)",
             time.monotonic() - began, run["peak"] / GIB)
    return step_cost(run), note


def _reads_values(exc: BaseException) -> bool:
    """Whether a fake-tensor run failed because the model's code read a tensor's value (``float(t)``, ``.item()``)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    return isinstance(exc, DataDependentOutputException)


def _fake_run(model: Any, x0: torch.Tensor, conds: list, lora: Any, settings: TrainSettings, cuda_kernels: bool) -> dict:
    with torch.inference_mode(False):
        mode, twin = fake_twin(model)
        with mode:
            return run_step(twin, x0, conds, lora, settings, cuda_kernels=cuda_kernels)


def _batch(model: Any, cfg: TrainSettings, latents: list, conditioning: list) -> tuple[torch.Tensor, list]:
    """The largest latent's first row and the first conditioning, as the run builds samples (on the CPU),
    repeated to the run's batch size (capped at the dataset's rows, as the loop caps it)."""
    batches = [lat["samples"] for lat in latents]
    largest = max(batches, key=_row_numel)
    sample = build_samples(model, [{"samples": largest[:1]}], [[conditioning[0][0]]], None, torch.device("cpu"))[0]
    rows = min(cfg.batch_size, sum(int(s.shape[0]) for s in batches))
    if is_minimax_h3(model):  # its forward takes one sample: a batch trains as forwards of one (train.data)
        rows = 1
    return sample.latent.unsqueeze(0).repeat(rows, *([1] * sample.latent.ndim)), [sample.cond] * rows


def _row_numel(samples: Any) -> int:
    """Elements of a LATENT's first row (every part of a packed audio-video latent)."""
    return sum(t[0].numel() for t in samples.unbind()) if is_packed(samples) else samples[0].numel()


def _smaller_base(base: str) -> str:
    """The fix a budget refusal offers for the base: fp8 for a larger one; for GGUF a smaller type (block swap, the
    last resort of the plans, cannot stream GGUF blocks)."""
    if base.startswith("GGUF"):
        return "load a smaller GGUF type (block swap cannot stream GGUF weights, so no plan swaps them), "
    return "" if base.startswith("fp8") else "load the base in fp8, "


def base_name(model: Any) -> str:
    """The base's storage as the report names it: "bf16", "fp8", "GGUF Q4_K" (the type most of its bytes are in)."""
    dtype = model.model.get_dtype()
    return gguf.describe_base(model.model.diffusion_model) or DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _config_key(model: Any) -> tuple:
    mc = model.model.model_config
    unet = tuple(sorted((k, repr(v)) for k, v in mc.unet_config.items()))
    dm = model.model.diffusion_model  # GGUF files of one config differ in their types and bytes
    stored = (tuple(sorted(gguf.qtype_counts(dm).items())), sum(r.nbytes for r in gguf.raw_layout(dm).values()))
    return (type(mc).__qualname__, unet, repr(getattr(mc, "manual_cast_dtype", None)),
            repr(getattr(mc, "optimizations", None)), stored)


def _shapes(cond: dict) -> tuple:
    return tuple(sorted((k, tuple(c.cond.shape) if isinstance(c.cond, torch.Tensor) else repr(c.cond))
                        for k, c in cond.items()))
