"""What the GPU machine is, checked against scripts/gpu/assumed.env (the bundle's wheels were built for it).

Prints one line ``ARRIVAL_JSON {...}`` (read by check.py into the summary's versions) and the checks; exits 1
when an assumption fails, with what to do, so no phase runs on a mismatched interpreter or torch.
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys

ENV = pathlib.Path(__file__).with_name("assumed.env")
# Environment switches that force TF32 for fp32 cuBLAS GEMMs whatever torch's flags say (NGC-style images set
# the first); gpu_check's test phases run with both at 0 so fp32 comparisons mean IEEE fp32, as on the CPU.
TF32_ENV = ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")


def assumed() -> dict[str, str]:
    lines = (ln.split("=", 1) for ln in ENV.read_text().splitlines() if ln[:1].isupper() and "=" in ln)
    return {k: v.strip() for k, v in lines}


def facts() -> dict:
    out: dict = {"python": platform.python_version(), "machine": platform.machine(), "executable": sys.executable}
    try:
        import torch

        out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        # what decides whether fp32 GEMMs round their operands to TF32 (docs/gpu.md)
        out["tf32"] = {"matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                       "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                       "float32_matmul_precision": torch.get_float32_matmul_precision(),
                       **{k: os.environ.get(k) for k in TF32_ENV}}
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out.update(device=props.name, capability=f"{props.major}.{props.minor}",
                       memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
    except Exception as exc:  # no torch at all: the checks below say so
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        out["driver"] = smi.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        out["driver"] = None
    return out


def problems(f: dict, want: dict[str, str]) -> list[str]:
    fix = ("rebuild the bundle for this machine (scripts/gpu/assumed.env, then scripts/gpu_bundle.sh; "
           "--with-torch carries a CUDA torch)")
    out = []
    if not f["python"].startswith(want["GPU_PYTHON"] + "."):
        out.append(f"Python {f['python']}, the bundle's wheels are for {want['GPU_PYTHON']}: {fix}")
    if "torch" not in f:
        out.append(f"torch does not import ({f.get('torch_error')}): {fix}")
        return out
    if f["torch"].split("+")[0] != want["GPU_TORCH"]:
        out.append(f"torch {f['torch']}, assumed {want['GPU_TORCH']}: {fix}")
    if f["torch_cuda"] != want["GPU_CUDA"]:
        out.append(f"torch's CUDA {f['torch_cuda']}, assumed {want['GPU_CUDA']}: {fix}")
    if not f["cuda_available"]:
        out.append("torch.cuda.is_available() is False: no usable GPU (driver, CUDA_VISIBLE_DEVICES?)")
    if f.get("triton") != want["GPU_TRITON"]:
        out.append(f"triton {f.get('triton')}, assumed {want['GPU_TRITON']} (the fused kernel's tests need it)")
    return out


def main() -> int:
    f, want = facts(), assumed()
    print("ARRIVAL_JSON " + json.dumps(f, sort_keys=True), flush=True)
    bad = problems(f, want)
    for line in bad:
        print("MISMATCH: " + line)
    if not bad:
        print(f"arrival ok: {f.get('device')} (sm {f.get('capability')}, {f.get('memory_gib')} GiB), driver "
              f"{f.get('driver')}, Python {f['python']}, torch {f['torch']}, triton {f.get('triton')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
