"""The pack loads once in a user's ComfyUI where it was cloned under another folder name.

Each test builds "your ComfyUI": a copy of the test host's ComfyUI tree in tmp_path (its own models/,
custom_nodes/, user/) with the pack in ``custom_nodes/ComfyUI-Precision-LoRA`` (the folder ``git clone``
gives): this checkout linked there, or a copy of its files. The scripts run as a user runs them, with no
PRECISION_LORA_* variables, and ComfyUI starts as a user starts it (``python main.py``, or run.sh's own
start). The only stand-in is ``sitecustomize.py`` on PYTHONPATH: this machine's torchvision has no working
C++ library, and it stubs the two operator schemas torchvision registers (as scripts/launch.py does for the
repository's own servers); a user's torchvision works without it.
"""
from __future__ import annotations

import collections
import glob
import os
import re
import shlex
import shutil
import subprocess

import comfy_bootstrap
import pytest

from server_harness import PYTHON, ROOT, ComfyServer, free_port, server_env

pytestmark = pytest.mark.e2e

CLONE = "ComfyUI-Precision-LoRA"
DEMO_FILES = ("precision_tiny_cosmos.safetensors", "precision_tiny_flux1_dev.safetensors",
              "precision_tiny_flux2.safetensors")
TWICE = "[Precision LoRA] the pack is installed twice"
SHIM = """import importlib.util
spec = importlib.util.spec_from_file_location("precision_lora_boot", {path!r})
boot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boot)
boot.stub_torchvision_before_import()
"""


# -- your ComfyUI --------------------------------------------------------------------------------------
def _user_comfyui(tmp_path) -> str:
    """A ComfyUI folder of its own (a copy: the host's tree is never written to)."""
    comfy = str(tmp_path / "ComfyUI")
    shutil.copytree(comfy_bootstrap.host_comfy_dir(), comfy, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return comfy


def _copy_pack(dest: str) -> str:
    """The pack's files as a clone has them (tracked and new files of this checkout, nothing ignored)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(dest, name))
    return dest


def _user_env(tmp_path, **extra: str) -> dict[str, str]:
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SHIM.format(path=os.path.join(ROOT, "scripts", "comfy_bootstrap.py")))
    env = {k: v for k, v in server_env().items()
           if not k.startswith("PRECISION_LORA_") and k not in ("COMFYUI_DIR", "COMFYUI_PYTHON", "PYTHONPATH")}
    return dict(env, PYTHONPATH=str(shim), **extra)


def _comfy_args() -> list[str]:
    """What this machine needs on any ComfyUI command line (a user without a GPU passes --cpu too)."""
    args = ["--disable-api-nodes", *shlex.split(os.environ.get("PRECISION_LORA_COMFY_ARGS", ""))]
    return args if comfy_bootstrap.cuda_available() else [*args, "--cpu"]


def _start(cmd: list[str], cwd: str, env: dict[str, str], port: int, log_path: str) -> ComfyServer:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = ComfyServer(cwd, port, proc, log_path)
    server._wait_ready(300)
    return server


# -- what ComfyUI registered -----------------------------------------------------------------------------
def _pack_node_modules(server: ComfyServer) -> set[str]:
    info = server.object_info()
    modules = {v.get("python_module") for k, v in info.items() if k.startswith("Precision")}
    assert "PrecisionTrainLoRA" in info and "PrecisionDemoLatent" in info, sorted(info)[:20]
    return modules


def _pack_js(server: ComfyServer, folders: list[str]) -> collections.Counter:
    """(folder, file) of each web file of the pack's folders that GET /extensions lists, with its count."""
    status, urls = server.get("/extensions")
    assert status == 200, urls
    found = collections.Counter()
    for url in urls:
        for folder in folders:
            if url.startswith(f"/extensions/{folder}/"):
                found[(folder, url[len(f"/extensions/{folder}/"):])] += 1
    return found


def _web_files() -> set[str]:
    web = os.path.join(ROOT, "web")
    return {os.path.relpath(p, web) for p in glob.glob(os.path.join(web, "**", "*.js"), recursive=True)}


def _template_categories(server: ComfyServer) -> list[str]:
    status, templates = server.get("/api/workflow_templates")
    assert status == 200, templates
    return sorted(k for k, names in templates.items() if "train_lora_demo" in names)


def _imported_folders(server: ComfyServer, custom: str) -> list[str]:
    """The pack's folders in ComfyUI's "Import times for custom nodes" list (one line per imported folder)."""
    pattern = r"seconds(?: \(IMPORT FAILED\))?: " + re.escape(custom + os.sep) + r"(\S+)\s*$"
    hits = re.findall(pattern, server.log_text(), re.M)
    return sorted(h for h in hits if h in (CLONE, comfy_bootstrap.PACK_NAME))


# -- A: the scripts leave one copy, and the next start loads it once --------------------------------------
def test_scripts_write_no_second_link_and_the_pack_loads_once(tmp_path):
    comfy = _user_comfyui(tmp_path)
    custom = os.path.join(comfy, "custom_nodes")
    clone = os.path.join(custom, CLONE)
    os.symlink(ROOT, clone)  # the pack cloned under its GitHub name, and this checkout is that clone
    before = sorted(os.listdir(custom))
    env = _user_env(tmp_path, COMFYUI_DIR=comfy, COMFYUI_PYTHON=PYTHON)
    out = subprocess.run([PYTHON, "scripts/make_demo_models.py", comfy], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert set(DEMO_FILES) <= set(os.listdir(os.path.join(comfy, "models", "diffusion_models")))
    assert sorted(os.listdir(custom)) == before, "make_demo_models.py wrote into custom_nodes/"

    port = free_port()
    server = _start(["bash", "scripts/run.sh", "--port", str(port), *_comfy_args()], clone, env, port,
                    str(tmp_path / "run.log"))
    try:
        assert sorted(os.listdir(custom)) == before, "run.sh wrote a second copy into custom_nodes/"
        assert f"with this pack from {clone}" in server.log_text()
        assert _imported_folders(server, custom) == [CLONE]
        assert _pack_node_modules(server) == {f"custom_nodes.{CLONE}"}
        served = _pack_js(server, [CLONE, comfy_bootstrap.PACK_NAME])
        assert set(served) == {(CLONE, f) for f in _web_files()} and set(served.values()) == {1}
        assert _template_categories(server) == [CLONE]
        assert TWICE not in server.log_text()
        assert server.pack_import_errors() == []
    finally:
        server.stop()


# -- A: two copies really there: the second is named, and registers nothing -----------------------------
def test_a_second_copy_is_named_and_registers_nothing(tmp_path):
    comfy = _user_comfyui(tmp_path)
    custom = os.path.join(comfy, "custom_nodes")
    link = os.path.join(custom, CLONE)
    os.symlink(ROOT, link)
    copy = _copy_pack(os.path.join(custom, comfy_bootstrap.PACK_NAME))  # a second copy, put there by hand
    port = free_port()
    server = _start([PYTHON, "main.py", "--listen", "127.0.0.1", "--port", str(port), *_comfy_args()], comfy,
                    _user_env(tmp_path), port, str(tmp_path / "server.log"))
    try:
        assert _imported_folders(server, custom) == sorted([CLONE, comfy_bootstrap.PACK_NAME])  # both imported
        lines = [ln for ln in server.log_text().splitlines() if TWICE in ln]
        assert len(lines) == 1, lines
        named = re.search(r"installed twice: (\S+) .* is loaded; (\S+) is a second copy", lines[0])
        assert named and {named[1], named[2]} == {link, copy}, lines[0]
        assert f"Remove {link} (or rename it to {CLONE}.disabled) and restart ComfyUI." in lines[0]
        loaded = os.path.basename(named[1])
        assert _pack_node_modules(server) == {f"custom_nodes.{loaded}"}  # registered by the loaded copy only
        served = _pack_js(server, [CLONE, comfy_bootstrap.PACK_NAME])
        assert set(served) == {(loaded, f) for f in _web_files()} and set(served.values()) == {1}
        assert server.pack_import_errors() == []
    finally:
        server.stop()


# -- B: demo models for a clone install: one command from the ComfyUI folder -----------------------------
EXTRA_PATHS = """mine:
    base_path: {base}
    is_default: true
    diffusion_models: diffusion_models
"""


@pytest.mark.parametrize("install", ["copy", "link", "copy, extra_model_paths.yaml"])
def test_demo_models_command_from_the_comfyui_folder(tmp_path, install):
    comfy = _user_comfyui(tmp_path)
    custom = os.path.join(comfy, "custom_nodes")
    pack = os.path.join(custom, CLONE)
    if install.startswith("copy"):
        _copy_pack(pack)
    else:
        os.symlink(ROOT, pack)
    folder = os.path.join(comfy, "models", "diffusion_models")
    if "extra" in install:  # the user keeps models elsewhere, first in ComfyUI's search order
        folder = str(tmp_path / "my_models" / "diffusion_models")
        with open(os.path.join(comfy, "extra_model_paths.yaml"), "w") as f:
            f.write(EXTRA_PATHS.format(base=tmp_path / "my_models"))
    before = sorted(os.listdir(custom))
    out = subprocess.run([PYTHON, f"custom_nodes/{CLONE}/scripts/make_demo_models.py"], cwd=comfy,
                         env=_user_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert sorted(os.listdir(custom)) == before, "make_demo_models.py wrote into custom_nodes/"
    for name in DEMO_FILES:
        assert f"wrote demo model {os.path.join(folder, name)}" in out.stderr, out.stderr[-3000:]
    _assert_demo_models_load(folder)


def _assert_demo_models_load(folder: str) -> None:
    """Each file loads with the pack's loader and holds the seeded tiny model; the Cosmos one also loads with
    ComfyUI's stock loader (what UNETLoader calls)."""
    import comfy_harness
    import torch

    load = comfy_harness.pack_module("nodes.model.load")
    tiny = comfy_harness.pack_module("demo.tiny_models")
    import comfy.sd

    for family in ("cosmos", "flux1_dev", "flux2"):
        path = os.path.join(folder, tiny.demo_model_filename(family))
        got = load.load_model_file(path, "fp32").model.diffusion_model.state_dict()
        want = tiny.tiny_state_dict(tiny.build_tiny_model(family, seed=0))
        assert got.keys() == want.keys(), family
        assert all(torch.equal(got[k].float(), want[k].float()) for k in want), family
    assert comfy.sd.load_diffusion_model(os.path.join(folder, DEMO_FILES[0])) is not None
