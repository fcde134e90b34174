"""LoRA: config, fp32-accumulating layers and the set, the file format, targeting (never imports ComfyUI).

Layering: imports attention/ and training/ only; probe/ and nodes/ build on it.
"""
