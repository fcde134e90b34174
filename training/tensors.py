"""Helpers over nested containers of tensors (optimizer state dicts, training states)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch


def nested_tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Every tensor inside ``obj`` (a tensor or nested dicts/lists/tuples), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from nested_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from nested_tensors(v)


def to_cpu(obj: Any, copy: bool = True) -> Any:
    """``obj`` with every tensor detached and on the CPU; containers are rebuilt.

    copy=True: every tensor is a new copy (nothing shared with ``obj``). copy=False: tensors already on the
    CPU are shared, not copied: only for values nobody will modify in place any more (a finished run).
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, Mapping):
        return {k: to_cpu(v, copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v, copy) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v, copy) for v in obj)
    return obj
