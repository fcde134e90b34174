"""The precision probe: what survives bf16 in a LoRA delta, and the report (never imports ComfyUI).

Layering: imports attention/, training/ and lora/ only; precision_nodes/ builds on it.
"""
