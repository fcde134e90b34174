"""The precision probe: what survives bf16 in a LoRA delta, what the stable backend would change in
attention, and the report (never imports ComfyUI).

Layering: imports attention/, training/ and lora/ only; nodes/ builds on it.
"""
