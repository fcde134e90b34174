#!/usr/bin/env bash
# Start ComfyUI 0.3.75 with this pack and its example workflows on 127.0.0.1.
#   bash scripts/run.sh [--port N] [extra ComfyUI args]      (PORT env var also works; default 8188)
# Data (models, inputs, outputs, user settings) lives in .comfy_base/ (git-ignored), or $PRECISION_LORA_BASE.
# If that base has no diffusion model, tiny demo models are generated first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
BASE="${PRECISION_LORA_BASE:-$ROOT/.comfy_base}"
PORT="${PORT:-8188}"
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
mkdir -p "$BASE/models/diffusion_models" "$BASE/models/loras"
if [ -z "$(find "$BASE/models/diffusion_models" -maxdepth 2 -type f \( -name '*.safetensors' -o -name '*.ckpt' -o -name '*.pt' -o -name '*.gguf' -o -name '*.sft' \) | head -1)" ]; then
  echo "[precision-lora] no diffusion model in $BASE/models/diffusion_models: generating tiny demo models"
  "$ROOT/.venv/bin/python" "$ROOT/scripts/make_demo_models.py" "$BASE"
fi
TC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$TC" ] && export LD_PRELOAD="$TC${LD_PRELOAD:+:$LD_PRELOAD}"
echo "[precision-lora] ComfyUI at http://127.0.0.1:$PORT  (base directory $BASE; example workflows under Workflow > Browse Templates > comfyui-precision-lora)"
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/launch.py" --base-directory "$BASE" --listen 127.0.0.1 --port "$PORT" --disable-api-nodes ${args[@]+"${args[@]}"}
