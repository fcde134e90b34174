"""The on-disk cache of encoded training data: keys, model identities, entry files, verified reads.

Pure (torch, safetensors, stdlib). ``nodes/dataset/cache.py`` feeds it ComfyUI's objects.

- ``Hasher``: a sha256 over a nested structure (dicts, lists, numbers, strings, tensors); tensors count by
  dtype, shape and bytes: every byte for small tensors, a strided sample of blocks for large ones
  (``sample=True``), so a 10 GB text encoder is identified in milliseconds, not minutes.
- ``model_identity(tensors, extra)``: names, shapes, dtypes and sampled bytes of every weight, plus ``extra``
  (patches, encode settings). A fine-tune or a merged LoRA changes the sampled blocks of every tensor it
  touches; a change confined to bytes between the sampled blocks is missed (the trade-off, docs/dataset_cache.md).
- ``EntryStore(folder)``: one ``<kind>/<key>.safetensors`` file per entry, written atomically
  (``training.files.atomic_write``), holding the tensors, their layout and a sha256 of every byte; ``load``
  returns None for a missing entry and raises ``BadEntry`` for one that does not verify (never trusted).
- ``pack_conditioning`` / ``unpack_conditioning``: a CONDITIONING list ``[[tensor, {extras}], ...]`` to
  tensors + JSON layout and back, dtype and values exact; an extra that is neither a tensor nor plain
  JSON data raises ``NotCacheable``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..training.files import atomic_write

FORMAT = "precision_lora.encode_cache/1"
FULL_BYTES = 1 << 16  # tensors up to this size are hashed whole
BLOCKS = 16  # larger ones: this many blocks of BLOCK_BYTES, evenly spaced (first and last included)
BLOCK_BYTES = 512


class NotCacheable(Exception):
    """An encoder output holds a value the cache cannot store exactly (the item is encoded, not stored)."""


class BadEntry(Exception):
    """A cache file that is unreadable, truncated, altered or not the entry its name says."""


def _raw(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def sampled_bytes(t: torch.Tensor) -> bytes:
    """Every byte of a small tensor; ``BLOCKS`` evenly spaced blocks of a large one (reads only those pages,
    one device-to-host copy per tensor)."""
    size = t.numel() * t.element_size()
    if size <= FULL_BYTES:
        return _raw(t)
    flat = t.detach().reshape(-1)
    per = max(1, BLOCK_BYTES // t.element_size())
    last = flat.numel() - per
    starts = sorted({round(i * last / (BLOCKS - 1)) for i in range(BLOCKS)})
    return _raw(torch.cat([flat[s:s + per] for s in starts]))


def _quantized(t: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
    """(stored data, parameters) of a quantized tensor subclass (comfy-kitchen's QuantizedTensor keeps its
    bytes in ``_qdata`` and its scales in ``_params``), else None."""
    data = getattr(t, "_qdata", None)
    return (data, getattr(t, "_params", None)) if isinstance(data, torch.Tensor) else None


class Hasher:
    """sha256 over nested data; ``sample``: large tensors by ``sampled_bytes`` (model weights), else whole."""

    def __init__(self, sample: bool = False):
        self.h = hashlib.sha256()
        self.sample = sample

    def add(self, value: Any) -> "Hasher":
        h = self.h
        if isinstance(value, torch.Tensor):
            h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
            quantized = _quantized(value)
            if quantized is not None:
                h.update(f"Q{type(value).__qualname__}".encode())
                self.add(quantized[0]).add(quantized[1])
            else:
                h.update(sampled_bytes(value) if self.sample else _raw(value))
        elif value is None or isinstance(value, (bool, int, str)):
            h.update(f"{type(value).__name__}:{value!r};".encode())
        elif isinstance(value, float):
            h.update(f"f:{value.hex() if math.isfinite(value) else value!r};".encode())
        elif isinstance(value, bytes):
            h.update(b"b%d:" % len(value) + value)
        elif isinstance(value, dict):
            h.update(b"{%d" % len(value))
            for k in sorted(value, key=repr):
                self.add(k).add(value[k])
        elif isinstance(value, (set, frozenset)):  # sorted: set order varies between processes
            self.add(sorted(value, key=repr))
        elif isinstance(value, (list, tuple)):
            h.update(b"[%d" % len(value))
            for item in value:
                self.add(item)
        elif isinstance(value, (torch.dtype, torch.device)):
            h.update(f"{value};".encode())
        elif callable(value) and hasattr(value, "__qualname__"):
            h.update(f"fn:{getattr(value, '__module__', '')}.{value.__qualname__};".encode())
        elif hasattr(value, "__dict__"):  # patch objects (LoRA adapters ...): their class and fields
            h.update(f"obj:{type(value).__module__}.{type(value).__qualname__}".encode())
            self.add({k: v for k, v in vars(value).items() if not k.startswith("__")})
        else:
            h.update(f"{type(value).__qualname__}:{value!r};".encode())
        return self

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def digest(*parts: Any, sample: bool = False) -> str:
    hasher = Hasher(sample)
    for part in parts:
        hasher.add(part)
    return hasher.hexdigest()


def model_identity(tensors: Iterable[tuple[str, torch.Tensor]], extra: Any = None) -> str:
    """Identity of an encoder: every (name, dtype, shape, sampled bytes) in name order, then ``extra``."""
    hasher = Hasher(sample=True)
    for name, t in sorted(tensors, key=lambda kv: kv[0]):
        hasher.add(name).add(t)
    return hasher.add(extra).hexdigest()


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False


def pack_conditioning(cond: Any) -> tuple[dict[str, torch.Tensor], list]:
    """A CONDITIONING ``[[tensor, {extras}], ...]`` -> (tensors, JSON layout). Raises NotCacheable."""
    if not isinstance(cond, list):
        raise NotCacheable(f"a conditioning is a {type(cond).__name__}, not a list")
    tensors: dict[str, torch.Tensor] = {}
    layout = []
    for i, entry in enumerate(cond):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], torch.Tensor) \
                or not isinstance(entry[1], dict):
            raise NotCacheable(f"conditioning entry {i} is not [tensor, dict]")
        tensors[f"{i}.cond"] = entry[0]
        extras = {}
        for name, value in entry[1].items():
            if isinstance(value, torch.Tensor):
                tensors[f"{i}.x.{name}"] = value
                extras[name] = {"tensor": f"{i}.x.{name}"}
            elif _plain(value):
                extras[name] = {"value": value, "tuple": isinstance(value, tuple)}
            else:
                raise NotCacheable(f"conditioning extra '{name}' is a {type(value).__name__}")
        layout.append(extras)
    return tensors, layout


def unpack_conditioning(tensors: dict[str, torch.Tensor], layout: list) -> list:
    out = []
    for i, extras in enumerate(layout):
        extra = {}
        for name, spec in extras.items():
            if "tensor" in spec:
                extra[name] = tensors[spec["tensor"]]
            else:
                extra[name] = tuple(spec["value"]) if spec.get("tuple") else spec["value"]
        out.append([tensors[f"{i}.cond"], extra])
    return out


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    return digest(*(x for name in sorted(tensors) for x in (name, tensors[name])))


class EntryStore:
    """Entries ``<folder>/<kind>/<key>.safetensors``; ``kind`` is ``latents`` or ``text``."""

    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)

    def path(self, kind: str, key: str) -> str:
        return os.path.join(self.folder, kind, f"{key}.safetensors")

    def store(self, kind: str, key: str, tensors: dict[str, torch.Tensor], layout: Any, info: Any = None) -> str:
        """Writes the entry atomically (a reader sees the old file or the whole new one). Returns its path."""
        data = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        meta = {"format": FORMAT, "kind": kind, "key": key, "layout": json.dumps(layout),
                "sha256": _checksum(data), "info": json.dumps(info)}
        return atomic_write(self.path(kind, key), lambda tmp: save_file(data, tmp, metadata=meta))

    def load(self, kind: str, key: str) -> tuple[dict[str, torch.Tensor], Any] | None:
        """(tensors on the CPU, layout), None when there is no entry; BadEntry when it does not verify."""
        path = self.path(kind, key)
        if not os.path.exists(path):
            return None
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            layout = json.loads(meta["layout"])
        except Exception as exc:  # truncated, not safetensors, bad JSON: re-encoded, never trusted
            raise BadEntry(f"{path} is unreadable ({type(exc).__name__}: {exc})") from exc
        if meta.get("format") != FORMAT or meta.get("kind") != kind or meta.get("key") != key:
            raise BadEntry(f"{path} is not the entry its name says (format/kind/key differ)")
        if meta.get("sha256") != _checksum(tensors):
            raise BadEntry(f"{path} fails its checksum (altered or partly written)")
        return tensors, layout
