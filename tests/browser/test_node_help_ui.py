"""Every pack node's help page, read in ComfyUI's own node documentation panel as a user opens it.

For every node the pack registers (the pack's entries of the server's /object_info: product and demo nodes, the
same set as web/docs/, which tests/comfy/test_node_help_pages.py ties to comfy_entrypoint), through the real panel:
the node is added to an empty canvas as the node menu adds it and selected, then the selection toolbox's Info
button (data-testid "info-button") is clicked with a real mouse click. The frontend's NodeHelpService fetches
/extensions/<pack folder>/docs/<NodeId>.md and the panel renders it as markdown: the node library sidebar's help
page on frontend 1.32 (ComfyUI 0.3.75), the right side panel's Info tab on 1.49 (ComfyUI 0.33.0) and 1.5x (the
newest, PRECISION_LORA_FRONTEND). The test reads the rendered text of the panel (.node-help-content, the markdown
only, not the panel's title bar): the page's first heading as a rendered <h1>, and every line of its "## Inputs"
section as rendered text (not the frontend's fallback, which shows only the node's description and an input table).
"""
from __future__ import annotations

import os
import re

import pytest

from precision_browser import BrowserError

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "web", "docs")
PACK_MODULE = "custom_nodes.comfyui-precision-lora"

# A blank canvas with one node of this type, added as the node menu adds it, framed and selected.
ADD_AND_SELECT = """(type) => {
  const app = window.comfyAPI.app.app;
  for (const n of [...app.graph.nodes]) app.graph.remove(n);
  const node = window.LiteGraph.createNode(type);
  app.graph.add(node);
  app.canvas.deselectAll?.();
  app.extensionManager.command.execute("Comfy.Canvas.FitView");
  app.canvas.selectNode(node);
  app.canvas.setDirty(true, true);
  return node.id;
}"""

# The help panel's markdown as rendered, once it shows the wanted page's heading (or, after `any`, whatever it shows).
HELP_SHOWN = """([heading, any]) => {
  const panels = [...document.querySelectorAll(".node-help-content")].filter((e) => e.offsetParent !== null);
  if (panels.length !== 1) return any ? { panels: panels.length } : false;
  const h1 = [...panels[0].querySelectorAll("h1")].map((h) => h.innerText.trim());
  if (!any && !h1.includes(heading)) return false;
  return { h1, text: panels[0].innerText };
}"""

# Leaves the page as the later tests expect it: no side panel open (1.49+ remembers the right side panel's state in
# the user's settings; 1.32 shows help in the node library sidebar tab).
CLOSE_PANELS = """async () => {
  const app = window.comfyAPI.app.app;
  const em = app.extensionManager;
  if (em.sidebarTab?.activeSidebarTabId === "node-library") {
    em.command.execute("Workspace.ToggleSidebarTab.node-library");
  }
  if (em.setting.get("Comfy.RightSidePanel.IsOpen")) await em.setting.set("Comfy.RightSidePanel.IsOpen", false);
  for (const n of [...app.graph.nodes]) app.graph.remove(n);
  return true;
}"""


def _markdown_text(md: str) -> str:
    """The text a markdown line shows once rendered: no code spans' backticks, emphasis marks or link targets."""
    md = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", md)
    md = md.replace("`", "").replace("**", "")
    return " ".join(md.split())


def page_facts(node_id: str) -> tuple[str, list[str]]:
    """The page's first heading and the rendered text of each item of its '## Inputs' section."""
    with open(os.path.join(DOCS, f"{node_id}.md"), encoding="utf-8") as f:
        text = f.read()
    heading = re.search(r"^# +(.+?)\s*$", text, re.M).group(1)
    inputs = re.search(r"^## Inputs\s*$(.*?)^## ", text, re.M | re.S).group(1)
    items = re.split(r"^- ", inputs, flags=re.M)[1:]
    return heading, [_markdown_text(item) for item in items]


def pack_nodes(server) -> list[str]:
    return sorted(n for n, d in server.object_info().items() if d.get("python_module") == PACK_MODULE)


def test_the_server_registers_a_help_page_for_each_pack_node(comfy_server):
    nodes = pack_nodes(comfy_server)
    pages = sorted(f[:-3] for f in os.listdir(DOCS) if f.endswith(".md"))
    assert len(nodes) >= 17 and nodes == pages, (nodes, pages)


def test_every_pack_node_shows_its_help_page_in_the_panel(comfy_page, comfy_server):
    page = comfy_page
    page.console(clear=True)
    shown, problems = {}, []
    try:
        for node_id in pack_nodes(comfy_server):
            heading, inputs = page_facts(node_id)
            page.evaluate(ADD_AND_SELECT, node_id)
            page.evaluate("() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))")
            page.call("click", selector='[data-testid="info-button"]')
            try:
                state = page.wait_for(HELP_SHOWN, [heading, False], timeout=15)
            except BrowserError:
                shows = page.evaluate(HELP_SHOWN, [heading, True])
                problems.append(f"{node_id}: the panel did not show '# {heading}': {shows}")
                continue
            text = " ".join(state["text"].split())
            missing = [line for line in inputs if line not in text]
            if missing:
                problems.append(f"{node_id}: input lines not in the rendered panel: {missing}\n  panel: {text[:600]}")
            shown[node_id] = state
            if node_id == "PrecisionLoadLoRA":
                page.screenshot("node_help_panel")
    finally:
        page.evaluate(CLOSE_PANELS)
        errors = page.pack_errors()
        page.console(clear=True)  # the expected 404s below are not the later tests' errors
    assert not problems, "\n".join(problems)
    assert len(shown) >= 17
    # The frontend asks for the page in the user's language first (docs/<NodeId>/en.md), which the pack does not ship;
    # the browser logs that 404 before the fallback to docs/<NodeId>.md, which is the page shown above.
    locale_first = re.compile(r"404 .*/extensions/comfyui-precision-lora/docs/Precision\w+/en\.md")
    assert [e for e in errors if not locale_first.search(e)] == []
