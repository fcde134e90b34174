"""PrecisionTrainLoRA on tiny real ComfyUI models: chaining, resume, cancel, NaN guard, DOP, base weights.

The node's ``execute`` is called the way ComfyUI calls an ``is_input_list`` node (every input a list)
under ``torch.inference_mode()``, like ComfyUI's executor does.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid

import pytest
import torch

from models import denoise, make_conditioning, make_latent, tiny_cosmos, tiny_flux1

FAMILIES = {"cosmos": tiny_cosmos, "flux1": tiny_flux1}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(train_mods):
    return train_mods


def _setup(mods, family: str, rank: int = 4):
    model = FAMILIES[family]()
    with torch.inference_mode():
        with_lora = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=rank, alpha=rank, targets="all"))
    return model, with_lora, make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)


def _run(mods, model, latent, cond, steps: int, settings=None, name: str = "test", **kw):
    args = {"settings": [settings or mods.Settings(learning_rate=1e-3)]}
    for key, value in kw.items():
        args[key] = [value]
    with torch.inference_mode():
        out = mods.train.PrecisionTrainLoRA.execute([model], [latent], [cond], [steps], [0], [name], **args)
    return out.result[:4]  # the fifth output (preview images) is tested in test_train_preview.py


def _unique(prefix: str) -> str:
    """A run name no other test uses: tests that look into a run's folder must not see another test's files."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def run_folder(name: str) -> str:
    """Where a run's checkpoints land: models/loras/<name>/ (issue 14 item 8)."""
    import folder_paths

    return os.path.join(folder_paths.get_folder_paths("loras")[0], name)


def _lora_values(model, mods) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in mods.glue.get_lora_set(model).state_dict().items()}


@pytest.mark.parametrize("family", ["cosmos", "flux1"])
def test_two_chained_nodes_equal_one_node(mods, family):
    _, m, latent, cond = _setup(mods, family)
    ref_model, ref_state, ref_losses, ref_steps = _run(mods, m, latent, cond, 10)
    a_model, a_state, _, _ = _run(mods, m, latent, cond, 5)
    b_model, b_state, b_losses, b_steps = _run(mods, a_model, latent, cond, 5, training_state=a_state)
    assert (ref_steps, b_steps) == (10, 10)
    assert b_losses["loss"] == ref_losses["loss"] and len(ref_losses["loss"]) == 10
    ref_w, b_w = _lora_values(ref_model, mods), _lora_values(b_model, mods)
    assert ref_w.keys() == b_w.keys() and all(torch.equal(ref_w[k], b_w[k]) for k in ref_w)
    # functional: the first node's output LoRA was not changed by the second node
    assert all(torch.equal(a_state.lora[k], v.cpu()) for k, v in mods.glue.get_lora_set(a_model).named_parameters())


def test_resume_from_checkpoint_file_continues_identical_losses(mods):
    _, m, latent, cond = _setup(mods, "flux1")
    _, _, ref_losses, _ = _run(mods, m, latent, cond, 8)
    settings = mods.Settings(learning_rate=1e-3, checkpoint_every=4)
    run = _unique("resume")
    _run(mods, m, latent, cond, 4, settings=settings, name=run)
    job = mods.jobs.current_job()
    assert job.step == 4
    stem = f"{run}_step000004"
    names = sorted(os.listdir(run_folder(run)))
    assert names == [stem + ".safetensors", stem + ".trainstate"], names  # the state beside the LoRA, no .state.pt
    newest = stem + ".safetensors"
    new_model, state, losses, steps = _run(mods, m, latent, cond, 4, resume_from=f"{run}/{newest}")
    assert steps == 8
    assert losses["loss"] == ref_losses["loss"]
    # A checkpoint written by an earlier version: the same LoRA with its state named <stem>.state.pt.
    folder, old = run_folder(run), "old_suffix_step000004"
    shutil.copy(os.path.join(folder, newest), os.path.join(folder, old + ".safetensors"))
    shutil.copy(os.path.join(folder, stem + ".trainstate"), os.path.join(folder, old + ".state.pt"))
    try:
        old_model, old_state, old_losses, old_steps = _run(mods, m, latent, cond, 4, resume_from=f"{run}/{old}.safetensors")
    finally:
        for suffix in (".safetensors", ".state.pt"):
            os.remove(os.path.join(folder, old + suffix))
    assert old_steps == 8 and old_losses["loss"] == losses["loss"] == ref_losses["loss"]
    new_w, old_w = _lora_values(new_model, mods), _lora_values(old_model, mods)
    assert new_w.keys() == old_w.keys() and all(torch.equal(new_w[k], old_w[k]) for k in new_w)
    assert old_state.generator.equal(state.generator)


def test_checkpoint_is_listed_by_lora_loaders_loads_in_stock_comfyui_and_old_states_resume(mods, caplog):
    """Issue 14 item 8: checkpoints land in models/loras/<run>/ (listed by folder_paths, loaded by stock
    LoraLoaderModelOnly with every key) without their training state (a .trainstate, no model extension of
    ComfyUI); a state in the old output/precision_lora/checkpoints, named .state.pt, still resumes."""
    import folder_paths
    import nodes as comfy_nodes

    _, m, latent, cond = _setup(mods, "flux1")
    _, _, ref_losses, _ = _run(mods, m, latent, cond, 6)
    run = _unique("listed")
    trained, _, _, _ = _run(mods, m, latent, cond, 3, name=run, settings=mods.Settings(learning_rate=1e-3, checkpoint_every=3))
    listed = [n for n in folder_paths.get_filename_list("loras") if n.startswith(f"{run}/{run}_step000003")]
    # ComfyUI lists every file with a model extension (.pt among them): only the LoRA, never its state.
    assert listed and all(n.endswith(".safetensors") for n in listed), listed
    lora = listed[-1]
    assert os.path.isfile(folder_paths.get_full_path("loras", lora)[: -len(".safetensors")] + ".trainstate")
    with caplog.at_level(logging.WARNING):
        stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(m, lora, 1.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    assert len(stock.patches) == len(mods.glue.get_lora_set(trained).adapters())
    torch.testing.assert_close(denoise(stock), denoise(trained), rtol=1e-4, atol=1e-4)
    # An existing user's run: its state in the old folder, resumed by its plain file name.
    state = folder_paths.get_full_path("loras", lora)[: -len(".safetensors")] + ".trainstate"
    os.makedirs(mods.tglue.checkpoint_dir(), exist_ok=True)
    shutil.copy(state, os.path.join(mods.tglue.checkpoint_dir(), "old_place.state.pt"))
    _, _, losses, steps = _run(mods, m, latent, cond, 3, resume_from="old_place.safetensors")
    assert steps == 6 and losses["loss"] == ref_losses["loss"]


def test_cancel_writes_a_loadable_checkpoint_before_stopping(mods, pack_module, caplog):
    import comfy.lora
    import comfy.model_management as mm
    import comfy_harness

    model, m, latent, cond = _setup(mods, "cosmos")
    server = comfy_harness.server()
    original = server.send_sync

    def interrupt_at_step_2(event, data, sid=None):
        original(event, data, sid)
        if event == "precision_lora.train_step" and data["step"] == 2:
            mm.interrupt_current_processing(True)

    server.send_sync = interrupt_at_step_2
    try:
        with pytest.raises(mm.InterruptProcessingException):
            _run(mods, m, latent, cond, 10, settings=mods.Settings(learning_rate=1e-3))
    finally:
        server.send_sync = original
        mm.interrupt_current_processing(False)
    done = [d for e, d, _ in server.events if e == "precision_lora.train_done"][-1]
    assert done["stopped"] is True and done["steps"] == 2 and done["checkpoint"].endswith(".safetensors")
    state = mods.ckpt.load_state(mods.ckpt.state_path_for(done["checkpoint"]))
    assert state.step == 2 and len(state.history) == 2
    tensors = comfy.utils.load_torch_file(done["checkpoint"])
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(tensors, key_map)
    assert not [r for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(patches) == len(mods.glue.get_lora_set(m).adapters())


def test_injected_nan_is_caught_and_nothing_non_finite_is_saved(mods):
    _, m, latent, cond = _setup(mods, "flux1")
    block = m.model.diffusion_model.double_blocks[0]
    calls = {"n": 0}

    def blow_up(module, args, output):
        calls["n"] += 1
        if calls["n"] in (3, 4, 5):  # forwards of optimizer steps 3..5
            return tuple(o * float("nan") for o in output)
        return output

    handle = block.register_forward_hook(blow_up)
    try:
        settings = mods.Settings(learning_rate=1e-3, nan_patience=3, checkpoint_every=1)
        run = _unique("nan")
        out, state, losses, steps = _run(mods, m, latent, cond, 7, settings=settings, name=run)
    finally:
        handle.remove()
    assert [p["step"] for p in state.history if p["skipped"]] == [3, 4, 5]
    assert state.rollbacks == 1 and steps == 7 and len(losses["loss"]) == 4
    folder = run_folder(run)
    states = [n for n in os.listdir(folder) if n.endswith(".trainstate")]
    assert states  # this run's own checkpoints (every step it kept)
    for name in states:
        saved = mods.ckpt.load_state(os.path.join(folder, name))
        assert all(torch.isfinite(v).all() for v in saved.lora.values()), name
    assert all(torch.isfinite(v).all() for v in _lora_values(out, mods).values())


def _sample(model, cond, seed: int = 3) -> torch.Tensor:
    """One euler step of ComfyUI's sampler on ``cond`` (object patches applied), as KSampler runs."""
    import comfy.sample

    latent = make_latent(model, 1, width=32, height=32, seed=seed)["samples"]
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent, disable_pbar=True,
                                   seed=seed)


def test_dop_changes_the_update_and_keeps_the_class_prediction_near_the_base(mods):
    """The same run with and without DOP (class conditioning given to both): the logged DOP term is 0 at init
    (the LoRA is the identity) and positive after; DOP changes the LoRA it trains, and the trained model's
    prediction on the class prompt stays closer to the base model's than without DOP."""
    model, m, latent, cond = _setup(mods, "cosmos")
    class_cond = make_conditioning(model, 1, text="a photo of a person")
    runs = {}
    for dop in (0.0, 4.0):
        settings = mods.Settings(learning_rate=3e-3, dop_multiplier=dop)
        runs[dop] = _run(mods, m, latent, cond, 6, settings=settings, class_conditioning=class_cond)
    dops = [p["dop"] for p in runs[4.0][1].history]
    assert dops[0] == 0.0 and dops[-1] > 0.0
    plain, with_dop = _lora_values(runs[0.0][0], mods), _lora_values(runs[4.0][0], mods)
    assert any(not torch.equal(plain[k], with_dop[k]) for k in plain), "DOP did not change the update"
    base = _sample(model, class_cond)
    drift = {dop: float((_sample(out, class_cond) - base).pow(2).mean()) for dop, (out, *_rest) in runs.items()}
    assert drift[0.0] > 0 and drift[4.0] < 0.5 * drift[0.0], drift  # seeded: 0.06 vs 1.59


def test_base_weights_bit_identical_and_forwards_restored(mods):
    model, m, latent, cond = _setup(mods, "flux1")
    dm = model.model.diffusion_model
    before = {k: v.clone() for k, v in dm.state_dict().items()}
    flags = {n: p.requires_grad for n, p in dm.named_parameters()}
    settings = mods.Settings(learning_rate=1e-2, gradient_checkpointing=True)
    out, state, losses, _ = _run(mods, m, latent, cond, 3, settings=settings)
    after = dm.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert flags == {n: p.requires_grad for n, p in dm.named_parameters()}
    # LoRA object patches and checkpoint wrappers are gone (ComfyUI's unpatch may leave the original bound method)
    leftovers = [n for n, mod in dm.named_modules()
                 if "forward" in mod.__dict__ and getattr(mod.__dict__["forward"], "__func__", None) is not type(mod).forward]
    assert leftovers == []
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in state.lora.items() if "up" in k)


def test_checkpoint_now_and_stop_requests_address_the_running_job(mods):
    """What the HTTP control route does (job.request) while the node runs: a checkpoint, then a stop."""
    import comfy_harness

    _, m, latent, cond = _setup(mods, "flux1")
    server = comfy_harness.server()
    original = server.send_sync

    def control(event, data, sid=None):
        original(event, data, sid)
        if event == "precision_lora.train_step":
            if data["step"] == 2:
                mods.jobs.current_job().request("checkpoint")
            if data["step"] == 4:
                mods.jobs.current_job().request("stop")

    server.send_sync = control
    run = _unique("stop")
    try:
        _, state, losses, steps = _run(mods, m, latent, cond, 10, name=run)
    finally:
        server.send_sync = original
    done = [d for e, d, _ in server.events if e == "precision_lora.train_done"][-1]
    assert steps == 4 and len(losses["loss"]) == 4 and done["stopped"] is True
    names = {n for n in os.listdir(run_folder(run)) if n.endswith(".trainstate")}
    assert names == {f"{run}_step000002.trainstate", f"{run}_step000004.trainstate"}  # requested, then at the stop
    job = mods.jobs.current_job()
    assert job.running is False and [p["step"] for p in job.snapshot()["points"]] == [1, 2, 3, 4]


def test_stopped_run_is_not_served_from_cache_and_saved_lora_records_steps(mods):
    """A Stop changes the node's fingerprint (the next queue retrains); the trained set carries ss_steps."""
    import comfy_harness

    node = mods.train.PrecisionTrainLoRA
    _, m, latent, cond = _setup(mods, "cosmos")
    before = node.fingerprint_inputs(model=[m], steps=[3])
    out_model, _, _, steps = _run(mods, m, latent, cond, 3)
    assert steps == 3 and node.fingerprint_inputs(model=[m], steps=[3]) == before  # normal end: cache stays valid
    assert mods.glue.get_lora_set(out_model).info["ss_steps"] == "3"
    md = mods.glue.build_lora_metadata(out_model, mods.glue.describe_model(out_model), mods.glue.get_lora_set(out_model))
    assert md["ss_steps"] == "3"

    server = comfy_harness.server()
    original = server.send_sync

    def stop_at_two(event, data, sid=None):
        original(event, data, sid)
        if event == "precision_lora.train_step" and data["step"] == 2:
            mods.jobs.current_job().request("stop")

    server.send_sync = stop_at_two
    try:
        out_model, _, _, steps = _run(mods, m, latent, cond, 6)
    finally:
        server.send_sync = original
    assert steps == 2 and mods.glue.get_lora_set(out_model).info["ss_steps"] == "2"
    assert node.fingerprint_inputs(model=[m], steps=[6]) != before


def test_a_vram_plan_runs_the_session_and_the_state_keeps_what_the_user_set(mods, pack_module, monkeypatch):
    """#34: the memory planner's choices are what the training session runs with, recorded as planned (the
    LoRA metadata: the report line and, per setting, what was set and what was planned; ss_ keys say what ran),
    never overwriting the user's settings: the training state keeps them, so a resume with the same settings
    reports no change (it reported 'swap_blocks 0 -> 1' when the plan overwrote them)."""
    _, m, latent, cond = _setup(mods, "cosmos")
    seen = []
    real = mods.tglue.training_session
    monkeypatch.setattr(mods.train, "training_session", lambda model, lora_set, s: seen.append(
        (s.gradient_checkpointing, s.swap_blocks, s.offload_block_inputs)) or real(model, lora_set, s))
    settings = mods.Settings(learning_rate=1e-3, vram_budget_gb="8", gradient_checkpointing=True, swap_blocks=1)
    out_model, state, _, steps = _run(mods, m, latent, cond, 2, settings=settings)
    assert steps == 2 and seen == [(True, 0, False)]  # 8 GiB: checkpointing kept, nothing swapped
    assert (state.settings["swap_blocks"], state.settings["vram_budget_gb"]) == (1, "8")
    info = mods.glue.get_lora_set(out_model).info
    assert json.loads(info["precision_lora_planned"]) == {
        "gradient_checkpointing": {"set": True, "planned": True}, "offload_block_inputs": {"set": False, "planned": False},
        "swap_blocks": {"set": 1, "planned": 0}}
    assert info["precision_lora_vram_plan"].startswith("vram budget 8 GiB: ")
    assert "(the plan replaces swap_blocks=1)" in info["precision_lora_vram_plan"]
    assert info["ss_gradient_checkpointing"] == "True"
    assert pack_module("nodes.train.states").resume_changes(state, settings, "") == []


def _save(mods, pack_module, model, prefix: str, state=None, overwrite: bool = False) -> str:
    save = pack_module("nodes.lora.node").PrecisionSaveLoRA
    extra = {} if state is None else {"training_state": state}
    with torch.inference_mode():
        return save.execute(model, prefix, "output", "fp32", "auto", False, overwrite, **extra).result[0]


def test_saved_training_state_resumes_the_run_exactly(mods, pack_module):
    """Save LoRA writes the state beside the LoRA (issue 22 item 2); one that the earlier Save LoRA put in
    output/precision_lora/checkpoints under the LoRA's file name still resumes by the LoRA's name."""
    _, m, latent, cond = _setup(mods, "cosmos")
    _, _, ref_losses, _ = _run(mods, m, latent, cond, 6)
    a_model, a_state, _, _ = _run(mods, m, latent, cond, 3)
    path = _save(mods, pack_module, a_model, "state_save/resume_me", a_state)
    state_file = path[: -len(".safetensors")] + ".trainstate"
    assert os.path.isfile(path) and os.path.isfile(state_file)
    assert mods.ckpt.load_state(state_file).step == 3
    # a fresh graph: the attached (untrained) LoRA, continued from the saved state by name
    _, _, losses, steps = _run(mods, m, latent, cond, 3, resume_from="state_save/resume_me.safetensors")
    assert steps == 6 and losses["loss"] == ref_losses["loss"]
    old = os.path.join(mods.tglue.checkpoint_dir(), "resume_me.state.pt")
    os.makedirs(mods.tglue.checkpoint_dir(), exist_ok=True)
    os.replace(state_file, old)
    try:
        _, _, losses, steps = _run(mods, m, latent, cond, 3, resume_from="state_save/resume_me.safetensors")
    finally:
        os.remove(old)
    assert steps == 6 and losses["loss"] == ref_losses["loss"]


def test_save_refuses_a_foreign_or_existing_training_state_and_writes_nothing(mods, pack_module):
    import folder_paths

    _, m, latent, cond = _setup(mods, "cosmos")
    a_model, a_state, _, _ = _run(mods, m, latent, cond, 2)
    _, b_state, _, _ = _run(mods, a_model, latent, cond, 1, training_state=a_state)
    out_dir = os.path.join(folder_paths.get_output_directory(), "state_save")
    before = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    with pytest.raises(ValueError, match=r"PrecisionSaveLoRA: input 'training_state' does not hold this LoRA's "
                                         r"values \('.+' differs\): connect the training_state output"):
        _save(mods, pack_module, a_model, "state_save/foreign", b_state)
    with pytest.raises(ValueError, match=r"input 'training_state' belongs to a different LoRA"):
        _save(mods, pack_module, _setup(mods, "flux1")[1], "state_save/foreign", a_state)
    os.makedirs(out_dir, exist_ok=True)
    state_file = os.path.join(out_dir, "taken.trainstate")
    before.add("taken.trainstate")
    with open(state_file, "wb") as f:
        f.write(b"someone else's state")
    try:
        with pytest.raises(ValueError, match=r"taken.trainstate exists in .*: enable overwrite"):
            _save(mods, pack_module, a_model, "state_save/taken", a_state)
        with open(state_file, "rb") as f:
            assert f.read() == b"someone else's state"
    finally:
        os.remove(state_file)
    after = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    assert after == before - {"taken.trainstate"} and not os.path.exists(os.path.join(out_dir, "foreign.trainstate"))


@pytest.mark.parametrize("family", ["cosmos", "flux1"])
def test_checkpointing_with_lora_dropout_trains_the_same_lora(mods, family):
    """Recomputed blocks must redraw the forward's dropout masks (explicit generators torch does not replay)."""
    model = FAMILIES[family]()
    latent, cond = make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)
    cfg = mods.lora.LoRAConfig(rank=4, alpha=4, targets="all", dropout=0.3, rank_dropout=0.3)
    with torch.inference_mode():
        m = mods.glue.attach_lora(model, cfg)
    results = {}
    for ckpt in (False, True):
        settings = mods.Settings(learning_rate=1e-2, gradient_checkpointing=ckpt)
        out, state, losses, _ = _run(mods, m, latent, cond, 3, settings=settings)
        results[ckpt] = (_lora_values(out, mods), losses["loss"], state.extra_rng)
    (plain, plain_losses, plain_rng), (ckpt, ckpt_losses, ckpt_rng) = results[False], results[True]
    assert ckpt_losses == plain_losses
    for key in plain:
        torch.testing.assert_close(ckpt[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)
    assert plain_rng.keys() == ckpt_rng.keys() and all(torch.equal(plain_rng[k], ckpt_rng[k]) for k in plain_rng)


@pytest.mark.parametrize("family", ["cosmos", "flux1"])
def test_checkpointing_wraps_every_block_but_the_last_and_unwraps_them(mods, family):
    """Backward needs the last block's activations first: recomputing them saves no peak memory."""
    _, m, _, _ = _setup(mods, family)
    forked, lora_set = mods.tglue.fork_lora(m)
    dm = forked.model.diffusion_model
    blocks = mods.tglue.find_block_lists(dm, mods.tglue.BLOCK_LISTS)
    assert len(blocks) >= 2
    with mods.tglue.training_session(forked, lora_set, mods.Settings(gradient_checkpointing=True)):
        inside = ["forward" in b.__dict__ for b in blocks]
    assert inside == [True] * (len(blocks) - 1) + [False]
    assert not any("forward" in b.__dict__ for b in blocks)
    with mods.tglue.training_session(forked, lora_set, mods.Settings(gradient_checkpointing=False)):
        assert not any("forward" in b.__dict__ for b in blocks)


def test_stock_loader_weights_are_copied_out_of_inference_mode_once(mods, pack):
    """UNETLoader (run under inference mode, as ComfyUI runs every node) gives inference-tensor weights;
    training copies them once instead of on every forward, and their values stay the same."""
    import folder_paths
    import nodes as comfy_nodes

    from models import write_model_file

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    os.makedirs(folder, exist_ok=True)
    write_model_file("cosmos", os.path.join(folder, "train_stock_cosmos.safetensors"))
    with torch.inference_mode():
        (stock,) = comfy_nodes.UNETLoader().load_unet("train_stock_cosmos.safetensors", "default")
    dm = stock.model.diffusion_model
    assert all(p.is_inference() for p in dm.parameters())  # what the stock loader hands over
    before = {k: v.clone() for k, v in dm.state_dict().items()}
    flags = {n: p.requires_grad for n, p in dm.named_parameters()}
    seen = []
    hook = dm.blocks[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, args: seen.append((torch.is_grad_enabled(), m.weight.is_inference())))
    try:
        with torch.inference_mode():
            m = mods.glue.attach_lora(stock, mods.lora.LoRAConfig(rank=4, alpha=4, targets="all"))
        _, _, losses, steps = _run(mods, m, make_latent(stock, 1, width=32, height=32), make_conditioning(stock, 1), 2)
    finally:
        hook.remove()
    assert steps == 2 and all(v is not None for v in losses["loss"])
    assert [s for s in seen if s[0]] and not any(inf for grad, inf in seen if grad)  # no inference weight in training
    assert not any(p.is_inference() for p in dm.parameters())
    after = dm.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert flags == {n: p.requires_grad for n, p in dm.named_parameters()}


def test_fp8_base_trains_the_same_through_stock_and_precision_loaders(mods, pack):
    """An fp8_e4m3fn base (ComfyUI casts each weight to the compute dtype per layer) trains through either
    loader with the same losses; the fp8 weights are bit-identical afterwards."""
    import comfy_harness
    import folder_paths
    import nodes as comfy_nodes

    from models import write_model_file

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    os.makedirs(folder, exist_ok=True)
    write_model_file("cosmos", os.path.join(folder, "train_fp8_cosmos.safetensors"))
    loader = comfy_harness.node_class("PrecisionLoadDiffusionModel")
    with torch.inference_mode():
        (stock,) = comfy_nodes.UNETLoader().load_unet("train_fp8_cosmos.safetensors", "fp8_e4m3fn")
        ours, _ = loader.execute(model_name="train_fp8_cosmos.safetensors", weight_dtype="fp8_e4m3fn").args
    results = []
    for model in (stock, ours):
        dm = model.model.diffusion_model
        assert dm.blocks[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
        before = {k: v.clone() for k, v in dm.state_dict().items()}
        with torch.inference_mode():
            m = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=4, alpha=4, targets="all"))
        out, _, losses, _ = _run(mods, m, make_latent(model, 1, width=32, height=32), make_conditioning(model, 1), 3,
                                 settings=mods.Settings(learning_rate=1e-2))
        after = dm.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        lora = _lora_values(out, mods)
        assert any(v.abs().sum() > 0 for k, v in lora.items() if "up" in k)  # the LoRA trained
        results.append(losses["loss"])
    assert results[0] == results[1] and all(math.isfinite(v) for v in results[0])


def test_normal_weights_keeps_tied_tensors_tied_and_values_flags_equal(mods):
    with torch.inference_mode():
        root = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        root[1].weight = root[0].weight  # tied
        root[0].bias.requires_grad_(False)
    values = {k: v.clone() for k, v in root.state_dict().items()}
    assert root[0].weight.is_inference() and root[2].running_mean.is_inference()
    assert mods.tglue.normal_weights(root) == 8  # the tied weight once, 2 biases, BatchNorm: 2 params, 3 buffers
    assert root[1].weight is root[0].weight and isinstance(root[0].weight, torch.nn.Parameter)
    assert not any(t.is_inference() for t in [*root.parameters(), *root.buffers()])
    assert not root[0].bias.requires_grad and root[1].bias.requires_grad
    after = root.state_dict()
    assert all(torch.equal(values[k], after[k]) for k in values)
    assert mods.tglue.normal_weights(root) == 0  # nothing left to copy


def test_weights_the_load_itself_turns_into_inference_tensors_are_copied(mods, monkeypatch):
    """On a GPU, model management moves the weights inside the node, i.e. under inference mode, and
    ``Module.to`` there makes them inference tensors; so the copy must come after the load. Simulated on
    the CPU with a lossless dtype round trip inside the load."""
    import comfy.model_management as mm

    original, moved = mm.load_models_gpu, []

    def load_like_a_gpu(models, *args, **kwargs):
        out = original(models, *args, **kwargs)
        for m in models:
            dm = m.model.diffusion_model
            dm.to(torch.float64).to(torch.float32)
            moved.append(all(p.is_inference() for p in dm.parameters()))
        return out

    monkeypatch.setattr(mm, "load_models_gpu", load_like_a_gpu)
    _, m, latent, cond = _setup(mods, "cosmos")
    _, _, losses, steps = _run(mods, m, latent, cond, 2)
    assert moved and all(moved)  # the simulated load did produce inference weights
    assert steps == 2 and all(v is not None and math.isfinite(v) for v in losses["loss"])
