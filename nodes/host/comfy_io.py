"""One import point for ComfyUI's V3 node API, so an API rename is a one-line change here."""
from comfy_api.latest import ComfyExtension, io, ui  # noqa: F401

__all__ = ["ComfyExtension", "io", "ui"]
