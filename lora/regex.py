"""User-supplied regular expressions (LoRA include / exclude) that cannot freeze the server.

Python's ``re`` backtracks: one pattern such as ``(.*.*){1,4}Z`` searched over a model's module paths held
the GIL for ~35 s (tests/unit/test_regex_engine.py), blocking every HTTP request and /interrupt; each extra repetition took
about 6x longer. Two engines, chosen once:

- ``google-re2`` (``import re2``, in requirements.txt): linear-time matching whatever the pattern. Patterns
  RE2 cannot run in linear time (backreferences, lookaround) are refused with RE2's reason.
- without it, Python's ``re`` on a bounded subset: no repetition that contains a repetition or an
  alternation (the exponential cases), at most ``MAX_OPEN_REPEATS`` variable-width repetitions (the
  polynomial degree), no backreferences or lookaround. Module paths are short (< 300 characters), so a
  pattern inside the subset matches in well under a millisecond. Patterns outside it are refused with the
  reason and the remedy (install google-re2, or simplify).

Both engines cap the pattern at ``MAX_PATTERN_CHARS`` and its group nesting at ``MAX_GROUP_DEPTH`` (Python's
``re`` parser recurses once per level and raised RecursionError at ~500; RE2 takes any depth,
but no module path needs more than a few levels), and refuse text that is not valid Unicode (a lone UTF-16
surrogate). With RE2 the pattern is RE2's: ``\\p{Greek}`` and the like are accepted although ``re`` cannot parse
them; a pattern RE2 refuses is called invalid with ``re``'s reason when ``re`` refuses it too, else a pattern
RE2 cannot run in linear time. Errors are ``ValueError`` naming the field, the pattern and why.
"""
from __future__ import annotations

import importlib
import logging
import re
from typing import Any, Protocol

log = logging.getLogger(__name__)

MAX_PATTERN_CHARS = 1000
MAX_OPEN_REPEATS = 2
MAX_GROUP_DEPTH = 100
_engine: dict[str, Any] = {}


class Matcher(Protocol):
    def search(self, text: str) -> Any: ...


def _re2() -> Any | None:
    """The re2 module, or None when google-re2 is not installed (looked up once)."""
    if "re2" not in _engine:
        try:
            _engine["re2"] = importlib.import_module("re2")
        except ImportError:
            _engine["re2"] = None
            log.warning("google-re2 is not installed: include/exclude regexes are limited to a "
                        "bounded subset of Python's re (pip install google-re2 for any pattern in linear time)")
    return _engine["re2"]


def engine() -> str:
    """"re2" (linear time) or "re-bounded" (Python's re on the bounded subset)."""
    return "re2" if _re2() is not None else "re-bounded"


def _err(field: str, pattern: str, why: str, fix: str) -> ValueError:
    shown = pattern if len(pattern) <= 60 else pattern[:60] + "..."
    return ValueError(f"{field} regex {shown!r} {why}: {fix}")


def compile_user_regex(pattern: str, field: str, use_re2: bool | None = None) -> Matcher | None:
    """A matcher with ``.search(text)`` for a user pattern, None for an empty one. ``use_re2`` None: re2
    when installed. ValueError naming ``field``, the pattern and the reason when it is refused."""
    if not isinstance(pattern, str):
        raise _err(field, str(pattern), "is not text", "give a regular expression such as 'img_attn'")
    if not pattern.strip():
        return None
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _err(field, pattern, f"is {len(pattern)} characters long",
                   f"keep it under {MAX_PATTERN_CHARS} (module paths are short; alternatives can be split)")
    _check_text(pattern, field)
    re2 = _re2() if use_re2 is not False else None
    if use_re2 and re2 is None:
        raise _err(field, pattern, "needs google-re2", "pip install google-re2")
    if re2 is not None:
        return _compile_re2(re2, pattern, field)
    compiled = _compile_re(pattern, field)  # raises for invalid syntax
    why = bounded_problem(pattern)
    if why is not None:
        raise _err(field, pattern, f"{why}, which can take minutes to match without google-re2",
                   "pip install google-re2 (linear-time matching) or simplify the pattern")
    return compiled


def group_depth(pattern: str) -> int:
    """How deeply the groups of ``pattern`` nest, read as text: escapes and character classes skipped."""
    depth = deepest = i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":  # a class runs to the first ']' that is not its first member
            i += 2 if pattern[i + 1:i + 2] == "^" else 1
            i += 1 if pattern[i:i + 1] == "]" else 0
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1
    return deepest


def _check_text(pattern: str, field: str) -> None:
    """Refuse text no engine can take: a lone surrogate (not encodable), groups nested too deeply."""
    try:
        pattern.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _err(field, pattern, f"contains the lone UTF-16 surrogate {pattern[e.start]!r}, which is not text",
                   "retype the pattern (a copy from a broken source)") from None
    depth = group_depth(pattern)
    if depth > MAX_GROUP_DEPTH:
        raise _err(field, pattern, f"nests groups {depth} deep",
                   f"use at most {MAX_GROUP_DEPTH} levels (module paths need only a few)")


def _compile_re(pattern: str, field: str) -> Any:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise _err(field, pattern, f"is invalid ({e})", "fix the regular expression") from None
    except RecursionError:  # the group depth cap keeps this away; any other deep construct lands here
        raise _err(field, pattern, "is nested too deeply for Python's re parser",
                   "simplify the pattern") from None


def _compile_re2(re2: Any, pattern: str, field: str) -> Matcher:
    options = re2.Options()
    options.log_errors = False  # RE2 would print its own copy of every error to stderr
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else str(e)
    _compile_re(pattern, field)  # invalid for re too: re's reason, in Python's terms
    raise _err(field, pattern, f"cannot be matched in linear time ({reason})",
               "remove backreferences and lookaround (google-re2 matches everything else in linear time)")


def _parser() -> Any:
    try:
        return importlib.import_module("re._parser")  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        return importlib.import_module("sre_parse")


def bounded_problem(pattern: str) -> str | None:
    """Why ``pattern`` is outside the subset that Python's re matches quickly, or None (pattern compiles)."""
    parser = _parser()
    constants = importlib.import_module(parser.__name__.replace("_parser", "_constants").replace("sre_parse",
                                                                                              "sre_constants"))
    counts = {"open": 0}
    return _walk(parser.parse(pattern), constants, counts, inside_repeat=False)


def _walk(items: Any, c: Any, counts: dict[str, int], inside_repeat: bool) -> str | None:
    repeats = {c.MAX_REPEAT, c.MIN_REPEAT} | ({c.POSSESSIVE_REPEAT} if hasattr(c, "POSSESSIVE_REPEAT") else set())
    for op, arg in items:
        if op in (c.GROUPREF, c.GROUPREF_EXISTS):
            return "uses a backreference"
        if op in (c.ASSERT, c.ASSERT_NOT):
            return "uses lookahead/lookbehind"
        if op is c.BRANCH and inside_repeat:
            return "repeats an alternation ('(a|b)*')"
        if op in repeats:
            low, high, body = arg
            if inside_repeat:
                return "nests a repetition inside a repetition ('(x*)*')"
            if low != high:
                counts["open"] += 1
                if counts["open"] > MAX_OPEN_REPEATS:
                    return f"has more than {MAX_OPEN_REPEATS} variable repetitions ('*', '+', '?', '{{m,n}}')"
            why = _walk(body, c, counts, inside_repeat=high > 1)
        elif op is c.SUBPATTERN:
            why = _walk(arg[-1], c, counts, inside_repeat)
        elif op is c.BRANCH:
            why = next((w for b in arg[1] if (w := _walk(b, c, counts, inside_repeat)) is not None), None)
        elif op is getattr(c, "ATOMIC_GROUP", None):
            why = _walk(arg, c, counts, inside_repeat)
        else:
            why = None
        if why is not None:
            return why
    return None
