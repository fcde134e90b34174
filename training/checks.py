"""The two value checks every user input of the pack goes through: numbers and file names.

Both return ``None`` for a good value, else a phrase ``"<what is wrong>; <fix>"`` that callers prefix with
the node and input (``PrecisionX: input 'y'=<value> ...``). They never raise, whatever the value's type:
they run inside ComfyUI's validation, where a raised error would hide the message.

- ``number_problem``: a real number (not bool, not a string), finite (NaN passes ``<``/``>`` range tests, so
  it is refused explicitly), an integer where one is needed, inside ``[lo, hi]``.
- ``name_problem``: a file name, or a relative path under one of the pack's folders: no NUL or other control
  character (newlines included), no absolute path or drive, no ``..``, no characters Windows refuses, and
  every part short enough to leave room for the counter and suffix the pack appends (255-byte limit).
"""
from __future__ import annotations

import math
import re

# Longest part of a name, in UTF-8 bytes: file systems allow 255, and the pack appends counters and
# suffixes such as "_00001_.safetensors" or "_s000001_1.state.pt" (≤ 25 bytes).
MAX_NAME_PART_BYTES = 200
MAX_NAME_PARTS = 16
_WINDOWS_BAD = '<>:"|?*'
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def show(value: object, limit: int = 60) -> str:
    """``repr(value)`` shortened to ``limit`` characters (long inputs would flood the error)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(str(value))} characters)"


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounds(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"use a value in [{_num(lo)}, {_num(hi)}]"
    if lo is not None:
        return f"use a value >= {_num(lo)}"
    if hi is not None:
        return f"use a value <= {_num(hi)}"
    return "use a finite number"


def number_problem(value: object, lo: float | None = None, hi: float | None = None, *,
                   integer: bool = False) -> str | None:
    """Why ``value`` is not a finite number in ``[lo, hi]`` (an int when ``integer``), or None."""
    fix = _bounds(lo, hi)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "an integer" if integer else "a number"
        return f"is not {kind} (got {type(value).__name__}); {fix}"
    if not math.isfinite(value):
        return f"is not a finite number; {fix}"
    if integer and not isinstance(value, int):
        return f"is not an integer; {fix}"
    if lo is not None and value < lo:
        return f"is below the minimum {_num(lo)}; {fix}"
    if hi is not None and value > hi:
        return f"is above the maximum {_num(hi)}; {fix}"
    return None


def name_problem(value: object, *, subfolders: bool, empty_ok: bool = False) -> str | None:
    """Why ``value`` is not a safe file name (or relative path when ``subfolders``), or None.

    ``empty_ok``: an empty string means "none" for this input (e.g. resume_from).
    """
    example = "'my_lora' or 'sub/my_lora'" if subfolders else "'my_lora'"
    if not isinstance(value, str):
        return f"is not text (got {type(value).__name__}); give a name such as {example}"
    control = _CONTROL.search(value)
    if control:
        return (f"contains the control character {control.group()!r} (newlines and NUL are not allowed in file "
                f"names); remove it")
    norm = value.replace("\\", "/").strip()
    if not norm:
        return None if empty_ok else f"is empty; give a name such as {example}"
    if norm.startswith("/") or re.match(r"^[A-Za-z]:", norm):
        return f"is an absolute path; give a name relative to the pack's folder, such as {example}"
    parts = norm.split("/")
    if ".." in parts:
        return "contains '..' and would leave the pack's folder; remove the '..'"
    if not subfolders and len(parts) > 1:
        return f"must be a plain file name without '/' or '\\'; give a name such as {example}"
    bad = sorted({c for c in norm if c in _WINDOWS_BAD})
    if bad:
        return f"contains {''.join(bad)!r}, which file names cannot hold on Windows; remove them"
    if norm.endswith("/"):
        return f"ends with a folder separator and has no file name; give a name such as {example}"
    if len(parts) > MAX_NAME_PARTS:
        return f"has {len(parts)} folder levels; use at most {MAX_NAME_PARTS}"
    longest = max(len(p.encode("utf-8")) for p in parts)
    if longest > MAX_NAME_PART_BYTES:
        return (f"has a part of {longest} bytes; file names are limited to 255 bytes with the pack's counter and "
                f"suffix, so keep each part under {MAX_NAME_PART_BYTES}")
    return None
