"""The family counts README.md and docs/training.md state are docs/families.md's.

docs/families.md is the output of tests/comfy/test_families.py on each host (it fails when a row differs from
what the host gives). README.md no longer copies its table (the README is the front door; the table has 85
rows); it states how many families train on each host and links the doc. This test keeps those counts equal to
the doc's table, so neither can drift.
"""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLAIM = re.compile(r"(\d+) families on\s+(?:ComfyUI\s+)?0\.33\.0\s+\((\d+) on 0\.3\.75\)")


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def family_rows() -> list[list[str]]:
    """The rows of docs/families.md's table (family, preset, counts ..., trains on 0.33, trains on 0.3.75)."""
    text = _read("docs", "families.md")
    table = text[text.index("| family (ComfyUI class)"):]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| family")]


def trained_counts() -> tuple[int, int]:
    """How many families train on ComfyUI 0.33.0 and on 0.3.75, as the doc's table says."""
    rows = family_rows()
    return sum(r[8].startswith("yes") for r in rows), sum(r[9].startswith("yes") for r in rows)


def test_the_doc_table_has_every_family():
    rows = family_rows()
    assert len(rows) >= 21 and all(len(r) == 10 for r in rows)
    assert any(r[0] == "SD3" for r in rows)


def test_readme_and_training_doc_state_the_tables_counts():
    expected = trained_counts()
    for where in (("README.md",), ("docs", "training.md")):
        claims = [(int(a), int(b)) for a, b in CLAIM.findall(_read(*where))]
        assert claims, f"{os.path.join(*where)} no longer says how many families train on each host"
        assert all(c == expected for c in claims), (where, claims, expected)
    assert "docs/families.md" in _read("README.md")


if __name__ == "__main__":
    print("%d families on 0.33.0 (%d on 0.3.75)" % trained_counts())
