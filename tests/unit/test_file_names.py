"""nodes/checks/file_names.py: every check of a file name from outside the pack.

Names the pack creates (widget values; issue 13: D7 NUL / overlong names reached the OS as raw errors, D10
newlines), and names of existing files the browser's routes ask for (.., absolute paths, symlinks leaving the
folder, each with its HTTP status).
"""
from __future__ import annotations

import importlib
import os

import pytest
from pure_packages import PACK

from tests.unit.test_lora_routes import tree  # noqa: F401  (the fixture: two loras roots, symlinks of each kind)
from training.checks import show

fn = importlib.import_module(f"{PACK}.nodes.checks.file_names")
name_problem = fn.name_problem


NAMES = [
    # value, subfolders, empty_ok, expected phrase (None = accepted)
    ("my_lora", False, False, None),
    ("sub/dir/my_lora", True, False, None),
    ("", True, True, None),
    ("", False, False, "is empty"),
    ("a\x00b", True, False, "control character '\\x00'"),
    ("line\nbreak", False, False, "control character '\\n'"),
    ("../../x", True, False, "contains '..'"),
    ("a/../../x", True, False, "contains '..'"),
    ("/etc/passwd", True, False, "is an absolute path"),
    ("C:\\Windows\\x", True, False, "is an absolute path"),
    ("\\\\server\\share", True, False, "is an absolute path"),
    ("sub/x", False, False, "must be a plain file name"),
    ("x" * 300, False, False, "has a part of 300 bytes"),
    ("é" * 120, False, False, "has a part of 240 bytes"),
    ("ab:c?", True, False, "cannot hold on Windows"),
    ("a:b", True, False, "is an absolute path"),  # drive-relative on Windows
    ("dir/", True, False, "has no file name"),
    (123, True, False, "is not text (got int)"),
    # issue 22 item 5: what the portability rule missed
    ("a\x85b", False, False, "control character '\\x85' (U+0085)"),  # C1 (NEXT LINE)
    ("a\x9bb", True, False, "control character '\\x9b' (U+009B)"),
    ("a\u2028b", False, False, "line separator character '\\u2028' (U+2028 LINE SEPARATOR)"),
    ("a\u2029b", False, False, "paragraph separator character '\\u2029' (U+2029 PARAGRAPH SEPARATOR)"),
    ("a\u200bb", False, False, "invisible formatting character '\\u200b' (U+200B ZERO WIDTH SPACE)"),
    ("a\u200db", True, False, "(U+200D ZERO WIDTH JOINER)"),
    ("\ufeffa", False, False, "(U+FEFF ZERO WIDTH NO-BREAK SPACE)"),
    ("a\u2060b", False, False, "(U+2060 WORD JOINER)"),
    ("evil\u202etxt.exe", False, False, "(U+202E RIGHT-TO-LEFT OVERRIDE)"),
    ("a\u202ab", False, False, "(U+202A LEFT-TO-RIGHT EMBEDDING)"),
    ("a\u2066b", True, False, "(U+2066 LEFT-TO-RIGHT ISOLATE)"),
    ("a\u2069b", True, False, "(U+2069 POP DIRECTIONAL ISOLATE)"),
    ("a\ud800b", True, False, "lone UTF-16 surrogate character '\\ud800' (U+D800)"),
    ("CON", False, False, "a Windows device name"),
    ("con", False, False, "a Windows device name"),
    ("Aux.txt", False, False, "a Windows device name"),
    ("sub/nul", True, False, "has the part 'nul', a Windows device name"),
    ("PRN/x", True, False, "has the part 'PRN', a Windows device name"),
    ("COM1", False, False, "a Windows device name"),
    ("com9.safetensors", False, False, "a Windows device name"),
    ("LPT1", False, False, "a Windows device name"),
    ("lpt9.x.y", False, False, "a Windows device name"),
    ("COM\u00b9", False, False, "a Windows device name"),
    ("name.", False, False, "has the part 'name.' ending in a dot or space"),
    ("name ", False, False, "has the part 'name ' ending in a dot or space"),
    ("sub./x", True, False, "has the part 'sub.' ending in a dot or space"),
    ("sub /x", True, False, "has the part 'sub ' ending in a dot or space"),
    (".", False, False, "has the part '.', which names a folder"),
    ("sub/.", True, False, "has the part '.', which names a folder"),
    ("./x", True, False, "has the part '.', which names a folder"),
    ("...", False, False, "has the part '...', which names a folder"),
    # accepted: names that only look like the refused ones
    ("CONSOLE", False, False, None),
    ("com10", False, False, None),
    ("LPT", False, False, None),
    ("my.lora", False, False, None),
    ("sub/.hidden_lora", True, False, None),
    ("naïve lora", False, False, None),
    ("\u03b1\u03b2_\u65e5\u672c", False, False, None),  # Greek, CJK
    ("  leading spaces", False, False, None),
]


@pytest.mark.parametrize("value, subfolders, empty_ok, expected", NAMES, ids=[show(n[0], 20) for n in NAMES])
def test_name_problem(value, subfolders, empty_ok, expected):
    got = name_problem(value, subfolders=subfolders, empty_ok=empty_ok)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got
        assert "; " in got  # every message carries a fix after the semicolon


def _find(name, roots):
    return fn.find_model_file(name, roots, "loras", "metadata")


def test_names_inside_the_folders_resolve(tree):
    roots = tree["roots"]
    assert _find("mine.safetensors", roots) == os.path.realpath(tree["a"] / "mine.safetensors")
    assert _find("sub/deep.safetensors", roots).endswith(os.path.join("sub", "deep.safetensors"))
    assert _find("sub\\deep.safetensors", roots).endswith(os.path.join("sub", "deep.safetensors"))
    assert _find("second.safetensors", roots) == os.path.realpath(tree["b"] / "second.safetensors")
    # a symlink that stays inside the folder is fine
    assert _find("link_in.safetensors", roots) == os.path.realpath(tree["a"] / "mine.safetensors")


@pytest.mark.parametrize("name", [
    "../outside/secret.safetensors",
    "../../outside/secret.safetensors",
    "sub/../../../outside/secret.safetensors",
    "..\\..\\outside\\secret.safetensors",
    "sub/..",
    "..",
])
def test_dotdot_is_refused(tree, name):
    with pytest.raises(fn.QueryRefused) as e:
        _find(name, tree["roots"])
    assert e.value.status == 403
    assert "'..'" in str(e.value)


def test_absolute_paths_are_refused_even_inside_the_folder(tree):
    inside = str(tree["a"] / "mine.safetensors")
    for name in (inside, str(tree["outside"] / "secret.safetensors"), "/etc/passwd", "C:\\x\\y.safetensors",
                 "c:y.safetensors", "\\\\server\\share\\y.safetensors", "~/y.safetensors"):
        with pytest.raises(fn.QueryRefused) as e:
            _find(name, tree["roots"])
        assert e.value.status == 403, name
        assert "absolute" in str(e.value)


@pytest.mark.parametrize("name", ["link_out.safetensors", "dir_out/secret.safetensors"])
def test_symlinks_leaving_the_folder_are_refused(tree, name):
    with pytest.raises(fn.QueryRefused) as e:
        _find(name, tree["roots"])
    assert e.value.status == 403
    assert "outside the loras folders" in str(e.value)


@pytest.mark.parametrize("name,status", [
    ("", 400), ("   ", 400), (None, 400), ("a\x00.safetensors", 400), ("x" * 2000 + ".safetensors", 400),
    ("notes.txt", 400), ("sub//deep.safetensors", 400), ("missing.safetensors", 404), ("sub/missing.safetensors", 404),
    ("sub", 400),
])
def test_bad_or_missing_names(tree, name, status):
    with pytest.raises(fn.QueryRefused) as e:
        _find(name, tree["roots"])
    assert e.value.status == status
    assert str(e.value).startswith("metadata: ")  # plain: the route's answer adds the pack's prefix (lookup)


def test_a_directory_named_like_a_lora_is_not_found(tree):
    os.makedirs(tree["a"] / "folder.safetensors")
    with pytest.raises(fn.QueryRefused) as e:
        _find("folder.safetensors", tree["roots"])
    assert e.value.status == 404


def test_inside_follows_symlinks_and_accepts_the_root_itself(tree):
    a = str(tree["a"])
    assert fn.inside(a, a)
    assert fn.inside(a, os.path.join(a, "sub", "not_yet_written.safetensors"))
    assert not fn.inside(a, os.path.join(a, "dir_out"))  # a link to a folder outside
    assert not fn.inside(a, os.path.join(a, "..", "loras_sibling"))
    assert not fn.inside(a, a + "_sibling")  # a shared prefix is not containment


def test_route_answers_carry_the_status_and_name_the_route(tree):
    route = fn.FileRoute("/x", "loras", "metadata", lambda path: {"path": path})
    status, body = route.lookup("../x.safetensors", tree["roots"])
    assert status == 403 and body["error"].startswith("[Precision LoRA] metadata: '..' is refused")
    status, body = route.lookup("mine.safetensors", tree["roots"])
    assert status == 200 and body == {"name": "mine.safetensors", "path": os.path.realpath(tree["a"] / "mine.safetensors")}
