"""The pack registers once per ComfyUI, however many copies of it ``custom_nodes/`` holds.

ComfyUI imports every folder of ``custom_nodes/``, so the pack cloned as ``ComfyUI-Precision-LoRA`` plus a
link ``comfyui-precision-lora`` to it (or two clones) would register every node and every web extension
twice. A folder is a copy of the pack when its real path is this pack's, or when its ``pyproject.toml``
names the same ``[project]``. The first copy ComfyUI imports registers; each later one registers nothing:
``skip_second_copy`` takes its web folder back out of ComfyUI's list of served extensions and logs one error
line naming both folders and the one to remove.

Everything but ``skip_second_copy`` and ``_skipped_extension`` uses the standard library only:
``scripts/comfy_bootstrap.py`` loads this file by its path to decide where a link to the checkout may go.
"""
from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

PACK_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WEB_DIRECTORY = "web"  # the pack's __init__ WEB_DIRECTORY, relative to the pack's folder
_NAME = re.compile(r'^\s*name\s*=\s*["\']([^"\']+)["\']', re.M)


def project_name(folder: str) -> str | None:
    """``[project] name`` of ``folder/pyproject.toml``; None when there is no such file or name."""
    try:
        with open(os.path.join(folder, "pyproject.toml"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = _NAME.search(section.group(1)) if section else None
    return found.group(1) if found else None


def is_pack_copy(folder: str, pack_dir: str = PACK_DIR) -> bool:
    """Whether ``folder`` is the pack at ``pack_dir``: the same real path, or a package folder whose
    pyproject names the same project."""
    if not os.path.isdir(folder):
        return False
    if os.path.realpath(folder) == os.path.realpath(pack_dir):
        return True
    name = project_name(pack_dir)
    return (name is not None and project_name(folder) == name
            and os.path.isfile(os.path.join(folder, "__init__.py")))


def pack_copies(custom_nodes: str, pack_dir: str = PACK_DIR) -> list[str]:
    """The entries of a ``custom_nodes`` folder that ComfyUI would import as this pack, sorted by name
    (``*.disabled`` folders are skipped by ComfyUI, so here too)."""
    try:
        names = sorted(os.listdir(custom_nodes))
    except OSError:
        return []
    paths = [os.path.join(custom_nodes, n) for n in names if not n.endswith(".disabled")]
    return [p for p in paths if is_pack_copy(p, pack_dir)]


def folder_to_remove(loaded: str, skipped: str) -> str:
    """The copy to tell the user to remove: the one that is a link (a script or a user made it beside a
    clone), else the one ComfyUI skipped."""
    if os.path.islink(loaded) and not os.path.islink(skipped):
        return loaded
    return skipped


def _describe(folder: str) -> str:
    return f"{folder} (a link to {os.path.realpath(folder)})" if os.path.islink(folder) else folder


def duplicate_message(loaded: str, skipped: str) -> str:
    """One line: both folders, which one ComfyUI registered, which one to remove and how."""
    remove = folder_to_remove(loaded, skipped)
    # logged before the pack registers (and by scripts/comfy_bootstrap.py, which loads this file by its path)
    return (f"[Precision LoRA] the pack is installed twice: {_describe(loaded)} is loaded; "
            f"{_describe(skipped)} is a second copy, so its nodes and web files are not registered. "
            f"Remove {remove} (or rename it to {os.path.basename(remove)}.disabled) and restart ComfyUI.")


def earlier_copies(own: str, loaded_dirs: dict[str, str]) -> list[str]:
    """Folders ComfyUI already imported (``nodes.LOADED_MODULE_DIRS``'s values, in import order) that are
    copies of the pack at ``own``, ``own`` itself excepted."""
    own = os.path.abspath(own)
    return [d for d in loaded_dirs.values() if os.path.abspath(d) != own and is_pack_copy(d, own)]


def unserve_web(own: str, earlier: list[str], web_dirs: dict[str, str]) -> None:
    """Take ``own``'s web folder out of ComfyUI's ``EXTENSION_WEB_DIRS`` (ComfyUI added it on import, before
    calling ``comfy_entrypoint``). A key shared with an earlier copy (the same folder name under another
    custom_nodes path) is given back to that copy."""
    name = os.path.basename(own)
    if web_dirs.get(name) != os.path.abspath(os.path.join(own, WEB_DIRECTORY)):
        return
    same_name = [d for d in earlier if os.path.basename(d) == name]
    if same_name:
        web_dirs[name] = os.path.abspath(os.path.join(same_name[0], WEB_DIRECTORY))
    else:
        del web_dirs[name]


def skip_second_copy(init_file: str):
    """In ``comfy_entrypoint``: None when this is the first copy of the pack ComfyUI imports (register as
    usual); otherwise an extension with no nodes, after unserving this copy's web folder and logging which
    folder to remove."""
    import nodes as comfy_nodes  # ComfyUI's nodes.py (the pack's own nodes/ is only reached relatively)

    own = os.path.dirname(os.path.abspath(init_file))
    earlier = earlier_copies(own, comfy_nodes.LOADED_MODULE_DIRS)
    if not earlier:
        return None
    unserve_web(own, earlier, comfy_nodes.EXTENSION_WEB_DIRS)
    log.error(duplicate_message(earlier[0], own))
    return _skipped_extension()


def _skipped_extension():
    from .comfy_io import ComfyExtension

    class SecondCopy(ComfyExtension):
        async def get_node_list(self) -> list:
            return []

    return SecondCopy()
