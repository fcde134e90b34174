#!/usr/bin/env bash
# Set-up (idempotent) + the whole test suite: unit, in-process ComfyUI, real server (e2e), browser, JS.
#   bash scripts/test.sh [pytest args]      e.g. bash scripts/test.sh -m "not slow" -x
# Exits non-zero on any failure, including "no tests collected".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
TC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$TC" ] && export LD_PRELOAD="$TC${LD_PRELOAD:+:$LD_PRELOAD}"
status=0
if [ -d tests/js ] && ls tests/js/*.test.mjs >/dev/null 2>&1; then
  echo "== node --test tests/js"
  node --test tests/js/ || status=1
fi
echo "== pytest"
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "[precision-lora] pytest collected no tests: failing"; fi
[ $rc -eq 0 ] || status=1
exit $status
