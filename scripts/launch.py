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


def database_args(comfy_dir: str, base: str, argv: list[str]) -> list[str]:
    """``--database-url`` in the base directory, for a ComfyUI that has a database (0.33 does) and when none is
    given. Its default, ``<ComfyUI>/user/comfyui.db``, lies in the unpacked host tree, which has no ``user``
    folder and is never written to: ComfyUI then logs "[ERROR] Failed to initialize database"."""
    given = [*argv, *os.environ.get("PRECISION_LORA_COMFY_ARGS", "").split()]
    if any(a == "--database-url" or a.startswith("--database-url=") for a in given):
        return []
    with open(os.path.join(comfy_dir, "comfy", "cli_args.py"), encoding="utf-8") as f:
        if "--database-url" not in f.read():
            return []
    user = os.path.join(base, "user")
    os.makedirs(user, exist_ok=True)
    return ["--database-url", "sqlite:///" + os.path.join(user, "comfyui.db")]


def main(argv: list[str]) -> None:
    if "--base-directory" not in argv:
        raise SystemExit("launch.py: --base-directory DIR is required")
    i = argv.index("--base-directory") + 1
    base = argv[i] = os.path.abspath(argv[i])
    comfy_bootstrap.link_pack(base)
    argv.extend(database_args(comfy_bootstrap.COMFY_DIR, base, argv))
    comfy_dir = comfy_bootstrap.prepare(argv, parse_args=False)
    os.chdir(comfy_dir)
    runpy.run_path(os.path.join(comfy_dir, "main.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
