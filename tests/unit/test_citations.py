"""Citations resolve: docs and product code point only at files in the repository.

Design notes, issue numbers and documents that live outside the repository (an "issue 13, D4", a "#29", a
PRECISION.md) mean nothing to a reader of a clone, so docs (README.md, docs/, web/, workflows/*.py) and product
code (its docstrings, comments and texts) cite a doc section, a test or a bench instead. Tests may keep their
history notes, but may not name a file the repository does not have. A relative markdown link in README.md,
docs/*.md or web/docs/*.md must reach a file (and, with ``#anchor``, a heading) that exists.
"""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRODUCT = ("attention", "lora", "training", "nodes", "runner", "probe", "demo", "scripts", "bench", "web")
SUFFIXES = (".py", ".md", ".sh", ".js", ".mjs", ".json", ".txt")
SKIP_DIRS = {"__pycache__", "node_modules", ".hosts", ".cache", "artifacts"}

# documents kept beside the repository, never in it
MISSING_FILES = re.compile(r"\b(?:PRECISION|COMFYUI|MEMORY|DESIGN)\.md\b")
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+")
DESIGN_ITEM = re.compile(r"\bD-?\d+\b")
# "#29" alone is this project's issue; "owner/repo #12" and "ComfyUI PR #12" name a public upstream one
QUALIFIED = re.compile(r"(?:\b[\w.-]+/[\w.-]+|\bComfyUI)(?: (?:PR|pull|issue))? #\d+(?:,? #\d+)*")
BARE_NUMBER = re.compile(r"(?<![\w&])#\d+\b")
LINK = re.compile(r"\]\(([^()\s]+)\)")


def citation_problems(text: str, *, bare_numbers: bool = True) -> list[str]:
    """What in ``text`` cites something a clone of the repository does not have (empty when nothing)."""
    found = [m.group(0) for m in MISSING_FILES.finditer(text)]
    found += [m.group(0) for m in ISSUE.finditer(text)]
    found += [m.group(0) for m in DESIGN_ITEM.finditer(text)]
    if bare_numbers:
        found += [m.group(0) for m in BARE_NUMBER.finditer(QUALIFIED.sub("", text))]
    return found


def _files(folders: tuple[str, ...], suffixes: tuple[str, ...] = SUFFIXES) -> list[str]:
    out = []
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(suffixes)]
    return out


def _docs() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *_files(("docs",), (".md",)), *_files(("web",), (".md",))]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _lines_with(path: str, check) -> list[str]:
    return [f"{_rel(path)}:{n}: {problems} in {line.strip()[:120]!r}"
            for n, line in enumerate(_read(path).splitlines(), 1) if (problems := check(line))]


@pytest.mark.parametrize("text, found", [
    ("see PRECISION.md §3", ["PRECISION.md"]),
    ("(../shared/MEMORY.md §2)", ["MEMORY.md"]),
    ("docs/memory.md and docs/DEVELOPING.md", []),
    ("fixed in issue 13, D4", ["issue 13", "D4"]),
    ("Issue #29 on a GPU", ["Issue #29", "#29"]),
    ("(#29 item 2)", ["#29"]),
    ("kijai/ComfyUI-FluxTrainer #82, #51 and kohya-ss/sd-scripts #1503", []),
    ("~4 GB (Comfy-Org/ComfyUI PR #12189), ComfyUI PR #12189", []),
    ("a 2D or 3D latent, D = 128, (B, C, H, W)", []),
    ("tensor shapes D-4 and D12", ["D-4", "D12"]),
    ("colour: 'var(--border, #555)'; &#39; entity", ["#555"]),  # a colour is not a citation: JS is checked without
])
def test_the_detector(text, found):
    assert citation_problems(text) == found


def test_docs_and_product_code_cite_only_what_the_repository_has():
    bad = []
    for path in [*_docs(), *_files(("workflows",), (".py",)), *_files(PRODUCT)]:
        colours = path.endswith((".js", ".mjs"))  # CSS colours such as #555 are not issue numbers
        bad += _lines_with(path, lambda line, c=colours: citation_problems(line, bare_numbers=not c))
    assert not bad, "cite a doc section, test or bench of the repository instead:\n" + "\n".join(bad)


def test_tests_name_no_file_outside_the_repository():
    bad = []
    for path in _files(("tests",), (".py", ".md", ".mjs", ".js")):
        if os.path.samefile(path, __file__):
            continue  # this file names them to find them
        bad += _lines_with(path, lambda line: [m.group(0) for m in MISSING_FILES.finditer(line)])
    assert not bad, "\n".join(bad)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def link_problems(path: str) -> list[str]:
    """Relative links of the markdown file ``path`` whose file or heading does not exist."""
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(full):
            bad.append(f"{_rel(path)}: ]({target}) names a file that does not exist")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            bad.append(f"{_rel(path)}: ]({target}) names a heading {_rel(full)} does not have")
    return bad


def test_the_link_checker(tmp_path):
    (tmp_path / "there.md").write_text("# Title\n## Will it fit my GPU?\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[a](there.md) [b](there.md#will-it-fit-my-gpu) [c](missing.md) [d](there.md#nowhere) "
                    "[e](https://example.com/x) [f](#title-here)\n## Title here\n", encoding="utf-8")
    problems = link_problems(str(page))
    assert len(problems) == 2
    assert "](missing.md) names a file" in problems[0] and "](there.md#nowhere) names a heading" in problems[1]


def test_relative_links_in_the_docs_resolve():
    bad = [problem for path in _docs() for problem in link_problems(path)]
    assert not bad, "\n".join(bad)
