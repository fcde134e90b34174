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


@pytest.fixture
def one_thread():
    """One intra-op thread: on 2 shared cores, training loops run several times faster than oversubscribed."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
