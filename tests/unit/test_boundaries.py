"""The pure core never imports ComfyUI, and the package imports without ComfyUI present."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFY_MODULES = ("comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "server",
                 "execution", "nodes", "node_helpers", "latent_preview")

PROBE = r"""
import importlib, pkgutil, sys
sys.path.insert(0, {root!r} + "/scripts")
import pure_packages
pure_packages.install()
for pkg in pure_packages.PURE:
    mod = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        importlib.import_module(info.name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in {comfy!r})
print("LOADED:" + ",".join(sorted(m for m in sys.modules if m.startswith(pure_packages.PURE))))
print("COMFY:" + ",".join(bad))
"""


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout


sys.path.insert(0, os.path.join(ROOT, "scripts"))
import pure_packages  # noqa: E402

# Top-level folders of Python code that may import ComfyUI (the nodes and what runs them) or are not the product.
COMFY_SIDE = {"nodes", "runner", "demo"}
TOOLING = {"tests", "bench", "scripts", "workflows"}


def test_every_top_level_folder_is_pure_or_named_as_comfyui_side():
    """A new folder of product code is covered by the tests below (pure) or named here as ComfyUI's side."""
    folders = {d for d in os.listdir(ROOT) if not d.startswith(".") and os.path.isdir(os.path.join(ROOT, d))
               and any(f.endswith(".py") for f in os.listdir(os.path.join(ROOT, d)))}
    assert folders - TOOLING == set(pure_packages.PURE) | COMFY_SIDE, folders


def test_pure_packages_import_no_comfyui_module():
    out = _run(PROBE.format(root=ROOT, comfy=set(COMFY_MODULES)))
    loaded = out.split("LOADED:")[1].splitlines()[0].split(",")
    assert {"attention", "training", "lora", "probe", "data", "lora.file", "probe.survival", "data.files",
            "data.video_files", "data.encode_cache"} <= set(loaded)
    assert out.split("COMFY:")[1].strip() == ""


def test_pure_sources_have_no_comfyui_import_statement():
    import re

    pattern = re.compile(r"^\s*(import|from)\s+(" + "|".join(COMFY_MODULES) + r")\b", re.M)
    offenders = []
    for pkg in pure_packages.PURE:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    if pattern.search(open(path).read()):
                        offenders.append(os.path.relpath(path, ROOT))
    assert offenders == []


def test_package_root_imports_without_comfyui():
    code = (f"import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('pl_pack', {os.path.join(ROOT, '__init__.py')!r},"
            f" submodule_search_locations=[{ROOT!r}])\n"
            f"m = importlib.util.module_from_spec(spec); sys.modules['pl_pack'] = m; spec.loader.exec_module(m)\n"
            f"print(m.WEB_DIRECTORY, callable(m.comfy_entrypoint), 'comfy' in sys.modules)")
    assert _run(code).split() == ["./web", "True", "False"]


def test_the_message_prefix_is_written_where_messages_leave_the_pack():
    """#34: one prefix, added at the boundary (nodes/host/errors.py); pure packages and node code write plain
    messages. The one other literal: the second-copy message, logged before the pack registers (and read by
    scripts/comfy_bootstrap.py, which loads that file by its path)."""
    found = {}
    for top in sorted({*pure_packages.PURE, *COMFY_SIDE}):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    count = open(path, encoding="utf-8").read().count("[Precision LoRA]")
                    if count:
                        found[os.path.relpath(path, ROOT)] = count
    assert found == {os.path.join("nodes", "host", "errors.py"): 2, os.path.join("nodes", "host", "single_copy.py"): 1}
