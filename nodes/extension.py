"""The V3 extension: the pack's node classes and its one-time registrations (HTTP routes, start-up sweep)."""
from __future__ import annotations

from .attention import node as attention
from .checks import gate_errors
from .dataset import cache as dataset_cache, node as dataset, resolution, video_node as video_dataset
from .host import errors, housekeeping
from .lora import node as lora, routes as lora_routes
from .model import info as model_info, load as load_model
from .probe import node as probe
from .train import loss_graph, node as train, preview_node, routes as train_routes
from .host.comfy_io import ComfyExtension, io

# A module that fails to import fails the pack loudly (ComfyUI prints IMPORT FAILED), which the e2e tests
# look for.
PRODUCT_NODES: list[type[io.ComfyNode]] = [
    *load_model.NODES, *attention.NODES, *lora.NODES, *resolution.NODES, *train.NODES, *preview_node.NODES, *loss_graph.NODES, *probe.NODES,
    *dataset.NODES,
    *dataset_cache.NODES,
    *video_dataset.NODES,
]
# Each register() is idempotent: HTTP routes, the sweep of stale temporary files, the middleware that
# files each of the gate's messages once, under its input, and the prefix on the pack's log records.
REGISTRATIONS = (train_routes.register, lora_routes.register, model_info.register, housekeeping.register,
                 gate_errors.register, errors.install_log_prefix)


def register_routes() -> None:
    for register in REGISTRATIONS:
        register()


class PrecisionLoRAExtension(ComfyExtension):
    """The product nodes plus ``extra_nodes`` (the demo nodes, passed in by the pack's ``__init__``)."""

    def __init__(self, extra_nodes: list[type[io.ComfyNode]] = ()):
        self.extra_nodes = list(extra_nodes)

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        # ComfyUI 0.3.75 never calls on_load; node loading happens before the server adds its routes,
        # so this is the place to register ours.
        register_routes()
        return [*PRODUCT_NODES, *self.extra_nodes]
