"""Write the tiny demo models into <base>/models/diffusion_models if they are missing.

    python scripts/make_demo_models.py BASE_DIR [--force]

Cosmos-Predict2 (Anima-type DiT, ~15 M parameters; loads with stock UNETLoader too), Flux.1 dev and
Flux.2 (tiny configs recorded in the file's metadata; load them with "Load Diffusion Model (Precision)").
"""
from __future__ import annotations

import os
import sys

import comfy_bootstrap

DEMO_FAMILIES = ("cosmos", "flux1_dev", "flux2")


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: make_demo_models.py BASE_DIR [--force]")
    base = os.path.abspath(argv[0])
    force = "--force" in argv
    folder = os.path.join(base, "models", "diffusion_models")
    os.makedirs(folder, exist_ok=True)
    import importlib

    pack = comfy_bootstrap.load_pack_in_process(base)
    tiny = importlib.import_module(f"{pack.__name__}.demo.tiny_models")
    for family in DEMO_FAMILIES:
        path = os.path.join(folder, tiny.demo_model_filename(family))
        if force or not os.path.exists(path):
            tiny.write_tiny_model(family, path, seed=0)
            sys.stderr.write(f"[Precision LoRA] wrote demo model {path}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
