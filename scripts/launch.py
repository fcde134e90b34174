"""Start ComfyUI (the host comfy_bootstrap picks: the one whose venv runs this) with this pack loaded.

    python scripts/launch.py --base-directory DIR [--port N] [other ComfyUI args]

The base directory holds models, inputs, outputs, user data and custom_nodes/<pack> (a symlink here).
"""
from __future__ import annotations

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bootstrap  # noqa: E402


def main(argv: list[str]) -> None:
    if "--base-directory" not in argv:
        raise SystemExit("launch.py: --base-directory DIR is required")
    i = argv.index("--base-directory") + 1
    base = argv[i] = os.path.abspath(argv[i])
    comfy_bootstrap.link_pack(base)
    comfy_dir = comfy_bootstrap.prepare(argv, parse_args=False)
    os.chdir(comfy_dir)
    runpy.run_path(os.path.join(comfy_dir, "main.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
