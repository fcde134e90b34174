"""Which linear layers get a LoRA: presets per model family (``presets.py``), include/exclude regexes, block
filters, modules narrower than the rank, dry run.

Module paths are relative to the diffusion model (``double_blocks.0.img_attn.qkv``); shapes are
(in_features, out_features). Everything here is pure string/regex logic on those two things.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..training.checks import show
from .presets import FAMILY_ALIASES, PRESETS, preset_family, preset_names
from .regex import Matcher, compile_user_regex

__all__ = ["FAMILY_ALIASES", "PRESETS", "TargetPlan", "dry_run", "plan_targets", "preset_family", "preset_names",
           "select_targets", "validate_target_options"]

BLOCK_GROUPS = ("double_blocks", "single_blocks", "transformer_blocks", "joint_blocks", "blocks", "layers",
                "input_blocks", "middle_block", "output_blocks", "double_layers", "single_layers")
_BLOCK_RE = re.compile(r"(?:^|\.)(" + "|".join(BLOCK_GROUPS) + r")\.(\d+)(?:\.|$)")
_ITEM_RE = re.compile(r"(?:([a-z_]+):)?(\d{1,6})(?:-(\d{1,6}))?")  # block indices have at most 6 digits


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
                f"blocks filter item {show(item)} is invalid: use 'N', 'N-M' or '<group>:N-M' with group "
                f"in {list(BLOCK_GROUPS)}, separated by commas (e.g. 'double_blocks:0-5, single_blocks:0-9')"
            )
        start = int(m.group(2))
        stop = int(m.group(3)) if m.group(3) is not None else start
        if stop < start:
            raise ValueError(f"blocks filter range {item!r} is empty: write the smaller index first")
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
        raise ValueError(f"targets={targets!r} is unknown: use one of {preset_names()}")
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


@dataclass(frozen=True)
class TargetPlan:
    """What a target selection picked (``chosen``: path → (in, out), path order) and the preset's matches it
    left out because they are narrower than the rank (``narrow``), with the rank it was planned for."""

    chosen: dict[str, tuple[int, int]]
    narrow: tuple[TargetInfo, ...]
    rank: int
    preset_family: str

    def report_lines(self) -> list[str]:
        """One line per module left out, for the dry-run report (empty when none)."""
        return [f"left out (narrower than rank {self.rank}): {t.describe()}" for t in self.narrow]


def _preset_matchers(family: str, targets: str) -> list[re.Pattern[str]]:
    fam = preset_family(family)
    if targets not in PRESETS[fam]:
        raise ValueError(
            f"targets={targets!r} is not a preset of model family '{family}': use one of {list(PRESETS[fam])}"
        )
    return [re.compile(p) for p in PRESETS[fam][targets]]


def _in_blocks(path: str, ranges: tuple[BlockRange, ...]) -> bool:
    if not ranges:
        return True
    blk = block_of(path)
    return blk is not None and any(r.matches(*blk) for r in ranges)


def plan_targets(linears: Mapping[str, tuple[int, int]], family: str, targets: str, include: str = "",
                 exclude: str = "", blocks: str = "", rank: int = 0) -> TargetPlan:
    """Pick LoRA targets among ``linears`` (path → (in, out)). Raises ValueError if nothing matches.

    preset(family) ∪ include, minus exclude, restricted to the block filter (modules outside any block
    are dropped when a block filter is given). ``include`` / ``exclude`` are searched (``re.search``
    semantics) by ``lora.regex``, which never backtracks exponentially. A module narrower than ``rank``
    (min(in, out) < rank) that only the preset matches is left out and listed in ``narrow``; one that
    ``include`` names raises (the user asked for it by name).
    """
    inc, exc, ranges = _parse_options(targets, include, exclude, blocks)
    preset = _preset_matchers(family, targets)
    chosen: dict[str, tuple[int, int]] = {}
    narrow: list[TargetInfo] = []
    for path in sorted(linears):
        by_include = inc is not None and inc.search(path) is not None
        hit = by_include or any(p.fullmatch(path) for p in preset)
        if not hit or (exc is not None and exc.search(path) is not None) or not _in_blocks(path, ranges):
            continue
        n_in, n_out = linears[path]
        if min(n_in, n_out) < rank:
            if by_include:
                raise ValueError(
                    f"include={include!r} names '{path}' ({n_in} -> {n_out}), narrower than "
                    f"rank={rank}: use rank <= {min(n_in, n_out)} or leave that module out of include"
                )
            narrow.append(TargetInfo(path, n_in, n_out))
            continue
        chosen[path] = linears[path]
    if not chosen:
        raise ValueError(_nothing_matches(linears, family, targets, include, exclude, blocks, narrow, rank))
    return TargetPlan(chosen, tuple(narrow), rank, preset_family(family))


def _nothing_matches(linears: Mapping[str, tuple[int, int]], family: str, targets: str, include: str, exclude: str,
                     blocks: str, narrow: list[TargetInfo], rank: int) -> str:
    if narrow:  # every match is narrower than the rank: the rank is what to change
        widest = max(narrow, key=lambda t: min(t.in_features, t.out_features))
        return (f"LoRA rank={rank} exceeds the width of '{widest.path}' "
                f"({widest.out_features}x{widest.in_features}): use rank <= "
                f"{min(widest.in_features, widest.out_features)}, the widest of the {len(narrow)} modules "
                f"targets={targets!r} include={include!r} selects, or select wider modules")
    sample = ", ".join(sorted(linears)[:8]) or "(the model has no linear layers)"
    return (f"no module matches targets={targets!r} include={include!r} exclude={exclude!r} "
            f"blocks={blocks!r} for family '{family}' ({len(linears)} linear layers, e.g. {sample}): "
            "widen the preset, fix the regex or the block filter")


def select_targets(linears: Mapping[str, tuple[int, int]], family: str, targets: str, include: str = "",
                   exclude: str = "", blocks: str = "", rank: int = 0) -> dict[str, tuple[int, int]]:
    """``plan_targets(...).chosen``: the selected modules, path → (in, out), in path order."""
    return plan_targets(linears, family, targets, include, exclude, blocks, rank).chosen


def dry_run(linears: Mapping[str, tuple[int, int]], family: str, targets: str, include: str = "",
            exclude: str = "", blocks: str = "", rank: int = 0) -> list[TargetInfo]:
    """The modules a LoRA would wrap, with shapes, in path order (same rules as plan_targets)."""
    chosen = select_targets(linears, family, targets, include, exclude, blocks, rank)
    return [TargetInfo(p, i, o) for p, (i, o) in chosen.items()]
