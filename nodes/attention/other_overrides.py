"""Other packs' attention overrides: who set one, and one run as the kernel under the pack's override.

ComfyUI has one attention override slot, ``transformer_options["optimized_attention_override"]``, called as
``override(func, q, k, v, heads, *rest, **kwargs)`` with ``func`` the backend ComfyUI chose. Other packs put their
own there (ComfyUI-KJNodes: Patch Sage Attention KJ, its GGUF loader's ``attention_override``, NABLA attention,
flash), each replacing what was in the slot. The pack keeps such an override instead of dropping it
(docs/attention.md, "Other packs' attention overrides"): with backend ``auto`` it runs each call as the kernel,
called exactly as ComfyUI would have called it, with the pack's scale already folded into q.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch


def _origin(fn: Any) -> Any:
    """The function behind wrappers (``functools.wraps``, ``torch.compile``'s ``_torchdynamo_orig_callable``)."""
    for _ in range(8):
        inner = getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None)
        if inner is None or inner is fn:
            return fn
        fn = inner
    return fn


def _pack_of(module_name: str, path: str) -> tuple[str | None, str]:
    """(pack, file inside it): ("ComfyUI-KJNodes", "nodes/model_optimization_nodes.py"). ComfyUI imports a custom
    node pack under its folder's path as the module name (``nodes.load_custom_node``, dots written "_x_"), so the
    folder is the last part of the top-level package's name; "ComfyUI" for ComfyUI's own modules; None else."""
    parts = os.path.normpath(path).split(os.sep)
    top = module_name.split(".", 1)[0]  # the folder path of a pack has its dots as "_x_": the first dot ends it
    if os.sep in top:
        pack = os.path.basename(top.replace("_x_", "."))
        if pack in parts:
            return pack, "/".join(parts[len(parts) - parts[::-1].index(pack):])
        return pack, os.path.basename(path)
    if "custom_nodes" in parts[:-1]:
        at = len(parts) - 1 - parts[::-1].index("custom_nodes")
        return parts[at + 1], "/".join(parts[at + 2:])
    if top in ("comfy", "comfy_extras", "comfy_api", "nodes"):
        return "ComfyUI", os.path.basename(path)
    return None, os.path.basename(path)


def describe_override(fn: Any) -> str:
    """"GGUFLoaderKJ.attention_override_pytorch (ComfyUI-KJNodes, nodes/model_optimization_nodes.py)": the
    override's function and the pack (its folder under custom_nodes) and file that define it, for reports."""
    origin = _origin(fn)
    name = (getattr(origin, "__qualname__", None) or type(origin).__name__).replace("<locals>.", "")
    module_name = getattr(origin, "__module__", "") or ""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None) or getattr(getattr(origin, "__code__", None), "co_filename", None)
    if not path:
        return name
    pack, inside = _pack_of(module_name, path)
    return f"{name} ({inside})" if pack is None else f"{name} ({pack}, {inside})"


class ChainedKernel:
    """``previous`` (another pack's override) bound to ComfyUI's ``func``, in the signature of ComfyUI's attention
    functions, for the pack's override to run as its kernel (``glue._host``). ``counted`` is called once per call.

    Training through it needs its output to carry a gradient: an override whose kernel has none (SageAttention
    writes into fresh buffers) would stop the LoRA's gradients silently, so the first such call raises, naming it."""

    def __init__(self, previous: Callable[..., torch.Tensor], func: Callable[..., torch.Tensor],
                 counted: Callable[[], None]) -> None:
        self.previous, self.func, self.counted = previous, func, counted
        self.__name__ = describe_override(previous)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, *rest: Any,
                 **kwargs: Any) -> torch.Tensor:
        self.counted()
        out = self.previous(self.func, q, k, v, heads, *rest, **kwargs)
        if torch.is_grad_enabled() and not out.requires_grad and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
            raise ValueError(
                f"the attention override {self.__name__}, which another node set on this model and which the pack "
                "keeps as the attention kernel (Patch Attention backend auto), returns no gradient: training through "
                "it would silently stop the LoRA's gradients. Bypass that node while training, or choose a "
                "trainable backend in Patch Attention (Precision) (sdpa, math, stable), which replaces it")
        return out
