"""Every difference between the ComfyUI versions the pack supports, in one module.

The rest of the pack reads as if there were one ComfyUI. Supported: 0.3.75 (the oldest, the last release
before comfy-kitchen) up to the 0.33 series; both ends are tested (``scripts/test.sh``). What differs:

- **Version gate.** Older than 0.3.75: the V3 node API and the attention override this pack relies on
  are missing or different, so ``check_supported`` refuses to load with the supported range instead of
  failing deep inside a node. Newer than the newest tested: a one-time warning, then the pack loads.
- **Differentiable model code while training.** ComfyUI 0.30+ routes rotary embeddings through fused
  comfy-kitchen ops that have no autograd formula (Cosmos-Predict2 / Anima always, Flux unless
  ``comfy.model_management.in_training``), and the Flux kernel rejects float64. ``model_gradients()``
  sets ``in_training`` and routes those ops to comfy-kitchen's own plain-PyTorch implementations while
  gradients (or float64) are involved, and only then: inference keeps the fused kernels. Everything it
  changes is restored on exit, on error and on interrupt alike. The other comfy-kitchen ops ComfyUI's code
  calls run only where the pack needs no gradients (VAE decoding, quantization, int8 kernels ComfyUI skips
  while training); each is refused with its name and reason if a tensor that needs gradients ever reaches it
  (``KITCHEN_REFUSED_OPS``). ``tests/comfy/test_kitchen_ops.py`` reads ComfyUI's source for the list.
- **Flux config.** ``FluxParams`` gained a required ``txt_ids_dims`` (0.4+); 0.3.75 rejects the key.
  ``fit_flux_config`` writes exactly the keys the running version accepts.
- **Attention backends without a backward.** 0.33 added ``attention3_sage`` and
  ``attention_comfy_kitchen_int8`` beside ``attention_sage`` / ``attention_flash``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import re
import threading
from typing import Any, Callable, Iterator

import torch

import comfy.model_management as mm

log = logging.getLogger(__name__)

MIN_VERSION = (0, 3, 75)
NEWEST_TESTED = (0, 33, 0)
SUPPORTED_TEXT = "ComfyUI 0.3.75 up to 0.33.x (tested: 0.3.75 and 0.33.0)"
# ComfyUI attention functions (by __name__) whose gradients do not work: sage and sage3 have no backward
# (gradients silently stop), flash is a custom op without an autograd formula, the int8 kernel has none.
NO_BACKWARD_ATTENTION = ("attention_sage", "attention3_sage", "attention_flash", "attention_comfy_kitchen_int8")
# comfy-kitchen ops that the model code calls and that have no autograd formula; each has a plain-PyTorch
# twin of the same name in comfy_kitchen.backends.eager.rope or .adaln (LTXV's rms_adaln; "_": in place).
KITCHEN_ROPE_OPS = ("apply_rope", "apply_rope1", "apply_rope_split_half", "apply_rope_split_half1",
                    "rms_rope", "rms_rope1", "rms_rope_split_half", "rms_rope_split_half1",
                    "rms_rope_", "rms_rope_split_half_", "rms_adaln")
_INT8_ATTENTION = ("attention backend comfy_kitchen_int8 (--use-ck-attention), which has no backward",
                   "pick backend sdpa (or auto, which runs sdpa while gradients are needed) on Patch Attention, "
                   "or start ComfyUI without --use-ck-attention")
_QUANTIZE = ("quantizing a weight or, inside ComfyUI's quantized Linear autograd function, an activation",
             "train on a bf16/fp16/fp32 or fp8 base model (Load Diffusion Model (Precision) weight_dtype)")
# comfy-kitchen ops ComfyUI calls where the pack needs no gradients: (where ComfyUI calls it, the fix). Each
# has no autograd formula and no plain-PyTorch twin here; a call with a tensor that needs gradients is
# refused with this text instead of silently giving the LoRA wrong gradients.
KITCHEN_REFUSED_OPS: dict[str, tuple[str, str]] = {
    "na3d": ("LTXV's VAE decoder (neighbourhood attention)", "training never decodes through the VAE: "
             "decode previews and samples outside the training step"),
    "int8_attention": _INT8_ATTENTION,
    "prequantize_int8_attention": _INT8_ATTENTION,
    "int8_attention_from_prequantized": _INT8_ATTENTION,
    "int8_linear": ("ComfyUI's int8 Linear forward, which ComfyUI itself skips while training "
                    "(model_management.in_training)", _QUANTIZE[1]),
    "quantize_per_tensor_fp8": _QUANTIZE,
    "quantize_mxfp8": _QUANTIZE,
    "quantize_nvfp4": _QUANTIZE,
    "stochastic_rounding_fp8": ("rounding patched weights to fp8 (ComfyUI's weight patching)",
                                "keep the LoRA being trained unmerged (Attach LoRA / Train LoRA do)"),
    "flash_attention_decode": ("the Llama-family text encoders' token-by-token decoding (text generation)",
                               "encode prompts before training (Train LoRA's conditioning input)"),
}
# attributes of comfy_kitchen that ComfyUI reads which are not tensor ops: backend set-up, constants, types
KITCHEN_NOT_OPS = ("registry", "float_utils", "tensor", "list_backends", "int8_attention_is_available",
                   "flash_attention_decode_is_available")


def parse_version(text: str) -> tuple[int, int, int]:
    """"0.33.0" -> (0, 33, 0); extra parts or suffixes ("0.3.75rc1") are ignored."""
    parts = [int(m) for m in re.findall(r"\d+", text)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def comfyui_version() -> tuple[int, int, int]:
    """The running ComfyUI's version from its ``comfyui_version`` module ((0, 0, 0) if it has none)."""
    try:
        import comfyui_version
    except ImportError:
        return (0, 0, 0)
    return parse_version(getattr(comfyui_version, "__version__", "0.0.0"))


_warned_newer = False


def check_supported(version: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """Refuse an older ComfyUI with a message naming the supported versions; warn once for a newer one."""
    global _warned_newer
    version = comfyui_version() if version is None else version
    shown = ".".join(map(str, version))
    if version < MIN_VERSION:
        raise RuntimeError(f"this pack supports {SUPPORTED_TEXT}; this ComfyUI is {shown}. "
                           "Update ComfyUI (git pull, or the portable build's update script) and restart.")
    if version[:2] > NEWEST_TESTED[:2] and not _warned_newer:
        _warned_newer = True
        log.warning("ComfyUI %s is newer than the newest version this pack was tested on (%s); "
                    "if a node fails, report it with this line", shown, SUPPORTED_TEXT)
    return version


# ---- Flux config -------------------------------------------------------------------------------

def fit_flux_config(config: dict) -> dict:
    """``config`` with only the keys this ComfyUI's FluxParams accepts, plus the required ones it lacks
    (``txt_ids_dims``: [] for Flux.1, [3] for Flux.2, as ComfyUI's own detection sets them)."""
    from comfy.ldm.flux.model import FluxParams

    fields = {f.name: f for f in dataclasses.fields(FluxParams)}
    out = {k: v for k, v in config.items() if k in fields or k == "image_model"}
    if "txt_ids_dims" in fields and "txt_ids_dims" not in out:
        out["txt_ids_dims"] = [3] if config.get("image_model") == "flux2" else []
    return out


# ---- gradients through the model's own code -----------------------------------------------------

def _needs_plain_path(args: tuple, kwargs: dict) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(t.dtype == torch.float64 for t in tensors):
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _needs_gradients(args: tuple, kwargs: dict) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kwargs.values()))


def refused(name: str, fused: Callable[..., Any]) -> Callable[..., Any]:
    """``fused`` (the comfy-kitchen op ``name`` of KITCHEN_REFUSED_OPS), refusing calls that need gradients."""
    where, fix = KITCHEN_REFUSED_OPS[name]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        if _needs_gradients(args, kwargs):
            raise RuntimeError(
                f"training reached comfy-kitchen op '{name}' ({where}) with a tensor that needs "
                "gradients: it has no backward and the pack has no plain-PyTorch route for it, so the LoRA would "
                f"get wrong gradients. Fix: {fix}.")
        return fused(*args, **kwargs)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.precision_lora_refused = fused  # type: ignore[attr-defined]
    return refuse


class _KitchenRouter:
    """Stands in for the ``comfy_kitchen`` module inside ComfyUI's modules while the pack trains: the
    rotary/adaln ops go to comfy-kitchen's plain-PyTorch implementation when gradients or float64 are
    involved, to the fused kernel otherwise; the ops of KITCHEN_REFUSED_OPS refuse calls that need
    gradients; every other attribute is the module's own."""

    def __init__(self, kitchen: Any, plain: Any) -> None:
        self._kitchen, self._plain = kitchen, plain

    def __getattr__(self, name: str) -> Any:
        fused = getattr(self._kitchen, name)
        if name in KITCHEN_REFUSED_OPS and callable(fused):
            return refused(name, fused)
        if name not in KITCHEN_ROPE_OPS or not hasattr(self._plain, name):
            return fused
        plain = getattr(self._plain, name)

        def route(*args: Any, **kwargs: Any) -> Any:
            return (plain if _needs_plain_path(args, kwargs) else fused)(*args, **kwargs)

        return route


class _PlainKitchen:
    """comfy-kitchen's plain-PyTorch ops (its eager backend's rope and adaln modules) as one namespace."""

    def __init__(self, *modules: Any) -> None:
        self._modules = modules

    def __getattr__(self, name: str) -> Any:
        for module in self._modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(name)


def _kitchen_holder() -> tuple[Any, Any] | None:
    """(comfy.quant_ops module, comfy-kitchen's plain-PyTorch ops) where ComfyUI uses comfy-kitchen,
    else None (0.3.75)."""
    try:
        import comfy.quant_ops as quant_ops
        # by module path: the eager package's ``adaln`` attribute is its adaln function, not the module
        rope = importlib.import_module("comfy_kitchen.backends.eager.rope")
        adaln = importlib.import_module("comfy_kitchen.backends.eager.adaln")
    except ImportError:
        return None
    return (quant_ops, _PlainKitchen(rope, adaln)) if hasattr(quant_ops, "ck") else None


def _direct_kitchen_users(kitchen: Any, router: Any) -> list[tuple[Any, str, Any]]:
    """(module, attribute, value, stand-in) of ComfyUI modules that hold comfy-kitchen themselves rather than going
    through ``comfy.quant_ops.ck``: the module (JoyImage's ``comfy_kitchen.rms_rope``, LTXV's VAE decoder,
    the int8 attention backend, the Llama text encoder), or one of its refused ops bound at import
    (``comfy.float``'s stochastic rounding); with the stand-in each gets while the pack trains."""
    import sys

    ops = {id(getattr(kitchen, n, None)): n for n in KITCHEN_REFUSED_OPS if callable(getattr(kitchen, n, None))}
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("comfy.") or name == "comfy.quant_ops" or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is kitchen:
                found.append((module, attr, value, router))
            elif id(value) in ops:
                found.append((module, attr, value, refused(ops[id(value)], value)))
    return found


_depth = 0
_saved: dict[str, Any] = {}
_lock = threading.Lock()


def _enter() -> None:
    global _depth
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        if hasattr(mm, "in_training"):
            _saved["in_training"] = mm.in_training
            mm.in_training = True
        holder = _kitchen_holder()
        if holder is not None:
            quant_ops, plain = holder
            _saved["ck"] = quant_ops.ck
            quant_ops.ck = _KitchenRouter(quant_ops.ck, plain)
            _saved["direct"] = _direct_kitchen_users(_saved["ck"], quant_ops.ck)
            for module, attr, _, stand_in in _saved["direct"]:
                setattr(module, attr, stand_in)


def _exit() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth > 0:
            return
        if "in_training" in _saved:
            mm.in_training = _saved.pop("in_training")
        if "ck" in _saved:
            import comfy.quant_ops as quant_ops

            for module, attr, value, _ in reversed(_saved.pop("direct", [])):
                setattr(module, attr, value)
            quant_ops.ck = _saved.pop("ck")


@contextlib.contextmanager
def model_gradients() -> Iterator[None]:
    """While the body runs, ComfyUI's model code is differentiable (and float64-capable) on every
    supported version; on exit (normal, error or interrupt) every global it set is restored. Nests."""
    _enter()
    try:
        yield
    finally:
        _exit()


def globals_snapshot() -> dict[str, Any]:
    """The ComfyUI globals ``model_gradients`` touches, for tests that check they are restored."""
    holder = _kitchen_holder()
    return {"in_training": getattr(mm, "in_training", None),
            "ck": None if holder is None else holder[0].ck}


def set_reload(patcher: Any, factory: Callable[..., Any], *args: Any) -> Any:
    """Tell ComfyUI 0.33+ how to load ``patcher``'s model again: its deep copies (the built-in trainer's
    ``clone(force_deepcopy=True)``, multi-GPU clones) call ``factory(*args, disable_dynamic=True)`` instead
    of copying, and fail for models without one. A no-op on versions without ``cached_patcher_init``."""
    if hasattr(patcher, "cached_patcher_init"):
        patcher.cached_patcher_init = (factory, args)
    return patcher


def has_backward(func: Callable[..., Any]) -> bool:
    """False for ComfyUI attention functions whose gradients do not work (see NO_BACKWARD_ATTENTION)."""
    return getattr(func, "__name__", "") not in NO_BACKWARD_ATTENTION
