"""bench/attention.py --quick prints one table with finite positive times and ratios.

Lives in the comfy tier: the bench loads ComfyUI (in its own subprocess) to time the stock attention.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RATIOS = ["override_default/stock", "override_scale2x/stock", "stable/sdpa"]
TIMES = ["stock ms", "override_default ms", "override_scale2x ms", "sdpa ms", "stable ms"]


def test_quick_bench_prints_a_table_of_finite_positive_ratios():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "attention.py"), "--quick", "--repeats", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["shape (B, H, L, D)", *TIMES, *RATIOS]
    assert set(lines[1].replace("|", "")) == {"-"}
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert len(rows) == 2
    for row in rows:
        assert len(row) == len(header)
        values = dict(zip(header[1:], (float(c) for c in row[1:])))
        assert all(math.isfinite(x) and x > 0 for x in values.values()), row
        for ratio in RATIOS:  # each ratio is the quotient of the printed times (to rounding)
            a, b = ratio.split("/")
            assert math.isclose(values[ratio], values[f"{a} ms"] / values[f"{b} ms"], rel_tol=0.02, abs_tol=2e-3)
    assert "stock ComfyUI backend: attention_" in run.stdout
