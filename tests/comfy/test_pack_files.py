"""Files the pack writes: modes follow the umask; leftovers of interrupted saves are swept at start.

Issue 13: D9 (every file the pack wrote was mode 0600 with umask 022, ComfyUI's own are 0644), D11
(leftover .partial files were never cleaned up).
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import torch

from models import tiny_flux1


def test_a_saved_lora_follows_the_umask(pack_module):
    glue = pack_module("nodes.lora.glue")
    save = pack_module("nodes.lora.node").PrecisionSaveLoRA
    old = os.umask(0o022)
    try:
        with torch.inference_mode():
            model = glue.attach_lora(tiny_flux1(), pack_module("lora.config").LoRAConfig(rank=2, alpha=2))
        path = save.execute(model, "modes/lora", "loras", "fp32", "auto", True, False).result[0]
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_start_up_sweep_removes_partials_of_dead_writers_in_the_pack_folders(pack_module):
    import folder_paths

    housekeeping = pack_module("nodes.host.housekeeping")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    deep = os.path.join(folder_paths.get_folder_paths("loras")[0], "sub", "deeper")
    ckpt = os.path.join(folder_paths.get_output_directory(), "precision_lora", "checkpoints")
    run = pack_module("nodes.train.checkpoint_files").run_folder("sweep_run")  # where checkpoints land now
    stale, live = [], []
    for folder in (deep, ckpt, run):
        os.makedirs(folder, exist_ok=True)
        stale.append(os.path.join(folder, f".precision_lora_{proc.pid}_00ff.partial"))
        live.append(os.path.join(folder, f".precision_lora_{os.getpid()}_00ff.partial"))
    for p in stale + live:
        open(p, "w").close()
    assert set(housekeeping.pack_folders()) >= {os.path.abspath(folder_paths.get_folder_paths("loras")[0])}
    removed = housekeeping.sweep(housekeeping.pack_folders())
    assert sorted(removed) == sorted(stale)
    assert all(os.path.exists(p) for p in live)
    for p in live:
        os.remove(p)


def test_the_pack_nodes_package_and_comfyuis_nodes_py_do_not_clash(pack_module):
    # Issue 24: the design's nodes/ shares its name with ComfyUI's nodes.py. With the repository root on
    # sys.path (python -m pytest from it), ``import nodes`` is still ComfyUI's, and the pack's is <pack>.nodes.
    import comfy_bootstrap
    import nodes as short

    assert os.path.dirname(short.__file__) == os.path.abspath(comfy_bootstrap.COMFY_DIR)
    assert hasattr(short, "NODE_CLASS_MAPPINGS")
    assert comfy_bootstrap.comfy_nodes_module() is short
    ours = pack_module("nodes")
    assert ours is not short and ours.__name__.endswith(".nodes")
    assert os.path.realpath(os.path.dirname(ours.__file__)) == os.path.join(os.path.realpath(comfy_bootstrap.ROOT), "nodes")
