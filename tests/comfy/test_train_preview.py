"""Previews during training (issue 14 item 4): PrecisionPreviewSettings -> PrecisionTrainLoRA's ``preview``.

Tiny Flux.1 model (tests/models.py) and a tiny real-architecture VAE built at test time (tests/preview_vae.py:
ComfyUI's TAESD with 16 latent channels and seeded random weights), loaded through ``comfy.sd.VAE`` as Load VAE
loads a file.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from models import make_conditioning, make_latent, tiny_flux1
from preview_vae import tiny_vae

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(pack_module):

    class E:
        glue = pack_module("nodes.lora.glue")
        train = pack_module("nodes.train.node")
        preview = pack_module("nodes.train.preview")
        node = pack_module("nodes.train.preview_node").PrecisionPreviewSettings
        compat = pack_module("nodes.host.comfy_compat")
        lora = pack_module("lora.config")
        Settings = pack_module("training.settings").TrainSettings

    E.vae = tiny_vae()
    E.model = tiny_flux1()
    with torch.inference_mode():
        E.attached = E.glue.attach_lora(E.model, E.lora.LoRAConfig(rank=4, alpha=4, targets="all", dropout=0.1))
    E.latent = make_latent(E.model, 1, width=32, height=32)
    E.cond = make_conditioning(E.model, 1)
    return E


def _preview(env, **kw):
    args = dict(positive=env.cond, vae=env.vae, sampler_name="euler", scheduler="simple", steps=2, cfg=1.0,
                width=32, height=32, batch_size=1, seed=7, every_n_steps=3, at_start=False, at_end=True)
    args.update(kw)
    return env.node.execute(**args).result[0]


def _train(env, steps: int, name: str, preview=None, model=None, settings=None, **kw):
    args = {"settings": [settings or env.Settings(learning_rate=1e-2)]}
    if preview is not None:
        args["preview"] = [preview]
    args.update({k: [v] for k, v in kw.items()})
    with torch.inference_mode():  # as ComfyUI's executor runs a node
        return env.train.PrecisionTrainLoRA.execute([model or env.attached], [env.latent], [env.cond], [steps], [0],
                                                    [name], **args)


def _folder(name: str) -> str:
    import folder_paths

    return os.path.join(folder_paths.get_output_directory(), "precision_lora", "previews", name)


def _lora(env, model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in env.glue.get_lora_set(model).state_dict().items()}


def _same_training(env, a, b) -> None:
    assert a.result[2]["loss"] == b.result[2]["loss"] and a.result[3] == b.result[3]
    wa, wb = _lora(env, a.result[0]), _lora(env, b.result[0])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_previews_at_the_right_steps_saved_shown_and_listed(env, monkeypatch):
    import comfy.utils

    live = []
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK",
                        lambda value, total, preview, node_id=None: preview and live.append((value, total, preview)))
    pv = _preview(env, width=48, height=32, batch_size=2, every_n_steps=2, at_start=True, at_end=True)
    out = _train(env, 5, "pv_steps", pv)
    # every 2 steps, step 0 (at_start) and the last step (at_end); two images each
    want = [f"pv_steps_step{s:06d}_{i}.png" for s in (0, 2, 4, 5) for i in (0, 1)]
    assert sorted(os.listdir(_folder("pv_steps"))) == want
    sizes = {Image.open(os.path.join(_folder("pv_steps"), f)).size for f in want}
    assert sizes == {(48, 32)}
    ui = out.ui.as_dict() if hasattr(out.ui, "as_dict") else out.ui
    assert [r["filename"] for r in ui["images"]] == want
    assert {(r["subfolder"], r["type"]) for r in ui["images"]} == {("precision_lora/previews/pv_steps", "output")}
    # shown on the node as they come: one side-by-side sheet per preview, at the node's local step
    assert [(v, t) for v, t, _ in live] == [(0, 5), (2, 5), (4, 5), (5, 5)]
    assert all(p[0] == "PNG" and p[1].size == (96, 32) for _, _, p in live)
    images = out.result[4]
    assert images.shape == (2, 32, 48, 3) and images.dtype == torch.float32
    saved_last = np.asarray(Image.open(os.path.join(_folder("pv_steps"), want[-2])))
    assert np.array_equal(saved_last, np.clip(255.0 * images[0].numpy(), 0, 255).astype(np.uint8))
    first = np.asarray(Image.open(os.path.join(_folder("pv_steps"), want[0]))).astype(int)
    assert 20 < first.mean() < 235 and first.std() > 1  # an image, not a saturated or flat field
    assert np.abs(first - saved_last).mean() > 1  # the LoRA trained in between changed the image


def test_training_is_bit_identical_with_previews_on_off_chained_and_resumed(env):
    pv = _preview(env, every_n_steps=2, at_start=True)
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    ref = _train(env, 10, "pv_ref")
    assert torch.equal(torch.get_rng_state(), rng_before)  # training itself never touches the global RNG
    on = _train(env, 10, "pv_on", pv)
    assert torch.equal(torch.get_rng_state(), rng_before)  # prepare_noise reseeds it: put back
    _same_training(env, ref, on)
    a = _train(env, 5, "pv_chain", pv)
    b = _train(env, 5, "pv_chain", pv, model=a.result[0], training_state=a.result[1])
    _same_training(env, ref, b)
    # resumed from the checkpoint the first half wrote, previews on
    _train(env, 5, "pv_resume", pv, settings=env.Settings(learning_rate=1e-2, checkpoint_every=5))
    c = _train(env, 5, "pv_resume2", pv, resume_from="pv_resume/pv_resume_step000005.safetensors")
    _same_training(env, ref, c)
    # chained 2 x 5 = 1 x 10 above; it previewed at 0, 2, 4, 5 (end of the first node), 6, 8, 10
    steps = sorted({f.split("_step")[1][:6] for f in os.listdir(_folder("pv_chain"))})
    assert steps == ["000000", "000002", "000004", "000005", "000006", "000008", "000010"]


def test_chained_and_resumed_runs_stay_bit_identical_with_previews_and_caption_dropout_on(env):
    empty = make_conditioning(env.model, 1, text="", tokens=3)

    def settings(**kw):
        return env.Settings(learning_rate=1e-2, caption_dropout=0.5, **kw)

    pv = _preview(env, every_n_steps=2, at_start=True)
    plain = _train(env, 10, "pvcd_plain", settings=env.Settings(learning_rate=1e-2))
    ref = _train(env, 10, "pvcd_ref", pv, settings=settings(), empty_conditioning=empty)
    assert ref.result[2]["loss"] != plain.result[2]["loss"]  # dropout is really on: some steps saw the empty caption
    a = _train(env, 5, "pvcd_chain", pv, settings=settings(), empty_conditioning=empty)
    b = _train(env, 5, "pvcd_chain", pv, model=a.result[0], training_state=a.result[1], settings=settings(),
               empty_conditioning=empty)
    _same_training(env, ref, b)
    _train(env, 5, "pvcd_resume", pv, settings=settings(checkpoint_every=5), empty_conditioning=empty)
    c = _train(env, 5, "pvcd_resume2", pv, resume_from="pvcd_resume/pvcd_resume_step000005.safetensors",
               settings=settings(), empty_conditioning=empty)
    _same_training(env, ref, c)
    # the previews themselves came out the same way: one run of 10 and the chained 2 x 5 at the shared steps
    for step in (0, 2, 4, 6, 8, 10):
        one = np.asarray(Image.open(os.path.join(_folder("pvcd_ref"), f"pvcd_ref_step{step:06d}_0.png")))
        two = np.asarray(Image.open(os.path.join(_folder("pvcd_chain"), f"pvcd_chain_step{step:06d}_0.png")))
        assert np.array_equal(one, two), step


def test_sampling_runs_without_gradients_dropout_or_in_training_and_restores_them(env, monkeypatch):
    import comfy.model_management as mm

    seen = []
    real = env.preview.sample_images

    def spy(model, p):
        lora_set = env.glue.get_lora_set(model)
        seen.append((torch.is_grad_enabled(), lora_set.training, getattr(mm, "in_training", False),
                     {k: v.clone() for k, v in lora_set.rng.get_state().items()}))
        return real(model, p)

    monkeypatch.setattr(env.preview, "sample_images", spy)
    before = env.compat.globals_snapshot()
    _train(env, 2, "pv_modes", _preview(env, every_n_steps=1))
    assert len(seen) == 2 and all(not grad and not training and not flag for grad, training, flag, _ in seen)
    assert env.compat.globals_snapshot() == before


def test_a_preview_failure_mid_run_keeps_the_checkpoint_and_names_the_input(env, monkeypatch):
    real = env.preview.sample_images
    calls = []

    def failing(model, p):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return real(model, p)

    monkeypatch.setattr(env.preview, "sample_images", failing)
    with pytest.raises(ValueError) as err:
        _train(env, 6, "pv_fail", _preview(env, every_n_steps=2))
    msg = str(err.value)
    assert "PrecisionTrainLoRA: input 'preview' failed at step 4" in msg and "simulated" in msg
    assert "pv_fail_step000004" in msg and "resume" in msg
    import folder_paths

    ckpt = os.path.join(folder_paths.get_folder_paths("loras")[0], "pv_fail", "pv_fail_step000004.trainstate")
    assert os.path.isfile(ckpt)


@pytest.mark.parametrize("values, text", [
    ({"width": 24}, "input 'width'=24 is not a multiple of 16 px"),
    ({"sampler_name": "nope"}, "input 'sampler_name'='nope' is not"),
    ({"every_n_steps": 0, "at_start": False, "at_end": False}, "never makes a preview; set every_n_steps > 0"),
])
def test_bad_preview_settings_are_refused_with_node_input_value_and_fix(env, values, text):
    args = dict(sampler_name="euler", scheduler="simple", steps=2, cfg=1.0, width=32, height=32, batch_size=1,
                seed=0, every_n_steps=3, at_start=False, at_end=True)
    args.update(values)
    problem = env.node.validate_inputs(**args)
    assert isinstance(problem, str) and "PrecisionPreviewSettings" in problem and text in problem
    with pytest.raises(ValueError, match="PrecisionPreviewSettings"):
        _preview(env, **values)


def test_preview_that_does_not_fit_the_model_is_refused_before_training(env):
    four = tiny_vae(channels=4)
    with pytest.raises(ValueError, match=r"PrecisionTrainLoRA: input 'preview': the VAE makes 4-channel latents, "
                                         r"this model uses 16; connect the VAE of the model's family"):
        _train(env, 2, "pv_misfit", _preview(env, vae=four))

    class CoarseVAE:  # a VAE of 16 px cells: with Flux's 2x2 patches images must be multiples of 32 px
        latent_channels, downscale_ratio = 16, 16

    with pytest.raises(ValueError, match=r"PrecisionPreviewSettings input 'width'=48 is not a multiple of 32 px.*use 64"):
        env.preview.check_fits(env.model, [_preview(env, vae=CoarseVAE(), width=48)])
    assert not os.path.exists(_folder("pv_misfit"))


def test_without_preview_the_outputs_keep_their_slots(env):
    out = _train(env, 1, "pv_none")
    assert len(out.result) == 5 and out.result[3] == 1 and out.result[4].shape == (1, 64, 64, 3)
    assert out.ui is None
    schema = env.train.PrecisionTrainLoRA.define_schema()
    assert [o.display_name for o in schema.outputs] == ["model", "training_state", "loss_map", "steps", "previews"]
