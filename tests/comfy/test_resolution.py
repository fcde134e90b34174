"""PrecisionResolutionBuckets and the training node's patch-grid check (issue 14 item 5)."""
from __future__ import annotations

import math

import pytest
import torch

from models import make_conditioning, make_latent, tiny_cosmos, tiny_flux1

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def res(pack_module):
    return pack_module("nodes.dataset.resolution")


def _image(w: int, h: int, colour: float) -> torch.Tensor:
    return torch.full((1, h, w, 3), colour)


def _run(res, images, resolution=64, multiple=16, max_upscale=2.0, texts=None, model=None, masks=None):
    kw = {} if masks is None else {"masks": masks}
    if texts is not None:
        kw["texts"] = texts
    if model is not None:
        kw["model"] = [model]
    out = res.PrecisionResolutionBuckets.execute(images, [resolution], [multiple], [max_upscale], **kw)
    return out.result


@pytest.mark.parametrize("resolution,multiple", [(64, 16), (512, 16), (1024, 16), (768, 64)])
def test_buckets_are_multiples_near_the_target_area_within_the_aspect_range(res, resolution, multiple):
    choices = res.buckets(resolution, multiple)
    assert (resolution, resolution) in choices
    for w, h in choices:
        assert w % multiple == 0 and h % multiple == 0
        assert w * h <= resolution**2
        assert max(w, h) / min(w, h) <= res.MAX_ASPECT
    assert res.nearest_bucket(300, 300, choices) == (resolution, resolution)
    wide = res.nearest_bucket(1600, 900, choices)
    assert wide[0] > wide[1] and abs(math.log(wide[0] / wide[1]) - math.log(16 / 9)) < 0.25


def test_images_are_fitted_in_order_and_texts_pass_through(res):
    images = [_image(100, 75, 0.1), _image(75, 100, 0.2), _image(64, 64, 0.3), _image(160, 40, 0.4)]
    texts = ["a", "b", "", "d"]
    fitted, out_texts, report, _ = _run(res, images, texts=texts)
    assert out_texts == texts
    for img, src in zip(fitted, images):
        _, h, w, c = img.shape
        assert (w % 16, h % 16, c) == (0, 0, 3) and w * h <= 64 * 64
        assert torch.allclose(img, torch.full_like(img, float(src[0, 0, 0, 0])), atol=1e-5)  # same image, same order
    shapes = [tuple(i.shape[1:3]) for i in fitted]
    assert shapes[0][1] > shapes[0][0] and shapes[1][0] > shapes[1][1] and shapes[2] == (64, 64)
    assert shapes[3][1] >= 2 * shapes[3][0]  # 4:1 lands on the widest bucket
    assert report.startswith("4 images -> 4 buckets") and "multiple 16 px (set on the node)" in report


def test_center_crop_keeps_the_middle(res):
    # a 128 x 64 image whose left and right quarters are 1, middle 0, into a square bucket: only the middle remains
    img = torch.zeros(1, 64, 128, 3)
    img[:, :, :32], img[:, :, 96:] = 1.0, 1.0
    out = res.fit(img, (64, 64))
    assert out.shape == (1, 64, 64, 3)
    assert float(out[:, :, 8:56].max()) < 1e-3


def test_the_multiple_comes_from_the_model(res):
    assert res.pixel_multiple(tiny_cosmos()) == 16  # patch 2 x VAE 8
    assert res.pixel_multiple(tiny_flux1()) == 16
    _, _, report, _ = _run(res, [_image(64, 64, 0.5)], multiple=0, model=tiny_cosmos())
    assert "multiple 16 px (from the model (cosmos_predict2: patch 2 x VAE 8))" in report
    _, _, report, _ = _run(res, [_image(64, 64, 0.5)], multiple=0)
    assert "multiple 16 px (default (no model connected))" in report


def test_unusable_images_are_named(res):
    ok = _image(64, 64, 0.5)
    with pytest.raises(ValueError, match=r"PrecisionResolutionBuckets: input 'images': image 1 .* is 20 x 20 px, "
                                         r"too small for resolution 64: .*3.20x upscaling \(max_upscale 2.0\)"):
        _run(res, [ok, _image(20, 20, 0.1)])
    with pytest.raises(ValueError, match=r"image 2 .* has zero size \(1, 0, 64, 3\)"):
        _run(res, [ok, ok, torch.zeros(1, 0, 64, 3)])
    with pytest.raises(ValueError, match=r"image 0 .* is unreadable \(object\)"):
        _run(res, [object()])
    # text where an image belongs is what an API prompt can type: the input gate names it (nodes/checks/gate.py)
    with pytest.raises(ValueError, match=r"input 'images'='not an image' is a value typed into the prompt, not an "
                                         r"IMAGE; connect an IMAGE output to it"):
        _run(res, ["not an image"])
    with pytest.raises(ValueError, match=r"input 'texts' has 1 entries for 2 images"):
        _run(res, [ok, ok], texts=["a"])
    assert len(_run(res, [_image(20, 20, 0.1)], max_upscale=4.0)[0]) == 1  # allowed when asked for


@pytest.fixture(scope="module")
def train(pack_module):
    class M:
        glue = pack_module("nodes.lora.glue")
        node = pack_module("nodes.train.node").PrecisionTrainLoRA
        lora = pack_module("lora.config")
    return M


def _train(train, model, latent):
    with torch.inference_mode():
        m = train.glue.attach_lora(model, train.lora.LoRAConfig(rank=2, alpha=2, targets="all"))
        return train.node.execute([m], [make_latent(model, 1, 64, 64), latent], [make_conditioning(model, 1)],
                                  [1], [0], ["res_check"])


def test_training_names_a_latent_off_the_patch_grid_with_the_fix(train):
    model = tiny_cosmos()
    odd = make_latent(model, 1, width=72, height=96)  # 9 x 12 latent pixels: the Cosmos case
    with pytest.raises(ValueError, match=r"PrecisionTrainLoRA: input 'latents': latent 1 has shape \(1, 16, 1, 12, 9\): "
                                         r"12 x 9 latent pixels .* needs multiples of 2 latent pixels \(16 image pixels\); "
                                         r"put PrecisionResolutionBuckets"):
        _train(train, model, odd)


def test_a_padding_model_trains_an_off_grid_latent_and_says_so(train, caplog):
    model = tiny_flux1()
    with caplog.at_level("WARNING"):
        out = _train(train, model, make_latent(model, 1, width=72, height=96))
    assert out.result[3] == 1
    assert "the model pads it, so it trains" in caplog.text


def test_wan22_5b_multiple_is_its_vae_16_times_patch_2(res):
    """Wan 2.2 5B's VAE downscales 16x (ComfyUI 0.3.75's Wan22 latent format does not state it; 0.33 does): its
    buckets are multiples of 32 px, so an 80 x 48 image cannot give a 5 x 3 latent off the 2 x 2 patch grid."""
    import families

    wan = families.build("WAN22_T2V")
    assert res.pixel_multiple(wan) == 32
    _, _, report, _ = _run(res, [_image(80, 48, 0.5)], multiple=0, model=wan)
    assert "multiple 32 px (from the model (" in report and "patch 2 x VAE 16))" in report, report


def test_masks_are_scaled_and_cropped_as_their_images(res):
    """A mask is fitted exactly as its image (here each mask is its image's red channel: after bucketing it still
    is, pixel for pixel); without masks the output is the whole image; a mask of another size than its image, or
    a count that does not pair, is refused by name."""
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(1, 60, 100, 3, generator=g), torch.rand(1, 100, 60, 3, generator=g)]
    masks = [im[..., 0].clone() for im in images]
    fitted, _, _, fitted_masks = _run(res, images, masks=masks)
    for image, mask in zip(fitted, fitted_masks):
        assert mask.shape == image.shape[:3] and torch.equal(mask, image[..., 0])
    _, _, _, whole = _run(res, images)
    assert [tuple(m.shape) for m in whole] == [tuple(f.shape[:3]) for f in fitted]
    assert all(bool((m == 1).all()) for m in whole)
    with pytest.raises(ValueError, match=r"input 'masks': mask 1 \(0-based\) is 60x60 px but image 1 is 60x100 px"):
        _run(res, images, masks=[masks[0], torch.ones(1, 60, 60)])
    with pytest.raises(ValueError, match=r"input 'masks' has 1 masks for 2 images"):
        _run(res, images, masks=masks[:1])
