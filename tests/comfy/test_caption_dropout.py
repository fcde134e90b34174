"""Caption dropout through PrecisionTrainLoRA on a tiny Flux.1: the empty caption comes in as
``empty_conditioning``; chained and resumed runs stay bit-identical with dropout on."""
from __future__ import annotations

import os

import pytest
import torch

from models import make_conditioning, make_latent, tiny_flux1

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(train_mods):
    return train_mods


@pytest.fixture(scope="module")
def setup(mods):
    model = tiny_flux1()
    with torch.inference_mode():
        m = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=4, alpha=4, targets="all"))
    latents = [make_latent(model, 1, width=32, height=32, seed=s) for s in (1, 2)]
    conds = [make_conditioning(model, 1, text=t) for t in ("a photo of sks", "sks on a beach")]
    # another token count than the captions: dropped samples must form their own forward groups
    empty = make_conditioning(model, 1, text="", tokens=3)
    return m, latents, conds, empty


def _run(mods, setup, steps: int, p: float, conds=None, name: str = "cdrop", **kw):
    m, latents, default_conds, empty = setup
    args = {"settings": [kw.pop("settings", None) or mods.Settings(learning_rate=1e-3, batch_size=2, caption_dropout=p)]}
    kw.setdefault("empty_conditioning", empty)
    args.update({k: [v] for k, v in kw.items() if v is not None})  # ComfyUI omits unconnected optional inputs
    with torch.inference_mode():
        out = mods.train.PrecisionTrainLoRA.execute([m], latents, conds or default_conds, [steps], [0], [name], **args)
    return out.result[:4]


def _lora(mods, model) -> dict:
    return {k: v.detach().clone() for k, v in mods.glue.get_lora_set(model).state_dict().items()}


def test_the_settings_node_offers_caption_dropout_off_by_default(mods):
    spec = {i.id: i for i in mods.train.PrecisionTrainSettings.define_schema().inputs}["caption_dropout"]
    assert (spec.default, spec.min, spec.max) == (0.0, 0.0, 1.0)
    assert mods.train.build_settings({"caption_dropout": 1.5}).startswith("TrainSettings.caption_dropout=1.5")


def test_an_api_workflow_saved_before_caption_dropout_still_validates_and_runs_with_it_off():
    """caption_dropout is an optional input: a prompt without it (every API workflow exported before it existed)
    is not refused as 'Required input is missing', and the settings it builds have dropout off."""
    import json

    from comfy_harness import run_graph

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "workflows", "api", "train_lora_demo.json")) as f:
        prompt = json.load(f)
    settings_id = next(k for k, v in prompt.items() if v["class_type"] == "PrecisionTrainSettings")
    assert prompt[settings_id]["inputs"].pop("caption_dropout") == 0.0  # the shipped file has it
    result = run_graph(prompt, outputs=[settings_id])
    assert result["success"], result["messages"]
    assert result["outputs"][settings_id][0][0].caption_dropout == 0.0


def test_dropout_changes_training_and_p1_trains_on_the_empty_caption(mods, setup):
    _, _, off, _ = _run(mods, setup, 4, 0.0)
    _, _, on, _ = _run(mods, setup, 4, 0.5)
    assert on["loss"] != off["loss"]
    _, _, everything, _ = _run(mods, setup, 4, 1.0)
    _, _, empty_captions, _ = _run(mods, setup, 4, 0.0, conds=[setup[3], setup[3]])
    assert everything["loss"] == empty_captions["loss"]  # exactly: the node swaps the conditioning, nothing else


def test_chained_and_resumed_runs_are_bit_identical_with_dropout_on(mods, setup):
    import folder_paths

    ref_model, _, ref, _ = _run(mods, setup, 10, 0.5)
    a_model, a_state, _, _ = _run(mods, setup, 5, 0.5)
    b_model, _, chained, steps = _run(mods, setup, 5, 0.5, training_state=a_state)
    assert steps == 10 and chained["loss"] == ref["loss"]
    ref_w, b_w = _lora(mods, ref_model), _lora(mods, b_model)
    assert all(torch.equal(ref_w[k], b_w[k]) for k in ref_w)
    settings = mods.Settings(learning_rate=1e-3, batch_size=2, caption_dropout=0.5, checkpoint_every=5)
    _run(mods, setup, 5, 0.5, settings=settings, name="cdrop_resume")
    folder = os.path.join(folder_paths.get_folder_paths("loras")[0], "cdrop_resume")
    newest = sorted(n for n in os.listdir(folder) if n.startswith("cdrop_resume_step000005") and n.endswith(".safetensors"))[-1]
    _, _, resumed, _ = _run(mods, setup, 5, 0.5, resume_from=f"cdrop_resume/{newest}")
    assert resumed["loss"] == ref["loss"]


def test_dropout_without_empty_conditioning_is_refused_with_the_fix(mods, setup):
    with pytest.raises(ValueError, match=r"PrecisionTrainLoRA: input 'empty_conditioning': not connected, but "
                                         r"settings.caption_dropout=0.3 > 0 .*CLIPTextEncode"):
        _run(mods, setup, 1, 0.3, empty_conditioning=None)


def test_an_empty_conditioning_of_several_rows_is_refused(mods, setup):
    m = setup[0]
    with pytest.raises(ValueError, match=r"input 'empty_conditioning': has 2 conditioning rows"):
        _run(mods, setup, 1, 0.3, empty_conditioning=make_conditioning(m, 2, text=""))
