"""HTTP routes of the training job: stop / checkpoint-now, and the current run's loss history.

``POST /precision_lora/train/control`` body ``{"action": "stop" | "checkpoint", "node_id"?: str}`` addresses
only the training job running now (the client never names a file or path). Answers
``{"ok": true, "action", "node_id", "step"}``; 400 ``{"ok": false, "error"}`` for a bad body; 409 when no
training runs (``"no training is running"``) or ``node_id`` names another node.

``GET /precision_lora/train/history`` answers ``{"running", "node_id", "prompt_id", "points": [{"step",
"loss", "lr", "sigma"}...]}`` of the current (or last) run, so a reloaded page can redraw its chart.

``TrainJob`` (the running job's control requests and loss history) lives here, free of ComfyUI, so tests
drive the handlers with aiohttp's test client; ``register()`` binds them to ComfyUI's server.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

CONTROL_ROUTE = "/precision_lora/train/control"
HISTORY_ROUTE = "/precision_lora/train/history"
ACTIONS = ("stop", "checkpoint")
EMPTY_HISTORY: dict[str, Any] = {"running": False, "node_id": None, "prompt_id": None, "points": []}

_registered = False


class TrainJob:
    """The training job that runs now (or ran last): control requests from HTTP and its loss history."""

    def __init__(self, node_id: str | None, prompt_id: str | None, points: list[dict]) -> None:
        self.node_id, self.prompt_id = node_id, prompt_id
        self.points = list(points)
        self.running = True
        self.step = points[-1]["step"] if points else 0
        self._requests: list[str] = []
        self._lock = threading.Lock()

    def request(self, action: str) -> None:
        with self._lock:
            self._requests.append(action)

    def take_request(self) -> str | None:
        with self._lock:
            if not self._requests:
                return None
            return "stop" if "stop" in self._requests else self._requests.pop(0)

    def add_point(self, point: dict) -> None:
        with self._lock:
            self.points.append(point)
            self.step = point["step"]

    def snapshot(self) -> dict:
        with self._lock:
            return {"running": self.running, "node_id": self.node_id, "prompt_id": self.prompt_id,
                    "points": [dict(p) for p in self.points]}


_current: dict[str, TrainJob | None] = {"job": None}


def start_job(node_id: str | None, prompt_id: str | None, points: list[dict]) -> TrainJob:
    job = TrainJob(node_id, prompt_id, points)
    _current["job"] = job
    return job


def current_job() -> TrainJob | None:
    return _current["job"]


def _fail(status: int, error: str):
    from aiohttp import web

    return web.json_response({"ok": False, "error": error}, status=status)


def make_control_handler(get_job: Callable[[], Any]):
    """aiohttp handler for CONTROL_ROUTE over ``get_job()`` (a ``TrainJob`` or None)."""
    from aiohttp import web

    async def control(request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, ValueError):
            return _fail(400, "body must be JSON: {\"action\": \"stop\" | \"checkpoint\"}")
        if not isinstance(body, dict) or body.get("action") not in ACTIONS:
            got = body.get("action") if isinstance(body, dict) else body
            return _fail(400, f"action {got!r} is unknown; use one of {list(ACTIONS)}")
        job = get_job()
        if job is None or not job.running:
            return _fail(409, "no training is running")
        node_id = body.get("node_id")
        if node_id is not None and str(node_id) != str(job.node_id):
            return _fail(409, f"node {node_id} is not training now (node {job.node_id} is)")
        job.request(body["action"])
        log.info("[Precision LoRA] %s requested for training node %s at step %d", body["action"], job.node_id, job.step)
        return web.json_response({"ok": True, "action": body["action"], "node_id": job.node_id, "step": job.step})

    return control


def make_history_handler(get_job: Callable[[], Any]):
    """aiohttp handler for HISTORY_ROUTE."""
    from aiohttp import web

    async def history(request):
        job = get_job()
        return web.json_response(dict(EMPTY_HISTORY) if job is None else job.snapshot())

    return history


def register() -> None:
    """Add both routes to ComfyUI's server once (idempotent)."""
    global _registered
    if _registered:
        return
    from server import PromptServer

    routes = PromptServer.instance.routes
    routes.post(CONTROL_ROUTE)(make_control_handler(current_job))
    routes.get(HISTORY_ROUTE)(make_history_handler(current_job))
    _registered = True
    log.info("[Precision LoRA] routes %s and %s registered", CONTROL_ROUTE, HISTORY_ROUTE)
