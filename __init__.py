"""ComfyUI Precision LoRA: registration only.

ComfyUI imports this package as a custom node pack. It finds ``comfy_entrypoint`` (V3 extension) and
``WEB_DIRECTORY``. Without ComfyUI (unit tests, tools) importing the package does nothing else.
"""
WEB_DIRECTORY = "./web"

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]


async def comfy_entrypoint():
    # Imported lazily: nodes/ is the only package that imports ComfyUI.
    from .nodes.extension import PrecisionLoRAExtension

    return PrecisionLoRAExtension()
