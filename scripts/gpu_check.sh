#!/usr/bin/env bash
# GPU truth in one command (docs/gpu.md). On a GPU machine without network, from the repository
# root, after the bundle's parts arrived (scripts/gpu/receive.sh):
#   bash scripts/gpu_check.sh [--minutes N] [--out DIR] [--bundle DIR] [--work DIR] [--only PHASE] [--resume]
# installs the bundle into a throwaway environment (--work, default /tmp/precision_lora_gpu) and runs every
# phase of scripts/gpu/phases.py in priority order, each under `timeout` (its time box, cut to what is left of
# --minutes, default 9), writing DIR/summary.md, DIR/summary.json and DIR/logs.tar.gz after every phase.
#   bash scripts/gpu_check.sh --dry-run      (any machine) lists every phase with its command and time box and
#                                            checks the bundle is complete; exit 1 names what is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
exec "${GPU_CHECK_PYTHON:-python3}" scripts/gpu/check.py "$@"
