"""bench/lora.py --quick prints the delta-survival table (with the expected gains) and a cost ratio.

D12 (issue 13): the time ratio is only checked to be finite and positive (its band is machine-specific)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_quick_prints_gain_table_and_ratio():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "lora.py"), "--quick"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    rows = {m.group(1): [float(v) for v in m.group(2).split(" | ")]
            for m in re.finditer(r"^(\de-\d\d) \| (.+)$", out, re.M)}
    assert set(rows) == {"1e-03", "3e-03", "1e-02"}
    plain, rounded, merge, ours = rows["1e-03"]
    assert ours > 0.95 and max(plain, rounded, merge) < 0.65
    assert all(v > 0.95 for v in rows["1e-02"])
    ratio = re.search(r"ratio fp32/bf16 = ([0-9.eE+-]+|nan|inf)", out)
    # D12 (issue 13): the fp32/bf16 time ratio is machine-specific (0.063 on an AMD EPYC without AVX-512 bf16);
    # only that it is a finite, positive number holds everywhere.
    assert ratio is not None and math.isfinite(float(ratio.group(1))) and float(ratio.group(1)) > 0
