"""Sum the pytest junit reports of scripts/test.sh's runs (one per host, and the browser run on the newest frontend,
"0.33.0+frontend-<version>") into one closing line.

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
    grand = {"passed": 0, "failed": 0, "skipped": 0}
    ok = bool(paths)
    for path in paths:
        host = os.path.basename(path).removesuffix(".xml")
        try:
            c = counts(path)
        except (OSError, ET.ParseError) as exc:
            print(f"ComfyUI {host}: no test report ({exc})")
            ok = False
            continue
        print(f"ComfyUI {host}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
        for key in grand:
            grand[key] += c[key]
    print(f"total: {grand['passed']} passed, {grand['failed']} failed, {grand['skipped']} skipped")
    return 0 if ok and grand["failed"] == 0 and grand["passed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
