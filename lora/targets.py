"""Which linear layers get a LoRA: presets per model family, include/exclude regexes, block filters, dry run.

Module paths are relative to the diffusion model (``double_blocks.0.img_attn.qkv``); shapes are
(in_features, out_features). Everything here is pure string/regex logic on those two things.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..training.checks import show
from .regex import Matcher, compile_user_regex

# One registry: family -> preset -> regexes matched with re.fullmatch against module paths.
_FLUX_ATTN = (
    r"double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)",
    # Single-stream blocks fuse attention with the MLP: linear1 = qkv + mlp-in, linear2 = proj + mlp-out.
    r"single_blocks\.\d+\.linear[12]",
)
_FLUX_MLP = (r"double_blocks\.\d+\.(img|txt)_mlp\.\d+",)
_FLUX_ALL = (r"(double_blocks|single_blocks)\.\d+\..+",)
_COSMOS_SELF = (r"blocks\.\d+\.self_attn\.(q_proj|k_proj|v_proj|output_proj)",)
_COSMOS_CROSS = (r"blocks\.\d+\.cross_attn\.(q_proj|k_proj|v_proj|output_proj)",)
_COSMOS_MLP = (r"blocks\.\d+\.mlp\.layer[12]",)
_GENERIC_ATTN = (r".*(attn|attention)[^.]*\.(to_q|to_k|to_v|to_out\.0|q_proj|k_proj|v_proj|o_proj|out_proj|output_proj|qkv|proj)",)
_GENERIC_MLP = (r".*(mlp|ff|feed_forward)[^.]*\..+",)

PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "flux": {"attention": _FLUX_ATTN, "attention_mlp": _FLUX_ATTN + _FLUX_MLP, "all": _FLUX_ALL, "none": ()},
    "cosmos": {
        "attention": _COSMOS_SELF + _COSMOS_CROSS,
        "self_attention": _COSMOS_SELF,
        "attention_mlp": _COSMOS_SELF + _COSMOS_CROSS + _COSMOS_MLP,
        "all": (r"blocks\.\d+\..+",),
        "none": (),
    },
    "generic": {"attention": _GENERIC_ATTN, "attention_mlp": _GENERIC_ATTN + _GENERIC_MLP, "all": (r".+",), "none": ()},
}
# Families whose blocks share Flux.1's module names (Flux.2 differs only in global modulation).
FAMILY_ALIASES: dict[str, str] = {
    "flux": "flux", "flux1": "flux", "flux2": "flux", "chroma": "flux", "kontext": "flux",
    "cosmos": "cosmos", "cosmos_predict2": "cosmos", "anima": "cosmos",
}
BLOCK_GROUPS = ("double_blocks", "single_blocks", "transformer_blocks", "joint_blocks", "blocks", "layers",
                "input_blocks", "middle_block", "output_blocks")
_BLOCK_RE = re.compile(r"(?:^|\.)(" + "|".join(BLOCK_GROUPS) + r")\.(\d+)(?:\.|$)")
_ITEM_RE = re.compile(r"(?:([a-z_]+):)?(\d{1,6})(?:-(\d{1,6}))?")  # block indices have at most 6 digits


def preset_names() -> list[str]:
    """Every preset name of any family, for the node's option list ("attention" first)."""
    names: list[str] = []
    for presets in PRESETS.values():
        names.extend(n for n in presets if n not in names)
    return names


def preset_family(family: str) -> str:
    """Map a model family name (as model_info reports it) to a preset family; unknown → "generic"."""
    key = family.lower().replace(".", "").replace("-", "_")
    return FAMILY_ALIASES.get(key, "generic")


@dataclass(frozen=True)
class BlockRange:
    group: str | None
    start: int
    stop: int  # inclusive

    def matches(self, group: str, index: int) -> bool:
        return (self.group is None or self.group == group) and self.start <= index <= self.stop


def parse_blocks(spec: str) -> tuple[BlockRange, ...]:
    """Parse "0-3,7" or "double_blocks:0-5; single_blocks:10" into ranges. Empty spec → no filter."""
    ranges: list[BlockRange] = []
    for item in re.split(r"[,;]", spec):
        item = item.strip().replace(" ", "")
        if not item:
            continue
        m = _ITEM_RE.fullmatch(item)
        if m is None or (m.group(1) is not None and m.group(1) not in BLOCK_GROUPS):
            raise ValueError(
                f"[Precision LoRA] blocks filter item {show(item)} is invalid: use 'N', 'N-M' or '<group>:N-M' with group "
                f"in {list(BLOCK_GROUPS)}, separated by commas (e.g. 'double_blocks:0-5, single_blocks:0-9')"
            )
        start = int(m.group(2))
        stop = int(m.group(3)) if m.group(3) is not None else start
        if stop < start:
            raise ValueError(f"[Precision LoRA] blocks filter range {item!r} is empty: write the smaller index first")
        ranges.append(BlockRange(m.group(1), start, stop))
    return tuple(ranges)


def block_of(path: str) -> tuple[str, int] | None:
    """(group, index) of the first block list in a module path, or None outside any block."""
    m = _BLOCK_RE.search(path)
    return None if m is None else (m.group(1), int(m.group(2)))


def _compile(pattern: str, field: str) -> Matcher | None:
    """A user regex through ``lora.regex`` (linear time with google-re2, else a bounded subset)."""
    return compile_user_regex(pattern, field)


def _parse_options(targets: str, include: str, exclude: str,
                   blocks: str) -> tuple[Matcher | None, Matcher | None, tuple[BlockRange, ...]]:
    """(include, exclude, block ranges) after the checks that need no model: known preset name,
    compilable regexes, parseable block filter."""
    if targets not in preset_names():
        raise ValueError(f"[Precision LoRA] targets={targets!r} is unknown: use one of {preset_names()}")
    return _compile(include, "include"), _compile(exclude, "exclude"), parse_blocks(blocks)


def validate_target_options(targets: str, include: str, exclude: str, blocks: str) -> None:
    """Checks that need no model: known preset name, compilable regexes, parseable block filter."""
    _parse_options(targets, include, exclude, blocks)


@dataclass(frozen=True)
class TargetInfo:
    path: str
    in_features: int
    out_features: int

    def describe(self) -> str:
        return f"{self.path}  ({self.in_features} -> {self.out_features})"


def select_targets(linears: Mapping[str, tuple[int, int]], family: str, targets: str, include: str = "",
                   exclude: str = "", blocks: str = "") -> dict[str, tuple[int, int]]:
    """Pick LoRA targets among ``linears`` (path → (in, out)). Raises ValueError if nothing matches.

    preset(family) ∪ include, minus exclude, restricted to the block filter (modules outside any block
    are dropped when a block filter is given). ``include`` / ``exclude`` are searched (``re.search``
    semantics) by ``lora.regex``, which never backtracks exponentially.
    """
    inc, exc, ranges = _parse_options(targets, include, exclude, blocks)
    fam = preset_family(family)
    if targets not in PRESETS[fam]:
        raise ValueError(
            f"[Precision LoRA] targets={targets!r} is not a preset of model family '{family}': use one of {list(PRESETS[fam])}"
        )
    preset = [re.compile(p) for p in PRESETS[fam][targets]]
    chosen: dict[str, tuple[int, int]] = {}
    for path in sorted(linears):
        hit = any(p.fullmatch(path) for p in preset) or (inc is not None and inc.search(path) is not None)
        if not hit or (exc is not None and exc.search(path) is not None):
            continue
        if ranges:
            blk = block_of(path)
            if blk is None or not any(r.matches(*blk) for r in ranges):
                continue
        chosen[path] = linears[path]
    if not chosen:
        sample = ", ".join(sorted(linears)[:8]) or "(the model has no linear layers)"
        raise ValueError(
            f"[Precision LoRA] no module matches targets={targets!r} include={include!r} exclude={exclude!r} "
            f"blocks={blocks!r} for family '{family}' ({len(linears)} linear layers, e.g. {sample}): "
            "widen the preset, fix the regex or the block filter"
        )
    return chosen


def dry_run(linears: Mapping[str, tuple[int, int]], family: str, targets: str, include: str = "",
            exclude: str = "", blocks: str = "") -> list[TargetInfo]:
    """The modules a LoRA would wrap, with shapes, in path order (same rules as select_targets)."""
    chosen = select_targets(linears, family, targets, include, exclude, blocks)
    return [TargetInfo(p, i, o) for p, (i, o) in chosen.items()]
