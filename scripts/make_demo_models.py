"""Write the tiny demo models the example workflows use into a ComfyUI's models folder, if they are missing.

    cd /path/to/ComfyUI && python custom_nodes/<this pack's folder>/scripts/make_demo_models.py [--force]
    python scripts/make_demo_models.py BASE_DIR [--force]

With no BASE_DIR (run it with the Python your ComfyUI runs with) it finds the ComfyUI it is in: the one whose
``custom_nodes/`` holds this pack, else the current folder when that is a ComfyUI. The files go to the first
``diffusion_models`` folder of that ComfyUI that its ``extra_model_paths.yaml`` marks ``is_default``, else to
``models/diffusion_models``. Nothing is written into ``custom_nodes/``: the pack is imported from where it
is. BASE_DIR (the repository's scripts and tests) is a ComfyUI base directory of the host
``comfy_bootstrap`` picks.

Cosmos-Predict2 (Anima-type DiT, ~15 M parameters; loads with stock UNETLoader too), Flux.1 dev and
Flux.2 (tiny configs recorded in the file's metadata; load them with "Load Diffusion Model (Precision)").
The demo workflows need nothing else: their Demo Latent / Demo Conditioning nodes stand in for the VAE and
text encoders, and the LoRA they load is the one the training demo saves.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

import comfy_bootstrap

DEMO_FAMILIES = ("cosmos", "flux1_dev", "flux2")
USAGE = ("usage: python custom_nodes/<this pack's folder>/scripts/make_demo_models.py [--force]  "
         "(from your ComfyUI folder), or make_demo_models.py BASE_DIR [--force]")
log = logging.getLogger(__name__)


def is_comfyui(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "main.py")) and os.path.isfile(os.path.join(folder, "folder_paths.py"))


def find_comfyui(script: str, cwd: str) -> str:
    """The ComfyUI this script belongs to: the one whose custom_nodes/ holds the pack folder ``script`` is in
    (the path as run, links not resolved), else ``cwd`` when it is a ComfyUI folder."""
    pack = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    custom_nodes = os.path.dirname(pack)
    if os.path.basename(custom_nodes) == "custom_nodes" and is_comfyui(os.path.dirname(custom_nodes)):
        return os.path.dirname(custom_nodes)
    if is_comfyui(cwd):
        return os.path.abspath(cwd)
    raise SystemExit(f"[Precision LoRA] make_demo_models.py: {pack} is not in a ComfyUI's custom_nodes/ and "
                     f"{os.path.abspath(cwd)} is not a ComfyUI folder (no main.py). Run it from your ComfyUI "
                     f"folder, or pass the folder: {USAGE}")


def add_extra_model_paths(comfy_dir: str) -> None:
    """As ComfyUI's main.py does at start: the model folders of ``<ComfyUI>/extra_model_paths.yaml``."""
    config = os.path.join(comfy_dir, "extra_model_paths.yaml")
    if os.path.isfile(config):
        import utils.extra_config

        utils.extra_config.load_extra_path_config(config)


def demo_folder(base: str) -> str:
    """Where ComfyUI's own loaders look first: an ``is_default`` extra folder when one is set, else
    ``<base>/models/diffusion_models``."""
    import folder_paths

    models = os.path.abspath(os.path.join(base, "models"))
    first = os.path.abspath(folder_paths.get_folder_paths("diffusion_models")[0])
    return os.path.join(models, "diffusion_models") if os.path.commonpath([first, models]) == models else first


def write_models(tiny, folder: str, force: bool) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    written = []
    for family in DEMO_FAMILIES:
        path = os.path.join(folder, tiny.demo_model_filename(family))
        if force or not os.path.exists(path):
            tiny.write_tiny_model(family, path, seed=0)
            written.append(path)
            log.info("[Precision LoRA] wrote demo model %s", path)
        else:
            log.info("[Precision LoRA] demo model %s is there already (--force rewrites it)", path)
    return written


def main(argv: list[str]) -> list[str]:
    names = [a for a in argv if not a.startswith("--")]
    if len(names) > 1 or any(a not in ("--force",) for a in argv if a.startswith("--")):
        raise SystemExit(USAGE)
    if names:
        base = os.path.abspath(names[0])
    else:
        base = find_comfyui(__file__, os.getcwd())
        comfy_bootstrap.use_comfyui(base)  # that ComfyUI's own code, not a host of this repository
        log.info("[Precision LoRA] your ComfyUI: %s", base)
    pack = comfy_bootstrap.load_pack_in_process(base, link=False)
    if is_comfyui(base):
        add_extra_model_paths(base)
    tiny = importlib.import_module(f"{pack.__name__}.demo.tiny_models")
    return write_models(tiny, demo_folder(base), "--force" in argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)  # what this script wrote; ComfyUI's own start-up lines stay out
    main(sys.argv[1:])
