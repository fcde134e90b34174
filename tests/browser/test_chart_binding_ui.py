"""A run's loss chart belongs to the graph tab that queued it (issue 23 item 6).

Every API-format file dropped on the page loads with the nil graph id, and two tabs of one shipped file
share that file's fixed id: keyed by graph id, one graph showed another graph's run. The chart is now keyed
by the workflow tab (web/lib/chart_owner.js ``graphIdentity``). Here two API-format graphs are dropped from
two files (same content, different names), each trains with its own step count from the page's Run button,
and each tab shows its own run only.
"""
from __future__ import annotations

import json
import os

import pytest

from precision_browser import CLEAR_TOASTS, DROP_WORKFLOW, GRAPH_LOADED
from test_training_ui import CHART_STATE, FIRST_TRAIN, SECOND_TRAIN, SET_WIDGET, SHOWN_PROMPT, _run_from_page

pytestmark = pytest.mark.browser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_DEMO = os.path.join(ROOT, "workflows", "api", "train_lora_demo.json")

ACTIVE_TAB = """() => window.comfyAPI.app.app.extensionManager?.workflow?.activeWorkflow?.path ?? null"""
GRAPH_ID = """() => { const app = window.comfyAPI.app.app; return (app.rootGraph ?? app.graph).id ?? null; }"""


def _drop_api(page, name: str) -> None:
    with open(API_DEMO) as f:
        _drop_api_text(page, name, f.read())


def _drop_api_text(page, name: str, text: str) -> None:
    """Drops an API-format prompt ``text`` on the page as file ``name`` and waits for its nodes."""
    page.evaluate(CLEAR_TOASTS)
    page.evaluate(DROP_WORKFLOW, {"name": name, "text": text})
    want = sorted(int(k) for k in json.loads(text))
    state = page.wait_for(GRAPH_LOADED, want, timeout=60)
    assert state["missingNodes"] == [] and state["dialogs"] == [], state


def _train(page, server, steps: int) -> str:
    """Sets both Train LoRA nodes to ``steps``, presses Run; returns the prompt id the chart shows."""
    for node in (FIRST_TRAIN, SECOND_TRAIN):
        assert page.evaluate(SET_WIDGET, [node, "steps", steps]) == steps
    entry = _run_from_page(page, server)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:2000]
    done = page.wait_for(f"""() => {{ const s = ({CHART_STATE})({FIRST_TRAIN}); return s && s.done ? s : false; }}""",
                         timeout=60)
    assert done["points"] == steps, done
    return page.evaluate(SHOWN_PROMPT, FIRST_TRAIN)


def test_two_graphs_dropped_from_api_files_keep_their_own_charts(comfy_page, comfy_server):
    page = comfy_page
    _drop_api(page, "chart_a_api.json")
    graph_a, tab_a = page.evaluate(GRAPH_ID), page.evaluate(ACTIVE_TAB)
    prompt_a = _train(page, comfy_server, 3)
    assert prompt_a

    _drop_api(page, "chart_b_api.json")
    graph_b, tab_b = page.evaluate(GRAPH_ID), page.evaluate(ACTIVE_TAB)
    # two tabs; frontends up to 1.49 give both API graphs the same (nil) graph id, the case that keyed charts by
    # graph id got wrong (1.58 gives each dropped file its own id): either way each tab keeps its own chart
    assert tab_a != tab_b, (graph_a, graph_b, tab_a, tab_b)
    # graph B has not run: its Train LoRA shows no points of A's run (the chart follows the tab within a frame
    # or two; keyed by graph id it kept showing A's 3 points)
    try:
        page.wait_for(f"""() => {{ const s = ({CHART_STATE})({FIRST_TRAIN}); return s && s.points === 0 && !s.done; }}""",
                      timeout=10)
    except Exception:
        pytest.fail(f"graph B shows another graph's run: {page.evaluate(CHART_STATE, FIRST_TRAIN)}")
    assert page.evaluate(SHOWN_PROMPT, FIRST_TRAIN) == ""

    prompt_b = _train(page, comfy_server, 5)
    assert prompt_b and prompt_b != prompt_a
    assert page.evaluate(CHART_STATE, FIRST_TRAIN)["points"] == 5
