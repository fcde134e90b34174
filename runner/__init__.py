"""Headless runner: a saved workflow's training part with ComfyUI used as a library (``scripts/train.py``)."""
