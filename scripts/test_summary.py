"""Sum the pytest junit reports of scripts/test.sh's runs (one per host, and the browser run on the newest frontend,
"0.33.0+frontend-<version>"; a whole-suite host run has two parts, "<host>@inprocess" and "<host>@servers") into one
closing line.

    python scripts/test_summary.py REPORT.xml ...     ->  "<host>: N passed, ..." per host, then
                                                          "total: N passed, N failed, N skipped"
Exits 1 when a report is missing or unreadable (a host whose pytest crashed before writing it).
"""
from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET


def counts(path: str) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["failed"] = total["failures"] + total["errors"]
    total["passed"] = total["tests"] - total["failed"] - total["skipped"]
    return total


def main(paths: list[str]) -> int:
    """One line per run label; a run's parts (``<label>@<part>.xml``: the in-process and the server tests of a
    whole-suite run) are summed into its line."""
    grand = {"passed": 0, "failed": 0, "skipped": 0}
    ok = bool(paths)
    labels: dict[str, list[str]] = {}
    for path in paths:
        labels.setdefault(os.path.basename(path).removesuffix(".xml").split("@")[0], []).append(path)
    for host, parts in labels.items():
        line = {"passed": 0, "failed": 0, "skipped": 0}
        missing = []
        for path in parts:
            try:
                c = counts(path)
            except (OSError, ET.ParseError) as exc:
                missing.append(f"{os.path.basename(path)}: {exc}")
                continue
            for key in line:
                line[key] += c[key]
        if missing:
            print(f"ComfyUI {host}: no test report ({'; '.join(missing)})")
            ok = False
        print(f"ComfyUI {host}: {line['passed']} passed, {line['failed']} failed, {line['skipped']} skipped")
        for key in grand:
            grand[key] += line[key]
    print(f"total: {grand['passed']} passed, {grand['failed']} failed, {grand['skipped']} skipped")
    return 0 if ok and grand["failed"] == 0 and grand["passed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
