"""ComfyUI Precision LoRA: registration only.

ComfyUI imports this package as a custom node pack. It finds ``comfy_entrypoint`` (V3 extension) and
``WEB_DIRECTORY``. Without ComfyUI (unit tests, tools) importing the package does nothing else.
"""
WEB_DIRECTORY = "./web"

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]


async def comfy_entrypoint():
    # Imported lazily: nodes/ is the only package that imports ComfyUI. A second copy of the pack in
    # custom_nodes/ (another folder name, or a link) registers nothing and names the folder to remove.
    from .nodes.host.single_copy import skip_second_copy

    second_copy = skip_second_copy(__file__)
    if second_copy is not None:
        return second_copy
    # The version gate comes next, so an unsupported ComfyUI gets the supported versions instead of an
    # import error from deep inside.
    from .nodes.host.comfy_compat import check_supported

    check_supported()
    from .demo.nodes import NODES as DEMO_NODES
    from .nodes.extension import PrecisionLoRAExtension

    # The demo nodes feed the tiny demo models in the example workflows; no product module imports them.
    return PrecisionLoRAExtension(extra_nodes=DEMO_NODES)
