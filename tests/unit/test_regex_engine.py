"""lora.regex: include/exclude patterns can never freeze the server.

Issue 13, D2: targets=none, include="(.*.*){1,4}Z" blocked all HTTP for ~35 s (Python's re held the GIL
while backtracking over the module paths); each extra repetition was ~6x slower.
"""
from __future__ import annotations

import time

import pytest
import re2  # noqa: F401  google-re2 is a required dependency (requirements.txt): its absence is a failure

from lora import regex, targets

# A model-sized list of module paths (Flux-like names, a thousand of them).
PATHS = {f"double_blocks.{i}.img_attn.qkv_projection_{'x' * 30}": (64, 64) for i in range(1000)}
EVIL = "(.*.*){1,6}Z"  # with backtracking: far beyond hours on these paths


@pytest.fixture
def without_re2(monkeypatch):
    monkeypatch.setitem(regex._engine, "re2", None)


def test_catastrophic_pattern_is_matched_in_linear_time_with_re2(monkeypatch):
    """D2: with google-re2 the pattern is accepted and matched; it simply matches no module."""
    monkeypatch.delitem(regex._engine, "re2", raising=False)
    assert regex.engine() == "re2"
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"no module matches targets='none' include='\(\.\*\.\*\)\{1,6\}Z'"):
        targets.select_targets(PATHS, "flux1", "none", include=EVIL)
    assert time.perf_counter() - start < 10  # any machine; Python's re would run for hours
    assert len(targets.select_targets(PATHS, "flux1", "none", include=r"img_attn\.qkv")) == len(PATHS)


def test_re2_refuses_what_it_cannot_match_in_linear_time_and_says_why():
    with pytest.raises(ValueError) as err:
        regex.compile_user_regex(r"(a)\1", "include", use_re2=True)
    assert "include regex '(a)\\\\1' cannot be matched in linear time (invalid escape sequence: \\1)" in str(err.value)
    assert "remove backreferences and lookaround" in str(err.value)


@pytest.mark.parametrize("pattern, why", [
    ("(.*.*){1,4}Z", "nests a repetition inside a repetition"),
    ("(img|txt)*_attn", "repeats an alternation"),
    (r"a.*b.*c.*d", "has more than 2 variable repetitions"),
    (r"(a)\1", "uses a backreference"),
    ("(?=img)img", "uses lookahead/lookbehind"),
])
def test_without_re2_patterns_outside_the_bounded_subset_are_refused(without_re2, pattern, why):
    """D2 fallback: no google-re2 in a user's install → the pattern is refused, naming it and the remedy."""
    assert regex.engine() == "re-bounded"
    with pytest.raises(ValueError, match=rf"^include regex .* {why}.*pip install google-re2"):
        targets.select_targets(PATHS, "flux1", "none", include=pattern)


def test_without_re2_ordinary_patterns_still_work(without_re2):
    chosen = targets.select_targets(PATHS, "flux1", "none", include=r"double_blocks\.(1|2)\d*\.img_attn", exclude="9$")
    assert chosen and all(p.startswith(("double_blocks.1", "double_blocks.2")) for p in chosen)
    assert len(targets.select_targets(PATHS, "flux1", "none", include=".*attn.*")) == len(PATHS)


@pytest.mark.parametrize("use_re2", [False, None])
def test_invalid_and_overlong_patterns_name_field_pattern_and_fix(use_re2):
    with pytest.raises(ValueError, match=r"exclude regex '\(' is invalid \(missing \), .*\): fix the regular"):
        regex.compile_user_regex("(", "exclude", use_re2=use_re2)
    with pytest.raises(ValueError, match=r"include regex 'aaaa.*\.\.\.' is 5000 characters long: keep it under 1000"):
        regex.compile_user_regex("a" * 5000, "include", use_re2=use_re2)
    assert regex.compile_user_regex("   ", "include", use_re2=use_re2) is None


@pytest.mark.parametrize("use_re2", [False, None])
@pytest.mark.parametrize("pattern, depth", [("(" * 500 + ")" * 500, 500), ("(" * 101 + "a" + ")" * 101, 101)],
                         ids=["500-deep", "101-deep"])
def test_deeply_nested_groups_are_refused_with_the_depth_not_a_recursion_error(use_re2, pattern, depth):
    """Issue 22 item 4: 500 nested groups (1000 characters, inside the length cap) raised RecursionError from
    re's parser."""
    with pytest.raises(ValueError, match=rf"include regex '\(\(\(.*\.\.\.' nests groups {depth} deep: use at most "
                                         r"100 levels"):
        regex.compile_user_regex(pattern, "include", use_re2=use_re2)
    assert regex.compile_user_regex("(" * 100 + "a" + ")" * 100, "include", use_re2=use_re2).search("a")


@pytest.mark.parametrize("pattern, depth", [(r"\(\(x", 0), ("[(]((x))", 2), ("[]()]", 0), ("[^](]", 0), ("(a(b)c)", 2)])
def test_group_depth_skips_escapes_and_character_classes(pattern, depth):
    assert regex.group_depth(pattern) == depth


def test_patterns_re2_accepts_are_no_longer_refused_by_the_re_pre_check(monkeypatch):
    """Issue 22 item 4: \\p{Greek} (RE2's Unicode classes) was refused because Python's re cannot parse it."""
    monkeypatch.delitem(regex._engine, "re2", raising=False)
    paths = {"blocks.0.attn": (4, 4), "blocks.0.\u03b1ttn": (4, 4)}  # a Greek alpha
    assert set(targets.select_targets(paths, "flux1", "none", include=r"\p{Greek}")) == {"blocks.0.\u03b1ttn"}
    with pytest.raises(ValueError, match=r"include regex '\\\\p\{Greek\}' is invalid \(bad escape \\p"):
        regex.compile_user_regex(r"\p{Greek}", "include", use_re2=False)  # the fallback keeps re's syntax


@pytest.mark.parametrize("use_re2", [False, None])
def test_a_lone_surrogate_is_refused_as_not_text(use_re2):
    with pytest.raises(ValueError, match=r"exclude regex 'a\\ud800' contains the lone UTF-16 surrogate '\\ud800', "
                                         r"which is not text: retype the pattern"):
        regex.compile_user_regex("a\ud800", "exclude", use_re2=use_re2)
