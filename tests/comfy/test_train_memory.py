"""300 training steps on tiny Flux.1: resident memory after step 50 grows by < 5 %; base weights bit-identical."""
from __future__ import annotations

import os

import pytest
import torch

from models import make_conditioning, make_latent, tiny_flux1

pytestmark = pytest.mark.slow


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_rss_flat_over_300_steps_and_base_weights_unchanged(pack_module):
    import comfy_harness

    glue, train, lora = pack_module("precision_nodes.lora_glue"), pack_module("precision_nodes.train"), pack_module("lora.config")
    Settings = pack_module("training.settings").TrainSettings
    model = tiny_flux1()
    before = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}
    latent, cond = make_latent(model, 2, width=32, height=32), make_conditioning(model, 2)
    server = comfy_harness.server()
    original, rss = server.send_sync, {}

    def record(event, data, sid=None):
        if event == "precision_lora.train_step":
            rss[data["step"]] = rss_bytes()  # not forwarded: the stand-in's event list would grow

    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server.send_sync = record
    try:
        with torch.inference_mode():
            attached = glue.attach_lora(model, lora.LoRAConfig(rank=8, alpha=8, targets="all"))
            out = train.PrecisionTrainLoRA.execute(
                [attached], [latent], [cond], [300], [0], ["mem"],
                settings=[Settings(learning_rate=1e-4, batch_size=2, grad_accum=2)])
    finally:
        server.send_sync = original
        torch.set_num_threads(old_threads)
    assert out.result[3] == 300 and len(rss) == 300
    growth = (rss[300] - rss[50]) / rss[50]
    assert growth < 0.05, f"RSS grew {growth:.1%} from step 50 ({rss[50] >> 20} MiB) to 300 ({rss[300] >> 20} MiB)"
    after = model.model.diffusion_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
