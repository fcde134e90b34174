"""ComfyUI glue for LoRA: attach/detach adapters on a ModelPatcher clone, find the LoRA set, build metadata.

Adapters are installed as object patches on each target Linear's ``forward``
(``diffusion_model.<path>.forward``), so ComfyUI applies them in ``patch_model`` and restores the original
forward in ``unpatch_model``; the shared ``nn.Module`` is never changed permanently. The LoRASet lives in
``set_attachments("precision_lora", lora_set)`` (shared by reference across clones). Nothing of ours is
placed in ``model_options``, so ComfyUI's ``.to(model_dtype)`` on patches at sampling start never casts
the fp32 LoRA parameters.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence

import comfy.ops
import torch

from ...lora.config import LoRAConfig
from ...lora.layer import LoRASet
from ...lora.lowrank import LoRAAdapter, lora_linear
from ...lora.linear import recomputable
from ...lora.locon import ConvGeometry, LoConAdapter, lora_conv2d
from ...lora.file import LoRAFactors, default_key_style, lora_metadata, lora_state_dict, read_lora_file, save_lora_file
from ...lora.formats import fit_rank, parse_lora
from ...training.checks import show
from ...lora.targets import TargetPlan, plan_targets as _plan_targets
from ...lora.adapter_files import is_adapter_file
from ..checks.file_names import inside, name_problem
from ..host import errors
from ..host.quantized import check_layer, is_linear, layer_weight
from ..model.info import ModelInfo, describe_model
from . import adapter_glue, conv_glue

log = logging.getLogger(__name__)

ATTACHMENT_KEY = "precision_lora"
LOADED_KEY = "precision_lora_loaded"  # frozen LoRASets added by PrecisionLoadLoRA (fp32 mode)
_PREFIX = "diffusion_model."


class LoRAForward:
    """Replacement ``forward`` for one Linear: base (ComfyUI-cast weights) + adapters, numerics in lora.layer."""

    def __init__(self, module: torch.nn.Linear, adapters: Sequence[LoRAAdapter]) -> None:
        self.module = module
        self.adapters = tuple(adapters)

    def __call__(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        try:
            return self._forward(x)
        except Exception as exc:  # also under KSampler or another pack's node: the pack's messages say whose
            errors.mark(exc)
            raise

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        comfy.ops.run_every_op()
        m = self.module
        for a in self.adapters:
            if next(a.parameters()).device != x.device:
                with torch.inference_mode(False):  # else Module.to would make its parameters inference tensors
                    a.to(x.device)  # adapters are not submodules of the model: follow the input's device
        weight, bias, release = layer_weight(m, x)  # ComfyUI's cast, dequantized (fp8, scaled fp8, quant_ops)
        fresh = weight is not m.weight and not isinstance(weight, torch.nn.Parameter)
        if torch.is_grad_enabled() and weight.is_inference():
            weight = weight.clone()  # autograd cannot save inference tensors (weights loaded inside a node)
            bias = None if bias is None else bias.clone()
            fresh = True
        if fresh and torch.is_grad_enabled() and x.requires_grad:
            # a copy made for this call: the backward casts it again rather than keeping it (lora.linear.recomputable)
            recomputable(weight, _recast(m, x.new_empty(0)))
        if isinstance(m, torch.nn.Conv2d):  # adapter 'locon' (lora.locon)
            out = lora_conv2d(x, weight, bias, ConvGeometry(m.stride, m.padding, m.dilation, m.groups), self.adapters)
        else:
            out = lora_linear(x, weight, bias, self.adapters)
        release()
        return out


@contextlib.contextmanager
def outside_compiled_graphs():
    """For the body, every LoRA'd layer runs eager inside a compiled block (``torch.compiler.disable``: a graph
    break around it): its Python-side steps (the device follow, ComfyUI's cast, the recomputable base weight,
    the fp32 low-rank autograd functions) run as they do without compilation. Restored on exit."""
    original = LoRAForward.__dict__["__call__"]
    LoRAForward.__call__ = torch.compiler.disable(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        LoRAForward.__call__ = original  # type: ignore[method-assign]


def _recast(module: torch.nn.Module, probe: torch.Tensor):
    """The base weight of ``module`` cast again as ``layer_weight`` casts it for an input like ``probe`` (its
    dtype and device only): (weight, release) for the backward of ``lora.linear``'s base GEMM."""
    def recast() -> tuple[torch.Tensor, object]:
        weight, _bias, release = layer_weight(module, probe)
        return weight, release
    return recast


def linear_layers(model) -> dict[str, tuple[int, int]]:
    """Every Linear of the diffusion model: path → (in_features, out_features)."""
    dm = model.model.diffusion_model
    return {name: (m.in_features, m.out_features) for name, m in dm.named_modules() if is_linear(m)}


def model_family(model) -> str:
    return describe_model(model).family


def target_plan(model, cfg: LoRAConfig) -> TargetPlan:
    """What ``cfg`` selects in this model, and the preset's matches left out as narrower than the rank."""
    plan = _plan_targets(linear_layers(model), model_family(model), cfg.targets, cfg.include, cfg.exclude, cfg.blocks,
                         rank=cfg.rank)
    if cfg.adapter != "locon":
        return plan
    return dataclasses.replace(plan, chosen={**plan.chosen, **conv_glue.locon_convs(model, cfg, model_family(model))})


def plan_targets(model, cfg: LoRAConfig) -> dict[str, tuple[int, int]]:
    """The modules ``cfg`` selects in this model (ValueError listing module names when none)."""
    return target_plan(model, cfg).chosen


def _new_lora_set(cfg: LoRAConfig, shapes: Mapping[str, tuple[int, int]], device: torch.device | None = None,
                  weights: Mapping[str, torch.Tensor] | None = None) -> LoRASet:
    # Nodes run under inference_mode; trainable parameters must be ordinary tensors. They are placed on the
    # model's load device up front, so an optimizer built on them never sees a later device move.
    with torch.inference_mode(False):
        lora_set = LoRASet(cfg, shapes, weights=weights)
        return lora_set if device is None else lora_set.to(device)


def install(model, lora_set: LoRASet, attachment_key: str | None = ATTACHMENT_KEY):
    """Clone ``model`` and patch every adapter of ``lora_set`` in (stacking on adapters already there)."""
    patched = model.clone()
    dm = model.model.diffusion_model
    modules = dict(dm.named_modules())
    for path, adapter in lora_set.adapters().items():
        conv = isinstance(adapter, LoConAdapter) and isinstance(modules.get(path), torch.nn.Conv2d)
        if path not in modules or not (conv or is_linear(modules[path])):
            raise ValueError(f"LoRA module '{path}' is not a linear layer of this model")
        check_layer(modules[path], path)
        key = f"{_PREFIX}{path}.forward"
        previous = patched.object_patches.get(key)
        earlier = previous.adapters if isinstance(previous, LoRAForward) else ()
        patched.add_object_patch(key, LoRAForward(modules[path], earlier + (adapter,)))
    if attachment_key is not None:
        patched.set_attachments(attachment_key, lora_set)
    return patched


def attach_lora(model, cfg: LoRAConfig, init_file: str | None = None,
                plan: Mapping[str, tuple[int, int]] | None = None):
    """A clone of ``model`` with a new trainable LoRASet (eval mode; ``train()`` it for dropouts).

    ``init_file``: continue from a LoRA file: its rank must equal ``cfg.rank`` and its modules must be
    among the selected targets. ``plan``: ``plan_targets(model, cfg)`` when the caller has it already.
    Raises ValueError before anything is attached.
    """
    shapes = plan_targets(model, cfg) if plan is None else plan
    factors: dict[str, LoRAFactors] = {}
    parsed: dict = {}
    what = f"PrecisionAttachLoRA: init_lora '{init_file}'"
    if init_file:
        tensors, _md = read_lora_file(init_file)
        if cfg.adapter == "locon":
            factors = _locon_init(model, tensors, cfg.rank, what)
        elif adapter_glue.uses_adapter_files(cfg, tensors):
            parsed = adapter_glue.init_adapters(tensors, linear_layers(model), cfg, shapes, what)
        else:
            factors = parse_lora(tensors, linear_layers(model), name=f"init LoRA '{init_file}'")
            factors = fit_rank(factors, cfg.rank, what)
    weights = adapter_glue.base_weights(model, shapes) if cfg.adapter == "dora" else None
    lora_set = _new_lora_set(cfg, shapes, model.load_device, weights)
    if factors:
        with torch.inference_mode(False):
            lora_set.load_factors({p: (f.down, f.up, f.scale) for p, f in factors.items()})
    adapter_glue.load_init(lora_set, parsed, what)
    log.info("attached rank-%d %s to %d modules (%d parameters, fp32_accumulation=%s)",
             cfg.rank, cfg.adapter, len(shapes), lora_set.num_parameters(), cfg.fp32_accumulation)
    return install(model, lora_set)


def _locon_init(model, tensors: Mapping[str, torch.Tensor], rank: int, what: str) -> dict[str, LoRAFactors]:
    """init_lora for adapter 'locon': the file's Conv2d modules (flat factors) and its Linear modules."""
    factors, rest = conv_glue.split_conv_factors(tensors, conv_glue.conv_layers(model), what)
    if rest:
        factors |= parse_lora(rest, linear_layers(model), name=what)
    return fit_rank(factors, rank, what)


def lora_set_from_factors(factors: Mapping[str, LoRAFactors], cfg: LoRAConfig, strength: float,
                          device: torch.device | None = None) -> LoRASet:
    """An inference LoRASet holding a file's factors at ``strength`` (frozen parameters)."""
    shapes = {p: (int(f.down.shape[1]), int(f.up.shape[0])) for p, f in factors.items()}
    lora_set = _new_lora_set(cfg, shapes, device)
    with torch.inference_mode(False):
        lora_set.load_factors({p: (f.down, f.up, f.scale) for p, f in factors.items()})
        lora_set.requires_grad_(False)
    lora_set.set_multiplier(strength)
    return lora_set


def detach_lora(model):
    """A clone of ``model`` without any Precision LoRA object patch or attachment (base forward restored)."""
    patched = model.clone()
    for key in [k for k, v in patched.object_patches.items() if isinstance(v, LoRAForward)]:
        del patched.object_patches[key]
    patched.remove_attachments(ATTACHMENT_KEY)
    patched.remove_attachments(LOADED_KEY)
    return patched


def get_lora_set(model) -> LoRASet | None:
    """The LoRASet most recently attached to this model (or one of its ancestors), or None."""
    return model.get_attachment(ATTACHMENT_KEY)


def _mixed_precision(model) -> str:
    dtype = model.model.get_dtype()
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")


def attention_metadata(model, info: ModelInfo) -> dict[str, str]:
    """The model's attention settings as metadata (default settings when it was never patched); ``info`` is
    ``describe_model(model)``."""
    from ...attention.config import AttentionConfig
    from ..attention.glue import get_attention_config

    head_dim = info.head_dim
    cfg = get_attention_config(model) or AttentionConfig()
    return cfg.to_metadata(head_dim) if head_dim else {"ss_attn_mode": cfg.backend}


def build_lora_metadata(model, info: ModelInfo, lora_set: LoRASet,
                        extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """Metadata for saving ``lora_set`` trained on ``model``: kohya ss_* keys, attention settings, pack version.

    ``info`` is ``describe_model(model)``, taken once by the caller (a run's checkpoints share it).
    ``extra`` holds metadata keys verbatim, e.g. ``{"ss_steps": 500, "ss_training_started_at": t0}``.
    """
    family = info.family
    md = {"ss_training_finished_at": str(time.time())}
    md.update(attention_metadata(model, info))
    md.update(getattr(lora_set, "info", {}))
    md.update({str(k): v for k, v in (extra or {}).items()})
    return lora_metadata(lora_set.config, family=family, key_style=default_key_style(family),
                         mixed_precision=_mixed_precision(model), extra=md)


def write_lora(path: str, model, info: ModelInfo, lora_set: LoRASet, key_style: str, save_dtype: str = "fp32",
               extra: Mapping[str, object] | None = None, overwrite: bool = False) -> str:
    """The one way the pack writes a LoRA file (Save LoRA, periodic checkpoints, EMA files): the state dict in
    ``key_style`` / ``save_dtype`` (ValueError when a value does not fit that dtype), its metadata
    (``build_lora_metadata``), then ``lora.file.save_lora_file``, which refuses NaN/inf (``NonFiniteError``) and an
    existing ``path`` unless ``overwrite`` before writing, and writes atomically: a failure leaves no file behind.
    Returns the absolute path."""
    tensors = lora_state_dict(lora_set, key_style, save_dtype)
    return save_lora_file(path, tensors, build_lora_metadata(model, info, lora_set, extra), overwrite=overwrite)


# ---- loading a LoRA file onto a model ---------------------------------------------------------------------

def load_lora_fp32(model, tensors: Mapping[str, torch.Tensor], strength: float, name: str):
    """Clone with the file's factors as unmerged adapters on the fp32 path (one frozen LoRASet per rank; a
    LoKr / LoHa / DoRA file: one frozen set of its adapters)."""
    loaded = list(model.get_attachment(LOADED_KEY) or ())
    convs = conv_glue.conv_layers(model)
    factors, tensors = conv_glue.split_conv_factors(tensors, convs, name) if convs else ({}, tensors)
    for lora_set in conv_glue.frozen_conv_sets(factors, convs, strength, model.load_device):  # LoCon modules
        model = install(model, lora_set, attachment_key=None)
        loaded.append(lora_set)
    if factors and not tensors:
        model.set_attachments(LOADED_KEY, tuple(loaded))
        return model
    if is_adapter_file(tensors):
        lora_set = adapter_glue.frozen_adapter_set(tensors, linear_layers(model), strength, name, model.load_device)
        patched = install(model, lora_set, attachment_key=None)
        patched.set_attachments(LOADED_KEY, (*loaded, lora_set))
        return patched
    factors = parse_lora(tensors, linear_layers(model), name=name)
    patched = model
    for rank in sorted({f.rank for f in factors.values()}):
        group = {p: f for p, f in factors.items() if f.rank == rank}
        cfg = LoRAConfig(rank=rank, alpha=float(rank), targets="none")
        lora_set = lora_set_from_factors(group, cfg, strength, model.load_device)
        patched = install(patched, lora_set, attachment_key=None)
        loaded.append(lora_set)
    patched.set_attachments(LOADED_KEY, tuple(loaded))
    return patched


def load_lora_merge(model, tensors: Mapping[str, torch.Tensor], strength: float, name: str):
    """Clone with ComfyUI's standard weight patches (what LoraLoaderModelOnly does)."""
    import comfy.lora
    import comfy.lora_convert

    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    loaded = comfy.lora.load_lora(comfy.lora_convert.convert_lora(dict(tensors)), key_map)
    if not loaded:
        raise ValueError(
            f"{name}: none of its {len(tensors)} keys (e.g. {sorted(tensors)[:3]}) matches this model: "
            "it is a LoRA for another model family or architecture; pick a LoRA trained for this model"
        )
    patched = model.clone()
    applied = patched.add_patches(loaded, strength)
    if len(applied) < len(loaded):
        log.warning("%s: %d of %d LoRA weights found no model weight", name,
                    len(loaded) - len(applied), len(loaded))
    return patched


LOAD_MODES = {"fp32": load_lora_fp32, "merge": load_lora_merge}


def load_lora(model, tensors: Mapping[str, torch.Tensor], strength: float, mode: str, name: str):
    """Apply a LoRA file's tensors in ``mode`` ("fp32" unmerged, "merge" ComfyUI patches)."""
    if mode not in LOAD_MODES:
        raise ValueError(f"PrecisionLoadLoRA: mode={mode!r} is unknown: use one of {list(LOAD_MODES)}")
    return LOAD_MODES[mode](model, tensors, strength, name)


# ---- where PrecisionSaveLoRA writes ------------------------------------------------------------------------

SAVE_FOLDERS = ("loras", "output")


def save_folder(folder: str) -> str:
    """Absolute base folder: the first ``loras`` folder ComfyUI knows, or the output directory."""
    import folder_paths

    if folder == "loras":
        return os.path.abspath(folder_paths.get_folder_paths("loras")[0])
    if folder == "output":
        return os.path.abspath(folder_paths.get_output_directory())
    raise ValueError(f"PrecisionSaveLoRA: folder={folder!r} is unknown: use one of {list(SAVE_FOLDERS)}")


def folders_made_for(folder: str, prefix: str) -> list[str]:
    """The subfolders of ``prefix`` under the save folder that do not exist yet (deepest first): what saving there
    creates, and removes again (when still empty) if the save fails."""
    base = save_folder(folder)
    missing, at = [], os.path.dirname(os.path.join(base, prefix.replace("\\", "/").strip()))
    while at.startswith(base + os.sep) and not os.path.isdir(at):
        missing.append(at)
        at = os.path.dirname(at)
    return missing


def remove_empty(folders: Sequence[str]) -> None:
    """Removes each folder of ``folders`` (deepest first) that exists and is empty."""
    for at in folders:
        if os.path.isdir(at) and not os.listdir(at):
            os.rmdir(at)


def resolve_save_path(folder: str, prefix: str, use_counter: bool) -> str:
    """File path for a new LoRA: ``<prefix>_00001_.safetensors`` with ComfyUI's counter, or ``<prefix>.safetensors``.

    Raises ValueError when the prefix (or a symlink on the way) leaves the folder.
    """
    import folder_paths

    reason = name_problem(prefix, subfolders=True)
    if reason:
        raise ValueError(f"PrecisionSaveLoRA: input 'filename_prefix'={show(prefix)} {reason}")
    base = save_folder(folder)
    os.makedirs(base, exist_ok=True)
    prefix = prefix.replace("\\", "/").strip()
    if use_counter:
        out_dir, name, counter, _sub, _ = folder_paths.get_save_image_path(prefix, base)
        path = os.path.join(out_dir, f"{name}_{counter:05}_.safetensors")
    else:
        path = os.path.join(base, prefix if prefix.endswith(".safetensors") else prefix + ".safetensors")
    if not inside(base, os.path.dirname(path)):
        raise ValueError(
            f"PrecisionSaveLoRA: filename_prefix={prefix!r} resolves outside {base} (through a symlink): "
            "choose a name inside the folder"
        )
    return path


# ---- attention settings recorded in a LoRA file ------------------------------------------------------------

ATTENTION_POLICIES = ("apply_recorded", "ignore", "override")


def _same_attention(a, b) -> bool:
    return a.replace(collect_stats=False) == b.replace(collect_stats=False)


def apply_attention_policy(model, md: Mapping[str, str], policy: str, override=None, name: str = "LoRA"):
    """Return (model, note). ``apply_recorded`` patches the file's settings (none recorded → unchanged),
    ``ignore`` leaves the model as it is, ``override`` patches ``override`` (an AttentionConfig). Warns when
    the incoming model is already patched with settings that differ from the ones the LoRA was trained with.
    """
    from ...attention.config import AttentionConfig
    from ..attention.glue import get_attention_config, patch_attention

    try:
        recorded = AttentionConfig.from_metadata(md)
    except ValueError as e:
        raise ValueError(f"PrecisionLoadLoRA: {name}: {e}; set attention to 'ignore' or 'override'") from None
    current = get_attention_config(model)
    target = {"apply_recorded": recorded, "ignore": None, "override": override}.get(policy, "bad")
    if target == "bad":
        raise ValueError(f"PrecisionLoadLoRA: attention={policy!r} is unknown: use one of {list(ATTENTION_POLICIES)}")
    if current is not None and recorded is not None and not _same_attention(current, recorded):
        log.warning("PrecisionLoadLoRA: %s was trained with attention %s but the incoming model is "
                    "patched with %s; %s", name, recorded, current,
                    "the recorded settings replace them" if policy == "apply_recorded" else "keeping the model's")
    if target is None:
        note = "attention: no settings recorded (default)" if recorded is None else f"attention: {policy} (model unchanged)"
        return model, note
    target.validate()
    target, fallback = _installed_backend(target, name)
    if current is None and target.is_default():
        return model, f"attention: {target.backend}, default scale{fallback}"
    return patch_attention(model, target), f"attention: {target}{fallback}"


def _installed_backend(target, name: str):
    """A recorded backend that is not installed here (e.g. flash on a CPU machine) falls back to ``auto``
    with the same scale: the scale changes the model's behaviour, the backend only its speed."""
    from ...attention.backends import available

    reason = available().get(target.backend) if target.backend != "auto" else None
    if reason is None:
        return target, ""
    log.warning("PrecisionLoadLoRA: %s records attention backend %r, which is unavailable here "
                "(%s); using ComfyUI's own attention (auto) with the same softmax scale", name, target.backend, reason)
    return target.replace(backend="auto"), f" (recorded backend {target.backend!r} unavailable here: {reason}; using auto)"
