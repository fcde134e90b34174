"""Video training (issue 25 item 4): Wan 2.1, Wan 2.2 (5B, 48-channel VAE), HunyuanVideo, LTXV and Mochi train on
video latents (frames > 1) encoded from clips by ComfyUI's own video VAE classes, and on still images as
one-frame videos.

Per family: a clip of step+1 frames (5 for Wan / HunyuanVideo, 9 for LTXV, 7 for Mochi: two latent frames) goes
through PrecisionCachedTrainingDataset with the family's tiny VAE (tests/video_vaes.py: ComfyUI's VAE loader and
autoencoder classes at a few MB); its latent must equal ComfyUI's own ``vae.encode`` of the frames (what VAE
Encode gives) with 2 latent frames; the family's tiny diffusion model (tests/families.py) memorises it with the
default LoRA (loss falls below 0.8x) and the saved keys go through ComfyUI's LoRA loader with every key used.
A clip of a length the VAE does not encode whole is refused with the count to trim to; the loader
(PrecisionLoadVideoDataset's reading) decodes a real video file as ComfyUI's VideoFromFile does and cuts it.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import families
from video_vaes import MODEL_OF, RULES, tiny_video_vae

pytestmark = pytest.mark.usefixtures("one_thread")
RANK, STEPS = 4, 20
CLIP_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_hidden_layers": 2}


def tiny_clip(seed: int = 0):
    """A CLIP-L of width 64 through ComfyUI's text-encoder loader (the dataset node needs a CLIP to run)."""
    import comfy.sd
    import comfy.sd1_clip

    shapes = comfy.sd1_clip.SDClipModel(device="meta", dtype=torch.float32,
                                        model_options={"clip_l_model_config": dict(CLIP_CONFIG)}).transformer.state_dict()
    gen = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in shapes.items()}
    return comfy.sd.load_text_encoder_state_dicts([sd], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION,
                                                  model_options={"model_config": dict(CLIP_CONFIG)})


def clip_frames(frames: int, side: int, seed: int = 0) -> torch.Tensor:
    """A moving smooth pattern (frames, side, side, 3) in [0, 1]: each frame differs from the last."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand((1, 3, 4, 4), generator=gen)
    big = torch.nn.functional.interpolate(base, size=(side + frames, side + frames), mode="bilinear", align_corners=False)
    out = [big[0, :, t:t + side, t:t + side].movedim(0, -1) for t in range(frames)]
    return torch.stack(out).clamp(0, 1).contiguous()


@pytest.fixture(scope="module")
def clip(pack):
    return tiny_clip()


def _dataset(pack_module, clips, vae, clip, texts=None):
    cache = pack_module("nodes.dataset.cache")
    with torch.inference_mode():  # as ComfyUI's executor runs the node
        return cache.build(clips, texts or ["a clip"], vae, clip, "off", "/nonexistent")


def _memorise(pack_module, model, latents: list[dict], conds: list, steps: int = STEPS):
    """The default LoRA trained on the latents with fixed noise and noise level (test_families' method)."""
    lglue, tglue, tdata = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.train.data"))
    loop, lora = pack_module("training.loop"), pack_module("lora.config")
    settings = pack_module("training.settings").TrainSettings(learning_rate=1e-2)
    with torch.inference_mode():
        attached = lglue.attach_lora(model, lora.LoRAConfig(rank=RANK, alpha=RANK))
        out, lora_set = tglue.fork_lora(attached)
        with tglue.training_session(out, lora_set, settings) as device:
            samples, report = tdata.build_dataset(out, latents, conds, None, device)
            base = tglue.model_fns(out, lora_set, settings, device)
            gen = torch.Generator().manual_seed(3)
            fixed = {id(s): torch.randn((1, *s.latent.shape), generator=gen).to(device) for s in samples}
            by_latent = {id(s.latent): fixed[id(s)] for s in samples}

            def noise_of(x0):
                return by_latent.get(id(x0), next(iter(fixed.values())))

            fns = dataclasses.replace(base, noise_latent=lambda s, n, x0: base.noise_latent(s, noise_of(x0), x0),
                                      target=lambda s, n, x0: base.target(s, noise_of(x0), x0),
                                      sigma_of_u=lambda u: base.sigma_of_u(torch.full_like(u, 0.5)))
            result = loop.train(lora_set, samples, fns, settings, steps, seed=0)
    return [p["loss"] for p in result.state.history], lora_set, samples, report


def _stock_loads(pack_module, model, lora_set, caplog) -> None:
    import logging

    import comfy.lora

    lfile, lglue = pack_module("lora.file"), pack_module("nodes.lora.glue")
    tensors = lfile.lora_state_dict(lora_set, lfile.default_key_style(lglue.model_family(model)))
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(tensors, key_map)
    assert not [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(patches) == len(lora_set.adapters()) > 0


@pytest.mark.parametrize("family", sorted(RULES))
def test_family_trains_on_a_clip_encoded_by_its_video_vae(pack_module, clip, family, caplog):
    step, down = RULES[family]
    vae = tiny_video_vae(family)
    frames = clip_frames(step + 1, 2 * down, seed=1)
    latents, _, report = _dataset(pack_module, [frames], vae, clip)
    x = latents[0]["samples"]
    assert tuple(x.shape[:3]) == (1, vae.latent_channels, 2) and x.shape[3:] == (2, 2), x.shape
    with torch.inference_mode():
        torch.testing.assert_close(x, vae.encode(frames), rtol=0, atol=0)  # what ComfyUI's VAE Encode gives
    assert f"{step}k+1 frames" in report.summary() and f"{step + 1} -> 2 latent" in report.summary()
    name = MODEL_OF[family]
    model = families.build(name)
    losses, lora_set, samples, _ = _memorise(pack_module, model, latents, [families.conditioning(name)])
    assert samples[0].latent.shape[1] == 2  # trained on the two latent frames
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, f"{family}: loss {first:.4f} -> {last:.4f}"
    _stock_loads(pack_module, model, lora_set, caplog)


def test_still_images_train_as_one_frame_videos_beside_clips(pack_module, clip, caplog):
    """Wan 2.1: a still image (an IMAGE of one frame) encodes to a one-frame video latent (1, 16, 1, h, w); with
    a 9-frame clip it makes a dataset of two shapes, trained in two buckets, and the loss falls on both."""
    vae = tiny_video_vae("wan21")
    still, moving = clip_frames(1, 16, seed=2), clip_frames(9, 16, seed=3)
    latents, _, report = _dataset(pack_module, [still, moving], vae, clip, ["a still", "a clip"])
    assert [tuple(l["samples"].shape) for l in latents] == [(1, 16, 1, 2, 2), (1, 16, 3, 2, 2)]
    with torch.inference_mode():
        torch.testing.assert_close(latents[0]["samples"], vae.encode(still), rtol=0, atol=0)
    assert "1 -> 1 latent, 9 -> 3 latent" in report.summary()
    model = families.build("WAN21_T2V")
    conds = [families.conditioning("WAN21_T2V", seed=s) for s in (0, 1)]
    losses, lora_set, samples, data_report = _memorise(pack_module, model, latents, conds, steps=30)
    assert data_report.buckets == 2 and sorted(s.latent.shape[1] for s in samples) == [1, 3]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.8 * first, f"loss {first:.4f} -> {last:.4f}"
    _stock_loads(pack_module, model, lora_set, caplog)


@pytest.mark.parametrize("family,frames,fits", [("wan21", 10, 9), ("ltxv", 12, 9), ("mochi", 8, 7),
                                                ("hunyuan_video", 6, 5)])
def test_a_clip_the_vae_cannot_encode_whole_is_refused_with_the_count_to_trim_to(pack_module, clip, family, frames,
                                                                                 fits):
    step, down = RULES[family]
    vae = tiny_video_vae(family)
    good = clip_frames(step + 1, down)
    with pytest.raises(ValueError) as err:
        _dataset(pack_module, [good, clip_frames(frames, down)], vae, clip)
    message = str(err.value)
    for part in ("PrecisionCachedTrainingDataset", "input 'images'", "clip 1", f"has {frames} frames",
                 f"{step}k+1 frames", f"drop the last {frames - fits}", f"trim the clip to {fits} frames"):
        assert part in message, (part, message)


def test_an_image_vae_still_encodes_every_frame_as_its_own_image(pack_module, clip):
    """Frames through an image VAE (TAESD) are images: one latent per frame, no frame rule, no clip line."""
    from preview_vae import tiny_vae

    frames = clip_frames(3, 32)
    latents, _, report = _dataset(pack_module, [frames], tiny_vae(), clip)
    assert tuple(latents[0]["samples"].shape) == (3, 16, 4, 4)
    assert "k+1 frames" not in report.summary()


def write_video(path: str, frames: torch.Tensor, fps: int = 8) -> None:
    """An mp4 (h264, yuv444p so colours survive) of ``frames`` (T, H, W, 3) in [0, 1], written with PyAV."""
    import av

    with av.open(path, mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv444p"
        stream.options = {"crf": "0"}
        for frame in (frames * 255).round().to(torch.uint8).numpy():
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_the_video_folder_loader_decodes_as_comfyui_and_cuts_to_the_rule(pack_module, tmp_path):
    from comfy_api.latest import InputImpl

    files = pack_module("data.video_files")
    decode = pack_module("nodes.dataset.video_node").decode_video
    frames = clip_frames(14, 32, seed=4)
    write_video(str(tmp_path / "walk.mp4"), frames)
    (tmp_path / "walk.txt").write_text("a walk")
    write_video(str(tmp_path / "b_short.mp4"), clip_frames(3, 32, seed=5))
    (tmp_path / "b_short.txt").write_text("short")
    from PIL import Image

    Image.fromarray((clip_frames(1, 24, seed=6)[0] * 255).byte().numpy()).save(tmp_path / "still.png")
    (tmp_path / "notes.md").write_text("x")
    stock = InputImpl.VideoFromFile(str(tmp_path / "walk.mp4")).get_components().images
    assert stock.shape[0] == 14

    data = files.load_clips(str(tmp_path), "input/clips", 4, 33, 1, decode)
    assert [tuple(c.shape) for c in data.clips] == [(1, 32, 32, 3), (1, 24, 24, 3), (13, 32, 32, 3)]
    assert data.texts == ["short", "", "a walk"]
    torch.testing.assert_close(data.clips[2], stock[:13], rtol=0, atol=0)  # Load Video's decode, bit for bit
    report = "\n".join(data.lines)
    assert "walk.mp4: 14 frames at 8 fps -> kept the first 13 (the frame rule)" in report
    assert "b_short.mp4: 3 frames at 8 fps -> kept the first 1 (the frame rule)" in report
    assert "still.png: still image, trains as a one-frame clip" in report
    assert "not read: notes.md" in report and "still.png: no caption" in report
    assert "3 clips from input/clips" in report

    strided = files.load_clips(str(tmp_path), "input/clips", 8, 5, 2, decode)  # every 2nd frame, at most 5, 8k+1
    torch.testing.assert_close(strided.clips[2], stock[0:10:2][:1], rtol=0, atol=0)
    assert "walk.mp4: frame_stride 2: 5+ frames at 8 fps -> kept the first 1 (the frame rule)" in "\n".join(strided.lines)
    capped = files.load_clips(str(tmp_path), "input/clips", 4, 9, 1, decode)
    torch.testing.assert_close(capped.clips[2], stock[:9], rtol=0, atol=0)  # 0.33 decodes only the frames needed
    assert capped.clips[2].shape[0] == 9 and \
        "walk.mp4: 9+ frames at 8 fps -> kept the first 9 (max_frames 9)" in "\n".join(capped.lines)
    with pytest.raises(files.DatasetError, match="still.png has no caption"):
        files.load_clips(str(tmp_path), "input/clips", 4, 33, 1, decode, missing_caption="refuse")


def test_resolution_buckets_scale_every_frame_of_a_clip_alike(pack_module):
    """PrecisionResolutionBuckets between the video loader and the dataset node: a clip keeps its frames, each
    scaled and cropped as the first (a frame scaled alone equals the clip's frame)."""
    res = pack_module("nodes.dataset.resolution")
    clip = clip_frames(9, 40, seed=7)[:, :, :40]
    wide = torch.cat([clip, clip.flip(2)], dim=2)  # (9, 40, 80, 3)
    out, counts = res.bucket_images([wide, clip_frames(1, 48, seed=8)], 48, 16, 2.0)
    assert out[0].shape[0] == 9 and out[1].shape[0] == 1 and len(counts) == 2
    size = (int(out[0].shape[2]), int(out[0].shape[1]))
    torch.testing.assert_close(out[0][4:5], res.fit(wide[4:5], size), rtol=0, atol=0)


def test_a_clips_mask_rides_on_its_video_latent_and_trains_its_frames_masked(pack_module, clip):
    """Cached Training Dataset's masks with a video VAE (Wan 2.1): one mask per clip goes to the video latent's grid
    as its noise_mask, which Train LoRA's dataset reads as that sample's mask on every latent frame; a mask per
    frame is refused (one mask for the clip)."""
    cache, data = pack_module("nodes.dataset.cache"), pack_module("nodes.train.data")
    to_grid = pack_module("training.masks").to_grid
    vae, down = tiny_video_vae("wan21"), RULES["wan21"][1]
    frames = clip_frames(5, down * 2)  # 2x2 latent cells, 2 latent frames
    mask = torch.zeros(1, down * 2, down * 2)
    mask[:, :down] = 1.0  # the top half
    with torch.inference_mode():
        latents, conds, report = cache.build([frames], ["a clip"], vae, clip, "off", "/nonexistent", masks=[mask])
    samples = latents[0]["samples"]
    assert samples.ndim == 5 and samples.shape[2] == 2
    assert torch.equal(latents[0]["noise_mask"][0], to_grid(mask[0], tuple(samples.shape[1:])).reshape(1, 2, 2))
    assert "1 masks (1 distinct, on their latents as noise_mask): 1 computed, 0 from cache" in report.summary()
    model = families.build("WAN21_T2V")
    built, dataset_report = data.build_dataset(model, latents, [families.conditioning("WAN21_T2V")], None,
                                               torch.device("cpu"))
    assert dataset_report.masked == [0]
    assert built[0].mask.shape == (1, 1, 2, 2) and built[0].mask.flatten().tolist() == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"input 'masks': mask 0 \(0-based\) has 5 masks for image 0; give one mask "
                                         r"for the clip"):
        cache.build([frames], ["a clip"], vae, clip, "off", "/nonexistent", masks=[mask.expand(5, -1, -1)])
