"""The dataset report of PrecisionTrainLoRA is shown on the node, not only logged (issue 14 item 9).

At the start of a run the node sends the report as ComfyUI's progress text for its own node id: both
supported frontends (1.32 with ComfyUI 0.3.75, 1.49 with 0.33) draw that as a read-only text widget on the
executing node, as ComfyUI's own nodes show image sizes. The browser test tests/browser/test_preview_ui.py
checks the widget in the page.
"""
from __future__ import annotations

import logging
import struct

import pytest
import torch

from models import make_conditioning, make_latent, tiny_flux1

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(train_mods):
    return train_mods


def _events_of_a_run(mods, node_id: str | None, client_id: str | None = "client-a"):
    """Runs 2 steps on 3 samples (two sizes, two sharing a caption) as node ``node_id`` of a prompt queued by
    ``client_id``; returns the events the server got during the run and the log lines."""
    import comfy_harness
    from comfy_execution.utils import CurrentNodeContext

    model = tiny_flux1()
    with torch.inference_mode():
        m = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=4, alpha=4, targets="all"))
    latents = [make_latent(model, 1, width=32, height=32, seed=1), make_latent(model, 1, width=32, height=32, seed=2),
               make_latent(model, 1, width=48, height=32, seed=3)]
    conds = [make_conditioning(model, 1, text=t) for t in ("a photo of sks", "a photo of sks", "sks on a beach")]
    server = comfy_harness.server()
    before, old_client = len(server.events), server.client_id
    server.client_id = client_id
    try:
        with torch.inference_mode():
            if node_id is None:
                mods.train.PrecisionTrainLoRA.execute([m], latents, conds, [2], [0], ["report"],
                                                      settings=[mods.Settings(learning_rate=1e-3)])
            else:
                with CurrentNodeContext("prompt-report", node_id):
                    mods.train.PrecisionTrainLoRA.execute([m], latents, conds, [2], [0], ["report"],
                                                          settings=[mods.Settings(learning_rate=1e-3)])
    finally:
        server.client_id = old_client
    return server.events[before:]


def test_the_dataset_report_is_sent_to_the_node_at_the_start_of_the_run(mods, caplog):
    with caplog.at_level(logging.INFO):
        events = _events_of_a_run(mods, "42")
    names = [e for e, _, _ in events]
    texts = [(d, sid) for e, d, sid in events if e == "progress_text"]
    assert len(texts) == 1, names
    shown, sid = texts[0]
    assert shown["node"] == "42" and sid == "client-a"  # to the page that queued the prompt, for this node
    # before the first step: the user reads it while the run goes on
    assert names.index("progress_text") < names.index("precision_lora.train_step")
    text = shown["text"]
    assert text.startswith("dataset: 3 samples from 3 LATENT inputs; sizes ")
    assert "2 buckets" in text and "captions: 2 distinct for 3 samples" in text
    assert "samples 1, 2 have the same caption" in text
    logged = [r.getMessage().split("PrecisionTrainLoRA: ", 1)[1] for r in caplog.records
              if "PrecisionTrainLoRA: dataset:" in r.getMessage() or "PrecisionTrainLoRA: captions:" in r.getMessage()
              or "PrecisionTrainLoRA: samples " in r.getMessage()]
    assert text.split("\n") == logged  # the node shows what the console logs, line for line


def test_without_a_node_id_nothing_is_sent(mods):
    events = _events_of_a_run(mods, None)
    assert [e for e, _, _ in events if e == "progress_text"] == []
    assert "precision_lora.train_step" in [e for e, _, _ in events]  # the run itself happened


def test_the_hosts_progress_text_carries_node_and_text_as_the_frontends_read_them():
    """ComfyUI's own PromptServer.send_progress_text (not the stand-in) packs what both frontends decode:
    a 4-byte big-endian node id length, the node id, then the UTF-8 text."""
    import server as comfy_server

    sent = []

    class Recorder:
        def send_sync(self, event, data, sid=None):
            sent.append((event, data, sid))

    text = "dataset: 3 samples\ncaptions: 2 distinct for 3 samples"
    comfy_server.PromptServer.send_progress_text(Recorder(), text, "42", "client-a")
    (event, data, sid), = sent
    assert event == comfy_server.BinaryEventTypes.TEXT and sid == "client-a"
    (length,) = struct.unpack(">I", data[:4])
    assert data[4:4 + length].decode() == "42" and data[4 + length:].decode() == text
