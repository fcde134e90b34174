"""LTX-2 (LTXAV, ComfyUI 0.33+) trains on its packed audio-video LATENT (#25).

LTXVConcatAVLatent puts a video latent (B, 128, T, H, W) and an audio latent (B, 8, frames, 16) in one LATENT
(a NestedTensor); ComfyUI's sampler packs the parts flat into (B, 1, N) and hands the part shapes to the model
as the ``latent_shapes`` cond, with one sigma, one noise draw per element and one flow target for the pack.
The tiny LTXAV here is ComfyUI's own class at small widths (video and audio streams, audio-video
cross-attention); it memorises a packed latent with the default LoRA, the audio stream's adapters learn
too, the file loads in stock ComfyUI with every key used, and wrong latents are refused by name.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import families

pytestmark = pytest.mark.usefixtures("one_thread")
RANK, STEPS = 4, 20
NODE = "PrecisionTrainLoRA"


@pytest.fixture(scope="module")
def ltxav(pack):
    reason = families.available("LTXAV")
    if reason is not None:
        pytest.skip(reason)
    return families.build("LTXAV")  # ComfyUI's class at the family table's tiny widths


def _av_latent(seed: int = 0) -> dict:
    """Video (1, 128, 2, 2, 2) and audio (1, 8, 4, 16) joined by ComfyUI's own LTXVConcatAVLatent."""
    return families.packed_latent("LTXAV", seed)


def _conditioning(seed: int = 0) -> list:
    """A processed LTX-2 text embedding: the video and the audio connector's outputs, caption_channels (64) each
    (the width preprocess_text_embeds takes as is)."""
    return families.conditioning("LTXAV", seed)


def _memorise(pack_module, model, latents, conds):
    lglue, tglue, tdata = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.train.data"))
    loop, lora = pack_module("training.loop"), pack_module("lora.config")
    settings = pack_module("training.settings").TrainSettings(learning_rate=1e-2)
    with torch.inference_mode():
        attached = lglue.attach_lora(model, lora.LoRAConfig(rank=RANK, alpha=RANK))
        out, lora_set = tglue.fork_lora(attached)
        with tglue.training_session(out, lora_set, settings) as device:
            samples, report = tdata.build_dataset(out, latents, conds, None, device)
            base = tglue.model_fns(out, lora_set, settings, device)
            fixed = torch.randn((1, *samples[0].latent.shape), generator=torch.Generator().manual_seed(3))
            fns = dataclasses.replace(base, noise_latent=lambda s, n, x0: base.noise_latent(s, fixed, x0),
                                      target=lambda s, n, x0: base.target(s, fixed, x0),
                                      sigma_of_u=lambda u: base.sigma_of_u(torch.full_like(u, 0.5)))
            with torch.no_grad():
                sigma = torch.tensor([0.5])
                x_t = base.noise_latent(sigma, fixed, samples[0].latent[None])
                pred = base.predict(x_t, sigma, base.collate([samples[0].cond]))
            result = loop.train(lora_set, samples, fns, settings, STEPS, seed=0)
    return [p["loss"] for p in result.state.history], lora_set, samples, report, (x_t, pred)


def test_ltxav_trains_on_its_packed_audio_video_latent(pack_module, ltxav, caplog):
    import comfy.lora
    import comfy.utils

    latent = _av_latent()
    video, audio = latent["samples"].unbind()
    losses, lora_set, samples, report, (x_t, pred) = _memorise(pack_module, ltxav, [latent], [_conditioning()])

    # the sample is ComfyUI's sampler pack: flat (1, N) of video then audio, the part shapes in the conds
    packed, shapes = comfy.utils.pack_latents([video, audio])
    assert len(samples) == 1 and samples[0].latent.shape == (1, 128 * 8 + 8 * 4 * 16)
    torch.testing.assert_close(samples[0].latent, ltxav.model.process_latent_in(packed)[0], rtol=0, atol=0)
    assert samples[0].cond["latent_shapes"].cond == [(1, 128, 2, 2, 2), (1, 8, 4, 16)]
    assert "64x64 px x1" in report.summary()  # sized by the video part (2 x 2 latent pixels, 32 px each)
    # the prediction is the model's on both parts: the audio slice answers the audio latent, not zeros
    assert pred.shape == x_t.shape and float(pred[..., 128 * 8:].abs().mean()) > 1e-3

    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, f"loss {first:.4f} -> {last:.4f}"
    audio_up = [a for p, a in lora_set.adapters().items() if "audio_attn1" in p]
    assert audio_up and all(float(a.up.detach().abs().sum()) > 0 for a in audio_up), "audio adapters never learnt"

    lfile, lglue = pack_module("lora.file"), pack_module("nodes.lora.glue")
    tensors = lfile.lora_state_dict(lora_set, lfile.default_key_style(lglue.model_family(ltxav)))
    key_map = comfy.lora.model_lora_keys_unet(ltxav.model, {})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(tensors, key_map)
    assert not [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(patches) == len(lora_set.adapters()) > 0


def test_the_packed_forward_is_comfyuis_sampler_step(pack_module, ltxav):
    """One euler step of ComfyUI's own sampler on the AV LATENT (it packs, noises and denoises the parts) equals
    the x0 the training forward implies for the same noise and sigma: the pack's layout, noise scaling, conds
    and velocity parametrisation are the sampler's, for the video and for the audio slice."""
    import comfy.sample
    import comfy.samplers
    import comfy.utils

    tglue, tdata = pack_module("nodes.train.glue"), pack_module("nodes.train.data")
    settings = pack_module("training.settings").TrainSettings()
    latent, cond = _av_latent(seed=4), _conditioning(seed=4)
    noise = comfy.sample.prepare_noise(latent["samples"], 7)
    with torch.inference_mode():
        stock = comfy.sample.sample(ltxav, noise, 1, 1.0, "euler", "simple", cond, cond, latent["samples"],
                                    disable_pbar=True, seed=7)
    stock_packed, _ = comfy.utils.pack_latents(stock.unbind())
    device = torch.device("cpu")
    samples, _ = tdata.build_dataset(ltxav, [latent], [cond], None, device)
    fns = tglue.model_fns(ltxav, None, settings, device)
    sigma = comfy.samplers.calculate_sigmas(ltxav.model.model_sampling, "simple", 1)[:1].float()
    packed_noise, _ = comfy.utils.pack_latents(noise.unbind())
    with torch.no_grad():
        x_t = fns.noise_latent(sigma, packed_noise[0][None], samples[0].latent[None])
        x0 = x_t - sigma * fns.predict(x_t, sigma, fns.collate([samples[0].cond]))
    ours = ltxav.model.process_latent_out(x0)
    torch.testing.assert_close(ours, stock_packed, rtol=1e-4, atol=1e-4)
    assert float((stock_packed[..., 128 * 8:] - packed_noise[..., 128 * 8:]).abs().mean()) > 1e-3  # audio denoised


def test_caption_dropouts_empty_caption_carries_the_pack_layout(pack_module, ltxav):
    """The empty caption's conds (caption dropout) are encoded with the sample's part shapes: the forward on
    the empty caption runs on the packed latent and differs from the caption's."""
    tglue, tdata, captions = (pack_module(m) for m in ("nodes.train.glue", "nodes.train.data", "nodes.train.captions"))
    settings = pack_module("training.settings").TrainSettings(caption_dropout=0.5)
    device = torch.device("cpu")
    samples, _ = tdata.build_dataset(ltxav, [_av_latent()], [_conditioning()], None, device)
    samples = captions.with_empty_caption(ltxav, samples, [_conditioning(seed=9)], settings, device)
    assert samples[0].empty_cond["latent_shapes"].cond == [(1, 128, 2, 2, 2), (1, 8, 4, 16)]
    fns = tglue.model_fns(ltxav, None, settings, device)
    sigma, x = torch.tensor([0.5]), samples[0].latent[None]
    with torch.no_grad():
        with_caption = fns.predict(x, sigma, fns.collate([samples[0].cond]))
        empty = fns.predict(x, sigma, fns.collate([samples[0].empty_cond]))
    assert empty.shape == x.shape and not torch.allclose(empty, with_caption)


def test_train_node_save_and_stock_load_on_the_av_latent(pack_module, ltxav, caplog):
    """PrecisionTrainLoRA (dataset report, metadata, checkpointing as a user runs it) on the AV LATENT, then
    PrecisionSaveLoRA; stock LoraLoaderModelOnly loads the file with no key left and its sampler output on the
    AV latent (video and audio) is the trained model's."""
    import os

    import comfy.sample
    import folder_paths
    import nodes as comfy_nodes

    lglue, lora = pack_module("nodes.lora.glue"), pack_module("lora.config")
    train = pack_module("nodes.train.node").PrecisionTrainLoRA
    save = pack_module("nodes.lora.node").PrecisionSaveLoRA
    settings = pack_module("training.settings").TrainSettings(learning_rate=1e-2)
    latent, cond = _av_latent(seed=5), _conditioning(seed=5)
    with torch.inference_mode():
        attached = lglue.attach_lora(ltxav, lora.LoRAConfig(rank=RANK, alpha=RANK))
        out = train.execute([attached], [latent], [cond], [4], [0], ["ltxav_av"], settings=[settings]).result
        trained, steps = out[0], out[3]
        path = save.execute(trained, "packed/ltxav_av", "loras", "fp32", "auto", True, False).result[0]
    info = lglue.get_lora_set(trained).info
    assert steps == 4 and "64x64 px x1" in info["precision_lora_dataset"]

    def sample(model):
        noise = comfy.sample.prepare_noise(latent["samples"], 1)
        with torch.inference_mode():
            return comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent["samples"],
                                       disable_pbar=True, seed=1).unbind()

    name = os.path.relpath(path, folder_paths.get_folder_paths("loras")[0]).replace(os.sep, "/")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(ltxav, name, 1.0)[0]
    assert not [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(stock.patches) == len(lglue.get_lora_set(trained).adapters())
    ours, theirs, base = sample(trained), sample(stock), sample(ltxav)
    for part in range(2):  # video, audio
        torch.testing.assert_close(theirs[part], ours[part], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(ours[part], base[part], atol=1e-5), f"part {part}: the LoRA changes nothing"


def test_the_memory_budget_measures_the_packed_sample(pack_module, ltxav):
    """vram_budget_gb's step measurement takes the packed row (every part) with its part shapes in the conds."""
    budget = pack_module("nodes.train.budget")
    settings = pack_module("training.settings").TrainSettings(batch_size=2)
    small = _av_latent(seed=6)
    big = {"samples": type(small["samples"])([torch.zeros((1, 128, 2, 2, 2)), torch.zeros((1, 8, 40, 16))])}
    x0, conds = budget._batch(ltxav, settings, [small, big], [_conditioning()])
    assert tuple(x0.shape) == (2, 1, 128 * 8 + 8 * 40 * 16)  # the longer audio is the largest row
    assert conds[0]["latent_shapes"].cond == [(1, 128, 2, 2, 2), (1, 8, 40, 16)]


def _refusal(pack_module, model, latent, conds) -> str:
    tdata = pack_module("nodes.train.data")
    with pytest.raises(ValueError) as err:
        tdata.build_dataset(model, [latent], conds, None, torch.device("cpu"))
    return str(err.value)


def test_a_plain_video_latent_into_ltxav_is_refused(pack_module, ltxav):
    video = _av_latent()["samples"].unbind()[0]
    message = _refusal(pack_module, ltxav, {"samples": video}, [_conditioning()])
    for part in (NODE, "input 'latents'", "latent 0", "(1, 128, 2, 2, 2)", "audio-video model",
                 "LTXVConcatAVLatent", "LTXVEmptyLatentAudio"):
        assert part in message, (part, message)


def test_an_audio_latent_of_the_wrong_shape_is_refused(pack_module, ltxav):
    from comfy_extras.nodes_lt import LTXVConcatAVLatent

    video = _av_latent()["samples"].unbind()[0]
    latent = LTXVConcatAVLatent.execute({"samples": video}, {"samples": torch.zeros((1, 8, 4, 12))}).args[0]
    message = _refusal(pack_module, ltxav, latent, [_conditioning()])
    for part in (NODE, "input 'latents'", "audio part of shape (1, 8, 4, 12)", "(B, 8, frames, 16)",
                 "LTXVEmptyLatentAudio"):
        assert part in message, (part, message)


def test_an_audio_video_latent_into_a_video_model_is_refused(pack_module):
    """Both hosts: ComfyUI's NestedTensor (what LTXVConcatAVLatent puts in a LATENT) into LTXV (video only)."""
    import comfy.nested_tensor

    gen = torch.Generator().manual_seed(0)
    parts = (torch.randn((1, 128, 2, 2, 2), generator=gen), torch.randn((1, 8, 4, 16), generator=gen))
    latent = {"samples": comfy.nested_tensor.NestedTensor(parts)}
    model = families.build("LTXV")
    message = _refusal(pack_module, model, latent, [families.conditioning("LTXV", training=True)])
    for part in (NODE, "input 'latents'", "audio-video LATENT", "(1, 128, 2, 2, 2), (1, 8, 4, 16)",
                 "LTXVSeparateAVLatent"):
        assert part in message, (part, message)


def test_the_probe_refuses_the_packed_latent_by_name(pack_module, ltxav):
    """Precision Probe ran process_latent_in on the NestedTensor and failed with torch's error; it now says what
    it cannot do and what to use."""
    probe = pack_module("nodes.probe.node")
    with pytest.raises(ValueError) as err:
        probe.pick(ltxav, [_av_latent()], [_conditioning()])
    message = str(err.value)
    for part in ("PrecisionProbe", "input 'latent'", "packed audio-video LATENT", "PrecisionTrainLoRA"):
        assert part in message, (part, message)
