#!/usr/bin/env bash
# Set-up (idempotent) + the whole test suite on every ComfyUI host: unit, in-process ComfyUI, real server
# (e2e), browser, JS.
#   bash scripts/test.sh [--host 0.33.0|0.3.75|custom|all] [pytest args]     e.g. bash scripts/test.sh --host 0.3.75 -x
# Default: all shipped hosts, one pytest run each (PRECISION_LORA_HOST=... works too). Exits non-zero on any
# failure, including "no tests collected" on a host. Each host's run lists its 25 slowest tests; the last line sums
# the hosts' counts.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/scripts/hosts.sh"
SPEC="${PRECISION_LORA_HOST:-all}"
if [ "${1:-}" = "--host" ]; then SPEC="$2"; shift 2; fi
read -r -a HOSTS <<< "$(host_list "$SPEC")"
bash scripts/setup.sh "${HOSTS[@]}"
# the suite writes ~9 GiB of real-size stand-in models into .cache/ (once per checkout) and per-process ComfyUI
# bases under the temp folder (removed as each process ends): say so up front when the disk is short
for dir in "$ROOT" "${TMPDIR:-/tmp}"; do
  free_gib=$(df -Pk "$dir" | awk 'NR==2 {printf "%d", $4 / 1048576}')
  if [ "${free_gib:-0}" -lt 12 ]; then
    echo "[precision-lora] warning: only ${free_gib} GiB free on the disk of $dir; the tests need ~12 GiB (stand-in models in .cache/, temporary ComfyUI bases): expect write errors"
  fi
done
TC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$TC" ] && export LD_PRELOAD="$TC${LD_PRELOAD:+:$LD_PRELOAD}"
status=0
if [ -d tests/js ] && ls tests/js/*.test.mjs >/dev/null 2>&1; then
  echo "== node --test tests/js"
  node --test tests/js/ || status=1
fi
REPORTS="$(mktemp -d)"
trap 'rm -rf "$REPORTS"' EXIT
for host in "${HOSTS[@]}"; do
  host_vars "$host"
  if [ "$host" = custom ]; then "$HOST_PY" -m pip install -q -r scripts/test-requirements.txt; fi
  echo "== pytest on ComfyUI $host ($HOST_COMFY)"
  set +e
  PRECISION_LORA_COMFYUI="$HOST_COMFY" "$HOST_PY" -m pytest --junitxml="$REPORTS/$host.xml" --durations=25 "$@"
  rc=$?
  set -e
  if [ $rc -eq 5 ]; then echo "[precision-lora] pytest collected no tests on ComfyUI $host: failing"; fi
  [ $rc -eq 0 ] || status=1
done
python3 scripts/test_summary.py "$REPORTS"/*.xml || status=1
exit $status
