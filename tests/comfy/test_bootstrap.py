"""scripts/comfy_bootstrap.py: what the launcher does before ComfyUI's main.py runs."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_launcher_does_not_import_torch_before_comfyui_main():
    """ComfyUI's main.py configures the CUDA allocator before its first ``import torch``; a torch imported
    earlier by the launcher made every server start fail on a GPU ("Allocator backend parsed at runtime !=
    allocator backend parsed at load time", seen on the lent H100). The torchvision stub still applies."""
    code = ("import sys; sys.path.insert(0, 'scripts'); import comfy_bootstrap as b; "
            "b.prepare(['--base-directory', '/tmp'], parse_args=False); "
            "print('torch imported:', 'torch' in sys.modules); print('args:', sys.argv[1:]); "
            "import torch, torchvision; print('nms:', hasattr(torch.ops.torchvision, 'nms'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch imported: False" in out.stdout, out.stdout
    assert "nms: True" in out.stdout, out.stdout
    import torch

    assert ("'--cpu'" in out.stdout) == (not torch.cuda.is_available()), out.stdout


def test_extra_comfy_args_reach_every_process():
    env = dict(os.environ, PRECISION_LORA_COMFY_ARGS="--disable-dynamic-vram --front-end-root '/tmp/a b'")
    code = ("import sys; sys.path.insert(0, 'scripts'); import comfy_bootstrap as b; "
            "b.prepare([], parse_args=False); print(sys.argv[1:])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'--disable-dynamic-vram', '--front-end-root', '/tmp/a b'" in out.stdout, out.stdout
