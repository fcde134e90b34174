#!/usr/bin/env bash
# Set-up (idempotent) + the whole test suite on every ComfyUI host: unit, in-process ComfyUI, real server
# (e2e), browser, JS.
#   bash scripts/test.sh [--host 0.33.0|0.3.75|custom|all] [pytest args]     e.g. bash scripts/test.sh --host 0.3.75 -x
# Default: all shipped hosts, one pytest run each (in a whole-suite run: its in-process tiers on two workers, then its
# server tiers; see run_one) (PRECISION_LORA_HOST=... works too), then, when 0.33.0 is among them
# and no pytest arguments but options were given, a third run: the browser tests of the pack's page extensions on
# ComfyUI 0.33.0 with the newest PyPI frontend (see NEWEST_FRONTEND_TESTS). Exits non-zero on any failure, including
# "no tests collected" on a host. Each run lists its 25 slowest tests; the last line sums the runs' counts.
# On a machine with 2+ cores and 40+ GiB available the runs go side by side in two lanes (PRECISION_LORA_JOBS=N sets it).
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

# The runs: one pytest run per host, and the browser tests of the pack's page extensions on ComfyUI 0.33.0 with the
# newest PyPI frontend (scripts/setup.sh unpacks it into .hosts/frontends/<version>/static; ComfyUI 0.33.0 pins 1.49.6,
# users who update ComfyUI run the newest): the loss chart and its controls, the scale display, LoRA info, list
# refresh, dataset report and previews, templates and node help. Not the real-workflow tests: they test the pack's
# server side, which the host runs cover. That run only when no tests were chosen by hand.
NEWEST_FRONTEND_TESTS=(
  tests/browser/test_page.py tests/browser/test_node_help_ui.py tests/browser/test_workflows_ui.py
  tests/browser/test_lora_refresh_ui.py tests/browser/test_chart_binding_ui.py tests/browser/test_training_ui.py
  tests/browser/test_preview_ui.py "tests/browser/test_first_lora_ui.py::test_step_3_the_workflow_from_browse_templates"
  --deselect "tests/browser/test_training_ui.py::test_three_runs_of_the_unchanged_workflow_train_once_and_a_change_retrains"
)
only_options=1
for arg in "$@"; do case "$arg" in -*) ;; *) only_options=0 ;; esac; done
frontend="$(readlink "$HOSTS_ROOT/frontends/newest" 2>/dev/null || true)"
FRONTEND_LABEL="0.33.0+frontend-${frontend:-missing}"
runs=()
for host in "${HOSTS[@]}"; do runs+=("$host"); done
if [[ " ${HOSTS[*]} " == *" 0.33.0 "* ]]; then
  if [ $only_options = 0 ]; then
    echo "[precision-lora] tests chosen by hand: no run on the newest frontend (PRECISION_LORA_FRONTEND=.hosts/frontends/newest/static runs any)"
  else
    runs+=(frontend)
  fi
fi

# Side by side: the runs share out over lanes (PRECISION_LORA_JOBS, default 2 when the machine has 2+ cores and
# 40+ GiB available, else 1), each lane one run after another. One run peaks near 12 GiB (its pytest process and its
# session ComfyUI server): on CI's 24 GiB machine two lanes filled the memory and thrashed (docs/DEVELOPING.md), so
# there the runs go one after the other. The runs share nothing they write but .cache/ (written atomically, per
# process) and loopback ports (each lane takes its own: tests/ports.py). With more than one lane each run's output
# goes to a log, printed whole when its lane ends.
# Workers for the in-process tiers of a whole-suite run (PRECISION_LORA_WORKERS=N; default: the CPU count, at most 2;
# 1 runs everything in one process as before). Not for tests chosen by hand (pass -n yourself).
workers="${PRECISION_LORA_WORKERS:-$(n=$(nproc); echo $((n < 2 ? n : 2)))}"
case "$workers" in ''|*[!0-9]*|0) echo "[precision-lora] PRECISION_LORA_WORKERS=$workers: use a count of workers (1, 2, ...)"; exit 2 ;; esac
label_of() { if [ "$1" = frontend ]; then echo "$FRONTEND_LABEL"; else echo "$1"; fi; }
run_one() {  # RUN [pytest args]: one pytest run; its junit report is REPORTS/<label>.xml, its exit status REPORTS/<label>.rc
  local run="$1" label rc
  shift
  label="$(label_of "$run")"
  if [ "$run" = frontend ]; then
    host_vars 0.33.0
    echo "== pytest on ComfyUI 0.33.0 with the newest frontend, comfyui-frontend-package ${frontend:-(missing)}: the browser tests of the pack's extensions"
    set -- "${NEWEST_FRONTEND_TESTS[@]}" "$@"
    export PRECISION_LORA_FRONTEND="$HOSTS_ROOT/frontends/newest/static"
  else
    host_vars "$run"
    if [ "$run" = custom ]; then "$HOST_PY" -m pip install -q -r scripts/test-requirements.txt; fi
    echo "== pytest on ComfyUI $run ($HOST_COMFY)"
  fi
  set +e
  if [ "$run" != frontend ] && [ $only_options = 1 ] && [ "$workers" -ge 2 ]; then
    # the whole suite: the in-process tiers (unit, comfy) on $workers pytest workers, a test file each at a time
    # (its tests in order on one worker), one intra-op thread each; then the server tiers (e2e, browser) in one
    # process, as before. Two reports: REPORTS/<label>@inprocess.xml and REPORTS/<label>@servers.xml.
    echo "== the in-process tests (tests/unit, tests/comfy) on $workers workers"
    OMP_NUM_THREADS=1 PRECISION_LORA_COMFYUI="$HOST_COMFY" "$HOST_PY" -m pytest -n "$workers" --dist loadfile \
      --junitxml="$REPORTS/$label@inprocess.xml" --durations=25 "$@" tests/unit tests/comfy
    rc=$?
    echo "== the server tests (tests/e2e, tests/browser)"
    PRECISION_LORA_COMFYUI="$HOST_COMFY" "$HOST_PY" -m pytest --junitxml="$REPORTS/$label@servers.xml" \
      --durations=25 "$@" tests/e2e tests/browser
    rc2=$?
    [ $rc -ne 0 ] || rc=$rc2
  else
    PRECISION_LORA_COMFYUI="$HOST_COMFY" "$HOST_PY" -m pytest --junitxml="$REPORTS/$label.xml" --durations=25 "$@"
    rc=$?
  fi
  set -e
  unset PRECISION_LORA_FRONTEND
  if [ $rc -eq 5 ]; then echo "[precision-lora] pytest collected no tests on ComfyUI $label: failing"; fi
  echo $rc > "$REPORTS/$label.rc"
}
jobs="${PRECISION_LORA_JOBS:-auto}"
if [ "$jobs" = auto ]; then
  avail_gib=$(awk '/^MemAvailable:/ {printf "%d", $2 / 1048576}' /proc/meminfo 2>/dev/null || echo 0)
  jobs=1
  if [ "$(nproc)" -ge 2 ] && [ "${avail_gib:-0}" -ge 40 ]; then jobs=2; fi
fi
case "$jobs" in ''|*[!0-9]*|0) echo "[precision-lora] PRECISION_LORA_JOBS=$jobs: use a count of runs side by side (1, 2, ...) or auto"; exit 2 ;; esac
[ "$jobs" -le ${#runs[@]} ] || jobs=${#runs[@]}
# lane i takes runs i, i + jobs, ...; with two hosts and the frontend run: 0.33.0 + frontend, 0.3.75
lane_runs() { local i=$1 k; for ((k = i; k < ${#runs[@]}; k += jobs)); do printf '%s ' "${runs[$k]}"; done; }
if [ "$jobs" -le 1 ]; then
  for run in "${runs[@]}"; do run_one "$run" "$@"; done
else
  pids=()
  for ((i = 0; i < jobs; i++)); do
    echo "== lane $((i + 1))/$jobs: $(lane_runs $i)(log: $REPORTS/lane$((i + 1)).log)"
    ( export PRECISION_LORA_PORT_LANE="$i/$jobs"
      for run in $(lane_runs $i); do run_one "$run" "$@"; done ) > "$REPORTS/lane$((i + 1)).log" 2>&1 &
    pids+=($!)
  done
  trap 'kill 0' INT TERM
  for ((i = 0; i < jobs; i++)); do
    wait "${pids[$i]}" || true
    cat "$REPORTS/lane$((i + 1)).log"
  done
fi
report_files=()
for run in "${runs[@]}"; do
  label="$(label_of "$run")"
  if [ -e "$REPORTS/$label@inprocess.xml" ] || [ -e "$REPORTS/$label@servers.xml" ]; then
    report_files+=("$REPORTS/$label@inprocess.xml" "$REPORTS/$label@servers.xml")
  else
    report_files+=("$REPORTS/$label.xml")
  fi
  [ "$(cat "$REPORTS/$label.rc" 2>/dev/null || echo 1)" = 0 ] || status=1
done
python3 scripts/test_summary.py "${report_files[@]}" || status=1
exit $status
