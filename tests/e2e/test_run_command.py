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


def test_run_script_starts_comfyui_with_demo_models(tmp_path):
    port = free_port()
    env = dict(os.environ, PRECISION_LORA_BASE=str(tmp_path), PORT=str(port))
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
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            assert r.status == 200 and b"<html" in r.read().lower()
        # the example workflows are served as templates of this pack
        status, templates = server.get("/api/workflow_templates")
        assert status == 200 and any("precision" in k for k in templates), templates
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
