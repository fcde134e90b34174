"""README's family table is docs/families.md's, shortened (issue 25 item 6).

docs/families.md is the output of tests/comfy/test_families.py on each host (it fails when a row differs from
what the host gives); this test keeps README's copy equal to it, so neither can drift. To refresh README after
the doc changed: ``python tests/unit/test_readme_families.py`` prints the table to paste between the markers.
"""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START, END = "<!-- families:start -->", "<!-- families:end -->"


def _rows(text: str) -> list[list[str]]:
    table = text[text.index("| family (ComfyUI class)"):]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| family")]


def readme_table() -> str:
    """family, default preset and its target count, scale coverage, trains on 0.33 / 0.3.75."""
    with open(os.path.join(ROOT, "docs", "families.md"), encoding="utf-8") as f:
        rows = _rows(f.read())
    yes = lambda cell: "yes" if cell.startswith("yes") else ""  # noqa: E731
    lines = ["| family (ComfyUI class) | default preset: targets | scale reaches | trains on 0.33 | trains on 0.3.75 |",
             "|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]}: {r[2]} | {r[7]} | {yes(r[8])} | {yes(r[9])} |" for r in rows]
    return "\n".join(lines)


def test_readme_family_table_is_the_docs_table():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert START in readme and END in readme
    shown = readme[readme.index(START) + len(START):readme.index(END)].strip()
    assert shown == readme_table()


def test_the_table_has_every_family_of_the_doc():
    table = readme_table().splitlines()[2:]
    assert len(table) >= 21 and all(line.count("|") == 6 for line in table)
    assert any(line.startswith("| SD3 |") for line in table)


if __name__ == "__main__":
    print(readme_table())
