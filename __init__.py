"""ComfyUI Precision LoRA: registration only.

ComfyUI imports this package as a custom node pack. It finds ``comfy_entrypoint`` (V3 extension) and
``WEB_DIRECTORY``. Without ComfyUI (unit tests, tools) importing the package does nothing else.
"""
WEB_DIRECTORY = "./web"

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]


async def comfy_entrypoint():
    # Imported lazily: nodes/ is the only package that imports ComfyUI. The version gate comes first, so an
    # unsupported ComfyUI gets the supported versions instead of an import error from deep inside.
    from .nodes.host.comfy_compat import check_supported

    check_supported()
    from .demo.nodes import NODES as DEMO_NODES
    from .nodes.extension import PrecisionLoRAExtension

    # The demo nodes feed the tiny demo models in the example workflows; no product module imports them.
    return PrecisionLoRAExtension(extra_nodes=DEMO_NODES)
