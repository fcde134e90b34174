"""HTTP routes of the training job: stop / checkpoint-now, and the current run's loss history.

Both are scoped to the client that queued the run (docs/workflows.md): ComfyUI gives each client an id (the
prompt's ``client_id``, the websocket ``clientId``) and the job remembers it.

``POST /precision_lora/train/control`` body ``{"action": "stop" | "checkpoint", "client_id": str,
"node_id"?: str}`` addresses only the training job running now (the client never names a file or path).
Answers ``{"ok": true, "action", "node_id", "step", "coalesced"}``; 400 ``{"ok": false, "error"}`` for a bad
body (not JSON, nested too deep, unknown action, no client_id), 413 for a body over ``MAX_BODY`` bytes,
409 when no training runs (``"no training is running"``) or ``node_id`` names another node, 403 when the
run belongs to another client (or was queued without a client_id). A checkpoint request while one is
pending or being written is coalesced into it (``"coalesced": true``): requests never pile up files.

``GET /precision_lora/train/history?client_id=<id>`` answers ``{"running", "node_id", "prompt_id",
"points": [{"step", "loss", "lr", "sigma"}...]}`` of the current (or last) run when that client queued it,
so a reloaded page can redraw its chart; other clients get the empty history.

The handlers take the job to act on from a callable, so tests drive them with aiohttp's test client over
any ``train_jobs.TrainJob``; ``register()`` binds them to ComfyUI's server and the process's job slot.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

CONTROL_ROUTE = "/precision_lora/train/control"
HISTORY_ROUTE = "/precision_lora/train/history"
ACTIONS = ("stop", "checkpoint")
MAX_BODY = 4096  # bytes; a control body is a few dozen
USAGE = '{"action": "stop" | "checkpoint", "client_id": "<your clientId>", "node_id": "<optional>"}'
EMPTY_HISTORY: dict[str, Any] = {"running": False, "node_id": None, "prompt_id": None, "points": []}

_registered = False


def _fail(status: int, error: str):
    from aiohttp import web

    return web.json_response({"ok": False, "error": error}, status=status)


async def _read_body(request: Any, limit: int) -> bytes | None:
    """The request body, or None when it is longer than ``limit`` bytes (read no further)."""
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1024):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse_control(request: Any) -> tuple[dict | None, Any]:
    """(body, None) or (None, error response) for a control request."""
    raw = await _read_body(request, MAX_BODY)
    if raw is None:
        return None, _fail(413, f"body is longer than {MAX_BODY} bytes; send {USAGE}")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than json's recursion limit
        body = None  # (Python 3.12's json parses deeper than 3.11's: such a body arrives as a list)
    if not isinstance(body, dict):
        return None, _fail(400, f"body must be JSON: {USAGE}")
    if body.get("action") not in ACTIONS:
        return None, _fail(400, f"action {str(body.get('action'))[:40]!r} is unknown; use one of {list(ACTIONS)}")
    if not isinstance(body.get("client_id"), str) or not body["client_id"]:
        return None, _fail(400, "client_id is missing: send the websocket clientId of the page that queued "
                                f"the prompt; {USAGE}")
    if body.get("node_id") is not None and not isinstance(body["node_id"], (str, int)):
        return None, _fail(400, "node_id must be a node id (text)")
    return body, None


def make_control_handler(get_job: Callable[[], Any]):
    """aiohttp handler for CONTROL_ROUTE over ``get_job()`` (a ``TrainJob`` or None)."""
    from aiohttp import web

    async def control(request):
        body, error = await _parse_control(request)
        if error is not None:
            return error
        job = get_job()
        if job is None or not job.running:
            return _fail(409, "no training is running")
        if not job.owned_by(body["client_id"]):
            who = "another client" if job.client_id is not None else "no client (it was queued without a client_id)"
            return _fail(403, f"this training run belongs to {who}: only the client that queued it can stop or "
                              "checkpoint it; use ComfyUI's Cancel to interrupt it")
        node_id = body.get("node_id")
        if node_id is not None and str(node_id) != str(job.node_id):
            return _fail(409, f"node {str(node_id)[:40]} is not training now (node {job.node_id} is)")
        coalesced = job.request(body["action"])
        log.info("%s requested for training node %s at step %d%s", body["action"], job.node_id,
                 job.step, " (coalesced with the pending one)" if coalesced else "")
        return web.json_response({"ok": True, "action": body["action"], "node_id": job.node_id, "step": job.step,
                                  "coalesced": coalesced})

    return control


def make_history_handler(get_job: Callable[[], Any]):
    """aiohttp handler for HISTORY_ROUTE."""
    from aiohttp import web

    async def history(request):
        job = get_job()
        mine = job is not None and job.owned_by(request.query.get("client_id"))
        return web.json_response(job.snapshot() if mine else dict(EMPTY_HISTORY))

    return history


def register() -> None:
    """Add both routes to ComfyUI's server once (idempotent)."""
    global _registered
    if _registered:
        return
    from server import PromptServer

    from .jobs import current_job

    routes = PromptServer.instance.routes
    routes.post(CONTROL_ROUTE)(make_control_handler(current_job))
    routes.get(HISTORY_ROUTE)(make_history_handler(current_job))
    from ..checks.graph import on_prompt

    add_handler = getattr(PromptServer.instance, "add_on_prompt_handler", None)  # stand-in servers have none
    if callable(add_handler):
        add_handler(on_prompt)  # rules across nodes, checked when a prompt is queued
    _registered = True
    log.info("routes %s and %s registered", CONTROL_ROUTE, HISTORY_ROUTE)
