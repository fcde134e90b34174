"""MiniMax H3 (ComfyUI 0.33+) trains on its packed audio-video LATENT (#25).

MiniMax H3 samples a video latent (B, 24, T, H, W) and a stereo audio latent (B, 32, 2, frames) (time last) as one
LATENT; ComfyUI's sampler packs it flat, with the part shapes as the ``latent_shapes`` cond, and carries the audio
stream scaled onto the video schedule (``audio_scale`` = shift 12 / audio_shift 3), read from the model's
``latent_shapes`` while it samples: in ``process_latent_in`` and in the ``minimax_payload`` cond. The pack packs,
scales and encodes a sample as the sampler does (one euler step equals the pack's x0 on both parts). The text
projection and token refiner, which ComfyUI runs once in ``extra_conds``, run in the training forward, so the
default LoRA's refiner adapters learn. ComfyUI's attention calls the fused ``rms_rope_split_half`` (no backward:
rerouted while gradients are needed) and adds residuals in place (``addcmul_``, safe under the pack's saved-tensor
copies). The tiny model (tests/minimax_h3_tiny.py) is ComfyUI's own class at small widths. Refused inputs:
test_minimax_h3_inputs.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import pytest
import torch

import families
import minimax_h3_tiny as tiny

pytestmark = pytest.mark.usefixtures("one_thread")
RANK, STEPS = 4, 20
N_VIDEO = tiny.N_VIDEO


@pytest.fixture(scope="module")
def h3(pack):
    return tiny.built_or_skip()


def _fixed_fns(base, shape, sigma: float = 0.5):
    fixed = torch.randn((1, *shape), generator=torch.Generator().manual_seed(3))
    return dataclasses.replace(base, noise_latent=lambda s, n, x0: base.noise_latent(s, fixed, x0),
                               target=lambda s, n, x0: base.target(s, fixed, x0),
                               sigma_of_u=lambda u: base.sigma_of_u(torch.full_like(u, sigma)))


def _memorise(pack_module, model, latents, conds, **settings):
    """The default LoRA (rank 4, lr 1e-2) on Patch Attention at 1.25x (the family table's check) with fixed noise
    and noise level; also records each training forward's batch size."""
    lglue, tglue, tdata = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.train.data"))
    loop, lora, aglue = pack_module("training.loop"), pack_module("lora.config"), pack_module("nodes.attention.glue")
    settings = pack_module("training.settings").TrainSettings(learning_rate=1e-2, **settings)
    config = pack_module("attention.config").AttentionConfig
    with torch.inference_mode():
        model = aglue.patch_attention(model, config(scale_mode="multiplier", scale_value=1.25))
        attached = lglue.attach_lora(model, lora.LoRAConfig(rank=RANK, alpha=RANK))
        out, lora_set = tglue.fork_lora(attached)
        with tglue.training_session(out, lora_set, settings) as device:
            samples, report = tdata.build_dataset(out, latents, conds, None, device)
            fns = _fixed_fns(tglue.model_fns(out, lora_set, settings, device), samples[0].latent.shape)
            batches = []
            predict = fns.predict
            fns = dataclasses.replace(fns, predict=lambda x, s, c: batches.append(x.shape[0]) or predict(x, s, c))
            result = loop.train(lora_set, samples, fns, settings, STEPS, seed=0)
    return [p["loss"] for p in result.state.history], lora_set, samples, report, batches


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_minimax_h3_memorises_a_packed_latent_with_the_default_preset(pack_module, h3, checkpointing):
    """The default ("attention") LoRA memorises one packed latent (< 0.8x in 20 steps at lr 1e-2, rank 4): the
    sample is the sampler's pack with the audio scaled onto the video schedule, the text encoder's states reach
    the forward (so the token refiner's adapters learn) and the blocks' adapters learn too."""
    import comfy.utils

    video, audio = tiny.parts()
    losses, lora_set, samples, report, _ = _memorise(pack_module, h3, [tiny.av()], [tiny.conditioning()],
                                                     gradient_checkpointing=checkpointing)
    scale = h3.model.model_sampling.audio_scale
    assert scale == 4.0  # shift 12 / audio_shift 3
    packed, _ = comfy.utils.pack_latents([video, audio])
    expected = torch.cat([packed[..., :N_VIDEO], packed[..., N_VIDEO:] * scale], dim=-1)[0]
    torch.testing.assert_close(samples[0].latent, expected, rtol=0, atol=0)
    cond = samples[0].cond
    assert cond["latent_shapes"].cond == [tiny.VIDEO, tiny.AUDIO]
    assert cond["minimax_payload"].cond["audio_scale"] == scale
    assert tuple(cond["c_crossattn"].cond.shape) == (1, tiny.TOKENS, tiny.TEXT_DIM)  # not refined in extra_conds
    assert "64x64 px x1" in report.summary()

    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, f"loss {first:.4f} -> {last:.4f}"
    adapters = lora_set.adapters()
    assert any(p.startswith("token_refiner.") for p in adapters) and any(p.startswith("blocks.") for p in adapters)
    unmoved = [p for p, a in adapters.items() if float(a.up.detach().abs().sum()) == 0]
    assert not unmoved, f"adapters that never learnt: {unmoved}"


def test_a_bf16_base_trains(pack_module, h3):
    """The released dtype: bf16 blocks beside ComfyUI's fp32 patch projections and output heads."""
    model = tiny.build(dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.model.diffusion_model.named_parameters()}
    assert dtypes["blocks.0.attn.qkv_proj.weight"] == torch.bfloat16
    assert dtypes["final_layer.audio_out.weight"] == dtypes["video_patch_proj.weight"] == torch.float32
    losses, lora_set, *_ = _memorise(pack_module, model, [tiny.av()], [tiny.conditioning()])
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    assert all(float(a.up.detach().abs().sum()) > 0 for a in lora_set.adapters().values())


def _keyframe_conditioning(seed: int = 0) -> list:
    """What MiniMaxH3ImageToVideo gives with a first frame: the prompt's states with the image's tokens tagged 0
    (vision) and the frame's latent as a keyframe at frame 0 (a cond row block the model never denoises)."""
    cond = tiny.conditioning(seed)
    tags = torch.ones(tiny.TOKENS, dtype=torch.long)
    tags[1:5] = 0
    frame = torch.randn((1, 24, 1, 4, 4), generator=torch.Generator().manual_seed(seed + 5))
    cond[0][1] = {"minimax_token_tags": tags, "minimax_keyframes": [{"resolved_frame_index": 0, "latent": frame}]}
    return cond


def _sampler_step(pack_module, model, cond: list, seed: int):
    """(the stock sampler's packed output, the pack's) for one euler step from sigma 0.5 to 0."""
    import comfy.sample
    import comfy.samplers
    import comfy.utils

    tglue, tdata = pack_module("nodes.train.glue"), pack_module("nodes.train.data")
    settings = pack_module("training.settings").TrainSettings()
    latent = tiny.av(seed=4)
    noise = comfy.sample.prepare_noise(latent["samples"], 7)
    sigmas = torch.tensor([0.5, 0.0])
    with torch.inference_mode():
        stock = comfy.sample.sample_custom(model, noise, 1.0, comfy.samplers.sampler_object("euler"), sigmas, cond,
                                           cond, latent["samples"], disable_pbar=True, seed=seed)
    stock_packed, shapes = comfy.utils.pack_latents(stock.unbind())
    device = torch.device("cpu")
    samples, _ = tdata.build_dataset(model, [latent], [cond], None, device)
    fns = tglue.model_fns(model, None, settings, device)
    sigma = sigmas[:1]
    packed_noise, _ = comfy.utils.pack_latents(noise.unbind())
    with torch.no_grad():
        x_t = fns.noise_latent(sigma, packed_noise[0][None], samples[0].latent[None])
        x0 = x_t - sigma * fns.predict(x_t, sigma, fns.collate([samples[0].cond]))
    before = model.model.latent_shapes  # the sampler leaves its shapes on the model
    model.model.latent_shapes = None
    with tdata.sampler_shapes(model, shapes):
        ours = model.model.process_latent_out(x0)
    assert model.model.latent_shapes is None  # restored
    model.model.latent_shapes = before
    clean, _ = comfy.utils.pack_latents(latent["samples"].unbind())
    return stock_packed, ours, clean


def test_the_packed_forward_is_comfyuis_sampler_step(pack_module, h3):
    """One euler step of ComfyUI's own sampler from sigma 0.5 (it packs, scales the audio, noises and denoises)
    equals the x0 the training forward implies for the same noise and sigma, on the video and the audio part.
    At sigma 0.5 the audio stream runs at its own shifted sigma, so a wrong audio scale would show."""
    stock_packed, ours, clean = _sampler_step(pack_module, h3, tiny.conditioning(seed=4), seed=7)
    torch.testing.assert_close(ours[..., :N_VIDEO], stock_packed[..., :N_VIDEO], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[..., N_VIDEO:], stock_packed[..., N_VIDEO:], rtol=1e-4, atol=1e-4)
    assert float((stock_packed[..., N_VIDEO:] - clean[..., N_VIDEO:]).abs().mean()) > 1e-2  # audio was denoised


def test_a_first_frame_keyframe_trains_as_the_sampler_runs_it(pack_module, h3):
    """Image-to-video conditioning (a keyframe's latent in the payload, its rows in the packed layout) gives the
    sampler's step (sampled with seed 0: the keyframe's noise augmentation is seeded by the sampler's seed, and the
    pack encodes with 0), and the default LoRA memorises with it."""
    stock_packed, ours, _ = _sampler_step(pack_module, h3, _keyframe_conditioning(seed=4), seed=0)
    torch.testing.assert_close(ours, stock_packed, rtol=1e-4, atol=1e-4)
    plain, _, _ = _sampler_step(pack_module, h3, tiny.conditioning(seed=4), seed=0)
    assert not torch.allclose(plain, stock_packed, atol=1e-4)  # the keyframe changes the step
    losses, _, samples, _, _ = _memorise(pack_module, h3, [tiny.av()], [_keyframe_conditioning()])
    assert len(samples[0].cond["minimax_payload"].cond["cond_video_latents"]) == 1
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_the_shift_nodes_schedule_is_the_one_trained(pack_module, h3):
    """ModelSamplingMiniMaxH3 (MiniMaxH3SigmaShift: video shift 5, audio 3) patches model_sampling and the DiT's
    shifts: the sampler step still equals the pack's, and the samples the training session builds carry its audio
    scale 5/3 (not the class's 4)."""
    import comfy.utils
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3SigmaShift

    shifted = MiniMaxH3SigmaShift.execute(h3, 5.0, 3.0).args[0]
    stock_packed, ours, _ = _sampler_step(pack_module, shifted, tiny.conditioning(seed=4), seed=7)
    torch.testing.assert_close(ours, stock_packed, rtol=1e-4, atol=1e-4)
    unshifted, _, _ = _sampler_step(pack_module, h3, tiny.conditioning(seed=4), seed=7)
    assert not torch.allclose(unshifted, stock_packed, atol=1e-4)
    losses, _, samples, _, _ = _memorise(pack_module, shifted, [tiny.av()], [tiny.conditioning()])
    assert samples[0].cond["minimax_payload"].cond["audio_scale"] == pytest.approx(5 / 3)
    video, audio = tiny.parts()
    packed, _ = comfy.utils.pack_latents([video, audio])
    torch.testing.assert_close(samples[0].latent[N_VIDEO:], packed[0, N_VIDEO:] * (5 / 3))
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_the_fused_rope_has_no_backward_and_the_session_reroutes_it(pack_module, h3):
    """ComfyUI's attention (while training) calls comfy-kitchen's rms_rope_split_half, which refuses a backward;
    inside the pack's session the call takes comfy-kitchen's plain-PyTorch twin: same values, and gradients."""
    import comfy.quant_ops
    from comfy.ldm.minimax.model import rope_rotation_table

    compat = pack_module("nodes.host.comfy_compat")
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn((1, 6, 2, 32), generator=gen, requires_grad=True) for _ in range(2))
    table = rope_rotation_table(torch.randn((6, 24), generator=gen), torch.float32)
    weight = torch.ones(32)
    args, kwargs = (q, k, table, weight, weight), {"epsilon": 1e-5, "rot_dim": 24}
    fused = comfy.quant_ops.ck.rms_rope_split_half
    fused_q, fused_k = fused(*args, **kwargs)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        (fused_q.sum() + fused_k.sum()).backward()
    with compat.model_gradients():
        routed_q, routed_k = comfy.quant_ops.ck.rms_rope_split_half(*args, **kwargs)
    torch.testing.assert_close(routed_q, fused_q.detach(), rtol=1e-5, atol=1e-5)
    (routed_q.pow(2).sum() + routed_k.sum()).backward()
    assert q.grad is not None and float(q.grad.abs().sum()) > 0
    assert comfy.quant_ops.ck.rms_rope_split_half is fused  # restored


def test_in_place_residuals_need_the_sessions_saved_tensor_copies(pack_module, h3):
    """The blocks add gated residuals in place (addcmul_) after norm1 / norm2 saved the stream: a plain backward
    fails, which is why MiniMax H3 is not one of glue.CLEAN_FAMILIES (the training forward copies saved tensors)."""
    tglue, tdata = pack_module("nodes.train.glue"), pack_module("nodes.train.data")
    compat, grad = pack_module("nodes.host.comfy_compat"), pack_module("training.grad")
    assert tglue.needs_in_place_fix(h3)
    samples, _ = tdata.build_dataset(h3, [tiny.av()], [tiny.conditioning()], None, torch.device("cpu"))
    x = samples[0].latent[None].clone().requires_grad_(True)
    sigma = torch.tensor([0.5])
    import comfy.samplers

    cond = comfy.samplers.cond_cat([samples[0].cond])
    with torch.inference_mode(False), compat.model_gradients(), torch.enable_grad():
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            h3.model.apply_model(x, sigma, **cond).sum().backward()
        with grad.clone_saved_tensors():
            out = h3.model.apply_model(x, sigma, **cond)
        out.sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all()) and float(x.grad.abs().sum()) > 0


def test_each_sample_trains_in_a_forward_of_its_own(pack_module, h3):
    """ComfyUI's forward takes batch size 1 ("MiniMax H3 supports batch size 1"): batch_size 2 over two samples
    trains each in its own forward (the batch loss is their mean) and still memorises."""
    losses, _, samples, report, batches = _memorise(pack_module, h3, [tiny.av(0), tiny.av(1)],
                                                    [tiny.conditioning(0), tiny.conditioning(1)], batch_size=2)
    assert len(samples) == 2 and samples[0].group != samples[1].group
    assert batches and set(batches) == {1} and len(batches) == 2 * STEPS
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_train_node_save_and_stock_load(pack_module, h3, caplog):
    """PrecisionTrainLoRA then PrecisionSaveLoRA; stock LoraLoaderModelOnly loads the file with no key left, and its
    sampler output (video and audio) is the trained model's, which differs from the base model's."""
    import os

    import comfy.sample
    import folder_paths
    import nodes as comfy_nodes

    lglue, lora = pack_module("nodes.lora.glue"), pack_module("lora.config")
    train = pack_module("nodes.train.node").PrecisionTrainLoRA
    save = pack_module("nodes.lora.node").PrecisionSaveLoRA
    settings = pack_module("training.settings").TrainSettings(learning_rate=1e-2)
    latent, cond = tiny.av(seed=5), tiny.conditioning(seed=5)
    with torch.inference_mode():
        attached = lglue.attach_lora(h3, lora.LoRAConfig(rank=RANK, alpha=RANK))
        out = train.execute([attached], [latent], [cond], [4], [0], ["minimax_h3_av"], settings=[settings]).result
        trained, steps = out[0], out[3]
        path = save.execute(trained, "packed/minimax_h3_av", "loras", "fp32", "auto", True, False).result[0]
    assert steps == 4 and "64x64 px x1" in lglue.get_lora_set(trained).info["precision_lora_dataset"]

    def sample(model):
        noise = comfy.sample.prepare_noise(latent["samples"], 1)
        with torch.inference_mode():
            return comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent["samples"],
                                       disable_pbar=True, seed=1).unbind()

    name = os.path.relpath(path, folder_paths.get_folder_paths("loras")[0]).replace(os.sep, "/")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(h3, name, 1.0)[0]
    assert not [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    adapters = lglue.get_lora_set(trained).adapters()
    assert len(stock.patches) == len(adapters) and any(p.startswith("token_refiner.") for p in adapters)
    ours, theirs, base = sample(trained), sample(stock), sample(h3)
    for part in range(2):  # video, audio
        torch.testing.assert_close(theirs[part], ours[part], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(ours[part], base[part], atol=1e-5), f"part {part}: the LoRA changes nothing"


@contextlib.contextmanager
def _reference_attention(multiplier: float, refiner: float | None = None):
    """MiniMax H3's attention (its module's binding of ComfyUI's optimized_attention, the only one it calls) as the
    fp64 softmax(q·kᵀ·scale)·v oracle at ``multiplier`` x the default scale, without the override seam;
    ``refiner``: another multiplier for the token refiner's calls (the text alone: TOKENS long)."""
    import comfy.ldm.minimax.model as minimax
    from attention.reference import reference_attention
    from comfy.ldm.modules.attention import AttentionTensorContainer

    original, calls = minimax.optimized_attention, [0]

    def oracle(q, k, v, heads, mask=None, skip_reshape=False, **kwargs):
        q, k, v = (t.take() if isinstance(t, AttentionTensorContainer) else t for t in (q, k, v))
        assert skip_reshape and mask is None and q.shape[1] == heads  # (B, H, L, D), as MiniMax H3 calls it
        calls[0] += 1
        m = refiner if refiner is not None and q.shape[2] == tiny.TOKENS else multiplier
        out = reference_attention(q, k, v, scale=m / math.sqrt(q.shape[-1]), layout="bhld")
        return out.transpose(1, 2).flatten(2).to(q.dtype)

    minimax.optimized_attention = oracle
    try:
        yield calls
    finally:
        minimax.optimized_attention = original


def test_every_attention_call_reaches_the_override(pack_module, h3):
    """Patch Attention sees every attention call of a stock sampling step (the token refiner's, which ComfyUI runs
    in extra_conds, and the blocks'), reports none unreached, gives stock output at default settings, and at 2x
    the scale gives the 2x oracle's output (every call scaled: the refiner's too)."""
    glue, config = pack_module("nodes.attention.glue"), pack_module("attention.config").AttentionConfig
    with families.count_attention_calls() as counts:
        stock = torch.cat([t.flatten() for t in tiny.denoise(h3).unbind()])
    # 2 blocks per forward, and the refiner's block once per conditioning (positive and negative) in extra_conds
    assert counts == {"comfy": 2 + 2, "sdpa": 0}, counts
    patched = glue.patch_attention(h3, config(collect_stats=True))
    same = torch.cat([t.flatten() for t in tiny.denoise(patched).unbind()])
    override = patched.model_options["transformer_options"][glue.OVERRIDE_KEY]
    assert glue.get_attention_stats(patched).total().calls == counts["comfy"]
    assert override.unreached() == {}
    assert torch.equal(same, stock)

    with _reference_attention(2.0) as calls:
        expected = torch.cat([t.flatten() for t in tiny.denoise(h3).unbind()])
    assert calls[0] == 4
    got = torch.cat([t.flatten() for t in tiny.denoise(
        glue.patch_attention(h3, config(scale_mode="multiplier", scale_value=2.0))).unbind()])
    err = float((got - expected).abs().max() / expected.abs().max())
    moved = float((stock - expected).abs().max() / expected.abs().max())
    assert err < 2e-4 and moved > 20 * max(err, 1e-6), (err, moved)
    with _reference_attention(2.0, refiner=1.0):  # the refiner's call left at 1x is far from the 2x output
        partial = torch.cat([t.flatten() for t in tiny.denoise(h3).unbind()])
    assert float((partial - expected).abs().max() / expected.abs().max()) > 20 * max(err, 1e-6)
