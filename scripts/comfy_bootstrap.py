"""Prepare a Python process to import a ComfyUI host (scripts/hosts.sh) that scripts/setup.sh set up.

Used by scripts/launch.py (the server) and by the test harness (in-process ComfyUI). Which ComfyUI: the
folder in ``PRECISION_LORA_COMFYUI`` if set; else the host whose venv runs this Python
(``.hosts/<name>/venv`` -> ``.hosts/<name>/comfyui``, also through the ``.venv`` link); else ``COMFYUI_DIR``
(your own install); else the newest shipped host. Nothing here edits site-packages: the torchvision
work-around defines the two operator schemas that torchvision's pure-Python part registers fake kernels
for, only when its CUDA-linked C++ library cannot be loaded.
"""
from __future__ import annotations

import atexit
import glob
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, ".hosts")
NEWEST_HOST = "0.33.0"
log = logging.getLogger(__name__)


def host_comfy_dir() -> str:
    """The ComfyUI tree this process uses (see the module docstring for the order)."""
    if os.environ.get("PRECISION_LORA_COMFYUI"):
        return os.path.abspath(os.environ["PRECISION_LORA_COMFYUI"])
    prefix = os.path.realpath(sys.prefix)
    if os.path.dirname(os.path.dirname(prefix)) == os.path.realpath(HOSTS) and os.path.basename(prefix) == "venv":
        return os.path.join(os.path.dirname(prefix), "comfyui")
    if os.environ.get("COMFYUI_DIR"):
        return os.path.abspath(os.environ["COMFYUI_DIR"])
    return os.path.join(HOSTS, NEWEST_HOST, "comfyui")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def sweep_stale_bases(prefix: str, parent: str | None = None) -> list[str]:
    """Remove ``<prefix><pid>_*`` folders whose process is gone (killed before its exit hook ran).

    Returns the removed paths. Folders without a pid after the prefix are left alone."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):].split("_", 1)[0] if name.startswith(prefix) else ""
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def temporary_base(prefix: str) -> str:
    """A fresh ComfyUI base folder for this process, ``<tmp>/<prefix><pid>_<random>``, removed when the process
    exits; the folders of this prefix left by processes that were killed are swept first. (An in-process
    ComfyUI writes models, LoRAs and outputs there, up to hundreds of MB: leaked ones fill a disk.)"""
    sweep_stale_bases(prefix)
    base = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}_")
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    return base


COMFY_DIR = host_comfy_dir()
PACK_NAME = "comfyui-precision-lora"

_torchvision_lib = None  # keeps the stub Library alive for the life of the process


def stub_torchvision_ops() -> bool:
    """Define torchvision::nms / qnms schemas if torchvision's C++ ops cannot load. Returns True if stubbed."""
    global _torchvision_lib
    spec = importlib.util.find_spec("torchvision")
    if spec is None or _torchvision_lib is not None:
        return False
    import torch

    if hasattr(torch.ops, "torchvision") and hasattr(torch.ops.torchvision, "nms"):
        return False
    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
    try:
        if libs:
            torch.ops.load_library(libs[0])
            return False
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_lib = lib
    return True


class _TorchvisionHook:
    """Import hook: runs ``stub_torchvision_ops`` right before the first ``import torchvision`` (ComfyUI
    imports torch first), so this process never imports torch before ComfyUI's main.py does."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            stub_torchvision_ops()
        return None  # the normal import machinery does the import


def stub_torchvision_before_import() -> None:
    """``stub_torchvision_ops`` now if torch or torchvision is already imported, else just before
    torchvision's first import."""
    if "torch" in sys.modules or "torchvision" in sys.modules:
        stub_torchvision_ops()
    elif not any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionHook())


def cuda_available() -> bool:
    """Whether torch sees a CUDA device, without importing torch into a process that has not yet: ComfyUI's
    main.py sets the CUDA allocator configuration before its first ``import torch``, and on a GPU a torch
    imported earlier makes it fail ("Allocator backend parsed at runtime != ... at load time")."""
    if "torch" in sys.modules:
        return sys.modules["torch"].cuda.is_available()
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


def use_comfyui(comfy_dir: str) -> None:
    """Import the ComfyUI in ``comfy_dir`` (a user's, found by a script) instead of the one ``host_comfy_dir``
    picked. Call it before ``prepare``."""
    global COMFY_DIR
    COMFY_DIR = os.path.abspath(comfy_dir)


def prepare(argv: list[str] | None = None, parse_args: bool = True) -> str:
    """Put ComfyUI on sys.path, stub torchvision, and set ComfyUI's command line. Returns the ComfyUI dir.

    Must run before the first ``import comfy``. ``argv`` are ComfyUI arguments (``--cpu`` is added
    when CUDA is unavailable).
    """
    if not os.path.isfile(os.path.join(COMFY_DIR, "main.py")):
        raise RuntimeError(
            f"comfyui-precision-lora: ComfyUI not found at {COMFY_DIR}; run 'bash scripts/setup.sh' first "
            "(or set COMFYUI_DIR to your own ComfyUI)"
        )
    # First on sys.path, ahead of the current directory: ComfyUI's own ``import nodes`` must find its nodes.py,
    # not this checkout's nodes/ package (same name) when a tool runs from the repository root.
    if COMFY_DIR in sys.path:
        sys.path.remove(COMFY_DIR)
    sys.path.insert(0, COMFY_DIR)
    stub_torchvision_before_import()
    # Extra ComfyUI arguments for every process the scripts and tests start, e.g. "--disable-dynamic-vram"
    # or, on a machine without the frontend package, "--front-end-root DIR".
    argv = [*(argv or []), *shlex.split(os.environ.get("PRECISION_LORA_COMFY_ARGS", ""))]
    if not cuda_available() and "--cpu" not in argv:
        argv.append("--cpu")
    sys.argv = [os.path.join(COMFY_DIR, "main.py"), *argv]
    if parse_args:
        import comfy.options

        comfy.options.enable_args_parsing()
    return COMFY_DIR


def _single_copy():
    """The pack's nodes/host/single_copy.py (standard library only), loaded by path: what counts as a copy of
    the pack is decided in one place, for the scripts' links and for the pack's own check at start-up."""
    name = "precision_lora_single_copy"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "nodes", "host", "single_copy.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def installed_copy(custom_nodes: str) -> str | None:
    """The entry of a ``custom_nodes`` folder that is this pack, under any folder name: this checkout (or a
    link to it) first, else another copy of the pack (same pyproject project); None if there is none. A link
    named ``PACK_NAME`` to another place counts as none: ``link_pack`` wrote it and re-points it."""
    copies = _single_copy().pack_copies(custom_nodes, ROOT)
    here = [c for c in copies if os.path.realpath(c) == os.path.realpath(ROOT)]
    others = [c for c in copies if not (os.path.islink(c) and os.path.basename(c) == PACK_NAME)]
    return (here or others or [None])[0]


def link_pack(base_dir: str) -> str:
    """The folder of ``<base>/custom_nodes`` that ComfyUI loads this pack from. When the pack is there
    already, under any name (a clone ``ComfyUI-Precision-LoRA``, a link), that folder, and nothing is written:
    a second link would make ComfyUI import the pack twice. Otherwise ``custom_nodes/<PACK_NAME>``, made a
    link to this checkout (idempotent)."""
    custom = os.path.join(base_dir, "custom_nodes")
    os.makedirs(custom, exist_ok=True)
    present = installed_copy(custom)
    if present is not None:
        if os.path.realpath(present) != os.path.realpath(ROOT):
            log.warning("[Precision LoRA] %s is another copy of this pack; this checkout (%s) is not linked "
                        "beside it, so ComfyUI loads that copy", present, ROOT)
        return present
    link = os.path.join(custom, PACK_NAME)
    if os.path.lexists(link) and not os.path.islink(link):
        raise RuntimeError(f"[Precision LoRA] {link} exists and is not this pack; move it away to link the pack")
    if os.path.lexists(link):
        log.warning("[Precision LoRA] %s pointed to %s; it now points to this checkout, %s",
                    link, os.path.realpath(link), ROOT)
        os.remove(link)
    os.symlink(ROOT, link)
    return link


def init_in_process(base_dir: str, argv: list[str] | None = None) -> None:
    """Import ComfyUI in this process with ``base_dir`` as its base directory (models, output, ...).

    Idempotent. Afterwards ComfyUI's own ``nodes`` module (not this pack's ``nodes/``) is importable.
    A stand-in ``PromptServer.instance`` collects ``send_sync`` events in ``.events`` for tests.
    """
    if "folder_paths" in sys.modules:
        return
    base_dir = os.path.abspath(base_dir)
    os.makedirs(base_dir, exist_ok=True)
    prepare(["--base-directory", base_dir, "--disable-api-nodes", *(argv or [])])
    import comfy.cli_args  # noqa: F401  (parses the args set above)
    import folder_paths  # noqa: F401
    # As main.py does: bind ComfyUI's ``utils`` package before a later import puts comfy/ on sys.path
    # (where comfy/utils.py would shadow it).
    import utils.extra_config  # noqa: F401
    import server

    if getattr(server.PromptServer, "instance", None) is None:
        server.PromptServer.instance = _StandInServer()


class _StandInServer:
    """Just enough of PromptServer for nodes that send events or register routes in-process."""

    def __init__(self) -> None:
        from aiohttp import web

        self.events: list[tuple[str, object, object]] = []
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.routes = web.RouteTableDef()
        self.app = web.Application()  # packs that add routes at import (ComfyUI-KJNodes' static folder)
        self.supports = set()
        # ComfyUI 0.33's built-in nodes register node replacements on the server at load: nothing to replace
        # without a frontend, but the call must not fail (it printed an error on every in-process start).
        self.node_replace_manager = _NoNodeReplacements()

    def send_sync(self, event, data, sid=None) -> None:
        self.events.append((event, data, sid))

    def send_progress_text(self, text, node_id, sid=None) -> None:
        self.events.append(("progress_text", {"text": text, "node": node_id}, sid))


class _NoNodeReplacements:
    def register(self, *args, **kwargs) -> None:
        pass


def comfy_nodes_module():
    """ComfyUI's own ``nodes`` module, checked to be ComfyUI's and not this checkout's nodes/ package."""
    import nodes

    where = os.path.dirname(os.path.abspath(getattr(nodes, "__file__", None) or ""))
    if where != os.path.abspath(COMFY_DIR):
        raise RuntimeError(
            f"comfyui-precision-lora: 'import nodes' found {where}, not ComfyUI's nodes.py in {COMFY_DIR}; "
            "the pack's nodes/ package shadows it when the checkout is ahead of ComfyUI on sys.path "
            "(call comfy_bootstrap.prepare() before importing anything of ComfyUI)"
        )
    return nodes


def _loaded_pack(comfy_nodes):
    """This checkout as ComfyUI already loaded it in this process (from any folder), or None."""
    for folder in comfy_nodes.LOADED_MODULE_DIRS.values():
        if os.path.realpath(folder) == os.path.realpath(ROOT):
            module = sys.modules.get(folder.replace(".", "_x_"))
            if module is not None:
                return module
    return None


def load_pack_in_process(base_dir: str, link: bool = True):
    """Load this pack through ComfyUI's own custom-node loader; returns the pack's module.

    Sub-modules are then importable as ``<returned module>.__name__ + ".nodes.x"``. The pack is loaded once
    per process. From ``<base>/custom_nodes`` where it is there (under any folder name); else, with ``link``,
    from a link written there (``link_pack``), or without, from this checkout where it is: nothing is written
    into ``custom_nodes/``.
    """
    import asyncio

    init_in_process(base_dir)
    comfy_nodes = comfy_nodes_module()
    loaded = _loaded_pack(comfy_nodes)
    if loaded is not None:
        return loaded
    base = os.path.abspath(base_dir)
    present = installed_copy(os.path.join(base, "custom_nodes"))
    if link:
        path = link_pack(base)
    elif present is not None and os.path.realpath(present) == os.path.realpath(ROOT):
        path = present
    else:
        path = ROOT
    if not asyncio.run(comfy_nodes.load_custom_node(path)):
        raise RuntimeError(f"comfyui-precision-lora: ComfyUI failed to load the pack from {path}")
    return sys.modules[path.replace(".", "_x_")]
