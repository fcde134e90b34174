"""Atomic file writes: nothing half-written ever appears under the final name."""
from __future__ import annotations

import os
import tempfile
from typing import Callable


def atomic_write(path: str, write: Callable[[str], None]) -> str:
    """Call ``write(tmp)`` on a temporary file in ``path``'s folder, then ``os.replace`` it onto ``path``.

    The folder is created if needed; on any error (or interrupt) the temporary file is removed and the
    error re-raised, leaving ``path`` as it was. Returns the absolute path.
    """
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".precision_lora_", suffix=".partial", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
