"""In-process ComfyUI for tests and benches: the pack loaded through ComfyUI's own custom-node loader.

``pack()`` imports ComfyUI once per process (CPU, a temporary base directory) and loads the pack;
``pack_module("nodes.lora.glue")`` returns a sub-module of the loaded pack; ``node_class(id)`` a
registered node class; ``run_graph(prompt)`` executes an API-format prompt with ComfyUI's executor.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "scripts"))
import comfy_bootstrap  # noqa: E402

_PREFIX = "precision_lora_comfy_"
# the base of this process's in-process ComfyUI; removed at exit (comfy_bootstrap.temporary_base)
BASE = os.environ.get("PRECISION_LORA_TEST_BASE") or comfy_bootstrap.temporary_base(_PREFIX)
_pack = None


def pack():
    """The pack's top-level module as ComfyUI loaded it (importing ComfyUI first if needed)."""
    global _pack
    if _pack is None:
        _pack = comfy_bootstrap.load_pack_in_process(BASE)
    return _pack


def pack_module(name: str):
    """A sub-module of the loaded pack, e.g. ``pack_module("demo.tiny_models")``."""
    return importlib.import_module(f"{pack().__name__}.{name}")


def node_class(node_id: str):
    pack()
    import nodes as comfy_nodes

    return comfy_nodes.NODE_CLASS_MAPPINGS[node_id]


def server():
    """The stand-in PromptServer (collects send_sync events in ``.events``)."""
    pack()
    import server as comfy_server

    return comfy_server.PromptServer.instance


def run_graph(prompt: dict, outputs: list[str] | None = None) -> dict:
    """Validate and execute an API-format prompt in-process.

    Returns ``{"success", "messages", "outputs": {node_id: tuple of output values}, "ui": {...}}``.
    Raises AssertionError with ComfyUI's validation errors if the prompt does not validate.
    """
    import uuid

    pack()
    import execution

    prompt_id = str(uuid.uuid4())
    if outputs is None:
        valid = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
        if not valid[0]:
            raise AssertionError(f"prompt did not validate: {valid[1]} {valid[3]}")
        outputs = valid[2]
    else:  # any node may be asked for (not only output nodes): validate just their inputs
        validated: dict = {}
        for node_id in outputs:
            ok, errors, _ = asyncio.run(execution.validate_inputs(prompt_id, prompt, node_id, validated))
            if not ok:
                raise AssertionError(f"node {node_id} did not validate: {errors}")
    executor = execution.PromptExecutor(server(), cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
    executor.execute(prompt, prompt_id, {}, outputs)
    values = {}
    for node_id in prompt:
        entry = executor.caches.outputs.get(node_id)
        if inspect.isawaitable(entry):  # ComfyUI 0.33's caches are async
            entry = asyncio.run(entry)
        if entry is not None:
            values[node_id] = getattr(entry, "outputs", entry)
    return {"success": executor.success, "messages": executor.status_messages,
            "outputs": values, "ui": executor.history_result.get("outputs", {})}
