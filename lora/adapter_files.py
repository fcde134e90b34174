"""LoKr / LoHa / DoRA files (the keys stock ComfyUI reads, as ``lora.file.lora_state_dict`` writes them) read back
as unmerged fp32 adapters for the pack's loader and for ``init_lora``.

A file is an adapter file when one of its keys ends in a LoKr (``.lokr_w1`` ...), LoHa (``.hada_w1_a`` ...) or
DoRA (``.dora_scale``) suffix; such a file may also hold plain LoRA modules (down/up/alpha). Module names are
the ones ``lora.formats.module_names`` knows for a whole layer (kohya ``lora_unet_...``, ``diffusion_model.``,
diffusers names of unfused layers). Scales follow stock ComfyUI: LoKr and LoHa ``alpha / rank`` (rank = the
``w2_b`` / ``hada_w1_b`` rows; no alpha: 1.0; a LoKr without a decomposed factor: 1.0 whatever the alpha),
LoRA and DoRA ``alpha / rank`` of ``lora_down``. Forms the fp32 adapters do not implement (Tucker ``t1``/``t2``
tensors, a decomposed LoKr ``w1``, a DoRA magnitude per output row, which stock normalises by the original
weight) are refused with the advice to use Load LoRA's ``merge`` mode (stock ComfyUI's own patching).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .adapters import DoRAAdapter, LoHaAdapter, LoKrAdapter
from .config import LoRAConfig
from .formats import SPELLINGS, UNREPRESENTABLE, module_names
from .lowrank import LoRAAdapter

KIND_KEYS: dict[str, tuple[str, ...]] = {
    "lokr": (".lokr_w1", ".lokr_w2", ".lokr_w2_a", ".lokr_w2_b"),
    "loha": (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b"),
    "dora": (".lora_down.weight", ".lora_up.weight", ".dora_scale"),
    "lora": (".lora_down.weight", ".lora_up.weight"),
}
UNSUPPORTED = (".lokr_w1_a", ".lokr_w1_b", ".lokr_t2", ".hada_t1", ".hada_t2")
_MARKERS = (".lokr_w1", ".hada_w1_a", ".dora_scale")
_MERGE = "load this file with Load LoRA (Precision) mode 'merge' (stock ComfyUI's patching)"


@dataclass(frozen=True)
class FileAdapter:
    """One module of an adapter file: its kind, its tensors by key suffix, and the scale stock ComfyUI uses."""

    kind: str
    parts: Mapping[str, torch.Tensor]
    scale: float


def is_adapter_file(tensors: Mapping[str, torch.Tensor]) -> bool:
    return any(k.endswith(_MARKERS) for k in tensors)


_CANONICAL = {down: ".lora_down.weight" for down, _ in SPELLINGS} | {up: ".lora_up.weight" for _, up in SPELLINGS}
_SUFFIXES = sorted({s for keys in KIND_KEYS.values() for s in keys} | set(UNSUPPORTED) | set(UNREPRESENTABLE)
                   | set(_CANONICAL) | {".alpha"}, key=len, reverse=True)


def _split(key: str) -> tuple[str, str] | None:
    """(module name, suffix) with every down/up spelling stock ComfyUI pairs mapped to lora_down / lora_up."""
    for suffix in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], _CANONICAL.get(suffix, suffix)
    return None


def parse_adapter_file(tensors: Mapping[str, torch.Tensor], linears: Mapping[str, tuple[int, int]],
                       name: str = "LoRA file") -> dict[str, FileAdapter]:
    """Path -> FileAdapter for every module of an adapter file (``is_adapter_file``); ValueError naming the key
    for keys that match no whole linear layer of this model, forms not implemented here, and incomplete modules."""
    names = {n: t for n, t in module_names(linears).items() if t.rows is None and not t.swap_halves}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    modules: dict[str, str] = {}  # path -> the file's module name
    for key, t in tensors.items():
        split = _split(key)
        if split is None or split[0] not in names:
            raise ValueError(f"{name}: key '{key}' matches no whole linear layer of this model: the "
                             "adapter file is for another model (or splits fused layers, which the fp32 adapters do "
                             f"not); {_MERGE}")
        if split[1] in UNSUPPORTED or (split[1] in UNREPRESENTABLE and split[1] not in KIND_KEYS["dora"]
                                       and not split[1].startswith((".lokr_", ".hada_"))):
            raise ValueError(f"{name}: '{key}' is a form the fp32 adapters do not implement; {_MERGE}")
        groups.setdefault(names[split[0]].path, {})[split[1]] = t
        modules[names[split[0]].path] = split[0]
    return {path: _module(modules[path], parts, linears[path], name) for path, parts in sorted(groups.items())}


def _kind(parts: Mapping[str, torch.Tensor]) -> str:
    if any(k.startswith(".lokr_") for k in parts):
        return "lokr"
    if any(k.startswith(".hada_") for k in parts):
        return "loha"
    return "dora" if ".dora_scale" in parts else "lora"


def _module(module: str, parts: Mapping[str, torch.Tensor], shape: tuple[int, int], name: str) -> FileAdapter:
    kind = _kind(parts)
    keys = [k for k in parts if k != ".alpha"]
    if kind == "lokr":
        need = (".lokr_w1", ".lokr_w2") if ".lokr_w2" in parts else (".lokr_w1", ".lokr_w2_a", ".lokr_w2_b")
    else:
        need = KIND_KEYS[kind]
    missing, extra = [k for k in need if k not in parts], [k for k in keys if k not in need]
    if missing or extra:
        raise ValueError(f"{name}: module '{module}' ({kind}) has {sorted(keys)}: "
                         f"{'missing ' + str(missing) if missing else 'mixed with ' + str(extra)}; the file is inconsistent")
    alpha = parts.get(".alpha")
    rank_key = {"lokr": ".lokr_w2_b", "loha": ".hada_w1_b"}.get(kind, ".lora_down.weight")
    rank = int(parts[rank_key].shape[0]) if rank_key in parts else None
    scale = 1.0 if alpha is None or rank is None else float(alpha.float().item()) / rank  # stock ComfyUI's rule
    if kind == "dora" and tuple(parts[".dora_scale"].shape) != (1, shape[0]):
        raise ValueError(f"{name}: '{module}.dora_scale' is a DoRA magnitude tensor, shape "
                         f"{tuple(parts['.dora_scale'].shape)}: the fp32 DoRA implements the per-input magnitude "
                         f"(1, {shape[0]}) that LyCORIS writes (stock ComfyUI normalises a per-row one by the original "
                         f"weight, not the adapted one); {_MERGE}")
    return FileAdapter(kind, {k: v for k, v in parts.items() if k != ".alpha"}, scale)


def build_adapter(path: str, fa: FileAdapter, shape: tuple[int, int], name: str = "LoRA file") -> nn.Module:
    """A frozen-ready adapter (fp32 parameters) holding ``fa`` for a linear of ``shape`` (in, out)."""
    n_in, n_out = shape
    p = fa.parts
    if fa.kind == "lokr":
        w1 = p[".lokr_w1"]
        w2 = p.get(".lokr_w2")
        b, d = (w2.shape if w2 is not None else (p[".lokr_w2_a"].shape[0], p[".lokr_w2_b"].shape[1]))
        rank = None if w2 is not None else int(p[".lokr_w2_b"].shape[0])
        if w1.dim() != 2 or w1.shape[0] * b != n_out or w1.shape[1] * d != n_in:
            raise ValueError(f"{name}: LoKr '{path}' is kron({tuple(w1.shape)}, ({b}, {d})) but the layer is "
                             f"{n_out}x{n_in}: the file is for another model size")
        cfg = LoRAConfig(rank=rank or 1, alpha=float(rank or 1), targets="none")
        adapter: nn.Module = LoKrAdapter(n_in, n_out, cfg, init=False, shapes=(tuple(w1.shape), (b, d), rank))
    else:
        rank = int(p[".hada_w1_b" if fa.kind == "loha" else ".lora_down.weight"].shape[0])
        cfg = LoRAConfig(rank=rank, alpha=float(rank), targets="none")
        cls = {"loha": LoHaAdapter, "dora": DoRAAdapter, "lora": LoRAAdapter}[fa.kind]
        adapter = cls(n_in, n_out, cfg, init=False)
    try:
        _load(adapter, fa)
    except ValueError as e:
        raise ValueError(f"{name}: {fa.kind} module '{path}': {e}; the file is for another model size") from None
    return adapter


def _load(adapter: nn.Module, fa: FileAdapter) -> None:
    if isinstance(adapter, LoRAAdapter) and not isinstance(adapter, DoRAAdapter):
        down, up = fa.parts[".lora_down.weight"], fa.parts[".lora_up.weight"]
        if tuple(down.shape) != tuple(adapter.down.shape) or tuple(up.shape) != tuple(adapter.up.shape):
            raise ValueError(f"down {tuple(down.shape)} / up {tuple(up.shape)} do not fit")
        with torch.no_grad():
            adapter.down.copy_(down.float())
            adapter.up.copy_(up.float() * (fa.scale / adapter.scale))
        adapter.mark_modified()
        return
    adapter.load_file(fa.parts, fa.scale)
