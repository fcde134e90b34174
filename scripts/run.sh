#!/usr/bin/env bash
# Start ComfyUI with this pack and its example workflows on 127.0.0.1.
#   bash scripts/run.sh [--host 0.33.0|0.3.75|custom] [--port N] [extra ComfyUI args]
# Host (scripts/hosts.sh): --host or PRECISION_LORA_HOST; default the newest shipped ComfyUI (0.33.0), or
# your own ComfyUI when COMFYUI_DIR=/path/to/ComfyUI is set (then at most a link custom_nodes/comfyui-precision-lora
# is written there, and none when the pack is in its custom_nodes/ already, under any folder name).
# PORT env var also works (default 8188). For shipped hosts, data (models, inputs, outputs, user settings)
# lives in .comfy_base/ (git-ignored) or $PRECISION_LORA_BASE; if it has no diffusion model, tiny demo
# models are generated first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/hosts.sh"
HOST="${PRECISION_LORA_HOST:-$(default_host)}"
PORT="${PORT:-8188}"
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT="$2"; shift 2 ;;
    --host) HOST="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
host_vars "$HOST"
bash "$ROOT/scripts/setup.sh" "$HOST"
TC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$TC" ] && export LD_PRELOAD="$TC${LD_PRELOAD:+:$LD_PRELOAD}"
if [ "$HOST" = custom ]; then
  # The pack's folder in your custom_nodes/: where it is already, under any name (a git clone), else a new link
  # custom_nodes/comfyui-precision-lora to this checkout. Never a second one: ComfyUI would import both.
  link_py='import sys; sys.path.insert(0, sys.argv[1]); import comfy_bootstrap as b; print(b.link_pack(sys.argv[2]))'
  pack_dir="$("$HOST_PY" -c "$link_py" "$ROOT/scripts" "$HOST_COMFY")"
  echo "[precision-lora] your ComfyUI ($HOST_COMFY) at http://127.0.0.1:$PORT with this pack from $pack_dir"
  cd "$HOST_COMFY"
  exec "$HOST_PY" main.py --listen 127.0.0.1 --port "$PORT" ${args[@]+"${args[@]}"}
fi
BASE="${PRECISION_LORA_BASE:-$ROOT/.comfy_base}"
mkdir -p "$BASE/models/diffusion_models" "$BASE/models/loras"
if [ -z "$(find "$BASE/models/diffusion_models" -maxdepth 2 -type f \( -name '*.safetensors' -o -name '*.ckpt' -o -name '*.pt' -o -name '*.gguf' -o -name '*.sft' \) | head -1)" ]; then
  echo "[precision-lora] no diffusion model in $BASE/models/diffusion_models: generating tiny demo models"
  "$HOST_PY" "$ROOT/scripts/make_demo_models.py" "$BASE"
fi
echo "[precision-lora] ComfyUI $HOST at http://127.0.0.1:$PORT  (base directory $BASE; example workflows under Workflow > Browse Templates > comfyui-precision-lora)"
exec "$HOST_PY" "$ROOT/scripts/launch.py" --base-directory "$BASE" --listen 127.0.0.1 --port "$PORT" --disable-api-nodes ${args[@]+"${args[@]}"}
