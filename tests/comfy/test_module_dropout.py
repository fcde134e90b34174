"""module_dropout inside its range (issue 22 item 3): a step in which every adapter is dropped has no gradient.

Such a step is skipped (no optimizer update, the LoRA and optimizer state untouched) and counted in the run's
outcome; the generators advance as in any other step, so chained and resumed runs stay bit-identical.
The node's ``execute`` is called as ComfyUI calls an ``is_input_list`` node, under ``inference_mode``.
"""
from __future__ import annotations

import re
import uuid

import pytest
import torch

from models import make_conditioning, make_latent, tiny_flux1

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(train_mods):
    return train_mods


def _attach(mods, module_dropout: float, seed: int = 0):
    """Two adapters (single_blocks.0.linear1 and linear2): with 0.99 about 98 % of the steps drop both."""
    model = tiny_flux1()
    cfg = mods.lora.LoRAConfig(rank=2, alpha=2, targets="all", exclude=r"double_blocks|modulation",
                               module_dropout=module_dropout, seed=seed)
    with torch.inference_mode():
        with_lora = mods.glue.attach_lora(model, cfg)
    return with_lora, make_latent(model, 1, width=16, height=16), make_conditioning(model, 1)


def _train(mods, model, latent, cond, steps: int, name: str = "dropout", **kw):
    args = {"settings": [mods.Settings(learning_rate=1e-3)]}
    args.update({k: [v] for k, v in kw.items()})
    with torch.inference_mode():
        out = mods.train.PrecisionTrainLoRA.execute([model], [latent], [cond], [steps], [0], [name], **args)
    return out.result[:4]


def _values(mods, model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in mods.glue.get_lora_set(model).state_dict().items()}


def test_module_dropout_099_runs_300_steps_and_counts_the_dropped_ones(mods):
    model, latent, cond = _attach(mods, 0.99)
    lora = mods.glue.get_lora_set(model)
    assert len(lora.adapters()) == 2, list(lora.adapters())
    out, state, losses, steps = _train(mods, model, latent, cond, 300)
    assert steps == 300 and len(state.history) == 300
    dropped = [p["step"] for p in state.history if p.get("dropped")]
    trained = [p["step"] for p in state.history if not p.get("dropped")]
    assert 250 < len(dropped) < 300 and trained, (len(dropped), trained)
    # every step measured its loss (a dropped step: with every adapter off, as module dropout defines the loss
    # of any step), so the chart has no gap and no "non-finite" count; dropped steps are marked skipped
    assert all(p["skipped"] for p in state.history if p.get("dropped"))
    assert len(losses["loss"]) == 300 and all(torch.isfinite(torch.tensor(losses["loss"])))
    summary = mods.glue.get_lora_set(out).info["precision_lora_outcome"]
    match = re.search(r"(\d+) steps had every adapter dropped \(module_dropout=0\.99\) and were skipped", summary)
    assert match and int(match.group(1)) == len(dropped), summary
    assert summary.startswith("ok:")
    # the optimizer stepped only on the trained steps (AdamW's per-parameter step count)
    steps_taken = {int(s["step"]) for s in state.optimizer["state"].values()}
    assert max(steps_taken) <= len(trained) and max(steps_taken) > 0


def test_a_dropped_step_changes_neither_the_lora_nor_the_optimizer(mods):
    model, latent, cond = _attach(mods, 0.5)
    _, state, _, _ = _train(mods, model, latent, cond, 12)
    flags = [bool(p.get("dropped")) for p in state.history]
    # a dropped step k after at least one trained step: the state after k - 1 steps equals the one after k
    k = next(i + 1 for i in range(1, len(flags)) if flags[i] and not all(flags[:i]))
    _, before, _, _ = _train(mods, model, latent, cond, k - 1)
    _, after, _, _ = _train(mods, model, latent, cond, k)
    assert after.history[-1]["dropped"] and len(after.history) == k
    assert all(torch.equal(before.lora[name], after.lora[name]) for name in before.lora)
    assert before.optimizer["state"].keys() == after.optimizer["state"].keys()
    for i, slot in before.optimizer["state"].items():
        assert all(torch.equal(v, after.optimizer["state"][i][key]) for key, v in slot.items()), i
    assert not torch.equal(before.generator, after.generator), "the step still drew its batch, noise, timesteps"


def test_chained_runs_with_module_dropout_equal_one_run(mods):
    model, latent, cond = _attach(mods, 0.5, seed=3)
    ref_out, ref_state, ref_losses, _ = _train(mods, model, latent, cond, 10)
    flags = [bool(p.get("dropped")) for p in ref_state.history]
    assert any(flags[:5]) and any(flags[5:]) and not all(flags), flags  # dropped steps in both halves
    a_out, a_state, _, _ = _train(mods, model, latent, cond, 5)
    b_out, b_state, b_losses, b_steps = _train(mods, a_out, latent, cond, 5, training_state=a_state)
    assert b_steps == 10 and b_losses == ref_losses
    assert [bool(p.get("dropped")) for p in b_state.history] == flags
    ref_w, b_w = _values(mods, ref_out), _values(mods, b_out)
    assert ref_w.keys() == b_w.keys() and all(torch.equal(ref_w[k], b_w[k]) for k in ref_w)
    assert ref_state.extra_rng.keys() == b_state.extra_rng.keys()
    assert all(torch.equal(ref_state.extra_rng[k], b_state.extra_rng[k]) for k in ref_state.extra_rng)
    assert torch.equal(ref_state.generator, b_state.generator)
    summary = mods.glue.get_lora_set(b_out).info["precision_lora_outcome"]
    assert f"{sum(flags[5:])} steps had every adapter dropped (module_dropout=0.5)" in summary, summary


def test_resume_from_a_checkpoint_file_with_module_dropout_equals_one_run(mods):
    model, latent, cond = _attach(mods, 0.5, seed=3)
    settings = mods.Settings(learning_rate=1e-3, checkpoint_every=5)
    name = f"dropout_resume_{uuid.uuid4().hex[:6]}"
    ref_out, ref_state, ref_losses, _ = _train(mods, model, latent, cond, 10, name=name + "_ref", settings=settings)
    _train(mods, model, latent, cond, 5, name=name, settings=settings)
    out, state, losses, steps = _train(mods, model, latent, cond, 5, name=name + "_b", settings=settings,
                                       resume_from=f"{name}/{name}_step000005.safetensors")
    assert steps == 10 and losses == ref_losses
    assert [p["dropped"] for p in state.history] == [p["dropped"] for p in ref_state.history]
    assert sum(p["dropped"] for p in state.history[5:]) > 0
    ref_w, w = _values(mods, ref_out), _values(mods, out)
    assert all(torch.equal(ref_w[k], w[k]) for k in ref_w)
    assert all(torch.equal(ref_state.extra_rng[k], state.extra_rng[k]) for k in ref_state.extra_rng)


def test_gradient_checkpointing_with_every_adapter_dropped_skips_the_same_steps(mods):
    """Checkpointed blocks make their inputs require grad, so the loss does even when every adapter is dropped:
    the step is recognised by its missing LoRA gradients, the same steps as without checkpointing."""
    model, latent, cond = _attach(mods, 0.7, seed=1)
    runs = {}
    for ckpt in (False, True):
        settings = mods.Settings(learning_rate=1e-3, gradient_checkpointing=ckpt)
        out, state, losses, _ = _train(mods, model, latent, cond, 10, settings=settings)
        runs[ckpt] = ([bool(p["dropped"]) for p in state.history], losses["loss"], _values(mods, out))
    (flags, losses, weights), (c_flags, c_losses, c_weights) = runs[False], runs[True]
    assert flags == c_flags and 0 < sum(flags) < 10, flags
    assert c_losses == losses
    for key in weights:
        torch.testing.assert_close(c_weights[key], weights[key], rtol=1e-5, atol=1e-6, msg=key)


def test_every_step_dropped_fails_the_run_naming_module_dropout(mods):
    """Nothing learned is a failed run (issue 13, D3): with this seed the first 5 steps drop both adapters."""
    model, latent, cond = _attach(mods, 0.99)
    with pytest.raises(ValueError, match=r"PrecisionTrainLoRA: the run failed.*5 steps had every adapter dropped "
                                         r"\(module_dropout=0\.99\).*every one of the 5 steps had every adapter "
                                         r"dropped.*lower module_dropout"):
        _train(mods, model, latent, cond, 5)
