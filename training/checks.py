"""The value check every number a user gives the pack goes through, and how a bad value is shown.

``number_problem`` returns ``None`` for a good value, else a phrase ``"<what is wrong>; <fix>"`` that callers
prefix with the node and input (``PrecisionX: input 'y'=<value> ...``). It never raises, whatever the value's
type: it runs inside ComfyUI's validation, where a raised error would hide the message. A real number (not
bool, not a string), finite (NaN passes ``<``/``>`` range tests, so it is refused explicitly), an integer
where one is needed, inside ``[lo, hi]``. File names are checked in ``nodes/checks/file_names.py``.
"""
from __future__ import annotations

import math


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

