"""The dataset cache (issue 23 item 3): PrecisionCachedTrainingDataset encodes each image and caption once,
with ComfyUI's own VAE and text encoder, and reads them back from disk afterwards.

Real ComfyUI encoders, tiny: the TAESD VAE of tests/preview_vae.py (16 latent channels, as Flux) and a
2-layer CLIP-L of width 64 loaded through ComfyUI's text-encoder loader. Encode calls are counted by
wrapping the two objects' encode methods. Every run here is a new call of the node, as after ComfyUI
dropped its cached outputs (another workflow ran, or the server restarted); the e2e test does it through
a real server.
"""
from __future__ import annotations

import logging
import os
import re

import pytest
import torch

from comfy_harness import node_class, pack_module

CAPTIONS = ["a photo of sks, red", "a photo of sks, green", "a photo of sks, red"]  # 2 distinct
CLIP_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_hidden_layers": 2}


def _out(result):
    return getattr(result, "result", result)


def tiny_clip(seed: int = 0, scale: float = 1.0):
    """A CLIP-L of width 64 (2 layers) through ComfyUI's own loader; ``scale`` multiplies one weight."""
    import comfy.sd
    import comfy.sd1_clip

    shapes = comfy.sd1_clip.SDClipModel(device="meta", dtype=torch.float32,
                                        model_options={"clip_l_model_config": dict(CLIP_CONFIG)}).transformer.state_dict()
    gen = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in shapes.items()}
    sd["text_model.encoder.layers.1.mlp.fc1.weight"] *= scale
    return comfy.sd.load_text_encoder_state_dicts([sd], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION,
                                                  model_options={"model_config": dict(CLIP_CONFIG)})


def tiny_vae(scale: float = 1.0):
    import comfy.sd
    from preview_vae import tiny_vae_state_dict

    sd = tiny_vae_state_dict()
    sd["taesd_encoder.1.conv.0.weight"] = sd["taesd_encoder.1.conv.0.weight"] * scale
    return comfy.sd.VAE(sd=sd)


def _images(n: int = 3, size: tuple[int, int] = (32, 32)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.rand(1, size[1], size[0], 3, generator=gen) for _ in range(n)]


class Counted:
    """Counts the encode calls of one VAE and one CLIP (the node calls exactly these methods)."""

    def __init__(self, vae, clip):
        self.vae, self.clip, self.images, self.texts = vae, clip, 0, 0
        vae_encode, clip_encode = vae.encode, clip.encode_from_tokens_scheduled

        def encode(pixels):
            self.images += 1
            return vae_encode(pixels)

        def encode_text(tokens, *args, **kwargs):
            self.texts += 1
            return clip_encode(tokens, *args, **kwargs)
        vae.encode, clip.encode_from_tokens_scheduled = encode, encode_text

    def take(self) -> tuple[int, int]:
        out, self.images, self.texts = (self.images, self.texts), 0, 0
        return out


@pytest.fixture(scope="module")
def enc(pack):
    return Counted(tiny_vae(), tiny_clip())


@pytest.fixture(autouse=True)
def _threads(one_thread):
    """One intra-op thread (tests/comfy/conftest.py): small convolutions run faster on 2 shared cores."""


@pytest.fixture
def folder(tmp_path, monkeypatch):
    path = str(tmp_path / "dataset_cache")
    monkeypatch.setenv("PRECISION_LORA_DATASET_CACHE", path)
    return path


def run(images, texts, vae, clip, cache: str = "use"):
    node = node_class("PrecisionCachedTrainingDataset")
    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        latents, conds, report = _out(node.execute(images=images, vae=[vae], clip=[clip], texts=texts, cache=[cache]))[:3]
    return latents, conds, report


def stock(images, texts, vae, clip):
    with torch.inference_mode():
        return _out(node_class("MakeTrainingDataset").execute(images=images, vae=[vae], clip=[clip], texts=texts))


def _same(a, b) -> None:
    """Bit for bit: the same nesting, the same dtypes and shapes, torch.equal values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (set(a), set(b))
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.fixture(scope="module", autouse=True)
def _stock_nodes(pack):
    import asyncio

    import nodes as comfy_nodes

    path = os.path.join(os.path.dirname(os.path.abspath(comfy_nodes.__file__)), "comfy_extras", "nodes_dataset.py")
    assert asyncio.run(comfy_nodes.load_custom_node(path, module_parent="comfy_extras"))


def test_second_run_encodes_nothing_and_equals_make_training_dataset_bit_for_bit(enc, folder):
    images = _images()
    latents, conds, report = run(images, CAPTIONS, enc.vae, enc.clip)
    assert enc.take() == (3, 2)  # 3 images, 2 distinct captions
    assert report.startswith("3 images (3 distinct): 3 encoded, 0 from cache; 3 captions (2 distinct): 2 encoded, "
                             "0 from cache; cache " + folder), report
    assert sorted(os.listdir(folder)) == ["latents", "text"] and len(os.listdir(os.path.join(folder, "latents"))) == 3
    ref_latents, ref_conds = stock(images, CAPTIONS, enc.vae, enc.clip)
    enc.take()
    _same(latents, ref_latents)
    _same(conds, ref_conds)
    again_latents, again_conds, again = run(images, CAPTIONS, enc.vae, enc.clip)
    assert enc.take() == (0, 0)
    assert "3 images (3 distinct): 0 encoded, 3 from cache; 3 captions (2 distinct): 0 encoded, 2 from cache" in again
    _same(again_latents, ref_latents)
    _same(again_conds, ref_conds)


def test_the_cache_folder_is_in_comfyuis_base_directory(pack, monkeypatch):
    import folder_paths

    monkeypatch.delenv("PRECISION_LORA_DATASET_CACHE", raising=False)
    glue = pack_module("nodes.dataset.cache_glue")
    assert glue.cache_folder() == os.path.join(folder_paths.base_path, "cache", "precision_lora", "dataset")


def _change(case: str, images, texts, vae, clip):
    """One input changed as a user would change it; returns the new (images, texts, vae, clip)."""
    images, texts = list(images), list(texts)
    if case == "caption":
        texts[1] = "a photo of sks, blue"
    elif case == "image":
        images[0] = images[0].clone()
        images[0][0, 5, 7, 1] += 0.25
    elif case == "resolution":
        images[2] = torch.nn.functional.interpolate(images[2].movedim(-1, 1), size=(48, 32)).movedim(1, -1)
    elif case == "vae weights":
        vae = tiny_vae(scale=1.01)
    elif case == "text encoder weights":
        clip = tiny_clip(scale=1.01)
    elif case == "clip skip":
        clip = clip.clone()
        clip.clip_layer(-2)
    elif case == "text encoder lora":
        clip = clip.clone()
        key = "clip_l.transformer.text_model.encoder.layers.0.mlp.fc1.weight"
        assert clip.add_patches({key: ("diff", (torch.full((128, 64), 0.01),))}, 1.0) == [key]
    else:
        raise AssertionError(case)
    return images, texts, vae, clip


# case -> (images encoded, distinct captions encoded) on the run after the change
CHANGES = {"caption": (0, 1), "image": (1, 0), "resolution": (1, 0), "vae weights": (3, 0),
           "text encoder weights": (0, 2), "clip skip": (0, 2), "text encoder lora": (0, 2)}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_changed_input_is_encoded_again_and_equals_a_fresh_encode(case, enc, folder):
    images = _images()
    run(images, CAPTIONS, enc.vae, enc.clip)
    enc.take()
    images2, texts2, vae2, clip2 = _change(case, images, CAPTIONS, enc.vae, enc.clip)
    counted = enc if (vae2, clip2) == (enc.vae, enc.clip) else Counted(vae2, clip2)
    latents, conds, report = run(images2, texts2, vae2, clip2)
    assert counted.take() == CHANGES[case], report
    ref_latents, ref_conds = stock(images2, texts2, vae2, clip2)
    counted.take()
    _same(latents, ref_latents)
    _same(conds, ref_conds)


def test_a_corrupt_or_truncated_entry_is_encoded_again_never_used(enc, folder, caplog):
    images = _images()
    ref_latents, ref_conds, _ = run(images, CAPTIONS, enc.vae, enc.clip)
    enc.take()
    latent_file = sorted(os.scandir(os.path.join(folder, "latents")), key=lambda e: e.name)[0].path
    text_file = sorted(os.scandir(os.path.join(folder, "text")), key=lambda e: e.name)[0].path
    with open(latent_file, "r+b") as f:  # one byte of tensor data flipped: safetensors still parses it
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x55]))
    with open(text_file, "r+b") as f:  # a half-written file
        f.truncate(os.path.getsize(text_file) // 2)
    with caplog.at_level(logging.WARNING):
        latents, conds, report = run(images, CAPTIONS, enc.vae, enc.clip)
    assert enc.take() == (1, 1)
    assert "2 cache entries failed verification and were encoded again" in report
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert "fails its checksum" in warnings and "is unreadable" in warnings
    _same(latents, ref_latents)
    _same(conds, ref_conds)
    run(images, CAPTIONS, enc.vae, enc.clip)  # the entries were rewritten whole
    assert enc.take() == (0, 0)


def test_training_from_cached_inputs_equals_training_from_fresh_encodes_bit_for_bit(enc, folder, pack_module):
    """Train LoRA (3 steps, tiny Flux.1 whose text widths are this CLIP's 64) from Make Training Dataset's
    fresh encodes and from the cache node's second (all cached) run: the same LoRA, every bit."""
    tiny, compat = pack_module("demo.tiny_models"), pack_module("nodes.host.comfy_compat")
    glue, lora, train = (pack_module(m) for m in ("nodes.lora.glue", "lora.config", "nodes.train.node"))
    config = compat.fit_flux_config({**tiny.TINY_UNET_CONFIGS["flux1_dev"], "context_in_dim": 64, "vec_in_dim": 64})
    model = tiny.build_tiny_model("flux1_dev", seed=0, unet_config=config)
    images = _images()
    run(images, CAPTIONS, enc.vae, enc.clip)
    cached_latents, cached_conds, report = run(images, CAPTIONS, enc.vae, enc.clip)
    assert "0 encoded, 3 from cache" in report and "0 encoded, 2 from cache" in report
    fresh_latents, fresh_conds = stock(images, CAPTIONS, enc.vae, enc.clip)
    trained = []
    for latents, conds in ((fresh_latents, fresh_conds), (cached_latents, cached_conds)):
        with torch.inference_mode():  # as ComfyUI's executor runs nodes
            attached = glue.attach_lora(model, lora.LoRAConfig(rank=2, alpha=2))
            out = _out(train.PrecisionTrainLoRA.execute([attached], latents, conds, [3], [0], ["cache_equal"]))
        trained.append({k: (a.down.detach().clone(), a.up.detach().clone())
                        for k, a in glue.get_lora_set(out[0]).adapters().items()})
    fresh, cached = trained
    assert set(fresh) == set(cached) and fresh
    assert any(bool(up.abs().sum() > 0) for _, up in fresh.values()), "the LoRA did not train"
    for k in fresh:
        assert torch.equal(fresh[k][0], cached[k][0]) and torch.equal(fresh[k][1], cached[k][1]), k


def test_rebuild_encodes_everything_again_and_off_writes_nothing(enc, folder, tmp_path, monkeypatch):
    images = _images()
    run(images, CAPTIONS, enc.vae, enc.clip)
    enc.take()
    first = {e.name: os.stat(e.path).st_mtime_ns for e in os.scandir(os.path.join(folder, "latents"))}
    _, _, report = run(images, CAPTIONS, enc.vae, enc.clip, cache="rebuild")
    assert enc.take() == (3, 2) and "(rebuild)" in report
    assert {e.name for e in os.scandir(os.path.join(folder, "latents"))} == set(first)
    off = str(tmp_path / "never_written")
    monkeypatch.setenv("PRECISION_LORA_DATASET_CACHE", off)
    latents, _, report = run(images, CAPTIONS, enc.vae, enc.clip, cache="off")
    assert enc.take() == (3, 2) and not os.path.exists(off) and "cache off (off)" in report


def test_texts_that_do_not_match_the_images_are_refused_naming_both_counts(enc, folder):
    with pytest.raises(ValueError, match=r"PrecisionCachedTrainingDataset: input 'texts' has 2 captions for 3 "
                                         r"images; connect one caption per image"):
        run(_images(), CAPTIONS[:2], enc.vae, enc.clip)
    assert enc.take() == (0, 0) and not os.path.exists(folder)


def test_progress_counts_every_item_and_an_interrupt_stops_between_items(enc, folder, caplog):
    import comfy.model_management
    import comfy.utils

    seen = []
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: seen.append((value, total)))
    try:
        images = _images(4)
        with caplog.at_level(logging.INFO):
            run(images[:2], CAPTIONS[:2], enc.vae, enc.clip)  # 2 images + 2 captions to encode
            run(images, ["x"], enc.vae, enc.clip)  # 2 images from the cache, 2 images + 1 caption to encode
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
    enc.take()
    assert seen[-1] == (5, 5) and (2, 5) in seen  # the 2 cached images count at once
    lines = [r.getMessage() for r in caplog.records if "PrecisionCachedTrainingDataset: encoding" in r.getMessage()]
    assert lines[-1].startswith("[Precision LoRA] PrecisionCachedTrainingDataset: encoding 3/3 (5/5 items ready)")
    assert "ETA 0:00:00" in lines[-1]
    comfy.model_management.interrupt_current_processing(True)
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            run(_images(2, (48, 48)), ["y"], enc.vae, enc.clip)
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert enc.take() == (0, 0)


def test_a_text_encoder_with_hooks_is_encoded_every_run_and_said_so(enc, folder):
    """CLIP hook nodes make the text encoder's output depend on the step (scheduled hooks): such captions are
    never cached; images still are."""
    import comfy.hooks

    clip = enc.clip.clone()
    clip.patcher.forced_hooks = comfy.hooks.HookGroup()
    counted = Counted(enc.vae, clip)
    images = _images()
    run(images, CAPTIONS, enc.vae, clip)
    counted.take()
    _, conds, report = run(images, CAPTIONS, enc.vae, clip)
    assert counted.take() == (0, 2)
    assert "the text encoder carries hooks (CLIP hook nodes); its outputs are encoded each run, not cached" in report
    assert not os.path.exists(os.path.join(folder, "text"))
    enc.take()  # the module's counter saw these images too (the same VAE)


def _left_masks(images: list[torch.Tensor], share: float = 0.5) -> list[torch.Tensor]:
    """One (1, H, W) mask per image: its left ``share`` white (train here), the rest black; widths differ per
    image so a mask paired with another image shows."""
    masks = []
    for i, image in enumerate(images):
        m = torch.zeros(1, image.shape[1], image.shape[2])
        m[:, :, :int(image.shape[2] * (share + 0.125 * i))] = 1.0
        masks.append(m)
    return masks


def _trained(pack_module, latents, conds, mask=None, **inputs) -> dict:
    """The LoRA (down, up) per module after 3 steps of Train LoRA on a tiny Flux.1 whose text widths are this
    CLIP's 64, from these latents and conditionings (``mask``: Train LoRA's mask input)."""
    tiny, compat = pack_module("demo.tiny_models"), pack_module("nodes.host.comfy_compat")
    glue, lora, train = (pack_module(m) for m in ("nodes.lora.glue", "lora.config", "nodes.train.node"))
    config = compat.fit_flux_config({**tiny.TINY_UNET_CONFIGS["flux1_dev"], "context_in_dim": 64, "vec_in_dim": 64})
    model = tiny.build_tiny_model("flux1_dev", seed=0, unet_config=config)
    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        attached = glue.attach_lora(model, lora.LoRAConfig(rank=2, alpha=2))
        out = _out(train.PrecisionTrainLoRA.execute([attached], latents, conds, [3], [0], ["cache_masks"], mask=mask,
                                                    **inputs))
    return {k: (a.down.detach().clone(), a.up.detach().clone())
            for k, a in glue.get_lora_set(out[0]).adapters().items()}


def test_masks_ride_on_their_latents_are_cached_and_train_as_train_loras_mask_input(enc, folder, pack_module):
    """masks: each image's mask goes to its latent's grid (the area average Train LoRA uses) as the LATENT's
    noise_mask; a second run reads the grid masks from the cache; Train LoRA trains these latents exactly as the
    plain latents with the same masks on its mask input (every bit), and not as the unmasked ones."""
    to_grid = pack_module("training.masks").to_grid
    images = _images(3, (64, 32))
    masks = _left_masks(images)
    latents, conds, report = run_masked(images, masks, enc)
    assert enc.take() == (3, 2)
    assert "3 masks (3 distinct, on their latents as noise_mask): 3 computed, 0 from cache" in report, report
    assert sorted(os.listdir(folder)) == ["latents", "masks", "text"]
    for latent, m in zip(latents, masks):
        samples = latent["samples"]
        assert latent["noise_mask"].shape == (1, 1, *samples.shape[-2:])
        assert torch.equal(latent["noise_mask"][0], to_grid(m[0], tuple(samples.shape[1:])))
    assert [float(lat["noise_mask"].mean()) for lat in latents] == [0.5, 0.625, 0.75]
    again, conds_again, report = run_masked(images, masks, enc)
    assert enc.take() == (0, 0)
    assert "3 masks (3 distinct, on their latents as noise_mask): 0 computed, 3 from cache" in report, report
    _same(again, latents)
    plain, _, _ = run(images, CAPTIONS, enc.vae, enc.clip)
    masked = _trained(pack_module, again, conds_again)
    by_input = _trained(pack_module, plain, conds_again, mask=masks)
    unmasked = _trained(pack_module, plain, conds_again)
    assert set(masked) == set(by_input) and masked
    for k in masked:
        assert torch.equal(masked[k][0], by_input[k][0]) and torch.equal(masked[k][1], by_input[k][1]), k
    assert any(not torch.equal(masked[k][1], unmasked[k][1]) for k in masked), "the masks changed nothing"


def run_masked(images, masks, enc, cache: str = "use", outside: str | None = None):
    node = node_class("PrecisionCachedTrainingDataset")
    extra = {} if outside is None else {"outside_mask": [outside]}
    with torch.inference_mode():
        return _out(node.execute(images=images, vae=[enc.vae], clip=[enc.clip], texts=CAPTIONS, cache=[cache],
                                 masks=masks, **extra))[:3]


def _other_outside(images: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The images with new random pixels wherever their mask is 0, the same pixels elsewhere."""
    gen = torch.Generator().manual_seed(7)
    return [torch.where(m.unsqueeze(-1) == 0, torch.rand(image.shape, generator=gen), image)
            for image, m in zip(images, masks)]


def test_outside_mask_gray_keeps_the_pixels_outside_the_masks_from_the_lora(enc, folder, pack_module):
    """outside_mask = gray: images that differ only where their masks are 0 encode to the same latents (the second
    set reads the first's entries: the same keys) and, at unmasked_weight 0, train the same LoRA, every bit. With
    keep, the same two sets give other latents and another LoRA: the model reads the region as context."""
    images = _images(3, (64, 32))
    masks = _left_masks(images)
    other = _other_outside(images, masks)
    assert all(not torch.equal(a, b) for a, b in zip(images, other))
    latents, conds, report = run_masked(images, masks, enc, outside="gray")
    assert enc.take() == (3, 2) and "pixels outside the masks set to gray before encoding" in report, report
    latents_other, _, report = run_masked(other, masks, enc, outside="gray")
    assert enc.take() == (0, 0) and "3 images (3 distinct): 0 encoded, 3 from cache" in report, report
    _same(latents_other, latents)
    kept, _, report = run_masked(images, masks, enc, outside="keep")
    kept_other, _, _ = run_masked(other, masks, enc, outside="keep")
    assert "before encoding" not in report, report
    assert all(not torch.equal(a["samples"], b["samples"]) for a, b in zip(kept, kept_other))
    assert all(not torch.equal(a["samples"], b["samples"]) for a, b in zip(kept, latents))
    first, second = _trained(pack_module, latents, conds), _trained(pack_module, latents_other, conds)
    assert set(first) == set(second) and first
    for k in first:
        assert torch.equal(first[k][0], second[k][0]) and torch.equal(first[k][1], second[k][1]), k
    a, b = _trained(pack_module, kept, conds), _trained(pack_module, kept_other, conds)
    assert any(not torch.equal(a[k][1], b[k][1]) for k in a), "keep: the region outside changed nothing"
    enc.take()


def test_a_colour_outside_the_masks_with_unmasked_weight_above_0_is_refused_by_train_lora(enc, folder, pack_module):
    """Latents encoded with outside_mask = gray carry the colour; Train LoRA at unmasked_weight 0.5 would train
    the flat gray there and refuses, naming the fix; the same latents encoded with keep train."""
    settings = pack_module("training.settings").TrainSettings(unmasked_weight=0.5)
    images = _images(3, (64, 32))
    latents, conds, _ = run_masked(images, _left_masks(images), enc, outside="gray")
    assert [lat["precision_outside_mask"] for lat in latents] == ["gray"] * 3
    with pytest.raises(ValueError, match=re.escape(
            "PrecisionTrainLoRA: input 'latents': LATENT 0 was encoded with the pixels outside its mask set to gray "
            "(Cached Training Dataset's outside_mask), and unmasked_weight=0.5 would train the LoRA on that flat "
            "colour there; set unmasked_weight to 0 (Precision Train Settings) or outside_mask to keep")):
        _trained(pack_module, latents, conds, settings=[settings])
    kept, _, _ = run_masked(images, _left_masks(images), enc, outside="keep")
    assert all("precision_outside_mask" not in lat for lat in kept)
    assert _trained(pack_module, kept, conds, settings=[settings])
    enc.take()


def test_outside_mask_blends_each_pixel_toward_the_colour_by_its_mask(pack_module):
    """0 gives the colour exactly, 1 the pixel exactly, between a blend; an alpha channel and an image without a
    mask are left alone; a (1, H, W) mask covers every image (frame) of its batch."""
    fill = pack_module("nodes.dataset.cache")._fill_outside
    image = torch.rand(2, 2, 3, 4, generator=torch.Generator().manual_seed(3))
    m = torch.tensor([[[0.0, 1.0, 0.25], [1.0, 0.0, 0.5]]])
    plain = torch.rand(1, 2, 3, 3)
    out, same = fill([image, plain], [m, None], "white")
    assert same is plain and torch.equal(out[..., 3], image[..., 3])
    assert torch.equal(out[:, 0, 0, :3], torch.ones(2, 3)) and torch.equal(out[:, 1, 1, :3], torch.ones(2, 3))
    assert torch.equal(out[:, 0, 1, :3], image[:, 0, 1, :3]) and torch.equal(out[:, 1, 0, :3], image[:, 1, 0, :3])
    torch.testing.assert_close(out[:, 0, 2, :3], image[:, 0, 2, :3] * 0.25 + 0.75, rtol=0, atol=1e-7)
    assert torch.equal(fill([image], [m], "black")[0][:, 0, 0, :3], torch.zeros(2, 3))


@pytest.mark.parametrize("masks,outside,message", [
    (None, "gray", "input 'outside_mask' is 'gray' but no masks are connected; connect masks (Precision Resolution "
                   "Buckets' masks) or set outside_mask to keep"),
    ("left", "grey", "input 'outside_mask'='grey' is not an option; choose one of ['keep', 'white', 'black', 'gray']"),
])
def test_outside_mask_without_masks_or_unknown_is_refused_before_anything_is_encoded(enc, folder, masks, outside,
                                                                                       message):
    images = _images(3, (64, 32))
    with pytest.raises(ValueError, match=re.escape("PrecisionCachedTrainingDataset: " + message)):
        run_masked(images, _left_masks(images) if masks else None, enc, outside=outside)
    assert enc.take() == (0, 0) and not os.path.exists(folder)


def test_a_changed_mask_is_computed_again_and_the_latents_come_from_the_cache(enc, folder):
    images = _images(3, (64, 32))
    run_masked(images, _left_masks(images), enc)
    enc.take()
    latents, _, report = run_masked(images, _left_masks(images, share=0.25), enc)
    assert enc.take() == (0, 0) and "3 images (3 distinct): 0 encoded, 3 from cache" in report
    assert "3 masks (3 distinct, on their latents as noise_mask): 3 computed, 0 from cache" in report, report
    assert [float(lat["noise_mask"].mean()) for lat in latents] == [0.25, 0.375, 0.5]


@pytest.mark.parametrize("case,message", [
    ("count", r"input 'masks' has 2 masks for 3 images; connect one mask per image, the masks of these images in "
              r"the same order \(the masks output of Precision Resolution Buckets\)"),
    ("swapped", r"input 'masks': mask 1 \(0-based\) is 64x32 px but image 1 is 32x64 px; connect one mask per "
                r"image"),
    ("batch", r"input 'masks': mask 0 \(0-based\) has 2 masks for image 0; give one mask for all 1 images of the "
              r"batch or one each"),
    ("type", r"input 'masks': mask 2 \(0-based\) has shape \(1, 1, 8, 8\), not a MASK \(B, H, W\); connect one "
             r"mask per image"),
])
def test_a_mask_that_does_not_pair_with_its_image_is_refused_before_anything_is_encoded(enc, folder, case, message):
    """Images of different sizes: a mask list in another order than the images (the masks of another loader) is
    refused naming both sizes; nothing is encoded or written."""
    images = _images(2, (64, 32)) + _images(1, (32, 64))
    images = [images[0], images[2], images[1]]
    masks = _left_masks(images)
    if case == "count":
        masks = masks[:2]
    elif case == "swapped":
        masks = [masks[0], masks[2], masks[1]]
    elif case == "batch":
        masks[0] = torch.cat([masks[0], masks[0]])
    else:
        masks[2] = torch.ones(1, 1, 8, 8)
    with pytest.raises(ValueError, match="PrecisionCachedTrainingDataset: " + message):
        run_masked(images, masks, enc)
    assert enc.take() == (0, 0) and not os.path.exists(folder)
