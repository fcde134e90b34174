"""The tracked training step moved into the pack (``training/memory_step.py``: the training node's memory
planner uses it); this name stays for the bench tools and tests that import ``memory_step``."""
from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import pure_packages  # noqa: E402

pure_packages.install()
sys.modules[__name__] = importlib.import_module("training.memory_step")
