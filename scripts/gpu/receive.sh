#!/usr/bin/env bash
# On the GPU machine, in each transfer call: keep the bundle parts this call carried (.gpu_bundle/manifest.json
# and .gpu_bundle/parts/*) in DEST, outside the repository copy, and say which parts are still missing.
#   bash scripts/gpu/receive.sh [DEST]        DEST default /tmp/precision_lora_bundle (lives while the machine is warm)
# Exit 0 once every group is complete and intact (sha256 of each part against the manifest), 3 while parts are
# missing; 1 when a part arrived corrupt.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${1:-/tmp/precision_lora_bundle}"
mkdir -p "$DEST/parts"
[ -f "$ROOT/.gpu_bundle/manifest.json" ] && cp "$ROOT/.gpu_bundle/manifest.json" "$DEST/manifest.json"
for part in "$ROOT"/.gpu_bundle/parts/*.tar.[0-9][0-9][0-9]; do
  [ -f "$part" ] || continue
  cp "$part" "$DEST/parts/" && echo "[receive] kept $(basename "$part") ($(stat -c %s "$part") bytes)"
done
report="$(python3 "$ROOT/scripts/gpu/bundle.py" verify --bundle "$DEST")"; rc=$?
echo "$report"
if [ $rc -eq 0 ]; then echo "[receive] bundle complete in $DEST"; exit 0; fi
if echo "$report" | grep -q "corrupt\|truncated"; then exit 1; fi
exit 3
