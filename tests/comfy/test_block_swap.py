"""Block swap through PrecisionTrainLoRA on tiny real ComfyUI models (#29 item 3).

On the CPU the device is the host, so the swap's "device" slots are host buffers; the code path is the one a
GPU runs (pack, ring, load before each block and its recomputation), without streams.
"""
from __future__ import annotations

import os
import uuid

import pytest
import torch

from models import make_conditioning, make_latent, tiny_cosmos, tiny_flux1, tiny_flux2

FAMILIES = {"cosmos": tiny_cosmos, "flux1": tiny_flux1, "flux2": tiny_flux2}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mods(train_mods, pack_module):
    train_mods.swap = pack_module("training.swap")
    train_mods.swap_glue = pack_module("nodes.train.swap_glue")
    train_mods.file = pack_module("lora.file")
    return train_mods


@pytest.fixture
def loads(mods, monkeypatch):
    """Counts BlockSwap.before calls (block runs that went through the swap) per run."""
    calls: list[int] = []
    original = mods.swap.BlockSwap.before

    def spy(self, i):
        calls.append(i)
        return original(self, i)

    monkeypatch.setattr(mods.swap.BlockSwap, "before", spy)
    return calls


def _setup(mods, family: str):
    model = FAMILIES[family]()
    with torch.inference_mode():
        m = mods.glue.attach_lora(model, mods.lora.LoRAConfig(rank=4, alpha=4, targets="all"))
    return m, make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)


def _settings(mods, swap: int, **kw):
    return mods.Settings(learning_rate=1e-3, gradient_checkpointing=True, swap_blocks=swap, **kw)


def _run(mods, model, latent, cond, steps: int, settings, name: str = "swap", **kw):
    args = {"settings": [settings]}
    for key, value in kw.items():
        args[key] = [value]
    with torch.inference_mode():
        out = mods.train.PrecisionTrainLoRA.execute([model], [latent], [cond], [steps], [0], [name], **args)
    return out.result[:4]


def _saved(mods, model) -> dict[str, torch.Tensor]:
    """The tensors PrecisionSaveLoRA writes (fp32, the family's key style)."""
    lora_set = mods.glue.get_lora_set(model)
    family = mods.glue.describe_model(model).family
    return mods.file.lora_state_dict(lora_set, mods.file.default_key_style(family), "fp32")


def _blocks(model, mods):
    return mods.tglue.find_block_lists(model.model.diffusion_model, mods.tglue.BLOCK_LISTS)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["flux1", "flux2", "cosmos"])
def test_swap_on_equals_swap_off_bit_for_bit(mods, family, loads):
    m, latent, cond = _setup(mods, family)
    half = len(_blocks(m, mods)) // 2  # of the len - 1 checkpointed blocks
    assert half >= 1
    ref_model, _, ref_losses, _ = _run(mods, m, latent, cond, 4, _settings(mods, 0))
    assert loads == []
    out, _, losses, _ = _run(mods, m, latent, cond, 4, _settings(mods, half))
    assert losses["loss"] == ref_losses["loss"] and len(losses["loss"]) == 4
    assert _same(_saved(mods, out), _saved(mods, ref_model))
    # each step ran the swapped blocks forward and again in backward's recomputation
    assert len(loads) == 4 * 2 * half and set(loads) == set(range(half))


def test_chained_and_resumed_runs_with_swap_equal_one_run(mods, loads):
    m, latent, cond = _setup(mods, "flux1")
    swap = len(_blocks(m, mods)) - 1  # every checkpointed block
    ref_model, _, ref_losses, _ = _run(mods, m, latent, cond, 10, _settings(mods, swap))
    a_model, a_state, _, _ = _run(mods, m, latent, cond, 5, _settings(mods, swap))
    b_model, _, b_losses, b_steps = _run(mods, a_model, latent, cond, 5, _settings(mods, swap), training_state=a_state)
    assert b_steps == 10 and b_losses["loss"] == ref_losses["loss"]
    assert len(loads) == (10 + 5 + 5) * 2 * swap  # every run streamed every checkpointed block, both ways
    assert _same(_saved(mods, b_model), _saved(mods, ref_model))
    # resume from the step-5 checkpoint file of a swapped run, swap on again
    run = f"swap_resume_{uuid.uuid4().hex[:8]}"
    _run(mods, m, latent, cond, 5, _settings(mods, swap, checkpoint_every=5), name=run)
    r_model, _, r_losses, r_steps = _run(mods, m, latent, cond, 5, _settings(mods, swap),
                                         resume_from=f"{run}/{run}_step000005.safetensors")
    assert r_steps == 10 and r_losses["loss"] == ref_losses["loss"]
    assert _same(_saved(mods, r_model), _saved(mods, ref_model))


def test_session_places_the_model_and_tells_model_management(mods):
    """Inside a swapped session the swapped blocks' base weights are views of their packed host buffers or of
    the ring; model management holds the model with the resident bytes; afterwards all of it is undone."""
    import comfy.model_management as mm

    m, _, _ = _setup(mods, "cosmos")
    forked, lora_set = mods.tglue.fork_lora(m)
    blocks = _blocks(forked, mods)
    with mods.tglue.training_session(forked, lora_set, _settings(mods, 2)) as device:
        held = [lm for lm in mm.current_loaded_models if lm.model is forked]
        assert len(held) == 1 and forked.model.model_loaded_weight_memory > 0
        streamed = sum(p.numel() * p.element_size() for b in blocks[:2] for p in b.parameters())
        every = [*forked.model.parameters(), *forked.model.buffers()]
        total = sum(t.numel() * t.element_size() for t in every)
        assert forked.model.model_loaded_weight_memory == total - streamed  # what is really on the device
        for b in blocks[:2]:  # one packed buffer per block: its weights lie in one span of their aligned sizes
            params = mods.swap.frozen_params(b)
            span = max(p.data_ptr() + p.numel() * p.element_size() for p in params) - min(p.data_ptr() for p in params)
            assert span <= sum(-(-p.numel() * p.element_size() // mods.swap.ALIGN) * mods.swap.ALIGN for p in params)
        assert all(not p.requires_grad for b in blocks[:2] for p in b.parameters())
        # wrapped: swap inside, checkpointing outside (every block but the last)
        assert ["forward" in b.__dict__ for b in blocks] == [True] * (len(blocks) - 1) + [False]
        assert device == forked.load_device
    assert not any(lm.model is forked for lm in mm.current_loaded_models)
    assert not any("forward" in b.__dict__ for b in blocks)
    assert all(p.device == forked.offload_device for p in forked.model.parameters())


def test_swap_without_checkpointing_or_beyond_the_blocks_is_refused(mods, pack_module):
    with pytest.raises(ValueError) as err:
        mods.Settings(swap_blocks=3)
    assert "swap_blocks=3" in str(err.value) and "gradient_checkpointing" in str(err.value)
    node = pack_module("nodes.train.node").PrecisionTrainSettings
    values = {**mods.Settings().to_dict(), "swap_blocks": 3}
    problem = node.check(values)
    assert problem is not None and "swap_blocks=3" in problem and "turn gradient_checkpointing on" in problem
    m, latent, cond = _setup(mods, "cosmos")
    most = len(_blocks(m, mods)) - 1
    with pytest.raises(ValueError) as err:
        _run(mods, m, latent, cond, 1, _settings(mods, most + 1))
    msg = str(err.value)
    assert "PrecisionTrainSettings" in msg and f"'swap_blocks'={most + 1}" in msg and f"at most {most}" in msg
    # a stock LoRA loader's weight patch is applied by ComfyUI only on a whole-model load: refused, nothing moved
    patched = m.clone()
    key = next(k for k in patched.model.state_dict() if k.endswith(".weight") and "blocks.0." in k)
    assert patched.add_patches({key: ("diff", (torch.zeros_like(patched.model.state_dict()[key]),))}) == [key]
    with pytest.raises(ValueError) as err:
        _run(mods, patched, latent, cond, 1, _settings(mods, 1))
    assert "1 weight patches" in str(err.value) and "set swap_blocks to 0" in str(err.value)


def test_bench_prints_swap_beside_no_swap(loads, monkeypatch, capsys):
    """bench/train.py --swap-blocks N: ours with checkpointing, N blocks swapped vs none, side by side with the
    ratio. Each configuration runs in this process (the bench's own child function, not a subprocess: two
    ComfyUI start-ups would cost a minute) and the swapped one streamed its block."""
    import importlib.util
    import json
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("bench_train_swap", os.path.join(root, "bench", "train.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    children: list[dict] = []

    def spawn(args, width, trainer, checkpointing, swap=0):
        argv = ["--child", "--quick", "--threads", "1", "--trainer", trainer, "--swap", str(swap)]
        bench.main(argv + (["--checkpointing"] if checkpointing else []))
        children.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        return children[-1]

    monkeypatch.setattr(bench, "_spawn", spawn)
    bench.main(["--quick", "--threads", "1", "--swap-blocks", "1"])
    text = capsys.readouterr().out
    assert [(c["swap"], c["checkpointing"], c["trainer"]) for c in children] == [(0, True, "ours"), (1, True, "ours")]
    rows = re.findall(r"^([01])\s+([0-9.]+)\s+([0-9.]+)$", text, re.M)
    assert [r[0] for r in rows] == ["0", "1"] and all(float(r[1]) > 0 for r in rows), text
    assert re.search(r"^ratio swap 1/none, model=tiny: time [0-9.]+x", text, re.M), text
    assert loads and set(loads) == {0}  # only the swapped run streamed, its one block


def test_previews_sample_through_the_swap_and_leave_placement_alone(mods, pack_module):
    """A preview samples with the training model mid-run (ComfyUI's sampler calls load_models_gpu on it, and
    the previewer again after decoding): the images and the training are those of the run without swap, and
    model management kept the model as the swap placed it (its resident bytes, never a full load) throughout."""
    from preview_vae import tiny_vae

    node = pack_module("nodes.train.preview_node").PrecisionPreviewSettings
    m, latent, cond = _setup(mods, "flux1")
    base = m.model
    pv = node.execute(positive=cond, vae=tiny_vae(), sampler_name="euler", scheduler="simple", steps=2, cfg=1.0,
                      width=32, height=32, batch_size=1, seed=7, every_n_steps=2, at_start=True,
                      at_end=True).result[0]
    seen: list[int] = []
    original = mods.swap.BlockSwap.before

    def spy(self, i):
        seen.append(base.model_loaded_weight_memory)
        return original(self, i)

    runs = {}
    for swap in (0, 1):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mods.swap.BlockSwap, "before", spy)
            with torch.inference_mode():
                out = mods.train.PrecisionTrainLoRA.execute([m], [latent], [cond], [3], [0], [f"swap_pv{swap}"],
                                                            settings=[_settings(mods, swap)], preview=[pv])
        runs[swap] = out.result
    (ref, on) = runs[0], runs[1]
    assert on[2]["loss"] == ref[2]["loss"] and _same(_saved(mods, on[0]), _saved(mods, ref[0]))
    assert torch.equal(on[4], ref[4])  # the last preview's images, sampled through the streamed block
    whole = sum(t.numel() * t.element_size() for t in (*base.parameters(), *base.buffers()))
    # training (3 steps x 2) and 3 previews of 2 sampling steps each went through the swap
    assert len(seen) >= 3 * 2 + 3 * 2 and len(set(seen)) == 1 and 0 < seen[0] < whole


@pytest.mark.parametrize("family, offload, swap", [("flux1", False, 0), ("flux1", True, 0), ("flux1", False, 1),
                                                   ("flux1", True, 1), ("cosmos", True, 1)])
def test_the_recomputation_equals_the_forward_in_every_memory_mode(mods, pack_module, monkeypatch, family, offload,
                                                                   swap):
    """The learning guard's recomputation check (training.grad.RecomputeCheck) through Train LoRA: checkpointing
    alone, with the block inputs on the host, with blocks swapped, and both: every checkpointed block's recomputed
    outputs are compared with its forward's, and equal (learning_guard 'stop' would have ended the run)."""
    grad = pack_module("training.grad")
    compared: list[int] = []
    original = grad.RecomputeCheck.recomputed
    monkeypatch.setattr(grad.RecomputeCheck, "recomputed",
                        lambda self, key, out: compared.append(key) or original(self, key, out))
    m, latent, cond = _setup(mods, family)
    settings = _settings(mods, swap, offload_block_inputs=offload, learning_guard="stop", learning_guard_steps=2)
    out, state, _, _ = _run(mods, m, latent, cond, 3, settings, name=f"recompute_{family}")
    learning = mods.glue.get_lora_set(out).info["precision_lora_learning"]
    assert learning == "learning: ok over 2 steps (every factor that got gradients moved)", learning
    assert state.step == 3 and sorted(set(compared)) == list(range(len(_blocks(m, mods)) - 1))
