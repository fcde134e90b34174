"""The pack's scripts in the real ComfyUI page: loaded, registered once each, no errors of ours."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser

OUR_EXTENSIONS = ["precision_lora.train_chart", "precision_lora.lora_info", "precision_lora.scale_display",
                  "precision_lora.seed_default", "precision_lora.train_report", "precision_lora.lora_refresh"]


def test_extensions_register_once_and_log_no_errors(comfy_page):
    names = comfy_page.evaluate("() => (window.comfyAPI.app.app.extensions || []).map((e) => e.name)")
    for name in OUR_EXTENSIONS:
        assert names.count(name) == 1, f"{name} registered {names.count(name)} times"
    # ComfyUI lists every .js under web/ (lib modules included) for the page to import.
    listed = comfy_page.evaluate("async () => (await (await fetch('/extensions')).json())"
                                 ".filter((n) => n.includes('/extensions/comfyui-precision-lora/'))")
    shipped = ("train_chart.js", "lora_info.js", "scale_display.js", "seed_default.js", "lib/series.js",
               "lib/lora_meta.js", "lib/scale.js", "lib/hooks.js", "lib/chart_owner.js",
               "train_report.js", "lib/run_memory.js", "lib/checkpoint_line.js", "lora_refresh.js")
    for f in shipped:
        assert any(s.endswith("/" + f) for s in listed), (f, listed)
    assert len(listed) == len(shipped), f"only shipped modules belong under web/: {listed}"
    assert comfy_page.pack_errors() == []
    comfy_page.screenshot("00_page_loaded")
