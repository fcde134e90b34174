"""Everything the pack says to the page, in one place: events, the text under a node, the console line.

Outside a server (tests, tools) there is no ``PromptServer.instance``: every function then does nothing (or
returns None). The headless runner's stand-in server takes console lines itself (``precision_lora_console``).
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def _server() -> Any:
    try:
        from server import PromptServer
    except ImportError:  # pragma: no cover - ComfyUI always has server
        return None
    return getattr(PromptServer, "instance", None)


def client_id() -> str | None:
    """The client that queued the running prompt (ComfyUI sets it on the server while a prompt executes)."""
    client = getattr(_server(), "client_id", None)
    return client if isinstance(client, str) and client else None


def executing_ids(unique_id: str | None = None) -> tuple[str | None, str | None]:
    """(node id, prompt id) of the node executing now; ``unique_id`` (the node's hidden input) when ComfyUI
    gives no executing context."""
    from comfy_execution.utils import get_executing_context

    ctx = get_executing_context()
    node_id = (ctx.node_id if ctx is not None else None) or unique_id
    return (None if node_id is None else str(node_id)), (ctx.prompt_id if ctx is not None else None)


def send(event: str, data: dict) -> None:
    """A ``precision_lora.*`` event to the client that queued the prompt (web/ listens for them)."""
    server = _server()
    if server is not None:
        server.send_sync(event, data, getattr(server, "client_id", None))


def show_on_node(text: str, node_id: str | None = None) -> None:
    """Text under the node in the page for the rest of the run: ComfyUI's progress text, which both supported
    frontends draw as a read-only text widget on the node (ComfyUI's own nodes show sizes with it).
    ``node_id`` None: the node executing now."""
    server = _server()
    if server is None or not hasattr(server, "send_progress_text"):
        return
    node_id = node_id if node_id is not None else executing_ids()[0]
    if node_id is not None:
        server.send_progress_text(text, node_id, client_id())


def console(line: str) -> None:
    """A progress line to ComfyUI's log; under the headless runner to its console instead (its stand-in server
    takes the line), so a headless run prints each report once."""
    take = getattr(_server(), "precision_lora_console", None)
    if callable(take):
        take(line)
    else:
        log.info(line)
