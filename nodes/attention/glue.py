"""ComfyUI glue for the attention override: binds ComfyUI's arguments and reshapes; nothing else.

``patch_attention(model, cfg)`` returns a clone whose ``transformer_options["optimized_attention_override"]``
is a ``PrecisionAttentionOverride``. ComfyUI's ``wrap_attn`` calls it as
``override(func, q, k, v, heads, *rest, **kwargs)`` for every attention call of the model, with ``func``
the backend ComfyUI selected. Layouts: q/k/v are (B, L, H·D) unless ``skip_reshape`` (then (B, H, L, D));
the output is (B, L, H·D) unless ``skip_output_reshape`` (then (B, H, L, D)). The mask comes as the
``mask`` keyword or as the 5th positional argument.

The override views q/k/v as 4-D tensors and hands them to the one call path,
``attention.dispatch.AttentionDispatcher.run``, which resolves the scale, observes, upcasts and runs the
chosen backend, or for backend ``auto`` ``func`` itself (bound here as a ``HostAttention``: ``func`` is the
undecorated backend and kwargs keep ``_inside_attn_wrapper``, so it never re-enters the override).

Keywords newer ComfyUI passes (0.33): ``scale`` (a model's own base scale, which every backend there
honours) is the base of the default and multiplier modes; ``enable_gqa`` (k/v with fewer heads than q)
is forwarded to ComfyUI's backend, and our backends get k/v heads repeated; ``low_precision_attention``
False (the model needs full precision there) runs an explicitly chosen ``sage`` on sdpa for that call.
Everything else is forwarded untouched.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import comfy.patcher_extension
import torch

from ...attention.config import AUTO_BACKEND, AttentionConfig
from ...attention.dispatch import AttentionDispatcher, HostAttention, Observer
from ...attention.stats import AttentionStats
from ..host import errors
from ..host.comfy_compat import has_backward
from .other_overrides import ChainedKernel, describe_override
from .reach import (PATCH_KEY, WRAPPER_KEY, ConditioningInjection, inside_attention, is_inside, reach_wrapper,
                    resolve_options)

log = logging.getLogger(__name__)

OVERRIDE_KEY = "optimized_attention_override"
# ComfyUI's backends take these after (q, k, v, heads), in this order.
POSITIONAL_NAMES = ("mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def _bind(rest: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Name the optional arguments whether they came by position or keyword."""
    if len(rest) > len(POSITIONAL_NAMES):
        raise TypeError(f"attention override got {4 + len(rest)} positional arguments; expected at most 8")
    bound = dict(zip(POSITIONAL_NAMES, rest))
    for name in POSITIONAL_NAMES:
        if name in kwargs:
            bound[name] = kwargs[name]
    return bound


def _to_4d(x: torch.Tensor, heads: int, skip_reshape: bool) -> tuple[torch.Tensor, str]:
    """ComfyUI q/k/v -> (4-D view, layout). (B, H, L, D) stays; (B, L, H·D) becomes (B, L, H, D).

    Without ``skip_reshape`` ComfyUI's backends view each tensor as (B, -1, heads, D), so a tensor already
    split into heads, (B, L, H, D), is valid too: SD3's MMDiT passes its v that way beside 3-D q and k."""
    if skip_reshape:
        return x, "bhld"
    b, length = x.shape[0], x.shape[1]
    return x.reshape(b, length, heads, -1), "blhd"  # a view unless x is oddly strided


def _flat(x: torch.Tensor, skip_reshape: bool) -> torch.Tensor:
    """(B, L, H, D) -> (B, L, H·D) where ComfyUI takes either (see ``_to_4d``)."""
    return x if skip_reshape or x.ndim == 3 else x.flatten(2)


def _to_comfy(x: torch.Tensor, skip_reshape: bool) -> torch.Tensor:
    """Inverse of ``_to_4d`` (a view): what ComfyUI's backend takes."""
    return x if skip_reshape else x.reshape(x.shape[0], x.shape[1], -1)


def k_heads(k: torch.Tensor, head_dim: int, skip_reshape: bool) -> int:
    """Heads of a key/value tensor: fewer than the query's under grouped-query attention."""
    return k.shape[1] if skip_reshape else k.shape[-1] // head_dim


def _from_4d(out: torch.Tensor, layout: str, skip_output_reshape: bool) -> torch.Tensor:
    """Our output (in ``layout``) -> what ComfyUI's backend would return."""
    if skip_output_reshape:
        return out if layout == "bhld" else out.transpose(1, 2)
    blhd = out.transpose(1, 2) if layout == "bhld" else out
    b, length, heads, dim = blhd.shape
    return blhd.reshape(b, length, heads * dim)


def _out_to_4d(out: torch.Tensor, heads: int, layout: str, skip_output_reshape: bool) -> torch.Tensor:
    """Inverse of ``_from_4d`` (a view): ComfyUI's output in ``layout``."""
    if skip_output_reshape:
        return out if layout == "bhld" else out.transpose(1, 2)
    blhd = out.reshape(out.shape[0], out.shape[1], heads, -1)
    return blhd if layout == "blhd" else blhd.transpose(1, 2)


def _host(func: Callable[..., torch.Tensor], heads: int, rest: tuple[Any, ...], kwargs: dict[str, Any],
          bound: dict[str, Any], layout: str) -> HostAttention:
    """ComfyUI's ``func`` as the dispatcher's host kernel: q/k/v back to ComfyUI's shapes, the (possibly
    upcast) mask where it came from, every other argument as ComfyUI passed it."""
    skip, skip_out = bool(bound.get("skip_reshape", False)), bool(bound.get("skip_output_reshape", False))

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        args, named = list(rest), kwargs
        if args:
            args[0] = mask
        elif "mask" in kwargs:
            named = {**kwargs, "mask": mask}
        out = func(_to_comfy(q, skip), _to_comfy(k, skip), _to_comfy(v, skip), heads, *args, **named)
        return _out_to_4d(out, heads, layout, skip_out)

    return HostAttention(getattr(func, "__name__", ""), run, has_backward(func))


class PrecisionAttentionOverride:
    """The callable stored in transformer_options. Deep copies return the same object (ComfyUI deep-copies
    model options per clone), so clones share its dispatcher and statistics.

    ``observer``: handed every call (as the dispatcher resolved it) before it runs; the probe's twin sets it.
    ``previous``: another pack's override that was on the model (or was set on it later in the graph), which
    this one keeps: with backend ``auto`` it runs each call as the kernel, with the scale folded into q
    (``other_overrides.ChainedKernel``); an explicitly chosen backend runs instead of it (the node says so).
    ``calls()`` counts the calls this override ran and those it handed to ``previous``.
    """

    precision_lora_override = True  # reach.is_pack_override

    def __init__(self, cfg: AttentionConfig, stats: AttentionStats | None = None,
                 observer: Observer | None = None, previous: Callable[..., torch.Tensor] | None = None) -> None:
        self.dispatcher = AttentionDispatcher(cfg, stats)
        self.observer = observer
        self.previous = previous
        self._label_lock = threading.Lock()
        self._last_options: dict | None = None
        self._call_index = 0
        self._unreached: dict[str, int] = {}
        self._counts = {"calls": 0, "previous": 0}
        self._composed: dict[int, PrecisionAttentionOverride] = {}

    @property
    def cfg(self) -> AttentionConfig:
        return self.dispatcher.cfg

    def __deepcopy__(self, memo: dict) -> PrecisionAttentionOverride:
        return self

    def _twin(self, observer: Observer | None, previous: Callable[..., torch.Tensor] | None) -> PrecisionAttentionOverride:
        """Shares this override's dispatcher (settings, statistics, warnings), call counts and unreached calls."""
        twin = PrecisionAttentionOverride(self.cfg, observer=observer, previous=previous)
        twin.dispatcher, twin._unreached, twin._counts = self.dispatcher, self._unreached, self._counts
        return twin

    def observed_by(self, observer: Observer) -> PrecisionAttentionOverride:
        """A twin that hands every call to ``observer`` as well."""
        return self._twin(observer, self.previous)

    def over(self, previous: Callable[..., torch.Tensor]) -> PrecisionAttentionOverride:
        """This override composed over ``previous`` (another pack's, set on the model after Patch Attention): the
        same twin for the same ``previous``, so a forward and its checkpointed recomputation share it."""
        with self._label_lock:
            twin = self._composed.get(id(previous))
            if twin is not None and twin.previous is previous:
                return twin
            twin = self._composed[id(previous)] = self._twin(self.observer, previous)
        log.warning("attention: %s was set on the model after Patch Attention (Precision); the "
                    "pack's override stays: %s", describe_override(previous), composition_note(twin))
        return twin

    def calls(self) -> dict[str, int]:
        """{"calls": attention calls this override ran, "previous": of them, those run by ``previous``}."""
        with self._label_lock:
            return dict(self._counts)

    def __call__(self, func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 heads: int, *rest: Any, **kwargs: Any) -> torch.Tensor:
        try:
            return self._call(func, q, k, v, heads, *rest, **kwargs)
        except Exception as exc:  # also under KSampler or another pack's node: the pack's messages say whose
            errors.mark(exc)
            raise

    def _call(self, func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              heads: int, *rest: Any, **kwargs: Any) -> torch.Tensor:
        if is_inside():  # called again from within this call (an override chaining to the one it replaced, as
            return func(q, k, v, heads, *rest, **kwargs)  # ComfyUI's newer ones do): the scale is applied once
        with self._label_lock:
            self._counts["calls"] += 1
        kernel = func
        if self.previous is not None and self.cfg.backend == AUTO_BACKEND:
            kernel = ChainedKernel(self.previous, func, self._count_previous)
        with inside_attention():  # the kernels below may call SDPA: not a direct call of the model's
            if self.cfg.is_default() and self.observer is None:
                return kernel(q, k, v, heads, *rest, **kwargs)
            return self._run(kernel, q, k, v, heads, rest, kwargs)

    def _count_previous(self) -> None:
        with self._label_lock:
            self._counts["previous"] += 1

    def note_unreached(self, reason: str) -> None:
        """Count an attention call of the patched model that runs without the override (``reach.py``)."""
        with self._label_lock:
            first = reason not in self._unreached
            self._unreached[reason] = self._unreached.get(reason, 0) + 1
        if first:
            log.warning("attention: a call of this model runs without the patched scale/backend "
                        "(%s); it keeps the model's own attention", reason)

    def unreached(self) -> dict[str, int]:
        """Attention calls seen running without the override, by reason (empty: every call reached)."""
        with self._label_lock:
            return dict(self._unreached)

    def _run(self, func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             heads: int, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        bound = _bind(rest, kwargs)
        skip = bool(bound.get("skip_reshape", False))
        q, k, v = (_flat(t, skip) for t in (q, k, v))
        q4, layout = _to_4d(q, heads, skip)
        kv_heads = k_heads(k, q4.shape[-1], skip)
        out = self.dispatcher.run(
            q4, _to_4d(k, kv_heads, skip)[0], _to_4d(v, kv_heads, skip)[0], mask=bound.get("mask"), layout=layout,
            layer=self._layer_label(kwargs.get("transformer_options")), base_scale=kwargs.get("scale"),
            low_precision=kwargs.get("low_precision_attention") is not False,
            host=_host(func, heads, rest, kwargs, bound, layout), observer=self.observer)
        return _from_4d(out, layout, bool(bound.get("skip_output_reshape", False)))

    def _layer_label(self, options: dict | None) -> str:
        """"double.3" from Flux's block_type/block_index, else "call.N": the N-th call seen with the same
        transformer_options dict (one dict per model forward)."""
        if not (self.cfg.collect_stats or self.observer is not None):
            return "call"
        if options is not None and "block_type" in options and "block_index" in options:
            return f"{options['block_type']}.{options['block_index']}"
        with self._label_lock:
            if options is not self._last_options:
                self._last_options, self._call_index = options, 0
            index = self._call_index
            self._call_index += 1
        return f"call.{index}"


def patch_attention(model: Any, cfg: AttentionConfig) -> Any:
    """A clone of the ModelPatcher ``model`` whose every attention call follows ``cfg``.

    The override lives in the clone's model_options only: the shared module is never touched, so
    bypassing the node (or using the original model) gives stock attention. ``cfg`` was validated when
    it was built.
    """
    clone = model.clone()
    options = clone.model_options.setdefault("transformer_options", {})
    override = PrecisionAttentionOverride(cfg, previous=_previous_override(options))
    if override.previous is not None:
        log.info("attention: the override already on the model, %s, is kept: %s",
                 describe_override(override.previous), composition_note(override))
    options[OVERRIDE_KEY] = options[PATCH_KEY] = override
    # Calls made without transformer_options, or straight to SDPA, reach the override too (reach.py). The
    # wrapper sits in the options themselves (copied, never shared with the source model): sampling and
    # the training step both call apply_model with them.
    wrappers = dict(options.get("wrappers", {}))
    apply_model = comfy.patcher_extension.WrappersMP.APPLY_MODEL
    wrappers[apply_model] = {**wrappers.get(apply_model, {}), WRAPPER_KEY: [reach_wrapper]}
    options["wrappers"] = wrappers
    # attention that runs while ComfyUI prepares the conditioning (Anima's LLM adapter in extra_conds)
    reach = ConditioningInjection(options)
    clone.set_injections(WRAPPER_KEY, [comfy.patcher_extension.PatcherInjection(reach.inject, reach.eject)])
    log.info("attention patched: backend=%s scale_mode=%s scale_value=%s",
             cfg.backend, cfg.scale_mode, cfg.scale_value)
    return clone


def _previous_override(options: dict) -> Callable[..., torch.Tensor] | None:
    """The other pack's override a new patch keeps: the one in the slot, or, when the slot holds the pack's own
    (patched twice, e.g. Load LoRA (Precision) applying a file's settings), the one that one kept."""
    current = options.get(OVERRIDE_KEY)
    return current.previous if isinstance(current, PrecisionAttentionOverride) else current


def composition_note(override: PrecisionAttentionOverride) -> str:
    """How ``override`` treats the other pack's override it keeps (for the node text and the log)."""
    name = describe_override(override.previous)
    if override.cfg.backend == AUTO_BACKEND:
        return (f"{name} runs each attention call as the kernel, with this node's softmax scale folded into q "
                "(training refuses it at its first call if its output carries no gradient)")
    return (f"{name} is NOT called: backend {override.cfg.backend!r} was chosen and replaces it; choose backend "
            "auto to keep it as the kernel")


def _override(model: Any) -> PrecisionAttentionOverride | None:
    """The pack's override a forward of ``model`` runs with (composed over a later one: ``resolve_options``)."""
    options = resolve_options(getattr(model, "model_options", {}).get("transformer_options", {})) or {}
    override = options.get(OVERRIDE_KEY)
    return override if isinstance(override, PrecisionAttentionOverride) else None


def get_attention_override(model: Any) -> PrecisionAttentionOverride | None:
    """The pack's override ``model`` runs with (composed with another pack's, where one is set), or None."""
    return _override(model)


def foreign_override(model: Any) -> Callable[..., torch.Tensor] | None:
    """Another pack's override on ``model`` that the pack does not run under its own (no Patch Attention)."""
    options = getattr(model, "model_options", {}).get("transformer_options", {})
    current = options.get(OVERRIDE_KEY)
    return None if current is None or _override(model) is not None else current


def get_attention_config(model: Any) -> AttentionConfig | None:
    """The AttentionConfig ``patch_attention`` set on ``model`` (None when not patched by this pack)."""
    override = _override(model)
    return None if override is None else override.cfg


def get_attention_stats(model: Any) -> AttentionStats | None:
    """The statistics collector of a patched model (filled only when cfg.collect_stats)."""
    override = _override(model)
    return None if override is None else override.dispatcher.stats
