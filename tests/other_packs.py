"""The two other packs of ../shared/custom_nodes/ (ComfyUI-GGUF, ComfyUI-KJNodes), installed beside this pack in a
test ComfyUI base, as users run them.

They are test data, like ComfyUI's own tarball: each tarball is checked against its recorded sha256, unpacked once
per checkout into ``.cache/other_packs/<folder>`` (never edited, never committed) and linked into a base's
``custom_nodes/``. Their Python requirements are in every shipped host's venv (scripts/hosts/other_packs.txt,
installed by scripts/setup.sh).

    install(base_dir)              links both packs into <base>/custom_nodes (what a server started there loads)
    load_in_process(folder)        imports one pack into the running in-process ComfyUI (tests/comfy), as ComfyUI's
                                   own loader does, and returns its module
"""
from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from unpack_comfyui import sha256_of  # noqa: E402  (the one sha256 of the set-up's tarballs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.environ.get("PRECISION_LORA_SHARED", os.path.join(ROOT, "..", "shared")), "custom_nodes")
CACHE = os.path.join(ROOT, ".cache", "other_packs")
GGUF, KJNODES = "ComfyUI-GGUF", "ComfyUI-KJNodes"
# folder -> (tarball, sha256), as ../shared/custom_nodes/README.md records them
PACKS = {
    GGUF: ("ComfyUI-GGUF-795e451.tar.gz", "9fdfa050c2ebb8e8cf9ef50eb9844ecd9bdf410b247a4518bcb1924b7e8ca056"),
    KJNODES: ("ComfyUI-KJNodes-3f20054.tar.gz", "717abbb13664e4b25894992d1e9174f51f1d8920320d935c04a9bf0710b90597"),
}


def unpacked(folder: str) -> str:
    """The pack's unpacked tree in the checkout's cache (unpacked on first use, under a lock: tests run in several
    processes)."""
    tarball, sha = PACKS[folder]
    target = os.path.join(CACHE, folder)
    if os.path.isfile(os.path.join(target, "__init__.py")):
        return target
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(target, "__init__.py")):
            return target
        path = os.path.join(SHARED, tarball)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the tests install {folder} from ../shared/custom_nodes/ "
                                    "beside the repository (PRECISION_LORA_SHARED points elsewhere)")
        got = sha256_of(path)
        if got != sha:
            raise ValueError(f"{path}: sha256 {got}, expected {sha} (../shared/custom_nodes/README.md)")
        tmp = tempfile.mkdtemp(dir=CACHE)
        with tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
        shutil.move(os.path.join(tmp, folder), target)
        shutil.rmtree(tmp)
    return target


def install(base_dir: str, folders: tuple[str, ...] = (GGUF, KJNODES)) -> list[str]:
    """Links the packs into ``<base_dir>/custom_nodes``; returns the links."""
    custom = os.path.join(base_dir, "custom_nodes")
    os.makedirs(custom, exist_ok=True)
    links = []
    for folder in folders:
        link = os.path.join(custom, folder)
        if not os.path.lexists(link):
            os.symlink(unpacked(folder), link)
        links.append(link)
    return links


def load_in_process(folder: str):
    """Imports the pack into the in-process ComfyUI (tests/comfy) the way ComfyUI's ``load_custom_node`` names it
    (the module is registered under its folder path) and returns the module; its nodes are not registered with
    the server, the tests call them directly."""
    import importlib.util

    path = unpacked(folder)
    name = path.replace(".", "_x_")  # ComfyUI's own naming (nodes.load_custom_node); KJNodes finds GGUF by it
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
