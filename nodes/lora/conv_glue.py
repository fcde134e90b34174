"""ComfyUI glue for adapter 'locon' (``lora.locon``): which Conv2d layers it adds, and LoCon modules of a file.

Attach LoRA's ``adapter=locon`` is LoRA on the selected Linear layers plus LoCon on the UNet's Conv2d layers
that kohya's LoCon (sd-scripts ``conv_dim``) adapts: the convolutions inside the res blocks (the 3x3
``in_layers`` / ``out_layers`` convs and the 1x1 ``skip_connection``) and the down/upsampling convs, in
ComfyUI's classes ``ResBlock``, ``Downsample`` and ``Upsample``. The input and output convs of the UNet
(``input_blocks.0.0``, ``out.2``) are not adapted, as in kohya. ``exclude`` and ``blocks`` apply to them as to
the Linear layers; the ``targets`` preset and ``include`` pick Linear layers only.

Reading a file, every Conv2d of the model is a possible LoCon module (a file written elsewhere may adapt the
input conv too): ``split_conv_factors`` takes those modules out of the file's tensors.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ...lora.config import LoRAConfig
from ...lora.file import LoRAFactors, parse_lora_tensors
from ...lora.layer import LoRASet
from ...lora.locon import conv_width
from ...lora.targets import _in_blocks, _parse_options

LOCON_PARENTS = ("ResBlock", "Downsample", "Upsample")  # ComfyUI's openaimodel classes (kohya: ResnetBlock2D, ...)
ConvShape = tuple[int, int, int, int]


def _is_plain_conv(m: torch.nn.Module) -> bool:
    return isinstance(m, torch.nn.Conv2d) and m.groups == 1 and m.padding_mode == "zeros"


def conv_layers(model) -> dict[str, ConvShape]:
    """Every Conv2d of the diffusion model a LoCon adapter can run on: path -> (in, out, kh, kw)."""
    dm = model.model.diffusion_model
    return {name: (m.in_channels, m.out_channels, *m.kernel_size) for name, m in dm.named_modules() if _is_plain_conv(m)}


def _in_parent(path: str, parents: Mapping[str, str]) -> bool:
    """True for a conv whose parent or grandparent is a res block / down / upsampler (``in_layers.2``)."""
    parent = path.rpartition(".")[0]
    return parents.get(parent) in LOCON_PARENTS or parents.get(parent.rpartition(".")[0]) in LOCON_PARENTS


def locon_convs(model, cfg: LoRAConfig, family: str) -> dict[str, ConvShape]:
    """The Conv2d layers adapter 'locon' adds (module doc), after ``exclude`` and ``blocks``. ValueError naming
    the input, its value and the fix when the model has none (a DiT) or the filters leave none."""
    dm = model.model.diffusion_model
    parents = {name: type(m).__name__ for name, m in dm.named_modules()}
    convs = {p: s for p, s in conv_layers(model).items() if _in_parent(p, parents)}
    if not convs:
        raise ValueError(f"input 'adapter'='locon' adds LoRA to a UNet's Conv2d layers, but this "
                         f"{family} model has no res-block Conv2d layer: use adapter 'lora' (the same LoRA on its "
                         "Linear layers)")
    _inc, exc, ranges = _parse_options(cfg.targets, "", cfg.exclude, cfg.blocks)
    chosen = {p: s for p, s in sorted(convs.items())
              if (exc is None or exc.search(p) is None) and _in_blocks(p, ranges)}
    if not chosen:
        raise ValueError(f"input 'adapter'='locon': exclude={cfg.exclude!r} blocks={cfg.blocks!r} "
                         f"leave none of the {len(convs)} res-block Conv2d layers: widen exclude / blocks, or use "
                         "adapter 'lora'")
    narrow = {p: s for p, s in chosen.items() if conv_width(s) < cfg.rank}
    if narrow:
        p, s = next(iter(narrow.items()))
        raise ValueError(f"input 'rank'={cfg.rank} exceeds the width of Conv2d '{p}' "
                         f"({s[1]}x{s[0]}x{s[2]}x{s[3]}): use rank <= {min(conv_width(x) for x in chosen.values())} "
                         "with adapter 'locon'")
    return chosen


def _module_name(key: str) -> str:
    for mark in (".lora_", ".alpha", ".dora_scale", ".hada_", ".lokr_", ".diff"):
        if mark in key:
            return key[: key.index(mark)]
    return key


def split_conv_factors(tensors: Mapping[str, torch.Tensor], convs: Mapping[str, ConvShape],
                       name: str) -> tuple[dict[str, LoRAFactors], dict[str, torch.Tensor]]:
    """(path -> flat factors (down (r, in*kh*kw), up (out, r)) of the file's Conv2d modules, the other tensors).
    A conv module needs stock's layout, down (r, in, kh, kw) and up (out, r, 1, 1) (ValueError naming the key)."""
    names = {}
    for path in convs:
        names["diffusion_model." + path] = path
        names["lora_unet_" + path.replace(".", "_")] = path
    mine: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        path = names.get(_module_name(key))
        if path is None:
            rest[key] = t
            continue
        n_in, n_out, kh, kw = convs[path]
        if key.endswith(".lora_down.weight"):
            if tuple(t.shape[1:]) != (n_in, kh, kw):
                raise ValueError(f"{name}: '{key}' is {tuple(t.shape)} but Conv2d '{path}' needs "
                                 f"(rank, {n_in}, {kh}, {kw}): the LoRA was trained for a different model size")
            t = t.reshape(t.shape[0], -1)
        elif key.endswith(".lora_up.weight"):
            if t.dim() != 4 or tuple(t.shape[2:]) != (1, 1):
                raise ValueError(f"{name}: '{key}' is {tuple(t.shape)}: a LoCon up factor is (out, rank, "
                                 "1, 1); other conv forms are not implemented in fp32 mode: load it with mode 'merge'")
            t = t.reshape(t.shape[0], t.shape[1])
        elif not key.endswith(".alpha"):
            raise ValueError(f"{name}: '{key}' on Conv2d '{path}' is a form the fp32 LoCon does not "
                             "implement (lora_down / lora_up / alpha only): load it with mode 'merge'")
        mine[key] = t
    flat = {p: (s[0] * s[2] * s[3], s[1]) for p, s in convs.items()}
    return (parse_lora_tensors(mine, flat, name) if mine else {}), rest


def frozen_conv_sets(factors: Mapping[str, LoRAFactors], convs: Mapping[str, ConvShape], strength: float,
                     device: torch.device | None) -> list[LoRASet]:
    """One frozen LoRASet of LoCon adapters per rank holding ``factors`` at ``strength``."""
    sets = []
    for rank in sorted({f.rank for f in factors.values()}):
        group = {p: f for p, f in factors.items() if f.rank == rank}
        with torch.inference_mode(False):
            lora_set = LoRASet(LoRAConfig(rank=rank, alpha=float(rank), targets="none"), {p: convs[p] for p in group},
                               init=False)
            lora_set.load_factors({p: (f.down, f.up, f.scale) for p, f in group.items()})
            if device is not None:
                lora_set.to(device)
            lora_set.requires_grad_(False)
        lora_set.set_multiplier(strength)
        sets.append(lora_set)
    return sets
