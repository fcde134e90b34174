"""training.files.atomic_write: durable, umask-respecting writes; leftovers of crashed writers removed.

Issue 13: D9 (every file the pack wrote was mode 0600 although the umask was 022), D11 (no fsync before
the final rename; leftover .partial files were never cleaned up).
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from training import files


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _write(path: str, text: str = "data") -> str:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    return files.atomic_write(path, write)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_file_mode_follows_the_umask(tmp_path, umask, mask, mode):
    """D9: tempfile.mkstemp made every file 0600 whatever the umask."""
    os.umask(mask)
    path = _write(str(tmp_path / "sub" / "a.txt"))
    assert stat.S_IMODE(os.stat(path).st_mode) == mode


def test_mode_follows_the_umask_even_when_the_writer_replaces_the_file(tmp_path, umask):
    """D9: safetensors' save_file replaces its target with a new 0600 file."""
    import torch
    from safetensors.torch import save_file

    path = files.atomic_write(str(tmp_path / "t.safetensors"), lambda tmp: save_file({"a": torch.zeros(2)}, tmp))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_the_temporary_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """D11: a crash right after the rename could leave an empty or partial file under the final name."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", src))
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    path = _write(str(tmp_path / "b.txt"), "payload")
    kinds = [c[0] for c in calls]
    assert kinds == ["fsync", "replace", "fsync"]
    tmp = calls[1][1]
    assert calls[0][1] == tmp and os.path.basename(tmp).startswith(f".precision_lora_{os.getpid()}_")
    assert calls[2][1] == str(tmp_path)  # the folder, so the rename itself is durable
    assert open(path).read() == "payload" and not os.path.exists(tmp)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = _write(str(tmp_path / "c.txt"), "old")

    def broken(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        files.atomic_write(path, broken)
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["c.txt"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_partials_of_dead_writers_are_removed_on_the_first_write_into_a_folder(tmp_path, monkeypatch):
    """D11: leftover .partial files of crashed saves were never cleaned up."""
    monkeypatch.setattr(files, "_swept", set())
    dead = tmp_path / f".precision_lora_{_dead_pid()}_0123abcd.partial"
    mine = tmp_path / f".precision_lora_{os.getpid()}_0123abcd.partial"  # a write in progress here
    old_style = tmp_path / ".precision_lora_x1y2z3.partial"  # mkstemp name of earlier versions
    fresh_old_style = tmp_path / ".precision_lora_q9w8e7.partial"
    other = tmp_path / "someone_else.partial"
    for p in (dead, mine, old_style, fresh_old_style, other):
        p.write_text("x")
    hour_ago = time.time() - 2 * 3600
    os.utime(old_style, (hour_ago, hour_ago))
    _write(str(tmp_path / "d.txt"))
    left = sorted(os.listdir(tmp_path))
    assert left == sorted(["d.txt", mine.name, fresh_old_style.name, other.name])
    dead.write_text("x")
    _write(str(tmp_path / "e.txt"))  # once per folder and process: the sweep does not run again
    assert dead.exists()
    assert files.remove_stale_partials(str(tmp_path)) == [str(dead)]
