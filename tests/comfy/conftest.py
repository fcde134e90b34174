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


@pytest.fixture(scope="session")
def train_mods(pack_module):
    """The modules the training-node tests reach into."""
    class M:
        glue = pack_module("nodes.lora.glue")
        train = pack_module("nodes.train.node")
        tglue = pack_module("nodes.train.glue")
        jobs = pack_module("nodes.train.jobs")
        lora = pack_module("lora.config")
        ckpt = pack_module("training.checkpoint")
        Settings = pack_module("training.settings").TrainSettings
    return M


@pytest.fixture
def one_thread():
    """One intra-op thread: on 2 shared cores, training loops run several times faster than oversubscribed."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
