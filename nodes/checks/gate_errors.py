"""One error entry per problem, under the input at fault, in ComfyUI's answer to a refused prompt.

ComfyUI (0.3.75 and 0.33, ``execution.validate_inputs``) files the one message a node's ``validate_inputs``
returns once under *every* input that function takes: the pack's gate takes them all (``**values``, so that
ComfyUI's own range and option checks, which NaN passes and 0.3.75 skips for V3 combos, give way to the
gate's), so one bad value came back as one ``custom_validation_failed`` entry per input, and a UI that marks
inputs by ``extra_info.input_name`` marked all of them. No return value or argument list of
``validate_inputs`` changes that, and the gate cannot know in advance which input will be at fault.

So the pack collapses them where the answer leaves the server: an aiohttp middleware on ``POST /prompt`` (and
``/api/prompt``, the frontend's path) keeps one entry per distinct pack message, filed under the input the
message names (``<Node>: input '<name>'=...``; for a rule across inputs, the first input it names). Entries
ComfyUI wrote itself, and messages of other packs, pass unchanged. ``collapse`` is the pure part.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from ..host import errors

log = logging.getLogger(__name__)

MARK = errors.PREFIX
CUSTOM = "custom_validation_failed"
PROMPT_PATHS = ("/prompt", "/api/prompt")
_registered = False


def _message(error: dict) -> tuple[str, str] | None:
    """(input name, pack message) of one of ComfyUI's copies of a pack message (details ``"<input> - <msg>"``)."""
    if error.get("type") != CUSTOM:
        return None
    name = (error.get("extra_info") or {}).get("input_name")
    details = error.get("details")
    if not isinstance(name, str) or not isinstance(details, str) or not details.startswith(f"{name} - {MARK}"):
        return None
    return name, details[len(name) + 3:]


def at_fault(message: str, names: list[str]) -> str:
    """The input ``message`` is about: the first of ``names`` it names (``input 'x'`` before a bare ``x``, as in
    ``include regex ...``), else the first of ``names``."""
    quoted = [(message.find(f"input '{n}'"), n) for n in names if f"input '{n}'" in message]
    if quoted:
        return min(quoted)[1]
    bare = [(m.start(), n) for n in names if (m := re.search(rf"(?<![\w']){re.escape(n)}(?![\w'])", message))]
    return min(bare)[1] if bare else names[0]


def collapse(errors: list[dict]) -> list[dict]:
    """``errors`` of one node with each pack message once, filed under its input; other entries unchanged."""
    copies: dict[str, list[str]] = {}
    for error in errors:
        found = _message(error)
        if found is not None:
            copies.setdefault(found[1], []).append(found[0])
    out, done = [], set()
    for error in errors:
        found = _message(error)
        if found is None:
            out.append(error)
        elif found[1] not in done:
            done.add(found[1])
            name = at_fault(found[1], copies[found[1]])
            extra = {**error["extra_info"], "input_name": name}
            out.append({**error, "details": f"{name} - {found[1]}", "extra_info": extra})
    return out


def collapse_response(body: Any) -> Any:
    """A /prompt answer (``{"error", "node_errors"}``) with every node's errors collapsed."""
    if isinstance(body, dict) and isinstance(body.get("node_errors"), dict):
        for info in body["node_errors"].values():
            if isinstance(info, dict) and isinstance(info.get("errors"), list):
                info["errors"] = collapse(info["errors"])
    return body


def middleware():
    """The aiohttp middleware that collapses the errors of a refused prompt."""
    from aiohttp import web

    @web.middleware
    async def one_entry_per_problem(request: web.Request, handler):
        response = await handler(request)
        if request.method != "POST" or request.path not in PROMPT_PATHS or response.status != 400 \
                or not isinstance(response, web.Response) or response.content_type != "application/json":
            return response
        try:
            body = json.loads(response.body)
        except (TypeError, ValueError):
            return response
        return web.json_response(collapse_response(body), status=response.status)

    return one_entry_per_problem


def register() -> None:
    """Add the middleware to ComfyUI's server once (idempotent); before the server starts, when the pack loads."""
    global _registered
    if _registered:
        return
    from server import PromptServer

    app = getattr(PromptServer.instance, "app", None)
    if app is None:  # an in-process stand-in (tests, the headless runner): no HTTP answers to collapse
        return
    try:
        app.middlewares.append(middleware())
    except RuntimeError:  # aiohttp froze the list: the server started before the pack loaded
        log.warning("the server is already running: a refused prompt lists each pack message "
                    "under every input of its node")
        return
    _registered = True
