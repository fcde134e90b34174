"""Pure-torch training core of ComfyUI Precision LoRA (never imports ComfyUI).

Import the submodules directly (``from training.loop import train``); this file stays import-light.
"""
