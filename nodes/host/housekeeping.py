"""Start-up housekeeping: remove the temporary files a crashed save of the pack left behind.

``register()`` (idempotent, run once when the pack loads) sweeps every folder tree the pack writes into by
default: the loras folders and ``output/precision_lora``. ``training.files.atomic_write`` also sweeps each
folder the first time it writes there, which covers user-chosen output subfolders.
"""
from __future__ import annotations

import logging
import os

from ...training.files import remove_stale_partials

log = logging.getLogger(__name__)
_done = False


def pack_folders() -> list[str]:
    """The folder trees the pack writes into by default (existing ones only)."""
    import folder_paths

    roots = list(folder_paths.get_folder_paths("loras"))
    roots.append(os.path.join(folder_paths.get_output_directory(), "precision_lora"))
    return [r for r in dict.fromkeys(os.path.abspath(r) for r in roots) if os.path.isdir(r)]


def sweep(roots: list[str]) -> list[str]:
    """Remove stale partial files in every folder under ``roots``; returns the removed paths."""
    removed: list[str] = []
    for root in roots:
        for folder, _dirs, _files in os.walk(root):
            removed += remove_stale_partials(folder)
    return removed


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    removed = sweep(pack_folders())
    if removed:
        log.info("removed %d temporary file(s) left by an interrupted save", len(removed))
