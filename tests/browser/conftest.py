"""Browser tier: Debian's chromium driven by playwright-core (tests/browser/driver.mjs) against a real server.

The browser is a long-lived node process commanded over stdin/stdout (one JSON line per command), so the
tests are plain pytest. Missing chromium or playwright-core is a failure with the fix in the message,
never a skip: `bash scripts/setup.sh` installs both.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ARTIFACTS = os.path.join(ROOT, "artifacts", "browser")
CHROMIUM = os.environ.get("PRECISION_LORA_CHROMIUM", "/usr/bin/chromium")
PACK_URL_PART = "/extensions/comfyui-precision-lora/"


class BrowserError(RuntimeError):
    pass


class Browser:
    """One chromium page. ``call(op, **args)`` sends a command to driver.mjs and returns its result."""

    def __init__(self, timeout: float = 60.0):
        problems = []
        if not os.path.exists(CHROMIUM):
            problems.append(f"chromium not found at {CHROMIUM} (apt-get install chromium, or run scripts/setup.sh)")
        if not os.path.isdir(os.path.join(HERE, "node_modules", "playwright-core")):
            problems.append("playwright-core not installed (cd tests/browser && npm install, or run scripts/setup.sh)")
        if shutil.which("node") is None:
            problems.append("node not found on PATH")
        if problems:
            raise BrowserError("[Precision LoRA] browser tests cannot start: " + "; ".join(problems))
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(["node", os.path.join(HERE, "driver.mjs")], cwd=HERE, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._next = 1
        hello = self._read(0, timeout)
        self.version = hello["version"]

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-3000:]

    def _read(self, want_id: int, timeout: float) -> object:
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise BrowserError(f"browser driver did not answer within {timeout}s") from None
            if line is None:
                raise BrowserError(f"browser driver exited:\n{self._stderr_text()}")
            msg = json.loads(line)
            if msg.get("id") != want_id:
                continue
            if not msg.get("ok"):
                raise BrowserError(msg.get("error"))
            return msg.get("result")

    def call(self, op: str, timeout: float = 120.0, **args) -> object:
        rid = self._next
        self._next += 1
        self.proc.stdin.write(json.dumps({"id": rid, "op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read(rid, timeout)

    # conveniences ------------------------------------------------------------------------------
    def evaluate(self, src: str, arg: object = None, timeout: float = 120.0) -> object:
        return self.call("evaluate", src=src, arg=arg, timeout=timeout)

    def wait_for(self, src: str, arg: object = None, timeout: float = 30.0) -> object:
        """Poll ``src(arg)`` in the page until it is truthy; returns that value."""
        return self.call("waitFor", src=src, arg=arg, timeout=timeout + 30, **{"timeout_ms": int(timeout * 1000)})

    def screenshot(self, name: str, selector: str | None = None) -> str:
        os.makedirs(ARTIFACTS, exist_ok=True)
        path = os.path.join(ARTIFACTS, name if name.endswith(".png") else name + ".png")
        self.call("screenshot", path=path, selector=selector)
        return path

    def console(self, clear: bool = False) -> dict:
        return self.call("console", clear=clear)

    def pack_errors(self) -> list[str]:
        """Console errors and uncaught exceptions that come from this pack's scripts."""
        logs = self.console()
        out = [f"console.{m['type']}: {m['text']} ({m['url']}:{m['line']})" for m in logs["messages"]
               if m["type"] == "error" and (PACK_URL_PART in m["url"] or "[Precision LoRA]" in m["text"])]
        out += [f"pageerror: {e['message']}\n{e['stack']}" for e in logs["errors"]
                if PACK_URL_PART in e["stack"] or "[Precision LoRA]" in e["message"]]
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(20)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="session")
def browser():
    b = Browser()
    yield b
    b.close()


PAGE_READY = """() => {
  const app = window.comfyAPI?.app?.app;
  if (!app?.graph || !app.canvas) return false;
  const names = (app.extensions || []).map((e) => e.name);
  return ["precision_lora.train_chart", "precision_lora.lora_info", "precision_lora.scale_display"]
    .every((n) => names.includes(n));
}"""


@pytest.fixture(scope="session")
def comfy_page(comfy_server, browser):
    """The ComfyUI page of the session's server (tests/conftest.py), opened once; tests load workflows into it."""
    # The first visit to a fresh ComfyUI opens the template browser; a returning user's page does not.
    status, body = comfy_server.request("/settings/Comfy.TutorialCompleted", True, method="POST")
    assert status == 200, body
    browser.call("goto", url=comfy_server.url + "/", waitFor=PAGE_READY, timeout=150)
    return browser
