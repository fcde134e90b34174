"""MiniMax H3 (ComfyUI 0.33+): inputs the pack refuses by name, and what it reads from them (#25).

A LATENT that is not MiniMax H3's packed audio-video latent (a plain video latent, LTX-2's audio layout, a video of
another VAE), a conditioning of another text encoder, a vram budget (the planner's fake tensors cannot run a forward
that reads the sigma as a number) and the probe's packed latent are refused naming node, input, value and fix;
caption dropout's empty caption is encoded as the sample, the budget measures the one-sample forward the loop runs,
and the head width (not hidden / heads here) reaches a LoRA's recorded scale. Training: test_minimax_h3_training.py.
"""
from __future__ import annotations

import math

import pytest
import torch

import minimax_h3_tiny as tiny

pytestmark = pytest.mark.usefixtures("one_thread")
RANK = 4
NODE = "PrecisionTrainLoRA"
N_VIDEO = tiny.N_VIDEO


@pytest.fixture(scope="module")
def h3(pack):
    return tiny.built_or_skip()


def _refusal(pack_module, model, latent, conds=None) -> str:
    tdata = pack_module("nodes.train.data")
    with pytest.raises(ValueError) as err:
        tdata.build_dataset(model, [latent], conds or [tiny.conditioning()], None, torch.device("cpu"))
    return str(err.value)


def test_a_plain_video_latent_is_refused(pack_module, h3):
    video, _ = tiny.parts()
    message = _refusal(pack_module, h3, {"samples": video})
    for part in (NODE, "input 'latents'", "latent 0", "(1, 24, 2, 4, 4)", "audio-video model", "LTXVConcatAVLatent",
                 "(B, 32, 2, frames)", "EmptyMiniMaxH3LatentAV"):
        assert part in message, (part, message)


def test_an_ltx2_layout_audio_part_is_refused(pack_module, h3):
    """LTX-2's audio layout (B, 8, frames, 16) is not MiniMax H3's (B, 32, 2, frames) with time last."""
    from comfy_extras.nodes_lt import LTXVConcatAVLatent

    video, _ = tiny.parts()
    latent = LTXVConcatAVLatent.execute({"samples": video}, {"samples": torch.zeros((1, 8, 4, 16))}).args[0]
    message = _refusal(pack_module, h3, latent)
    for part in (NODE, "input 'latents'", "audio part of shape (1, 8, 4, 16)", "(B, 32, 2, frames)",
                 "MiniMax H3's audio VAE"):
        assert part in message, (part, message)


def test_a_video_part_of_another_vae_is_refused(pack_module, h3):
    """The format's channels are 32 (the wider stream), but the video part has 24: a 32-channel video is refused."""
    from comfy_extras.nodes_lt import LTXVConcatAVLatent

    _, audio = tiny.parts()
    latent = LTXVConcatAVLatent.execute({"samples": torch.zeros((1, 32, 2, 4, 4))}, {"samples": audio}).args[0]
    message = _refusal(pack_module, h3, latent)
    for part in (NODE, "input 'latents'", "video part", "(1, 32, 2, 4, 4)", "C=24", "MiniMax H3's video VAE"):
        assert part in message, (part, message)


def test_a_conditioning_of_another_text_encoder_is_refused(pack_module, h3):
    """Text states of another width (here 64: not Qwen3-VL's) are refused before extra_conds' projection fails."""
    gen = torch.Generator().manual_seed(0)
    cond = [[torch.randn((1, tiny.TOKENS, 64), generator=gen), {}]]
    message = _refusal(pack_module, h3, tiny.av(), [cond])
    for part in (NODE, "input 'conditioning'", "(1, 8, 64)", f"(B, tokens, {tiny.TEXT_DIM})",
                 "CLIPLoader, type minimax"):
        assert part in message, (part, message)


def test_caption_dropouts_empty_caption_is_encoded_as_the_sample(pack_module, h3):
    """The empty caption's conds carry the sample's part shapes, the audio scale and the unrefined text states, and
    the forward on them differs from the caption's."""
    tglue, tdata, captions = (pack_module(m) for m in ("nodes.train.glue", "nodes.train.data", "nodes.train.captions"))
    settings = pack_module("training.settings").TrainSettings(caption_dropout=0.5)
    device = torch.device("cpu")
    samples, _ = tdata.build_dataset(h3, [tiny.av()], [tiny.conditioning()], None, device)
    samples = captions.with_empty_caption(h3, samples, [tiny.conditioning(seed=9, tokens=3)], settings, device)
    empty = samples[0].empty_cond
    assert empty["latent_shapes"].cond == [tiny.VIDEO, tiny.AUDIO]
    assert empty["minimax_payload"].cond["audio_scale"] == 4.0
    assert tuple(empty["c_crossattn"].cond.shape) == (1, 3, tiny.TEXT_DIM)
    fns = tglue.model_fns(h3, None, settings, device)
    sigma, x = torch.tensor([0.5]), samples[0].latent[None]
    with torch.no_grad():
        with_caption = fns.predict(x, sigma, fns.collate([samples[0].cond]))
        without = fns.predict(x, sigma, fns.collate([empty]))
    assert without.shape == x.shape and not torch.allclose(without, with_caption)


def test_the_memory_budget_measures_one_sample(pack_module, h3):
    """vram_budget_gb's step measurement runs the forward the loop runs: one sample, whatever the batch size."""
    budget = pack_module("nodes.train.budget")
    settings = pack_module("training.settings").TrainSettings(batch_size=2)
    x0, conds = budget._batch(h3, settings, [tiny.av(0), tiny.av(1)], [tiny.conditioning()])
    assert tuple(x0.shape) == (1, 1, N_VIDEO + 32 * 2 * 8) and len(conds) == 1
    assert conds[0]["latent_shapes"].cond == [tiny.VIDEO, tiny.AUDIO]


def test_the_probe_refuses_the_packed_latent_by_name(pack_module, h3):
    probe = pack_module("nodes.probe.node")
    with pytest.raises(ValueError) as err:
        probe.pick(h3, [tiny.av()], [tiny.conditioning()])
    for part in ("PrecisionProbe", "input 'latent'", "packed audio-video LATENT", "PrecisionTrainLoRA"):
        assert part in str(err.value), (part, str(err.value))


def test_a_vram_budget_is_refused_by_name(pack_module, h3):
    """The planner estimates a step on value-less fake tensors; MiniMax H3's forward reads the sigma as a number, so
    a budget is refused with the fix (torch's DataDependentOutputException before)."""
    budget, lglue, lora = (pack_module(m) for m in ("nodes.train.budget", "nodes.lora.glue", "lora.config"))
    settings = pack_module("training.settings").TrainSettings(vram_budget_gb="8")
    with torch.inference_mode():
        attached = lglue.attach_lora(h3, lora.LoRAConfig(rank=RANK, alpha=RANK))
    with pytest.raises(ValueError) as err:
        budget.plan_budget(attached, settings, [tiny.av()], [tiny.conditioning()])
    for part in (NODE, "input 'vram_budget_gb'='8'", "MiniMaxH3", "reads tensor values", "set vram_budget_gb to 0"):
        assert part in str(err.value), (part, str(err.value))


def test_head_dim_is_read_from_the_config_so_a_lora_records_its_scale(pack_module, h3):
    """MiniMax H3's width is not heads x head_dim (released: 5376 wide, 56 heads of 128): the head width comes from
    attention_head_dim, and a LoRA's metadata records the softmax scale (only the backend before)."""
    info = pack_module("nodes.model.info").describe_model(h3)
    assert (info.heads, info.head_dim) == (tiny.TINY["num_attention_heads"], tiny.TINY["attention_head_dim"])
    md = pack_module("nodes.lora.glue").attention_metadata(h3, info)
    assert float(md["ss_attn_softmax_scale"]) == pytest.approx(1 / math.sqrt(tiny.TINY["attention_head_dim"]))
