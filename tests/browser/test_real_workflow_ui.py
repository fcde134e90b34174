"""The shipped real workflows in the page on real-size stand-ins: README.md's "Your first LoRA" followed step by step.

The test that ran train_lora.json and inference_matching_scale.json after picking names (real-size CLIP-L, T5-XXL and
Flux VAE, tiny Flux.1) now follows the README's steps with the same files: tests/browser/test_first_lora_ui.py reads
the steps from README.md and does each (folders, names, Run, where the LoRA lands, the inference workflow); here they
run in order, with two more Runs of the unchanged graph after training, which must train nothing. Budget: 1800 s a
Run (~2 min each on an idle 2-core machine; it holds on one ~10x slower; a hung run still fails within it).
"""
from __future__ import annotations

import pytest
from test_first_lora_ui import (followed, infer_as_step_7, picks_of, run_again_trains_nothing,  # noqa: F401
                                train_as_steps_3_to_6)

pytestmark = pytest.mark.browser


def test_real_workflows_run_after_picking_names(comfy_page, comfy_server, followed):
    page, (base, steps) = comfy_page, followed
    page.console(clear=True)
    picks = picks_of(steps[4])
    lora_name = train_as_steps_3_to_6(page, comfy_server, base, steps, picks)
    run_again_trains_nothing(page, comfy_server)
    infer_as_step_7(page, comfy_server, base, steps, picks, lora_name)
    assert page.pack_errors() == []
