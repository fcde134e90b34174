"""Browser tier: Debian's chromium driven by playwright-core (tests/browser/driver.mjs) against the
session's real ComfyUI server (tests/conftest.py ``comfy_server``).

Missing chromium or playwright-core is a failure with the fix in the message, never a skip:
`bash scripts/setup.sh` installs both.
"""
from __future__ import annotations

import os
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
    return browser
