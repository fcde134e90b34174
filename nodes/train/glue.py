"""ComfyUI glue for training: model -> ModelFns, data -> Samples, model management, job control.

Everything ComfyUI-specific that the pure loop (``training.loop``) needs is built here:
- ``model_fns``: predict / sigma_of_u / noise_latent / target from the model's own ``model_sampling``
  (velocity for flow models, noise for eps/v models) and ``apply_model`` with the patcher's
  ``transformer_options`` (so the attention override applies during training);
- ``training_session``: load through ComfyUI's model management, copy inference-mode weights (stock
  loaders) out of inference mode once, freeze base weights, autograd on, in-place-safe saved tensors on
  Flux-like families, optional block checkpointing; unload afterwards;
- ``fork_lora``: the output MODEL gets its own copy of the LoRA set, so a chained node never mutates
  the LoRA of an upstream (cached) output;
"""
from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, Callable, Iterator

import torch

import comfy.model_management as mm
import comfy.model_sampling as cms

from ...training.checkpoint import TrainingState, write_checkpoint
from ...training.grad import autograd_enabled, checkpoint_blocks, clone_saved_tensors, find_block_lists
from ...lora.layer import LoRASet
from ...lora.file import default_key_style
from ...training.loop import ModelFns
from ...training.regional_compile import CompileReport, check_gradients, compiled_blocks
from ...training.sampling import weighted_mse
from ...training.settings import TrainSettings
from . import checkpoint_files, swap_glue
from ..attention.reach import reach_context
from ..host.comfy_compat import model_gradients
from ..host import gguf
from ..host.quantized import is_quantized
from ..lora.glue import ATTACHMENT_KEY, LoRAForward, outside_compiled_graphs, write_lora
from ..model.info import describe_model

log = logging.getLogger(__name__)

# Families whose blocks add residuals out of place, so autograd's saved tensors need no copies; every
# other family, unknown ones included, is treated as adding in place (Flux does).
# Anima: Cosmos-Predict2 blocks + an LLM adapter whose blocks add out of place (tests/comfy/test_anima.py).
CLEAN_FAMILIES = {"cosmos_predict2", "anima", "qwen_image", "wan", "lumina2", "sd3"}
BLOCK_LISTS = ("double_blocks", "single_blocks", "blocks", "transformer_blocks", "layers", "joint_blocks")


def needs_in_place_fix(model: Any) -> bool:
    """True unless the family is known to have no in-place residual adds."""
    return describe_model(model).family not in CLEAN_FAMILIES


class _OutOfPlaceAdds(torch.overrides.TorchFunctionMode):
    """``torch.add(a, b, out=t)`` computed out of place while autograd records and an operand or ``t`` needs a
    gradient (autograd refuses ``out=`` there). HiDream O1's Llama blocks are the callers and use the returned
    tensor (``x = torch.add(residual, x, out=output)``), so nothing reads ``t`` expecting the sum."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.add and kwargs.get("out") is not None and torch.is_grad_enabled():
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, kwargs["out"])):
                kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        return func(*args, **kwargs)


def prefix_cache_model(dm: Any) -> bool:
    """True for HiDream O1's transformer: it adds residuals with ``out=`` and caches the prompt prefix's
    keys / values across calls by token ids (``clear_kv_cache``), which training must not reuse."""
    try:
        from comfy.ldm.hidream_o1.model import HiDreamO1Transformer
    except ImportError:  # ComfyUI without HiDream O1 (0.3.75)
        return False
    return isinstance(dm, HiDreamO1Transformer)


@contextlib.contextmanager
def _prefix_cache_training(dm: Any) -> Iterator[None]:
    """HiDream O1 only (every other model: nothing): out-of-place ``out=`` adds for the forward and the
    checkpoint recomputations in backward, and no K/V cache from before or into after the session."""
    if not prefix_cache_model(dm):
        yield
        return
    dm.clear_kv_cache()
    try:
        with _OutOfPlaceAdds():
            yield
    finally:
        dm.clear_kv_cache()


def flow_kind(model_sampling: Any) -> str:
    """"rflow" (CONST, e.g. Flux/SD3), "cosmos" (COSMOS_RFLOW), "eps" (EPS/V/EDM; CogVideoX's
    V_PREDICTION_DDPM). ValueError otherwise."""
    if isinstance(model_sampling, cms.CONST):
        return "rflow"
    if isinstance(model_sampling, cms.COSMOS_RFLOW):
        return "cosmos"
    if isinstance(model_sampling, cms.X0):
        raise ValueError("PrecisionTrainLoRA: x0-prediction models are not supported for training")
    if isinstance(model_sampling, cms.EPS):
        return "eps"
    if isinstance(model_sampling, getattr(cms, "V_PREDICTION_DDPM", ())):
        # CogVideoX (ComfyUI 0.33+): x_t = x0 + sigma * noise as for eps models, and apply_model returns x0
        # either way, so the noise it implies is (x_t - x0_hat) / sigma: it trains as the eps models do.
        return "eps"
    raise ValueError(f"PrecisionTrainLoRA: unsupported model sampling {type(model_sampling).__name__}")


def resolve_target(settings: TrainSettings, kind: str) -> str:
    target = settings.target
    if target == "auto":
        return "noise" if kind == "eps" else "velocity"
    if target == "velocity" and kind == "eps":
        raise ValueError("PrecisionTrainSettings: target='velocity' needs a flow-matching model; "
                         "this model predicts noise: use target 'auto' or 'noise'")
    return target


def _bcast(sigma: torch.Tensor, ndim: int) -> torch.Tensor:
    return sigma.view(sigma.shape[0], *([1] * (ndim - 1)))


def model_fns(model: Any, lora_set: LoRASet | None, settings: TrainSettings, device: torch.device) -> ModelFns:
    """The model as pure callables for ``training.loop.train`` (see ``ModelFns`` for shapes).

    ``lora_set`` None: no ``predict_base`` (DOP unavailable)."""
    base = model.model
    ms = base.model_sampling
    kind = flow_kind(ms)
    target_kind = resolve_target(settings, kind)
    topts = model.model_options.get("transformer_options", {})
    in_place_fix = needs_in_place_fix(model)
    # HiDream O1: every training forward computes the prompt prefix's keys / values with the current weights
    clear_cache = base.diffusion_model.clear_kv_cache if prefix_cache_model(base.diffusion_model) else None

    def flow_time(sigma: torch.Tensor) -> torch.Tensor:
        return sigma / (sigma + 1.0) if kind == "cosmos" else sigma

    def denoised(x_t: torch.Tensor, sigma: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        ctx = clone_saved_tensors() if in_place_fix else contextlib.nullcontext()
        if clear_cache is not None:
            clear_cache()
        with ctx:
            # every sample is a positive (cond) chunk, as ComfyUI's sampler lists them (SeedVR2 splits its text
            # batch into negative / positive halves unless cond_or_uncond says every chunk is one branch)
            options = {**topts, "cond_or_uncond": [0] * x_t.shape[0]}
            return base.apply_model(x_t, sigma, transformer_options=options, **cond).float()

    def predict(x_t: torch.Tensor, sigma: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        x0_hat = denoised(x_t, sigma, cond)
        s = _bcast(sigma, x_t.ndim)
        if target_kind == "noise":
            return (x_t - x0_hat) / s
        return (ms.calculate_input(sigma, x_t) - x0_hat) / _bcast(flow_time(sigma), x_t.ndim)

    def predict_base(x_t: torch.Tensor, sigma: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        assert lora_set is not None
        saved = {p: a.multiplier for p, a in lora_set.adapters().items()}
        lora_set.set_multiplier(0.0)
        try:
            return predict(x_t, sigma, cond)
        finally:
            for p, a in lora_set.adapters().items():
                a.multiplier = saved[p]

    def sigma_of_u(u: torch.Tensor) -> torch.Tensor:
        return torch.tensor([float(ms.percent_to_sigma(1.0 - float(v))) for v in u], dtype=torch.float32,
                            device=device)

    def noise_latent(sigma: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        return ms.noise_scaling(_bcast(sigma, x0.ndim), noise, x0)

    # A flow model that scales its noise (HiDream O1: x_t = sigma * 8 * noise + (1 - sigma) * x0, ComfyUI's
    # CONST.noise_scaling) has the velocity 8 * noise - x0: the one predict computes from its x0 prediction
    noise_scale = float(getattr(ms, "noise_scale", 1.0))

    def target(sigma: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        if target_kind == "noise":
            return noise
        return noise - x0 if noise_scale == 1.0 else noise_scale * noise - x0

    from comfy.samplers import cond_cat

    return ModelFns(predict=predict, predict_base=predict_base if lora_set is not None else None, sigma_of_u=sigma_of_u, noise_latent=noise_latent,
                    target=target, collate=lambda conds: cond_cat(conds), device=device)


def fork_lora(model: Any, node: str = "PrecisionTrainLoRA") -> tuple[Any, LoRASet]:
    """A clone of ``model`` whose attached LoRA set is a fresh copy (same values, dropout RNG, config).

    Object patches holding adapters of the old set are rebuilt to hold the copy's adapters; adapters of
    other LoRA sets stacked on the same layer (e.g. a loaded LoRA) are kept as they are.
    """
    old = model.get_attachment(ATTACHMENT_KEY)
    if old is None:
        raise ValueError(f"{node}: the model has no LoRA attached; "
                         "put PrecisionAttachLoRA between the model loader and this node")
    with torch.inference_mode(False):
        new = old.copy()
    swap = {id(a): b for a, b in zip(old.adapters().values(), new.adapters().values())}
    out = model.clone()
    for key, patch in list(out.object_patches.items()):
        if isinstance(patch, LoRAForward) and any(id(a) in swap for a in patch.adapters):
            out.object_patches[key] = LoRAForward(patch.module, [swap.get(id(a), a) for a in patch.adapters])
    out.set_attachments(ATTACHMENT_KEY, new)
    return out, new


def kept_lora_bytes(model: Any, lora_set: LoRASet, device: torch.device | None = None) -> int:
    """Bytes of the LoRA adapters patched into ``model`` that the run does not train (a loaded LoRA stacked on the
    trained layers): adapters follow the input's device (``LoRAForward``), so they sit on the device through the
    run, beside the trained set and the set it was forked from. ``device``: only the tensors on it now."""
    mine = {id(a) for a in lora_set.adapters().values()}
    kept = {id(a): sum(p.numel() * p.element_size() for p in a.parameters() if device is None or p.device == device)
            for patch in model.object_patches.values() for a in getattr(patch, "adapters", ())
            if isinstance(a, torch.nn.Module) and id(a) not in mine}
    return sum(kept.values())


def _unload(model: Any) -> None:
    for i in range(len(mm.current_loaded_models) - 1, -1, -1):
        if mm.current_loaded_models[i].model is model:
            mm.current_loaded_models[i].model_unload()
            mm.current_loaded_models.pop(i)
    mm.soft_empty_cache()


def normal_weights(dm: torch.nn.Module) -> int:
    """Replace every inference-tensor parameter and buffer of ``dm`` by an ordinary copy, in place in the
    module (ComfyUI itself swaps Parameter objects when it patches weights); returns how many.

    Weights that ComfyUI's own loaders (``UNETLoader``) create inside a node are inference tensors (so are
    the device copies model management makes when it loads a model inside a node), which autograd refuses
    to save for backward. Converted once per load here, a layer's forward no longer has to copy its weight
    on every call (a whole-model copy per step, all of it held until backward). Values, dtypes,
    devices and ``requires_grad`` flags are unchanged, and a tensor two modules share stays shared. Each old
    tensor is freed as its copy is made (tied ones after the pass), so the peak grows by about one tensor.
    """
    slots = [(table, attr) for module in dm.modules() for table in (module._parameters, module._buffers)
             for attr, t in table.items() if t is not None and t.is_inference() and not is_quantized(t)]
    uses = collections.Counter(id(table[attr]) for table, attr in slots)  # all alive: ids are unique here
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # tied tensors: (old, kept alive; copy)
    with torch.inference_mode(False):
        for table, attr in slots:
            old = table[attr]
            if uses[id(old)] > 1:
                if id(old) not in shared:
                    shared[id(old)] = (old, _ordinary_copy(old))
                table[attr] = shared[id(old)][1]
            else:
                table[attr] = _ordinary_copy(old)
            del old
    return len(uses)


def _ordinary_copy(t: torch.Tensor) -> torch.Tensor:
    copy = t.clone()  # outside inference mode: an ordinary tensor
    return torch.nn.Parameter(copy, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else copy


def checkpointed_blocks(dm: Any, on: bool = True) -> list:
    """The blocks a run checkpoints (and block swap streams), in execution order; none when ``on`` is False.

    Every block of the model's block lists but the last: backward needs the last block's activations first,
    so recomputing them would cost a block's forward without lowering the peak (bench/train.py measures
    both). The one place this rule is written: the session, the memory planner and its block sizes."""
    return find_block_lists(dm, BLOCK_LISTS)[:-1] if on else []


@contextlib.contextmanager
def step_context(model: Any, lora_set: LoRASet, settings: TrainSettings, blocks: list,
                 swapped: list | tuple = (), device: Any = None) -> Iterator[None]:
    """What every training step runs under, for the run (``training_session``) and for the memory planner's
    estimate (``memory_estimate.run_step``) alike: the base weights frozen, autograd on, ComfyUI's model code
    differentiable (``comfy_compat.model_gradients``), the attention override's reach (``reach_context``),
    HiDream O1's prompt-prefix cache kept out (``_prefix_cache_training``), ``swapped`` blocks streaming to
    ``device``, ``blocks`` checkpointed (in-place-safe saved tensors, the LoRA dropout's RNG, block inputs in
    host memory as ``settings`` say). Undone on exit (also on error, stop and cancel)."""
    dm = model.model.diffusion_model
    frozen = [(p, p.requires_grad) for p in dm.parameters()]
    try:
        with autograd_enabled(), model_gradients(), reach_context(model), _prefix_cache_training(dm):
            for p, _ in frozen:
                p.requires_grad_(False)
            # swap outside checkpointing: the recomputation passes through the swap's wrappers too
            with swap_glue.streaming(swapped, device), \
                    checkpoint_blocks(blocks, in_place_adds=needs_in_place_fix(model), rng=lora_set.rng,
                                      offload_inputs=settings.offload_block_inputs):
                yield
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)


@contextlib.contextmanager
def compiled_training(model: Any, settings: TrainSettings,
                      on_change: Callable[[CompileReport], None] = lambda r: None) -> Iterator[CompileReport | None]:
    """``settings.compile`` 'blocks': every block of the model's block lists (the last included: compiling it
    costs no memory) compiled for the body (``training.regional_compile``), the LoRA layers eager inside them;
    yields the report (None when 'off'). Enter it before ``training_session``: the compiled forward is then the
    innermost, under block swap and checkpointing. Restored on exit."""
    if settings.compile == "off":
        yield None
        return
    blocks = find_block_lists(model.model.diffusion_model, BLOCK_LISTS)
    _refuse_quantized_compile(blocks)
    with outside_compiled_graphs(), compiled_blocks(blocks, on_change) as report:
        yield report


def sample_gradients(fns: ModelFns, lora_set: LoRASet, x0: torch.Tensor, cond: Any) -> dict[str, torch.Tensor]:
    """The LoRA gradients of one loss + backward of ``fns.predict`` on ``x0`` (b, ...) with fixed noise (seed 0)
    at sigma 0.6, dropout off (eval mode), by parameter name; the LoRA's gradients are cleared again afterwards,
    so a run that follows starts as it would without it."""
    was = lora_set.training
    lora_set.train(False)
    try:
        lora_set.zero_grad(set_to_none=True)
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0)).to(x0.device, x0.dtype)
        sigma = torch.full((x0.shape[0],), 0.6, device=x0.device)
        x_t = fns.noise_latent(sigma, noise, x0)
        loss = weighted_mse(fns.predict(x_t, sigma, cond), fns.target(sigma, noise, x0),
                            torch.ones(x0.shape[0], device=x0.device))
        loss.backward()
        return {n: p.grad.clone() for n, p in lora_set.named_parameters() if p.grad is not None}
    finally:
        lora_set.zero_grad(set_to_none=True)
        lora_set.train(was)


def check_compiled_gradients(report: CompileReport | None, model: Any, fns: ModelFns, lora_set: LoRASet,
                             sample: Any) -> None:
    """Before a compiled run trains: ``training.regional_compile.check_gradients`` on ``sample`` (eager vs compiled
    LoRA gradients within the tolerance of the model's compute dtype, else the run is eager). Nothing when off."""
    if report is None:
        return
    base = model.model
    dtype = getattr(base, "manual_cast_dtype", None) or base.get_dtype()
    x0, cond = sample.latent.unsqueeze(0), fns.collate([sample.cond])
    check_gradients(report, lambda: sample_gradients(fns, lora_set, x0, cond), dtype)


def _refuse_quantized_compile(blocks: list) -> None:
    """ValueError naming the node, input, value, layer and fix when a block holds a per-layer quantized weight
    (ComfyUI's QuantizedTensor, ComfyUI-GGUF's GGMLTensor): the model's loader made it an inference tensor, which
    the pack does not copy (``normal_weights``), and a compiled backward may save the stored weight instead of its
    cast, which autograd refuses at run time (measured: scaled fp8 on ComfyUI 0.33, "Inference tensors cannot be
    saved for backward"). Plain fp8 weights (fp8_e4m3fn / e5m2 storage) compile."""
    for block in blocks:
        for name, t in block.named_parameters():
            if is_quantized(t) or gguf.is_gguf(t):
                kind = f"GGUF {gguf.qtype_name(t)}" if gguf.is_gguf(t) else type(t).__name__
                raise ValueError(
                    f"PrecisionTrainSettings: input 'compile'='blocks' cannot compile this model's quantized layers "
                    f"({type(block).__name__} weight '{name}' is a {kind}): their weights are inference tensors a "
                    "compiled backward would save; set compile to off (quantized bases train eager), or load the "
                    "model in a plain dtype (fp8_e4m3fn, bf16) to compile")


@contextlib.contextmanager
def training_session(model: Any, lora_set: LoRASet, settings: TrainSettings) -> Iterator[torch.device]:
    """Load ``model`` (with its object patches) through model management (or, with blocks swapped, place it
    as ``swap_glue`` does), make its weights ordinary tensors (``normal_weights``), move the LoRA set there,
    and run the body under ``step_context``; unload afterwards (also on error, stop and cancel). Yields the
    device."""
    dm = model.model.diffusion_model
    blocks = checkpointed_blocks(dm, settings.gradient_checkpointing)
    swapped = swap_glue.swapped_blocks(blocks, settings, describe_model(model).family)
    if swapped:  # the pack places the model (swap_glue: who owns placement while blocks stream)
        swap_glue.load_resident(model, swapped)
    else:
        mm.load_models_gpu([model], force_full_load=True)
    device = model.load_device
    try:
        converted = normal_weights(dm)
        if converted:
            log.info("copied %d inference-mode weights of the model out of inference mode "
                     "(once per load)", converted)
        with torch.inference_mode(False):  # Module.to inside inference mode would make inference parameters
            lora_set.to(device)
        with step_context(model, lora_set, settings, blocks, swapped, device):
            yield device
    finally:
        if swapped:
            swap_glue.unload_resident(model)
        else:
            _unload(model)


# ---- checkpoint files (where: checkpoint_files) ----

CHECKPOINT_SUBDIR = checkpoint_files.LEGACY_SUBDIR


def checkpoint_dir() -> str:
    """The old checkpoint folder ``output/precision_lora/checkpoints``: PrecisionSaveLoRA's states, and
    checkpoints of earlier versions, which ``resume_from`` still finds."""
    return checkpoint_files.legacy_dir()


def checkpoint_writer(model: Any, lora_set: LoRASet, name: str) -> Callable[[TrainingState, str], str]:
    """``save_checkpoint`` hook: ``<loras>/<name>/<name>_step<step>.{trainstate,safetensors}`` (``checkpoint_files``).

    The LoRA file has the ``PrecisionSaveLoRA`` keys and metadata (plus the step and the reason)."""
    info = describe_model(model)  # once: every checkpoint of the run shares the description

    def save(state: TrainingState, reason: str) -> str:
        def write(path: str) -> str:
            return write_lora(path, model, info, lora_set, default_key_style(info.family),
                              extra={"ss_steps": state.step, "precision_lora_checkpoint": reason})

        return write_checkpoint(checkpoint_files.checkpoint_base(name, state.step), state, write)

    return save


def resolve_resume(name: str) -> checkpoint_files.ResumePick:
    """The state file (and the LoRA it must match) for ``name``: a checkpoint as the LoRA loaders list it, its
    absolute path, or a file name in the old checkpoint folder. ValueError with the right form otherwise."""
    return checkpoint_files.resolve_resume(name)
