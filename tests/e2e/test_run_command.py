"""The README's run command (scripts/run.sh) brings up ComfyUI with the pack and tiny demo models."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.request

import pytest

from server_harness import ROOT, ComfyServer, free_port

pytestmark = pytest.mark.e2e


def _host_name() -> str:
    """The shipped host this test session runs on (run.sh must start the same one)."""
    comfy = os.environ.get("PRECISION_LORA_COMFYUI", "")
    name = os.path.basename(os.path.dirname(os.path.abspath(comfy))) if comfy else "0.33.0"
    return name if name in ("0.33.0", "0.3.75") else "custom"


def _startup_problems(text: str) -> list[str]:
    """Lines of a ComfyUI start-up log that a newcomer would read as a broken install: any module that failed
    to import (ComfyUI's own ``comfy_extras`` nodes included) and any ERROR line (0.33's coloured
    ``[ERROR]``, 0.3.75's plain ``ERROR``)."""
    bad = re.compile(r"IMPORT FAILED|Cannot import|\[ERROR\]|^ERROR[: ]|Traceback")
    return [ln for ln in text.splitlines() if bad.search(re.sub(r"\x1b\[[0-9;]*m", "", ln))]


def test_run_script_starts_comfyui_with_demo_models(tmp_path):
    port = free_port()
    host = _host_name()
    env = dict(os.environ, PRECISION_LORA_BASE=str(tmp_path), PORT=str(port))
    if host != "custom":
        env["PRECISION_LORA_HOST"] = host
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "run.sh")], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ComfyServer(str(tmp_path), port, proc, str(log_path))
    try:
        server._wait_ready(240)
        text = server.log_text()
        assert re.search(rf"http://127\.0\.0\.1:{port}", text)
        models = sorted(os.listdir(tmp_path / "models" / "diffusion_models"))
        assert models == ["precision_tiny_cosmos.safetensors", "precision_tiny_flux1_dev.safetensors",
                          "precision_tiny_flux2.safetensors"]
        info = server.object_info("PrecisionLoadDiffusionModel")["PrecisionLoadDiffusionModel"]
        assert all(spec[1].get("tooltip") for spec in info["input"]["required"].values())
        assert server.pack_import_errors() == []
        # a clean start (issue 24): every ComfyUI node module imports (kornia, spandrel, PyOpenGL, comfy-angle and
        # torchaudio's Python part are installed by set-up) and no ERROR line, the database included
        assert _startup_problems(text) == []
        if host == "0.33.0":  # ComfyUI 0.33 keeps a database; launch.py puts it in the base directory
            assert (tmp_path / "user" / "comfyui.db").is_file()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            assert r.status == 200 and b"<html" in r.read().lower()
        # the example workflows are served as templates of this pack
        status, templates = server.get("/api/workflow_templates")
        assert status == 200 and any("precision" in k for k in templates), templates
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
