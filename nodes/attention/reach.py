"""Attention calls the override would not see, reached while a patched model runs its forward.

ComfyUI hands its attention override (``transformer_options["optimized_attention_override"]``) only to
attention calls that pass ``transformer_options``. Two kinds of call do not (ComfyUI 0.33.0 / 0.3.75):

- ComfyUI's own attention functions called without ``transformer_options``: PixArt α/Σ
  (``comfy.ldm.pixart``), HunyuanDiT (``comfy.ldm.hydit``, its pooler included), ErnieImage
  (``comfy.ldm.ernie``); or with the module's empty default ``transformer_options={}`` because its caller
  passed none down: Wan S2V's audio injector (``comfy.ldm.wan.model.AudioInjector_WAN``);
- ``torch.nn.functional.scaled_dot_product_attention`` called directly (or through
  ``comfy.ops.scaled_dot_product_attention``): Mochi (``comfy.ldm.genmo``), Anima's LLM adapter
  (``comfy.ldm.anima``).

Anima's adapter runs inside the model's forward outside inference mode (training), but while sampling
ComfyUI runs it once per prompt in ``Anima.extra_conds``, while it prepares the conditioning, before
``apply_model``. ``ConditioningInjection`` (a ComfyUI injection on the patched clone) runs the model's
``extra_conds`` inside ``reach_options`` too while the clone is loaded, so the adapter takes the same
attention in sampling as in training.

``reach_wrapper`` is a ComfyUI ``apply_model`` wrapper (``WrappersMP.APPLY_MODEL``) that
``patch_attention`` adds to the patched clone's transformer_options only. For the duration of that model's forward it:

1. replaces ComfyUI's attention functions, where a ``comfy.ldm`` module bound them at import, by shims
   that add the forward's ``transformer_options`` when a call has none or an empty / override-less dict
   (ComfyUI's ``wrap_attn`` then
   hands the call to the override as for every other model);
2. replaces ``torch.nn.functional.scaled_dot_product_attention`` by a shim that hands a direct call to
   the override as a (B, H, L, D) call (``skip_reshape``), with the caller's ``scale`` as the base. A causal
   call (``is_causal=True`` without a mask: HiDream O1's prompt prefix, ``comfy.ldm.hidream_o1``) goes as a
   call with SDPA's causal mask (query i sees keys 0..i), which the override's own kernels and statistics
   apply; ComfyUI's backend (``auto``) runs it as the caller wrote it (``is_causal=True``, no mask), so the
   default settings give stock output bit for bit.

Both are restored when the last forward using them exits, on every exit path (``finally``). The shims
act only in the context (thread) whose forward installed them (a ``ContextVar``), never inside the
override itself (its kernels call SDPA too), and pass every other call through untouched. A direct SDPA
call the override cannot take (``is_causal`` with a mask, dropout, not 4-D, GQA with a mask) runs unchanged
and is counted with its reason in ``unreached(override)``, which the attention node's report names.

Activation checkpointing recomputes blocks during the backward pass, after the forward returned: the
training session holds ``reach_context(model)`` around the whole run, so the recomputation computes
with the same attention as the forward.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

WRAPPER_KEY = "precision_lora_attention_reach"
OVERRIDE_KEY = "optimized_attention_override"
PATCH_KEY = "precision_lora_attention"  # the pack's own override, kept beside whatever override is in the slot
_OPTIONS: ContextVar[dict | None] = ContextVar("precision_lora_attention_options", default=None)
_INSIDE: ContextVar[bool] = ContextVar("precision_lora_inside_attention", default=False)
_lock = threading.Lock()
_state: dict[str, Any] = {"depth": 0, "saved": [], "process_wide": []}
_ORIGINAL_SDPA = torch.nn.functional.scaled_dot_product_attention


class CallCount:
    """Attention calls the model's code made while the shims were in place (``counting``): calls of ComfyUI's
    attention functions and direct SDPA calls, not the calls an override makes to its own kernels."""

    def __init__(self) -> None:
        self.calls = 0


_COUNTS: list[CallCount] = []


def _count_call() -> None:
    for count in list(_COUNTS):
        count.calls += 1


@contextlib.contextmanager
def counting() -> Iterator[CallCount]:
    """Counts the model's attention calls within the block (any thread): what the pack's override saw is
    compared with it (the training report, the saved LoRA's metadata)."""
    count = CallCount()
    with _lock:
        _COUNTS.append(count)
    try:
        yield count
    finally:
        with _lock:
            _COUNTS.remove(count)


def is_inside() -> bool:
    """True within an override's call (``inside_attention``)."""
    return _INSIDE.get()


@contextlib.contextmanager
def inside_attention() -> Iterator[None]:
    """Marks a span as the override's own attention call: the SDPA shim passes its calls through."""
    token = _INSIDE.set(True)
    try:
        yield
    finally:
        _INSIDE.reset(token)


def _comfy_attention_functions() -> set[int]:
    import comfy.ldm.modules.attention as attn

    return {id(getattr(attn, n)) for n in dir(attn)
            if (n.startswith("attention_") or n.startswith("optimized_attention")) and callable(getattr(attn, n))
            and n != "optimized_attention_for_device"}


def _active_options() -> dict | None:
    """This context's forward's options, else those of a process-wide span (``reach_context``: a training
    step's backward may run in autograd's worker threads, which do not see the step's context)."""
    options = _OPTIONS.get()
    if options is None and _state["process_wide"]:
        options = _state["process_wide"][-1]
    return options


class _OptionsShim:
    """ComfyUI attention function that adds the running forward's transformer_options to calls without.

    ``__wrapped__`` stays what the replaced function's is (ComfyUI's undecorated backend, under ``wrap_attn``):
    other packs' overrides call ``attention_pytorch.__wrapped__`` to reach the kernel itself (ComfyUI-KJNodes'
    sdpa override), and must not get the decorated function back, which would hand the call to the override
    again."""

    def __init__(self, func: Callable[..., torch.Tensor]) -> None:
        self.func = func
        functools.update_wrapper(self, func)
        self.__wrapped__ = getattr(func, "__wrapped__", func)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not _INSIDE.get():
            _count_call()
        options = _active_options()
        given = kwargs.get("transformer_options")
        if options is not None and not given:
            kwargs["transformer_options"] = options
        elif options is not None and "optimized_attention_override" not in given:
            # the module got options of its own but not the forward's (its caller passed none down)
            kwargs["transformer_options"] = {**options, **given}
        return self.func(*args, **kwargs)


def _sdpa_host(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None = None,
               attn_precision: Any = None, skip_reshape: bool = True, skip_output_reshape: bool = True,
               **kwargs: Any) -> torch.Tensor:
    """The direct SDPA call in ComfyUI's backend signature ((B, H, L, D) in and out): the override's
    ``func`` for backend ``auto``."""
    extra = {k: kwargs[k] for k in ("scale", "enable_gqa") if kwargs.get(k) is not None}
    if kwargs.get("causal"):  # the mask is the causal one the shim built: the caller's own call
        mask, extra["is_causal"] = None, True
    with inside_attention():
        return _ORIGINAL_SDPA(q, k, v, attn_mask=mask, **extra)


_sdpa_host.__name__ = "attention_sdpa_direct"


def _unreachable_reason(q: torch.Tensor, attn_mask: Any, dropout_p: float, is_causal: bool,
                        enable_gqa: bool) -> str | None:
    if is_causal and attn_mask is not None:
        return "causal (is_causal=True) with a mask"
    if dropout_p:
        return "attention dropout"
    if q.ndim != 4:
        return f"{q.ndim}-D query"
    if enable_gqa and attn_mask is not None:
        return "grouped-query attention with a mask"
    return None


def _sdpa_shim(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False, **kwargs: Any) -> torch.Tensor:
    options = _active_options()
    override = None if options is None or _INSIDE.get() else options.get("optimized_attention_override")
    if override is not None:
        _count_call()
    if override is None or kwargs:
        extra = {"scale": scale, "enable_gqa": enable_gqa} if enable_gqa else {"scale": scale}
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              **extra, **kwargs)
    reason = _unreachable_reason(query, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        note = getattr(override, "note_unreached", None)
        if note is not None:
            note(f"direct scaled_dot_product_attention: {reason}")
        extra = {"enable_gqa": True} if enable_gqa else {}
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, **extra)
    named: dict[str, Any] = {"mask": attn_mask, "skip_reshape": True, "skip_output_reshape": True,
                             "transformer_options": options}
    if is_causal:  # SDPA's causal mask (top-left aligned: query i sees keys 0..i), as a keep-mask
        named["mask"] = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        named["causal"] = True
    if scale is not None:
        named["scale"] = scale
    if enable_gqa:
        named["enable_gqa"] = True
    return override(_sdpa_host, query, key, value, query.shape[1], **named)


def _install() -> None:
    with _lock:
        _state["depth"] += 1
        if _state["depth"] > 1:
            return
        targets, saved = _comfy_attention_functions(), []
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith("comfy.ldm"):
                continue
            for attr, value in list(vars(module).items()):
                if id(value) in targets:
                    saved.append((module, attr, value))
                    setattr(module, attr, _OptionsShim(value))
        saved.append((torch.nn.functional, "scaled_dot_product_attention", _ORIGINAL_SDPA))
        torch.nn.functional.scaled_dot_product_attention = _sdpa_shim
        _state["saved"] = saved


def _uninstall() -> None:
    with _lock:
        _state["depth"] -= 1
        if _state["depth"] > 0:
            return
        for module, attr, value in reversed(_state["saved"]):
            setattr(module, attr, value)
        _state["saved"] = []


def is_pack_override(override: Any) -> bool:
    """The pack's own override (``glue.PrecisionAttentionOverride``, or one composed over another pack's)."""
    return bool(getattr(override, "precision_lora_override", False))


def resolve_options(options: dict | None) -> dict | None:
    """The transformer_options a forward runs with: ``options`` itself, or, when another node replaced the pack's
    override after Patch Attention (ComfyUI-KJNodes' Patch Sage Attention, NABLA attention, ...), a copy whose
    override is the pack's composed over that one (``PrecisionAttentionOverride.over``: the other override runs
    as the kernel, the pack applies the scale). The pack's override stays in the options under ``PATCH_KEY``
    through every clone (its deep copy is itself)."""
    if not options:
        return options
    ours, current = options.get(PATCH_KEY), options.get(OVERRIDE_KEY)
    if ours is None or current is None or is_pack_override(current):
        return options
    return {**options, OVERRIDE_KEY: ours.over(current)}


@contextlib.contextmanager
def reach_options(options: dict | None, process_wide: bool = False) -> Iterator[None]:
    """Within the block, attention calls of this context reach the pack's override in ``options``
    (``process_wide``: also calls from threads without a forward of their own, see ``_active_options``).
    Nothing happens for options without the pack's override: another pack's override alone runs as ComfyUI
    runs it (the shims would hand its own SDPA calls back to it: a recursion)."""
    if not options or not is_pack_override(options.get(OVERRIDE_KEY)):
        yield
        return
    token = _OPTIONS.set(options)
    _install()
    if process_wide:
        with _lock:
            _state["process_wide"].append(options)
    try:
        yield
    finally:
        if process_wide:
            with _lock:
                _state["process_wide"].remove(options)
        _uninstall()
        _OPTIONS.reset(token)


def reach_context(model: Any) -> contextlib.AbstractContextManager[None]:
    """``reach_options`` with a ModelPatcher's (resolved) transformer_options, process-wide: around a training
    run, so the blocks that activation checkpointing recomputes during the backward pass (after the forward
    returned, possibly in autograd's worker threads) compute with the same attention as the forward."""
    return reach_options(resolve_options(getattr(model, "model_options", {}).get("transformer_options")),
                         process_wide=True)


def reach_wrapper(executor: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """ComfyUI apply_model wrapper (``WrappersMP.APPLY_MODEL``: every model class runs it, with
    ``(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)``): the forward runs with its
    resolved transformer_options (``resolve_options``) inside ``reach_options`` of them."""
    positional = "transformer_options" not in kwargs and len(args) > 5
    options = args[5] if positional else kwargs.get("transformer_options")
    resolved = resolve_options(options)
    if resolved is not options:
        if positional:
            args = (*args[:5], resolved, *args[6:])
        else:
            kwargs["transformer_options"] = resolved
    current = _OPTIONS.get()
    if current is resolved or (current is not None and resolved is not None
                               and current.get(OVERRIDE_KEY) is resolved.get(OVERRIDE_KEY)):
        return executor(*args, **kwargs)
    with reach_options(resolved):
        return executor(*args, **kwargs)


_ABSENT = object()


class ConditioningReach:
    """A model's ``extra_conds`` run inside ``reach_options(options)``, so attention computed there (Anima's
    LLM adapter) reaches the override as it does inside the forward."""

    def __init__(self, extra_conds: Callable[..., Any], options: dict, replaced: Any) -> None:
        self.extra_conds, self.options = extra_conds, options
        self.replaced = replaced  # the model's own attribute before (an object patch), or _ABSENT

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _OPTIONS.get() is self.options:
            return self.extra_conds(*args, **kwargs)
        with reach_options(self.options):
            return self.extra_conds(*args, **kwargs)


def _clear_prefix_cache(model: Any) -> None:
    """HiDream O1 keeps its prompt prefix's keys / values on the diffusion model between runs, keyed by the
    prompt only (``comfy.ldm.hidream_o1``): a run under other attention settings would reuse keys / values
    computed under the old ones (the patched scale never reaching the prefix), and the unpatched model would
    reuse the patched clone's. Cleared when the patched clone is loaded and when it is unloaded."""
    clear = getattr(getattr(model, "diffusion_model", None), "clear_kv_cache", None)
    if callable(clear):
        clear()


class ConditioningInjection:
    """``inject`` / ``eject`` of a ComfyUI ``PatcherInjection``: while the patched clone is loaded (as when
    ComfyUI's sampler prepares the conditioning) its model's ``extra_conds`` is a ``ConditioningReach``, and a
    prompt-prefix key / value cache holds only what the clone's own forwards computed (``_clear_prefix_cache``).
    It acts on the patcher it is handed, so a clone that ComfyUI deep-copies wraps its own model."""

    def __init__(self, options: dict) -> None:
        self.options = options

    def inject(self, patcher: Any) -> None:
        model = patcher.model
        _clear_prefix_cache(model)
        replaced = vars(model).get("extra_conds", _ABSENT)
        if getattr(model, "extra_conds", None) is None or isinstance(replaced, ConditioningReach):
            return
        model.extra_conds = ConditioningReach(model.extra_conds, self.options, replaced)

    def eject(self, patcher: Any) -> None:
        model = patcher.model
        _clear_prefix_cache(model)
        current = vars(model).get("extra_conds")
        if not isinstance(current, ConditioningReach):
            return
        if current.replaced is _ABSENT:
            del model.extra_conds
        else:
            model.extra_conds = current.replaced


def installed() -> bool:
    """Whether the shims are in place now (tests: restored after every forward)."""
    return torch.nn.functional.scaled_dot_product_attention is not _ORIGINAL_SDPA
