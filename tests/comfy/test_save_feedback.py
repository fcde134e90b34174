"""What a run leaves in the LoRA lists and files: an exploded run's exploded checkpoints renamed out of the
lists (issue 22 item 6); Save LoRA's path shown on the node and kohya's ss_* training keys in the file
(issue 23 item 7)."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from models import cosmos_with_lora

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(train_mods):
    return train_mods


def _setup(mods):
    return cosmos_with_lora(mods, width=32)


def _run(mods, m, latent, cond, steps, settings, name):
    with torch.inference_mode():
        return mods.train.PrecisionTrainLoRA.execute([m], [latent], [cond], [steps], [7], [name],
                                                     settings=[settings])


def test_exploded_checkpoints_leave_the_lora_lists_and_the_error_says_so(mods):
    import comfy_harness
    import folder_paths

    m, latent, cond = _setup(mods)
    events = comfy_harness.server().events
    before = len(events)
    diverge = mods.Settings(learning_rate=10.0, max_grad_norm=0.0, loraplus_ratio=100.0, checkpoint_every=1)
    with pytest.raises(ValueError, match=r"the LoRA exploded: .* checkpoints? of this run with exploded weights "
                                         r"(were|was) renamed out of the LoRA lists \(exploding_step\d+\.safetensors"
                                         r"\.exploded"):
        _run(mods, m, latent, cond, 12, diverge, "exploding")
    folder = os.path.join(folder_paths.get_folder_paths("loras")[0], "exploding")
    files = sorted(os.listdir(folder))
    moved = [f for f in files if f.endswith(".safetensors.exploded")]
    assert moved and all(f[: -len(".safetensors.exploded")] + ".trainstate.exploded" in files for f in moved)
    listed = [n for n in folder_paths.get_filename_list("loras") if n.startswith("exploding/")]
    assert not any(n.endswith(".exploded") for n in listed)
    for name in listed:  # what the lists still offer is healthy
        with safe_open(folder_paths.get_full_path("loras", name), "pt") as f:
            assert all(f.get_tensor(k).abs().max() <= 1e3 for k in f.keys()), name
    assert len(listed) + len(moved) == 12
    done = [d for e, d, _ in events[before:] if e == "precision_lora.train_done"][-1]
    assert done["checkpoint"] is None or not done["checkpoint"].endswith(tuple(moved))


def test_save_lora_shows_its_path_and_writes_kohya_training_keys(mods, pack_module):
    import comfy_harness
    from comfy_execution.utils import CurrentNodeContext

    m, latent, cond = _setup(mods)
    settings = mods.Settings(learning_rate=2e-4, batch_size=1, grad_accum=2, caption_dropout=0.0,
                             lr_schedule="cosine", schedule_steps=100, warmup_steps=1)
    model, state, _, _, _ = _run(mods, m, latent, cond, 3, settings, "feedback").result
    save = pack_module("nodes.lora.node").PrecisionSaveLoRA
    server = comfy_harness.server()
    before = len(server.events)
    with torch.inference_mode(), CurrentNodeContext("prompt-save", "31"):
        out = save.execute(model, "feedback/final", "loras", "fp32", "auto", True, False, training_state=state)
    path = out.result[0]
    assert out.ui["text"] == [path, path[: -len(".safetensors")] + ".trainstate"]
    shown = [d for e, d, _ in server.events[before:] if e == "progress_text"]
    assert shown and shown[-1]["node"] == "31" and path in shown[-1]["text"]
    with safe_open(path, "pt") as f:
        md = f.metadata()
    assert all(isinstance(v, str) for v in md.values())
    expected = {"ss_learning_rate": "0.0002", "ss_lr_scheduler": "cosine", "ss_lr_warmup_steps": "1",
                "ss_max_train_steps": "3", "ss_steps": "3", "ss_resolution": "(32, 16)",
                "ss_network_dim": "2", "ss_network_alpha": "2.0", "ss_caption_dropout_rate": "0.0",
                "ss_gradient_accumulation_steps": "2", "ss_batch_size_per_device": "1", "ss_num_train_images": "1",
                "ss_training_seed": "7", "precision_lora_training_state": os.path.basename(out.ui["text"][1])}
    assert {k: md.get(k) for k in expected} == expected
    assert md["ss_optimizer"].startswith("adamw(betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01")
