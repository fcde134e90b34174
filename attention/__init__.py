"""Pure-torch attention: backend registry, scale resolution, fp64 reference, stable softmax, statistics.

Never imports ComfyUI (tests/unit/test_boundaries.py enforces it).
"""
from __future__ import annotations

from .backends import BACKENDS, available, get_backend
from .config import AttentionConfig
from .reference import math_attention, reference_attention
from .stable import StableOptions, stable_attention

__all__ = [
    "BACKENDS", "AttentionConfig", "StableOptions", "available", "get_backend",
    "math_attention", "reference_attention", "stable_attention",
]
