"""PrecisionTrainLoRA fails, instead of reporting success, when its run learned nothing or exploded.

Issue 13, D3: 67 of 80 steps skipped and 20 rollbacks with LoRA weights at 1.4e10 reported success, and the
LoRA was saved by the next node as a good result.
"""
from __future__ import annotations

import pytest
import torch

import comfy_harness
from models import make_conditioning, make_latent, tiny_cosmos


@pytest.fixture(scope="module")
def env(pack_module):
    class E:
        glue = pack_module("nodes.lora_glue")
        train = pack_module("nodes.train")
        Settings = pack_module("training.settings").TrainSettings
        model = tiny_cosmos()
    with torch.inference_mode():
        E.with_lora = E.glue.attach_lora(E.model, pack_module("training.lora").LoRAConfig(rank=2, alpha=2))
    E.latent = make_latent(E.model, 1, width=32, height=32)
    E.cond = make_conditioning(E.model, 1)
    return E


def _train(env, settings, steps, name):
    with torch.inference_mode():
        return env.train.PrecisionTrainLoRA.execute([env.with_lora], [env.latent], [env.cond], [steps], [0], [name],
                                                    settings=[settings])


def test_an_exploding_run_fails_with_the_reason_and_says_so_in_its_done_event(env, one_thread):
    events = comfy_harness.server().events
    before = len(events)
    diverge = env.Settings(learning_rate=10.0, max_grad_norm=0.0, loraplus_ratio=100.0)
    with pytest.raises(ValueError, match=r"^\[Precision LoRA\] PrecisionTrainLoRA: the run failed \(failed: 12 steps, "
                                         r"\d+ skipped, \d+ rollbacks, largest \|LoRA weight\| .*\): "
                                         r"the LoRA exploded: its largest \|weight\| is .*, above the bound 1000 .* lower learning_rate"):
        _train(env, diverge, 12, "outcome_diverge")
    done = [data for event, data, *_ in events[before:] if event == "precision_lora.train_done"]
    assert done and done[-1]["failed"] is True and done[-1]["outcome"].startswith("failed: 12 steps")


def test_a_healthy_run_records_its_outcome_in_the_lora_metadata(env, one_thread):
    out = _train(env, env.Settings(learning_rate=1e-3), 2, "outcome_ok")
    lora_set = env.glue.get_lora_set(out.result[0])
    assert lora_set.info["precision_lora_outcome"].startswith("ok: 2 steps, 0 skipped, 0 rollbacks")
