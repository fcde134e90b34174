"""Browser driver client and page helpers for the browser tests (and workflows/build.py).

``Browser`` starts tests/browser/driver.mjs (Debian chromium through playwright-core) and sends it one
JSON command per line. The JS snippets below run in the ComfyUI page.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading

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



# The frontend's full-screen busy mask (PrimeVue BlockUI, shown while ComfyUI starts and while a dropped file
# loads). PrimeVue 4.2's BlockUI leaves an orphaned mask over the whole page, swallowing every click, when it
# is blocked again before the previous mask's fade-out ended (its animationend handler removes the *newest*
# mask): a file dropped right after start-up did that on a slow CI machine. So the helpers below wait for the
# mask to be gone before a drop, and count a page or a graph as ready only without one.

PAGE_READY = """() => {
  const app = window.comfyAPI?.app?.app;
  if (!app?.graph || !app.canvas) return false;
  if (document.querySelector(".p-blockui-mask")) return false;
  if (!window.LiteGraph?.registered_node_types?.["PrecisionLoadDiffusionModel"]) return false;
  const names = (app.extensions || []).map((e) => e.name);
  return ["precision_lora.train_chart", "precision_lora.lora_info", "precision_lora.scale_display",
    "precision_lora.seed_default", "precision_lora.train_report"]
    .every((n) => names.includes(n));
}"""

# Drops a workflow file on the page the way a user's drag-and-drop does (the document's drop handler
# -> app.handleFile). Spies on the missing-node / missing-model dialogs first (they still open).
DROP_WORKFLOW = """async ({ name, text }) => {
  const app = window.comfyAPI.app.app;
  const seen = (window.__precisionDialogs ||= { missingNodes: [], missingModels: [] });
  if (!app.__precisionSpied) {
    const mn = app.showMissingNodesError;
    app.showMissingNodesError = function (types) {
      seen.missingNodes.push(...(types || []).map((t) => (typeof t === "string" ? t : t?.type ?? String(t))));
      return mn.apply(this, arguments);
    };
    const mm = app.showMissingModelsError;
    app.showMissingModelsError = function (models) {
      seen.missingModels.push(...(models || []).map((m) => m?.name ?? String(m)));
      return mm.apply(this, arguments);
    };
    app.__precisionSpied = true;
  }
  seen.missingNodes.length = 0;
  seen.missingModels.length = 0;
  // a drop while the previous busy mask fades out orphans a mask over the page (see PAGE_READY)
  for (let waited = 0; document.querySelector(".p-blockui-mask"); waited += 50) {
    if (waited > 30000) throw new Error("the frontend's busy mask (.p-blockui-mask) stayed 30 s before the drop");
    await new Promise((r) => setTimeout(r, 50));
  }
  const dt = new DataTransfer();
  dt.items.add(new File([text], name, { type: "application/json" }));
  document.dispatchEvent(new DragEvent("drop", { bubbles: true, cancelable: true, dataTransfer: dt }));
  return true;
}"""

# Truthy once the graph holds exactly the wanted node ids; reports dialogs and unknown node types.
GRAPH_LOADED = """(wantIds) => {
  const app = window.comfyAPI.app.app;
  // numbers in frontend 1.32 (ComfyUI 0.3.75), strings in 1.49 (ComfyUI 0.33)
  const ids = app.graph.nodes.map((n) => Number(n.id)).sort((a, b) => a - b);
  if (JSON.stringify(ids) !== JSON.stringify(wantIds)) return false;
  if (document.querySelector(".p-blockui-mask")) return false; // the file is still loading
  const seen = window.__precisionDialogs || { missingNodes: [], missingModels: [] };
  const dialogs = [...document.querySelectorAll(".p-dialog")]
    .filter((d) => d.offsetParent !== null)
    .map((d) => d.innerText.slice(0, 300));
  // Alerts (error / warning toasts); info toasts such as "definitions updated" are not problems.
  const toasts = [...document.querySelectorAll(".p-toast-message")]
    .filter((t) => /p-toast-message-(error|warn)/.test(t.className))
    .map((t) => t.innerText.slice(0, 300));
  const unregistered = app.graph.nodes.filter((n) => !window.LiteGraph.registered_node_types[n.type]).map((n) => n.type);
  return { ids, missingNodes: seen.missingNodes.slice(), missingModels: seen.missingModels.slice(), dialogs, toasts,
    unregistered };
}"""

# The API prompt the page would queue for the current graph.
PROMPT_OF_GRAPH = """async () => (await window.comfyAPI.app.app.graphToPrompt()).output"""

FIT_VIEW = """() => {
  const app = window.comfyAPI.app.app;
  app.canvas.deselectAll?.(); // FitView frames the selection when there is one
  const cmd = app.extensionManager?.command;
  if (cmd?.execute) { cmd.execute("Comfy.Canvas.FitView"); return "command"; }
  return "none";
}"""


FRAMES = "() => new Promise((r) => setTimeout(() => requestAnimationFrame(() => requestAnimationFrame(() => r(true))), 300))"


def fit_view(browser: "Browser") -> None:
    """Frame the whole graph (after the view a freshly loaded workflow restores, and node sizes, settle)."""
    browser.evaluate(FRAMES)
    browser.evaluate(FIT_VIEW)
    browser.evaluate(FRAMES)


# Display-only widgets that frontend 1.32 (ComfyUI 0.3.75) puts into the prompt and 1.49 (0.33) does not:
# the node has no such input, so they are not part of the graph.
DISPLAY_ONLY = {("PreviewAny", "preview")}


def normalise_prompt(prompt: dict) -> dict:
    """class_type and inputs of an API prompt (drops _meta titles and display-only widgets), links as
    [str(node), slot]."""
    out = {}
    for node_id, node in prompt.items():
        inputs = {}
        for k, v in node["inputs"].items():
            if (node["class_type"], k) in DISPLAY_ONLY:
                continue
            if isinstance(v, list) and len(v) == 2 and isinstance(v[1], int):
                v = [str(v[0]), v[1]]
            inputs[k] = v
        out[str(node_id)] = {"class_type": node["class_type"], "inputs": inputs}
    return out


# Closes alerts left by earlier steps, so a test sees only the ones its own action raised.
CLEAR_TOASTS = """() => {
  for (const b of document.querySelectorAll(".p-toast-message .p-toast-close-button")) b.click();
  return new Promise((r) => setTimeout(() => r(document.querySelectorAll(".p-toast-message").length), 300));
}"""

# The frontend's "Introducing Nodes 2.0" banner (shown until dismissed) covers the top of screenshots.
DISMISS_BANNER = """() => {
  const b = document.querySelector("div.from-blue-600 > button.right-4");
  if (b) b.click();
  return Boolean(b);
}"""


# Every node's box on the canvas (title bar included) and the pairs of nodes whose boxes overlap.
NODE_OVERLAPS = """() => {
  const app = window.comfyAPI.app.app;
  const LG = window.LiteGraph;
  const boxes = app.graph.nodes.map((n) => {
    const title = n.constructor?.title_mode === LG.NO_TITLE ? 0 : LG.NODE_TITLE_HEIGHT;
    return [Number(n.id), n.type, [n.pos[0], n.pos[1] - title, n.size[0], n.size[1] + title]];
  });
  const overlaps = [];
  for (let i = 0; i < boxes.length; i++) {
    for (let j = i + 1; j < boxes.length; j++) {
      const [a, b] = [boxes[i][2], boxes[j][2]];
      if (a[0] < b[0] + b[2] && b[0] < a[0] + a[2] && a[1] < b[1] + b[3] && b[1] < a[1] + a[3]) {
        overlaps.push([boxes[i][0], boxes[j][0]]);
      }
    }
  }
  return { boxes, overlaps };
}"""
