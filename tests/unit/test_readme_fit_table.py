"""README's "Will it fit my GPU?" table is docs/memory.md's (written by bench/memory_table.py), shortened.

README shows the 1024 px rows for 8-24 GB cards; docs/memory.md has every row and card. This test reads both
and fails when a README cell differs from what the doc's row says, so the front page cannot drift from the
estimates.
"""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = {"Flux.1-dev": "flux1-dev", "Flux.2 klein 4B": "flux2-klein-4b", "Flux.2 klein 9B": "flux2-klein-9b",
          "Flux.2 dev": "flux2-dev", "Qwen-Image": "qwen-image", "Z-Image": "z-image", "SDXL": "sdxl",
          "Cosmos-Predict2 2B": "cosmos-predict2-2b", "Anima": "anima"}
CARDS = ("8 GB", "12 GB", "16 GB", "24 GB")


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _table(text: str, header_start: str) -> list[dict[str, str]]:
    lines = text[text.index(header_start):].splitlines()
    header = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip().strip("|").split("|")))))
    return rows


def short_plan(cell: str) -> str:
    """A docs/memory.md plan cell as README writes it."""
    if re.fullmatch(r"ckpt: [\d.]+", cell):
        return "fits"
    m = re.fullmatch(r"ckpt, inputs on host, (\d+) of (\d+) swapped: [\d.]+", cell)
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    if re.fullmatch(r"ckpt, inputs on host: [\d.]+", cell):
        return "inputs on host"
    m = re.fullmatch(r"none \(min ([\d.]+)\)", cell)
    assert m, f"a plan cell README has no form for: {cell!r}"
    return f"does not fit (min {m.group(1)})"


def test_short_plan():
    assert short_plan("ckpt: 15.73") == "fits"
    assert short_plan("ckpt, inputs on host, 24 of 56 swapped: 7.96") == "24/56"
    assert short_plan("ckpt, inputs on host: 11.21") == "inputs on host"
    assert short_plan("none (min 8.6)") == "does not fit (min 8.6)"


def test_readme_fit_table_is_the_memory_docs():
    doc = {(r["model"], r["base"]): r for r in _table(_read("docs", "memory.md"), "| model | base | px |")
           if r["px"] == "1024"}
    readme = _table(_read("README.md"), "| model | base | checkpointing |")
    assert len(readme) >= 9
    for row in readme:
        source = doc[(MODELS[row["model"]], row["base"])]
        assert float(row["checkpointing"]) == float(source["ckpt, no swap"]), row
        assert float(row["+ block inputs in host memory"]) == float(source["ckpt, inputs on host"]), row
        for card in CARDS:
            assert row[card] == short_plan(source[card]), (row["model"], row["base"], card)
