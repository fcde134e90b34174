"""A real ComfyUI server subprocess with this pack, on a free loopback port, for e2e and browser tests.

``ComfyServer.start(base_dir)`` writes the tiny demo models (if missing), starts
``scripts/launch.py`` with ``--base-directory``, waits for ``GET /``, and fails loudly if the log says
the pack (or one of its modules) failed to import. ``stop()`` ends it by its PID.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

from ports import free_port  # noqa: F401  (re-exported: the e2e tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable  # the host's Python that runs the tests runs the server too
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
PACK = "comfyui-precision-lora"


def server_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if os.path.exists(TCMALLOC):  # CPU training is several times faster without glibc's page-fault storm
        env["LD_PRELOAD"] = TCMALLOC
    return env


class ComfyServer:
    def __init__(self, base_dir: str, port: int, proc: subprocess.Popen, log_path: str):
        self.base_dir, self.port, self.proc, self.log_path = base_dir, port, proc, log_path
        self.url = f"http://127.0.0.1:{port}"

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def start(cls, base_dir: str, timeout: float = 180.0, extra_args: list[str] | None = None) -> "ComfyServer":
        os.makedirs(base_dir, exist_ok=True)
        subprocess.run([PYTHON, os.path.join(ROOT, "scripts", "make_demo_models.py"), base_dir],
                       check=True, env=server_env())
        port = free_port()
        log_path = os.path.join(base_dir, "server.log")
        cmd = [PYTHON, os.path.join(ROOT, "scripts", "launch.py"), "--base-directory", base_dir,
               "--listen", "127.0.0.1", "--port", str(port), "--disable-api-nodes", *(extra_args or [])]
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                start_new_session=True)
        server = cls(base_dir, port, proc, log_path)
        server._wait_ready(timeout)
        return server

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ComfyUI did not answer within {timeout}s:\n{self.log_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    # -- log ---------------------------------------------------------------------------------
    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def pack_import_errors(self) -> list[str]:
        """Log lines saying that this pack, or one of its modules, failed to import."""
        bad = re.compile(r"IMPORT FAILED|Cannot import|Error while calling comfy_entrypoint|Traceback")
        lines = self.log_text().splitlines()
        hits = [ln for ln in lines if bad.search(ln) and PACK in ln]
        return hits + [ln for ln in lines if "comfy_entrypoint" in ln and "Error" in ln and ln not in hits]

    # -- HTTP --------------------------------------------------------------------------------
    def request(self, path: str, data: dict | None = None, method: str | None = None, timeout: float = 30):
        body = None if data is None else json.dumps(data).encode()
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw or b"null")
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def get(self, path: str):
        return self.request(path)

    def object_info(self, node_id: str | None = None) -> dict:
        status, data = self.get("/object_info" + (f"/{node_id}" if node_id else ""))
        assert status == 200, data
        return data

    def post_prompt(self, prompt: dict, client_id: str | None = None) -> str:
        """Queue an API-format prompt; raises AssertionError with ComfyUI's errors if it is rejected."""
        payload = {"prompt": prompt, "client_id": client_id or str(uuid.uuid4())}
        status, data = self.request("/prompt", payload)
        if status != 200:
            raise AssertionError(f"prompt rejected ({status}): {json.dumps(data, indent=1)[:3000]}")
        return data["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 300) -> dict:
        """Wait until the prompt is in /history; returns its entry. Fails with the execution error if any."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            status, data = self.get(f"/history/{urllib.parse.quote(prompt_id)}")
            if status == 200 and data and prompt_id in data:
                entry = data[prompt_id]
                if entry.get("status", {}).get("completed") is not None or entry.get("outputs"):
                    return entry
            time.sleep(0.3)
        raise TimeoutError(f"prompt {prompt_id} not finished after {timeout}s:\n{self.log_text()[-3000:]}")

    def run(self, prompt: dict, timeout: float = 300) -> dict:
        """post_prompt + wait; asserts the execution succeeded."""
        entry = self.wait(self.post_prompt(prompt), timeout)
        status = entry.get("status", {})
        assert status.get("status_str") == "success", json.dumps(status.get("messages"), indent=1)[:4000]
        return entry

    def output_path(self, *parts: str) -> str:
        return os.path.join(self.base_dir, "output", *parts)

    def interrupt(self) -> None:
        self.request("/interrupt", {})
