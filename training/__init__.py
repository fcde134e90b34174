"""Pure-torch training core of ComfyUI Precision LoRA (never imports ComfyUI).

Import the submodules directly (``from training.lora import LoRASet``); this file stays import-light.
"""
