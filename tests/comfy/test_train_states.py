"""Training states belong to their LoRA (issue 22 item 2) and resume_from takes every form the UI shows
(issue 23 item 2): Save LoRA keeps the subfolder, a state that is not its LoRA's is refused naming both files,
a missing folder is refused with the right form, the absolute path the node shows and the LoRA list's name
both resume. Node-level; tests/e2e/test_states_e2e.py runs the same through a real server's /prompt."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from models import cosmos_with_lora

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(train_mods):
    return train_mods


def _setup(mods):
    return cosmos_with_lora(mods)


def _run(mods, m, latent, cond, steps, lr=1e-3, name="states", **kw):
    args = {"settings": [kw.pop("settings", None) or mods.Settings(learning_rate=lr)]}
    args.update({k: [v] for k, v in kw.items()})
    with torch.inference_mode():
        return mods.train.PrecisionTrainLoRA.execute([m], [latent], [cond], [steps], [0], [name], **args).result[:4]


def _save(pack_module, model, prefix, state, folder="loras"):
    save = pack_module("nodes.lora.node").PrecisionSaveLoRA
    with torch.inference_mode():
        return save.execute(model, prefix, folder, "fp32", "auto", True, False, training_state=state)


def _lora_root() -> str:
    import folder_paths

    return os.path.abspath(folder_paths.get_folder_paths("loras")[0])


def test_states_keep_their_subfolder_resume_their_own_run_and_refuse_another(mods, pack_module):
    m, latent, cond = _setup(mods)
    _, _, ref_a, _ = _run(mods, m, latent, cond, 4, lr=1e-3)
    a_model, a_state, _, _ = _run(mods, m, latent, cond, 2, lr=1e-3)
    b_model, b_state, _, _ = _run(mods, m, latent, cond, 2, lr=3e-3)
    a_path = _save(pack_module, a_model, "states_ab/A/final", a_state).result[0]
    b_path = _save(pack_module, b_model, "states_ab/B/final", b_state).result[0]  # use_counter on: no refusal
    assert os.path.basename(a_path) == os.path.basename(b_path) and a_path != b_path
    a_state_file, b_state_file = (p[: -len(".safetensors")] + ".trainstate" for p in (a_path, b_path))
    assert os.path.isfile(a_state_file) and os.path.isfile(b_state_file)
    rel_a = os.path.relpath(a_path, _lora_root()).replace(os.sep, "/")
    assert rel_a.startswith("states_ab/A/")
    # A's name continues A's run (the same losses as 4 steps in one go, not B's learning rate)
    _, _, losses, steps = _run(mods, m, latent, cond, 2, lr=1e-3, resume_from=rel_a)
    assert steps == 4 and losses["loss"] == ref_a["loss"]
    # B's state put beside A's LoRA (what overwriting did before): refused, naming both files
    shutil.copy(b_state_file, a_state_file)
    problem = mods.train.PrecisionTrainLoRA.validate_inputs(resume_from=[rel_a])
    assert isinstance(problem, str), problem
    assert f"the training state {os.path.realpath(a_state_file)} does not belong to the LoRA " \
           f"{os.path.realpath(a_path)} (their LoRA values differ" in problem
    with pytest.raises(ValueError, match="does not belong to the LoRA"):
        _run(mods, m, latent, cond, 1, resume_from=rel_a)


def test_a_missing_folder_is_refused_with_the_right_form(mods, pack_module):
    m, latent, cond = _setup(mods)
    model, state, _, _ = _run(mods, m, latent, cond, 1)
    _save(pack_module, model, "states_hint/final", state)
    # the earlier Save LoRA's place for states: by the LoRA's file name in output/precision_lora/checkpoints
    legacy = mods.tglue.checkpoint_dir()
    os.makedirs(legacy, exist_ok=True)
    shutil.copy(os.path.join(_lora_root(), "states_hint", "final_00001_.trainstate"),
                os.path.join(legacy, "final_00001_.trainstate"))
    try:
        problem = mods.train.PrecisionTrainLoRA.validate_inputs(resume_from=["no_such_folder/final_00001_.safetensors"])
    finally:
        os.remove(os.path.join(legacy, "final_00001_.trainstate"))
    assert isinstance(problem, str) and "there is no folder 'no_such_folder' in " in problem, problem
    assert "e.g. 'my_lora/my_lora_step000072.safetensors'" in problem and "such as 'my_lora'" not in problem
    assert "states_hint/final_00001_.safetensors" in problem  # the nearest resumable checkpoint is named


def test_resume_takes_the_absolute_path_the_node_shows_and_the_list_name(mods):
    import comfy_harness
    import folder_paths

    m, latent, cond = _setup(mods)
    _, _, ref, _ = _run(mods, m, latent, cond, 4, name="shown")
    server = comfy_harness.server()
    before = len(server.events)
    _run(mods, m, latent, cond, 2, name="shown", settings=mods.Settings(learning_rate=1e-3, checkpoint_every=2))
    done = [d for e, d, _ in server.events[before:] if e == "precision_lora.train_done"][-1]
    absolute = done["checkpoint"]  # the line the node shows: "checkpoint: <absolute path>"
    listed = os.path.relpath(absolute, _lora_root()).replace(os.sep, "/")
    assert os.path.isabs(absolute) and listed in folder_paths.get_filename_list("loras")
    for form in (absolute, listed):
        assert mods.train.PrecisionTrainLoRA.validate_inputs(resume_from=[form]) is True, form
        _, _, losses, steps = _run(mods, m, latent, cond, 2, name="shown2", resume_from=form)
        assert steps == 4 and losses["loss"] == ref["loss"], form
    outside = mods.train.PrecisionTrainLoRA.validate_inputs(resume_from=["/etc/final.safetensors"])
    assert isinstance(outside, str) and "is an absolute path outside the loras folders" in outside
    assert "e.g. 'my_lora/my_lora_step000072.safetensors'" in outside
