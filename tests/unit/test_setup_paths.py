"""The set-up writes no absolute path of the checkout into a host's venv: a moved or copied checkout's venv must not
read the original checkout's files (the torchaudio Python part, .hosts/<version>/pure, came from the original
through an absolute path in precision_lora_pure.pth)."""
from __future__ import annotations

import glob
import os
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pth_files() -> list[str]:
    """The pack's .pth files in the venv running the tests (a shipped host's, set up by scripts/setup.sh)."""
    return glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "precision_lora*.pth"))


def test_the_venv_finds_the_pure_packages_by_a_relative_path():
    if not sys.prefix.startswith(os.path.join(ROOT, ".hosts")):
        pytest.skip("not a shipped host's venv (a custom ComfyUI's Python): scripts/setup.sh wrote nothing into it")
    found = _pth_files()
    assert found, "scripts/setup.sh writes precision_lora_pure.pth into every shipped host's venv"
    site = sysconfig.get_paths()["purelib"]
    for path in found:
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith(("#", "import"))]
        assert lines and not any(os.path.isabs(ln) for ln in lines), (path, lines)
        # the first line from the venv's own site folder; a second one (the newest host) from the same folder seen
        # through the .venv link, where Python's site joins it when run as .venv/bin/python  (lexically, as site does)
        through_link = os.path.join(ROOT, ".venv", os.path.relpath(site, sys.prefix))
        assert os.path.isdir(os.path.join(site, lines[0])), (path, lines)
        assert all(os.path.isdir(os.path.abspath(os.path.join(through_link, ln))) for ln in lines[1:]), (path, lines)
        assert all(ROOT not in ln for ln in lines), (path, lines)


def test_the_venv_link_finds_the_pure_packages_too():
    """.venv/bin/python (the docs' commands: bench/memory.py imports ComfyUI, which imports torchaudio) reads
    .venv/lib/.../site-packages, where the venv's own relative line leads to a folder that does not exist."""
    import subprocess

    link = os.path.join(ROOT, ".venv", "bin", "python")
    if not os.path.exists(link):
        pytest.skip("no .venv link (scripts/setup.sh makes it when it sets up the newest shipped host)")
    out = subprocess.run([link, "-c", "import torchaudio; print(torchaudio.__file__)"], capture_output=True, text=True)
    assert out.returncode == 0 and os.path.join(".hosts", "") in out.stdout, out.stderr[-1000:]
