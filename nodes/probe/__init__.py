"""Precision Probe: what bf16 costs a LoRA and how attention behaves, measured on the user's model."""
