"""Speed/memory summary: runs the attention, LoRA and training benches and collects their ratios in one table.

Each bench runs as its own process (``bench/<name>.py`` [--quick]); ratios are read from what it prints:
- markdown tables: every column whose header contains "/" (e.g. ``stable/sdpa``) is a ratio, one per row,
  labelled by the row's first cell;
- text lines ``... ratio <label> = <number>`` (e.g. ``ratio fp32/bf16 = 1.23``), or
  ``ratio <label>, <case>: <name> <number>x, <name> <number>x`` (e.g. ``ratio ours/builtin, checkpointing=False:
  time 1.23x, peak memory 0.90x``).
A bench that does not exist (yet) or fails is reported as such in the table, never skipped silently.

Run: ``.venv/bin/python bench/speed.py`` (every bench in full mode) or ``--quick``; ``--only lora`` runs one.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHES = {  # name -> (what its ratios mean, the doc that describes it)
    "attention": ("override overhead vs stock ComfyUI attention; stable vs sdpa", "docs/attention.md"),
    "lora": ("fp32-accumulating vs plain bf16 LoRA layer, forward+backward", "docs/lora.md"),
    "train": ("our training step vs ComfyUI's built-in trainer; memory", "docs/training.md"),
}
_NUM = r"[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"
_LINE_RATIO = re.compile(rf"ratio\s+(?P<label>[^=,:]+?)\s*=\s*(?P<value>{_NUM})")
_LINE_PAIRS = re.compile(r"ratio\s+(?P<label>[^\s,:=]+)[,\s]*(?P<case>[^:]*):(?P<rest>.*)")
_PAIR = re.compile(rf"(?P<name>[A-Za-z][A-Za-z ]*?)\s+(?P<value>{_NUM})x")
_NUMBER = re.compile(r"^\s*\**(?P<value>[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)x?\**\s*$")


@dataclass(frozen=True)
class Ratio:
    bench: str
    case: str
    name: str
    value: float | None  # None: no number (see ``note``)
    note: str = ""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table_ratios(bench: str, lines: list[str]) -> list[Ratio]:
    out: list[Ratio] = []
    header: list[str] | None = None
    for line in lines:
        if not line.strip().startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = cells
            continue
        if set("".join(cells)) <= set("-: "):
            continue  # the |---| separator
        for name, cell in zip(header, cells):
            match = _NUMBER.match(cell)
            if "/" in name and match:
                out.append(Ratio(bench, cells[0], name, float(match["value"])))
    return out


def parse_ratios(bench: str, text: str) -> list[Ratio]:
    """Every ratio a bench printed (markdown ratio columns and ``ratio <label> = <number>`` lines)."""
    lines = text.splitlines()
    found = _table_ratios(bench, lines)
    for line in lines:
        for match in _LINE_RATIO.finditer(line):
            before = line[:match.start()]
            case = (before.split(":")[0] if ":" in before else before).strip(" ,;") or "-"
            found.append(Ratio(bench, case, match["label"].strip(), float(match["value"])))
        pairs = _LINE_PAIRS.search(line)
        if pairs and not _LINE_RATIO.search(line):
            for pair in _PAIR.finditer(pairs["rest"]):
                name = f"{pairs['label']} {pair['name'].strip()}"
                found.append(Ratio(bench, pairs["case"].strip() or "-", name, float(pair["value"])))
    return found


def run_bench(name: str, quick: bool, timeout: float, bench_dir: str,
              log_dir: str | None = None) -> tuple[list[Ratio], float]:
    """Run ``bench_dir/<name>.py`` and parse it; a missing or failing bench gives one Ratio with a note.
    With ``log_dir`` its stdout is also written to ``log_dir/<name>.txt``."""
    path = os.path.join(bench_dir, f"{name}.py")
    if not os.path.exists(path):
        return [Ratio(name, "-", "-", None, f"not available: bench/{name}.py does not exist yet ({BENCHES.get(name, ('', '?'))[1]})")], 0.0
    cmd = [sys.executable, path] + (["--quick"] if quick else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return [Ratio(name, "-", "-", None, f"timed out after {timeout:.0f} s")], time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return [Ratio(name, "-", "-", None, f"failed (exit {proc.returncode}): {tail}")], elapsed
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, f"{name}.txt"), "w", encoding="utf-8") as f:
            f.write(proc.stdout)
    ratios = parse_ratios(name, proc.stdout)
    return ratios or [Ratio(name, "-", "-", None, "ran, but printed no ratio")], elapsed


def format_table(ratios: list[Ratio], commands: dict[str, str]) -> str:
    lines = ["| bench | case | ratio | value | command |", "|---|---|---|---|---|"]
    for r in ratios:
        value = f"{r.value:.3f}" if r.value is not None else r.note
        if r.value is not None and r.value <= 0:  # a quotient of times or memory: the bench measured wrong
            value += " (invalid: a ratio of times or memory must be > 0; the bench's measurement failed)"
        lines.append(f"| {r.bench} | {r.case} | {r.name} | {value} | `{commands[r.bench]}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, bench_dir: str | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="run every bench in its --quick mode")
    ap.add_argument("--only", choices=sorted(BENCHES), action="append", help="run only these benches")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per bench")
    ap.add_argument("--log-dir", help="also write each bench's own output to LOG_DIR/<name>.txt")
    args = ap.parse_args(argv)
    bench_dir = bench_dir or os.path.join(ROOT, "bench")
    names = args.only or list(BENCHES)
    ratios: list[Ratio] = []
    commands = {}
    for name in names:
        commands[name] = f".venv/bin/python bench/{name}.py" + (" --quick" if args.quick else "")
        found, elapsed = run_bench(name, args.quick, args.timeout, bench_dir, args.log_dir)
        ratios += found
        print(f"bench/{name}.py: {len(found)} rows in {elapsed:.1f} s ({BENCHES[name][0]})", file=sys.stderr)
    print(format_table(ratios, commands))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
