"""In-process ComfyUI tier: the pack is loaded through ComfyUI's custom-node loader once per session."""
from __future__ import annotations

import pytest

import comfy_harness


@pytest.fixture(scope="session")
def pack():
    return comfy_harness.pack()


@pytest.fixture(scope="session")
def pack_module(pack):
    return comfy_harness.pack_module
