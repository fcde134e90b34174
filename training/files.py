"""Atomic, durable file writes: nothing half-written ever appears under the final name.

``atomic_write`` writes into a temporary ``.precision_lora_<pid>_<token>.partial`` file in the target's
folder, fsyncs it, renames it onto the target (``os.replace``) and fsyncs the folder, so a crash leaves
either the old file or the complete new one (tests/unit/test_atomic_write.py). The file gets mode 0o666 minus the process
umask, as ComfyUI's own files do (``tempfile.mkstemp``, and safetensors, which replaces the file it writes,
made every file of the pack 0600).

Temporary files left by a crashed process are removed: ``remove_stale_partials(folder)`` deletes the pack's
``.partial`` files whose writer process is gone (or that are older than a day), and ``atomic_write`` runs
it once per folder and process, the first time it writes there.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

PARTIAL_PREFIX = ".precision_lora_"
PARTIAL_SUFFIX = ".partial"
STALE_AFTER_S = 24 * 3600  # a partial file older than this is stale even if its pid is alive (pid reuse)
_PID = re.compile(rf"^{re.escape(PARTIAL_PREFIX)}(\d+)_[0-9a-f]+{re.escape(PARTIAL_SUFFIX)}$")
_swept: set[str] = set()
_swept_lock = threading.Lock()


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _is_stale(name: str, path: str, now: float) -> bool:
    try:
        age = now - os.stat(path).st_mtime
    except OSError:
        return False
    m = _PID.match(name)
    if m is None:  # the pack's older mkstemp names carried no pid
        return age > 3600
    return age > STALE_AFTER_S or not _pid_alive(int(m.group(1)))


def remove_stale_partials(folder: str) -> list[str]:
    """Delete the pack's leftover temporary files directly in ``folder``; returns the removed paths."""
    removed = []
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if name.startswith(PARTIAL_PREFIX) and name.endswith(PARTIAL_SUFFIX):
            path = os.path.join(folder, name)
            if _is_stale(name, path, now):
                try:
                    os.remove(path)
                    removed.append(path)
                except OSError as exc:
                    log.warning("could not remove stale temporary file %s: %s", path, exc)
    if removed:
        log.info("removed %d stale temporary file(s) in %s", len(removed), folder)
    return removed


def _sweep_once(folder: str) -> None:
    with _swept_lock:
        if folder in _swept:
            return
        _swept.add(folder)
    remove_stale_partials(folder)


def _fsync_path(path: str, directory: bool = False) -> None:
    flags = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)) if directory else os.O_RDWR
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:  # some platforms (Windows) cannot open folders: the rename is all we get there
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], None]) -> str:
    """Call ``write(tmp)`` on a temporary file in ``path``'s folder, fsync it, then ``os.replace`` it onto
    ``path`` and fsync the folder.

    The folder is created if needed; on any error (or interrupt) the temporary file is removed and the
    error re-raised, leaving ``path`` as it was. The file's mode follows the umask. Returns the absolute path.
    """
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    _sweep_once(folder)
    tmp = os.path.join(folder, f"{PARTIAL_PREFIX}{os.getpid()}_{secrets.token_hex(8)}{PARTIAL_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    mode = os.fstat(fd).st_mode & 0o777  # 0o666 minus the umask, as for any new file
    os.close(fd)
    try:
        write(tmp)
        if os.stat(tmp).st_mode & 0o777 != mode:  # writers that replace the file (safetensors) make it 0600
            os.chmod(tmp, mode)
        _fsync_path(tmp)
        os.replace(tmp, path)
        _fsync_path(folder, directory=True)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
