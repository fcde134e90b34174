"""Browser tier: Debian's chromium driven by playwright-core (tests/browser/driver.mjs) against the
session's real ComfyUI server (tests/conftest.py ``comfy_server``).

Missing chromium or playwright-core is a failure with the fix in the message, never a skip:
`bash scripts/setup.sh` installs both.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from precision_browser import DISMISS_BANNER, PAGE_READY, Browser  # noqa: E402


@pytest.fixture(scope="session")
def browser():
    b = Browser()
    yield b
    b.close()


@pytest.fixture(scope="session")
def comfy_page(comfy_server, browser):
    """The ComfyUI page of the session's server, opened once; tests load workflows into it."""
    # The first visit to a fresh ComfyUI opens the template browser; a returning user's page does not.
    status, body = comfy_server.request("/settings/Comfy.TutorialCompleted", True, method="POST")
    assert status == 200, body
    # Screenshots: node text drawn at the zoom that fits a whole workflow; no minimap over the canvas.
    for setting, value in (("LiteGraph.Canvas.LowQualityRenderingZoomThreshold", 0.3), ("Comfy.Minimap.Visible", False)):
        status, body = comfy_server.request(f"/settings/{setting}", value, method="POST")
        assert status == 200, (setting, body)
    browser.call("goto", url=comfy_server.url + "/", waitFor=PAGE_READY, timeout=150)
    browser.evaluate(DISMISS_BANNER)
    # the frontend the run is meant for: the host's pinned one, or PRECISION_LORA_FRONTEND's (--front-end-root)
    running, expected = browser.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__"), expected_frontend_version()
    assert expected in (None, running), f"the page runs frontend {running}, not {expected}"
    return browser


def expected_frontend_version() -> str | None:
    """PRECISION_LORA_FRONTEND=.hosts/frontends/<version>/static (through the 'newest' link too): that version (None
    for a folder not named by a version); otherwise the comfyui-frontend-package this host's venv pins."""
    root = os.environ.get("PRECISION_LORA_FRONTEND")
    if root:
        name = os.path.basename(os.path.dirname(os.path.realpath(root)))
        return name if re.fullmatch(r"\d+\.\d+\.\d+", name) else None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("comfyui-frontend-package")
    except PackageNotFoundError:  # a custom host whose ComfyUI serves a frontend of its own
        return None
