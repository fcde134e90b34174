"""scripts/gpu_check.sh: the bundle installed into a throwaway environment and every phase of
scripts/gpu/phases.py run in priority order, each under its time box (docs/gpu.md).

    bash scripts/gpu_check.sh [--minutes N] [--out DIR] [--bundle DIR] [--work DIR] [--only NAME ...]
                              [--resume] [--dry-run]

Writes DIR/summary.md and DIR/summary.json after EVERY phase (a run killed mid-way still reports what
finished) and DIR/logs.tar.gz with each phase's whole log. ``--resume`` keeps the phases DIR/summary.json
already has as passed or failed and runs the rest (a second device call continues the first). ``--dry-run``
runs nothing: it lists every phase with its command and time box and checks the bundle is complete.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import bundle as bundle_tool  # noqa: E402
import phases as phase_list  # noqa: E402

TAIL_LINES = 40
MIN_BOX_S = 20  # a phase with less time than this left is reported "not run", not started
DONE = ("passed", "failed")


def tree_bytes() -> int:
    """Bytes the device tool sends with every call: tracked and untracked-not-ignored files."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def bundle_report(bundle: pathlib.Path) -> dict:
    """Per group: complete or what is missing and why, plus the transfer budget check."""
    verified = bundle_tool.verify(bundle)
    report = {"dir": str(bundle), "groups": {g: (p or "complete") for g, p in verified.items()}}
    mpath = bundle / "manifest.json"
    if mpath.is_file():
        m = json.loads(mpath.read_text())
        tree = tree_bytes()
        biggest = max((p["size"] for e in m["groups"].values() for p in e["parts"]), default=0)
        report.update(total_bytes=m["total_bytes"], parts_count=m["parts_count"], tree_bytes=tree,
                      largest_part_bytes=biggest, fits_one_call=biggest + tree <= m["call_limit_bytes"],
                      left_out=m["left_out"])
    report["complete"] = not any(p for p in verified.values())
    return report


def phase_blocker(phase: phase_list.Phase, report: dict, results: dict[str, dict]) -> str | None:
    """Why the phase cannot run here (None: it can)."""
    for g in phase.groups:
        state = report["groups"].get(g, [f"group {g!r} is not in the bundle"])
        if state != "complete":
            return f"bundle group {g} incomplete: {'; '.join(state) if isinstance(state, list) else state}"
    if phase.needs_file:
        f = ROOT / phase.needs_file
        if not f.is_file():
            return f"{phase.needs_file} does not exist in this tree"
        if phase.needs_text and phase.needs_text not in f.read_text():
            return f"{phase.needs_file} has no {phase.needs_text} option yet"
    if phase.needs_phase and results.get(phase.needs_phase, {}).get("result") != "passed":
        return f"needs phase {phase.needs_phase} to pass first"
    return None


def pytest_counts(text: str) -> dict[str, int]:
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|errors?|skipped)", ln)]
    if not lines:
        return {}
    return {k if k != "error" else "errors": int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|errors|error|skipped|xfailed|xpassed|deselected)", lines[-1])}


def run_phase(phase: phase_list.Phase, command: str, box: int, logs: pathlib.Path) -> dict:
    log = logs / f"{phase.name}.log"
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as fh:
        fh.write(f"$ {command}\n")
        fh.flush()
        rc = subprocess.run(["timeout", "-k", "15", str(box), "bash", "-c", command], cwd=ROOT, env=env,
                            stdout=fh, stderr=subprocess.STDOUT).returncode
    seconds = round(time.monotonic() - t0, 1)
    text = log.read_text(errors="replace")
    result = "timeout" if rc in (124, 137) else ("passed" if rc == 0 else "failed")
    out = {"result": result, "rc": rc, "seconds": seconds, "tail": text.splitlines()[-TAIL_LINES:]}
    counts = pytest_counts(text)
    if counts:
        out["counts"] = counts
    arrival = re.search(r"^ARRIVAL_JSON (.*)$", text, re.M)
    if arrival:
        out["facts"] = json.loads(arrival.group(1))
    return out


def write_summary(out: pathlib.Path, summary: dict, logs: pathlib.Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    if logs is not None and logs.is_dir():
        with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
            for f in sorted(logs.glob("*.log")):
                tar.add(f, arcname=f.name)


def markdown(s: dict) -> str:
    f = s.get("facts", {})
    lines = [f"# GPU check {s['started']}", "",
             f"- command: `{s['command']}`",
             f"- device: {f.get('device', 'unknown')} (sm {f.get('capability', '?')}, {f.get('memory_gib', '?')} GiB), "
             f"driver {f.get('driver', '?')}",
             f"- versions: Python {f.get('python', '?')}, torch {f.get('torch', '?')} (CUDA {f.get('torch_cuda', '?')}), "
             f"triton {f.get('triton', '?')}; pack commit {s.get('commit', '?')}",
             f"- TF32 state at arrival (the test phases run with the cuBLAS overrides at 0): {f.get('tf32', '?')}",
             f"- budget: {s['minutes']} min; used {s.get('elapsed_s', 0)} s" + (" (dry run)" if s["dry_run"] else ""),
             f"- bundle: {'complete' if s['bundle']['complete'] else 'INCOMPLETE'} ({s['bundle']['dir']})", "",
             "| # | phase | result | time s | box s | counts / reason | command |", "|---|---|---|---|---|---|---|"]
    for i, p in enumerate(s["phases"], 1):
        note = ", ".join(f"{v} {k}" for k, v in p.get("counts", {}).items()) or p.get("reason", "")
        lines.append(f"| {i} | {p['name']} | {p['result']} | {p.get('seconds', '')} | {p['box_s']} | {note} | "
                     f"`{p['command']}` |")
    for g, state in s["bundle"]["groups"].items():
        if state != "complete":
            lines.append(f"\nbundle group {g}: {'; '.join(state)}")
    for p in s["phases"]:
        if p["result"] in ("failed", "timeout") and p.get("tail"):
            lines += ["", f"## {p['name']}: {p['result']}", "", "```", *p["tail"][-25:], "```"]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=9.0,
                    help="wall-clock budget for all phases (default 9: one device call is at most 10 min)")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="folder for summary.md, summary.json, logs.tar.gz (default $OUT, else WORK/out)")
    ap.add_argument("--bundle", default=os.environ.get("GPU_BUNDLE") or str(ROOT / ".gpu_bundle"))
    ap.add_argument("--work", default=os.environ.get("GPU_WORK") or "/tmp/precision_lora_gpu",
                    help="the throwaway environment (venvs, ComfyUI trees, logs)")
    ap.add_argument("--only", action="append", choices=[p.name for p in phase_list.PHASES],
                    help="run only these phases (and nothing they need that has not passed)")
    ap.add_argument("--resume", action="store_true", help="keep passed/failed phases of DIR/summary.json")
    ap.add_argument("--dry-run", action="store_true", help="list phases and check the bundle; run nothing")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    work, bundle = pathlib.Path(a.work), pathlib.Path(a.bundle)
    out = pathlib.Path(a.out) if a.out else work / "out"
    report = bundle_report(bundle)
    previous = {}
    if a.resume and (out / "summary.json").is_file():
        previous = {p["name"]: p for p in json.loads((out / "summary.json").read_text())["phases"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    summary = {"started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": "bash scripts/gpu_check.sh " + " ".join(argv if argv is not None else sys.argv[1:]),
               "minutes": a.minutes, "dry_run": a.dry_run, "commit": commit, "bundle": report, "phases": []}
    results: dict[str, dict] = {n: p for n, p in previous.items() if p["result"] in DONE}
    facts = next((p["facts"] for p in results.values() if "facts" in p), {})
    summary["facts"] = facts
    logs = work / "logs"
    if not a.dry_run:
        logs.mkdir(parents=True, exist_ok=True)
    t_start, budget = time.monotonic(), a.minutes * 60
    for phase in phase_list.PHASES:
        command = phase_list.fill(phase, str(work), str(bundle))
        entry = {"name": phase.name, "what": phase.what, "command": command, "box_s": phase.box_s}
        if phase.name in results:
            entry.update({k: v for k, v in results[phase.name].items() if k not in entry}, resumed=True)
        elif a.only and phase.name not in a.only:
            entry.update(result="not selected")
        elif a.dry_run:
            blocker = phase_blocker(phase, report, {n: {"result": "passed"} for n in ("arrival", "install-0.33.0", "install-0.3.75")})
            entry.update(result="would run" if not blocker else "would skip", reason=blocker or "")
        else:
            blocker = phase_blocker(phase, report, results)
            left = int(budget - (time.monotonic() - t_start))
            if blocker:
                entry.update(result="skipped", reason=blocker)
            elif left < MIN_BOX_S:
                entry.update(result="not run", reason=f"out of time: {a.minutes} min budget spent")
            else:
                entry.update(run_phase(phase, command, min(phase.box_s, left), logs))
                entry["box_s"] = min(phase.box_s, left)
                results[phase.name] = entry
                summary["facts"] = entry.get("facts", summary["facts"])
        summary["phases"].append(entry)
        summary["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if not a.dry_run:
            write_summary(out, {**summary, "phases": summary["phases"] + pending(summary["phases"], work, bundle)},
                          logs)
    if a.dry_run:
        print(dry_run_text(summary))
        return 0 if report["complete"] else 1
    print((out / "summary.md").read_text())
    return 0 if all(p["result"] in ("passed", "not selected") for p in summary["phases"]) else 1


def pending(done: list[dict], work: pathlib.Path, bundle: pathlib.Path) -> list[dict]:
    """The phases not reached yet, listed in the interim summary so a killed run shows what it never began."""
    names = {p["name"] for p in done}
    return [{"name": p.name, "what": p.what, "command": phase_list.fill(p, str(work), str(bundle)),
             "box_s": p.box_s, "result": "pending"} for p in phase_list.PHASES if p.name not in names]


def dry_run_text(s: dict) -> str:
    b = s["bundle"]
    lines = [f"gpu_check dry run: {len(s['phases'])} phases, time boxes total "
             f"{sum(p['box_s'] for p in s['phases']) / 60:.1f} min (budget --minutes {s['minutes']}; a device call "
             "runs at most 10 min, --resume continues in the next)", ""]
    for i, p in enumerate(s["phases"], 1):
        lines.append(f"{i:2d}. {p['name']:<18} box {p['box_s']:>4} s  {p['result']}"
                     + (f" ({p['reason']})" if p.get("reason") else ""))
        lines.append(f"      {p['command']}")
    lines.append("")
    for g, state in b["groups"].items():
        lines.append(f"bundle {g}: " + (state if state == "complete" else "MISSING/BAD: " + "; ".join(state)))
    if "total_bytes" in b:
        lines.append(f"bundle total {b['total_bytes'] / 2**20:.1f} MiB in {b['parts_count']} parts; largest part "
                     f"{b['largest_part_bytes'] / 2**20:.1f} MiB + working tree {b['tree_bytes'] / 2**20:.1f} MiB "
                     + ("fits" if b["fits_one_call"] else "EXCEEDS") + " the 64 MiB per device call")
        lines += ["left out of the bundle:"] + [f"  - {x['what']}: {x['why']}" for x in b["left_out"]]
    lines.append("bundle complete" if b["complete"] else
                 "bundle INCOMPLETE: run scripts/gpu_bundle.sh here (or carry the missing parts, docs/gpu.md)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
