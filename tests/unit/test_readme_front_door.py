"""README.md as a ComfyUI user's front door: short, a table of contents, the repo's two commands on top, and the
install steps within its first 60 lines (a user reads that far before giving up)."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lines() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read().splitlines()


def test_readme_is_short_and_starts_with_the_two_commands_and_a_table_of_contents():
    lines = _lines()
    assert len(lines) <= 250, len(lines)
    top = "\n".join(lines[:12])
    assert "bash scripts/run.sh" in top and "bash scripts/test.sh" in top, top
    headings = [ln[3:] for ln in lines if ln.startswith("## ")]
    toc = [m.group(1) for ln in lines[:30] for m in [re.match(r"- \[([^\]]+)\]\(#", ln)] if m]
    assert toc == headings[:len(toc)] and len(toc) >= 6, (toc, headings)


def test_install_steps_end_within_the_first_60_lines():
    lines = _lines()
    start = lines.index("## Install into your ComfyUI")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    steps = [i for i in range(start, end) if re.match(r"\d+\. ", lines[i])]
    assert len(steps) >= 3, steps
    last = steps[-1]
    while last + 1 < end and lines[last + 1].startswith("   "):  # the last step's continuation lines
        last += 1
    assert last < 60, f"the install steps end at line {last + 1}"
    section = "\n".join(lines[start:end])
    assert "custom_nodes" in section and "requirements.txt" in section and "Restart" in section, section
