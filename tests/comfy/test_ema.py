"""Schedule-free's averaged weights and the EMA of the LoRA through the real nodes (issue 26 items 1 and 2):
what Save LoRA and the checkpoints write, that those files resume the run exactly, and that the EMA file
written beside a checkpoint loads in stock ComfyUI with every key."""
from __future__ import annotations

import logging
import os
import uuid

import pytest
import safetensors.torch
import torch

from models import denoise, make_conditioning, make_latent, tiny_flux1

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(train_mods):
    return train_mods


@pytest.fixture(scope="module")
def setup(mods):
    model = tiny_flux1()
    with torch.inference_mode():
        with_lora = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=4, alpha=4, targets="attention"))
    return with_lora, make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)


def _run(mods, setup, steps: int, settings, name: str = "ema", **kw):
    model, latent, cond = setup
    args = {"settings": [settings], **{k: [v] for k, v in kw.items()}}
    with torch.inference_mode():
        return mods.train.PrecisionTrainLoRA.execute([model], [latent], [cond], [steps], [0], [name], **args).result[:4]


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _eval_weights(mods, model, state) -> dict[str, torch.Tensor]:
    """Reference: pytorch_optimizer's own ScheduleFreeAdamW.eval() on the weights training continues from
    (``train_lora``) with the saved optimizer state (its groups in the LoRA set's order)."""
    import pytorch_optimizer

    lora_set = mods.glue.get_lora_set(model)
    name_of = {id(p): n for n, p in lora_set.named_parameters()}
    params = {n: torch.nn.Parameter(v.clone()) for n, v in state.train_lora.items()}
    groups = [{"params": [params[name_of[id(p)]] for p in g["params"]], "lr": 1.0} for g in lora_set.param_groups(1.0)]
    opt = pytorch_optimizer.ScheduleFreeAdamW(groups)
    opt.load_state_dict(state.optimizer)
    opt.eval()
    return {n: p.detach() for n, p in params.items()}


def test_schedule_free_save_lora_writes_the_eval_weights_and_resumes_the_run(mods, setup, pack_module):
    sf = mods.Settings(optimizer="schedulefree_adamw", learning_rate=1e-2)
    _, ref_state, ref_losses, _ = _run(mods, setup, 6, sf)
    a_model, a_state, _, _ = _run(mods, setup, 3, sf)
    reference = _eval_weights(mods, a_model, a_state)
    assert _equal(a_state.lora, reference) and not _equal(a_state.lora, a_state.train_lora)
    assert _equal({k: v.cpu() for k, v in mods.glue.get_lora_set(a_model).state_dict().items()}, a_state.lora)
    prefix = f"ema_tests/{_unique('sf')}"
    save = pack_module("nodes.lora.node").PrecisionSaveLoRA
    with torch.inference_mode():
        path = save.execute(a_model, prefix, "output", "fp32", "auto", False, False, training_state=a_state).result[0]
    assert mods.ckpt.state_lora_mismatch(a_state, safetensors.torch.load_file(path)) is None  # the file = eval weights
    _, b_state, losses, steps = _run(mods, setup, 3, sf, resume_from=f"{prefix}.safetensors")
    assert steps == 6 and losses["loss"] == ref_losses["loss"]
    assert _equal(b_state.lora, ref_state.lora) and _equal(b_state.train_lora, ref_state.train_lora)


def test_ema_beside_and_as_lora_files_resume_and_load_in_stock_comfyui(mods, setup, caplog):
    import folder_paths
    import nodes as comfy_nodes

    ema = dict(learning_rate=1e-2, ema_decay=0.8, ema_warmup=2, checkpoint_every=2)
    run_b, run_l = _unique("ema_beside"), _unique("ema_lora")
    b_model, b_state, _, _ = _run(mods, setup, 3, mods.Settings(**ema), name=run_b)
    l_model, l_state, l_losses, _ = _run(mods, setup, 3, mods.Settings(**ema, ema_save="as_lora"), name=run_l)
    folder = os.path.join(folder_paths.get_folder_paths("loras")[0], run_b)
    stem = f"{run_b}_step00000"
    assert sorted(os.listdir(folder)) == [f"{stem}2.safetensors", f"{stem}2.trainstate", f"{stem}2_ema.safetensors",
                                          f"{stem}3_ema.safetensors"]
    # the same EMA in both runs; as_lora's output LoRA is the EMA, beside's the trained weights
    assert _equal(b_state.ema, l_state.ema) and _equal(l_state.lora, l_state.ema)
    assert not _equal(b_state.lora, b_state.ema) and not b_state.train_lora
    ema_file = os.path.join(folder, f"{stem}3_ema.safetensors")
    assert mods.ckpt.state_lora_mismatch(l_state, safetensors.torch.load_file(ema_file)) is None
    with caplog.at_level(logging.WARNING):
        stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(setup[0], f"{run_b}/{stem}3_ema.safetensors", 1.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    torch.testing.assert_close(denoise(stock), denoise(l_model), rtol=1e-4, atol=1e-4)
    # the as_lora checkpoint of step 2 (its LoRA file is the EMA) resumes into the 3-step run
    _, r_state, losses, steps = _run(mods, setup, 1, mods.Settings(**ema, ema_save="as_lora"), name=_unique("ema_r"),
                                     resume_from=f"{run_l}/{run_l}_step000002.safetensors")
    assert steps == 3 and losses["loss"] == l_losses["loss"]
    assert _equal(r_state.ema, l_state.ema) and _equal(r_state.lora, l_state.lora)
