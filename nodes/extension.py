"""The V3 extension: collects every node class of the pack and registers its HTTP routes once."""
from __future__ import annotations

import importlib

from .comfy_io import ComfyExtension, io

# Each module lists its node classes in NODES. A module that fails to import fails the pack loudly
# (ComfyUI prints IMPORT FAILED), which the e2e tests look for.
NODE_MODULES = (
    "load_model",
    "attention",
    "lora",
    "train",
    "loss_graph",
    "probe",
    "test_data",
)
# Modules with a register() run once at load: HTTP routes, and the sweep of stale temporary files.
ROUTE_MODULES = ("train_routes", "lora_routes", "housekeeping")


def all_nodes() -> list[type[io.ComfyNode]]:
    nodes: list[type[io.ComfyNode]] = []
    for name in NODE_MODULES:
        module = importlib.import_module(f"{__package__}.{name}")
        nodes.extend(module.NODES)
    return nodes


def register_routes() -> None:
    for name in ROUTE_MODULES:
        module = importlib.import_module(f"{__package__}.{name}")
        module.register()


class PrecisionLoRAExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        # ComfyUI 0.3.75 never calls on_load; node loading happens before the server adds its routes,
        # so this is the place to register ours (each register() is idempotent).
        register_routes()
        return all_nodes()
