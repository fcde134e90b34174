"""Train from a saved workflow without the server or the browser: ComfyUI as a library.

    python custom_nodes/<this pack>/scripts/train.py workflow_api.json [--steps N] [--resume FILE]
    torchrun --nproc_per_node 2 custom_nodes/<this pack>/scripts/train.py workflow_api.json   # data parallel

Run it with ComfyUI's Python from the ComfyUI folder. The workflow is a file saved with ComfyUI's
Workflow > Export (API). The graph's own nodes run (loaders, dataset nodes, attention patch, LoRA attach,
settings, train, save) with ComfyUI's own executor, so the files are the ones the UI writes, in the same
output folder. Only the training part runs: the train nodes and the Save LoRA / loss graph nodes fed by
them (see runner/headless.py). ``--steps`` sets the steps of every train node; ``--resume`` continues a
training state (``*.trainstate``, ``*.state.pt`` of earlier versions, or its checkpoint ``*.safetensors``) in
the first train node.

Which ComfyUI: ``--comfyui DIR``; else the ComfyUI whose ``custom_nodes`` holds this pack; else the one
scripts/comfy_bootstrap.py picks (this checkout's hosts, ``COMFYUI_DIR``). ComfyUI's own options go after
``--`` (e.g. ``-- --output-directory /data/out --extra-model-paths-config my.yaml``).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/train.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("workflow", help="API-format workflow JSON (ComfyUI: Workflow > Export (API))")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of every train node (default: the workflow's)")
    ap.add_argument("--resume", default=None, help="training state (*.trainstate, *.state.pt of earlier versions, "
                                                   "or its checkpoint *.safetensors) to continue")
    ap.add_argument("--base-directory", default=None,
                    help="ComfyUI base directory (models, output, custom_nodes); default: ComfyUI's own folder")
    ap.add_argument("--comfyui", default=None, help="the ComfyUI folder (the one with main.py)")
    ap.add_argument("--only-this-pack", action="store_true",
                    help="load no other custom nodes (faster start; the workflow may use only this pack's and "
                         "ComfyUI's nodes)")
    ap.epilog = "ComfyUI options go after --, e.g. -- --output-directory DIR"
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.comfy_args = argv[cut + 1:]
    return args


def _comfy_dir(explicit: str | None) -> str | None:
    """``--comfyui``, or the ComfyUI this pack is installed in (``<comfy>/custom_nodes/<pack>``)."""
    if explicit:
        return os.path.abspath(explicit)
    parent = os.path.dirname(ROOT)
    if os.path.basename(parent) == "custom_nodes" and os.path.isfile(os.path.join(os.path.dirname(parent), "main.py")):
        return os.path.dirname(parent)
    return None


def _pin_gpu() -> None:
    """Under torchrun each local rank sees only its own GPU, before anything imports torch (ComfyUI then
    uses "the" GPU, and NCCL needs one device per rank)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "LOCAL_RANK" not in os.environ:
        return
    local = int(os.environ["LOCAL_RANK"])
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and local >= len(visible):
        raise SystemExit(f"scripts/train.py: local rank {local} but CUDA_VISIBLE_DEVICES={','.join(visible)} "
                         "lists fewer GPUs; start at most that many processes per machine (--nproc_per_node)")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[local] if visible else str(local)


def _apply_paths(comfy_dir: str) -> None:
    """What ComfyUI's main.py does with paths before it starts: extra model paths, other folders."""
    import folder_paths
    import utils.extra_config
    from comfy.cli_args import args

    default = os.path.join(comfy_dir, "extra_model_paths.yaml")
    if os.path.isfile(default):
        utils.extra_config.load_extra_path_config(default)
    for group in args.extra_model_paths_config or []:
        for path in group:
            utils.extra_config.load_extra_path_config(path)
    if args.output_directory:
        folder_paths.set_output_directory(os.path.abspath(args.output_directory))
    if args.input_directory:
        folder_paths.set_input_directory(os.path.abspath(args.input_directory))
    if args.user_directory:
        folder_paths.set_user_directory(os.path.abspath(args.user_directory))
    for kind in ("checkpoints", "clip", "vae", "diffusion_models", "loras"):
        folder_paths.add_model_folder_path(kind, os.path.join(folder_paths.get_output_directory(), kind))


def _load_nodes(only_this_pack: bool, base: str):
    """ComfyUI's built-in extra nodes and the custom nodes (this pack linked in if it is not there yet);
    returns this pack's module."""
    import folder_paths
    import nodes

    import comfy_bootstrap

    homes = [os.path.realpath(p) for p in folder_paths.get_folder_paths("custom_nodes")]
    installed = any(os.path.realpath(os.path.join(h, d)) == os.path.realpath(ROOT)
                    for h in homes if os.path.isdir(h) for d in os.listdir(h))
    if only_this_pack:
        asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
        return comfy_bootstrap.load_pack_in_process(base) if not installed else _load_installed(homes)
    if not installed:
        comfy_bootstrap.link_pack(base)
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
    return _pack_module()


def _load_installed(homes: list[str]):
    import nodes

    for h in homes:
        for d in os.listdir(h):
            path = os.path.join(h, d)
            if os.path.realpath(path) == os.path.realpath(ROOT):
                if not asyncio.run(nodes.load_custom_node(path)):
                    raise SystemExit(f"scripts/train.py: ComfyUI failed to load this pack from {path}")
                return _pack_module()
    raise SystemExit("scripts/train.py: this pack is not in a custom_nodes folder")


def _pack_module():
    init = os.path.realpath(os.path.join(ROOT, "__init__.py"))
    for module in list(sys.modules.values()):
        if os.path.realpath(getattr(module, "__file__", None) or "/nonexistent") == init:
            return module
    raise SystemExit("scripts/train.py: ComfyUI did not load this pack (see the import errors above)")


def main(argv: list[str]) -> int:
    args = _args(argv)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if main_rank else logging.WARNING, format="%(message)s")
    _pin_gpu()
    comfy_dir = _comfy_dir(args.comfyui)
    if comfy_dir:
        os.environ["PRECISION_LORA_COMFYUI"] = comfy_dir
    sys.path.insert(0, HERE)
    import comfy_bootstrap

    if args.base_directory is None and comfy_dir is None:
        raise SystemExit("scripts/train.py: this pack is not inside a ComfyUI's custom_nodes; give "
                         "--base-directory DIR (models, output) and, for your own ComfyUI, --comfyui DIR")
    base = os.path.abspath(args.base_directory or comfy_bootstrap.COMFY_DIR)
    comfy_bootstrap.init_in_process(base, args.comfy_args)
    _apply_paths(comfy_bootstrap.COMFY_DIR)
    pack = _load_nodes(args.only_this_pack, base)
    import importlib

    headless = importlib.import_module(f"{pack.__name__}.runner.headless")
    return headless.main(args.workflow, args.steps, args.resume)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
