"""PrecisionDemoPreview: a latent shown as an image without a VAE (used by the example workflows)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def preview(pack_module):
    return pack_module("demo.nodes").latent_to_preview


def test_first_three_channels_normalised_and_upscaled(preview):
    lat = torch.zeros(2, 16, 4, 5)
    lat[0, 0, 1, 2] = 5.0   # one bright pixel in red of image 0
    lat[0, 5] = 100.0        # channel 5 is not shown
    lat[1, 2] = torch.arange(20.0).reshape(4, 5)
    img = preview(lat)
    assert img.shape == (2, 32, 40, 3)
    assert img.min() >= 0 and img.max() <= 1
    assert img[0, 8:16, 16:24, 0].eq(1).all()  # the bright pixel, upscaled 8x nearest
    assert img[0, :8, :, :].eq(0).all()
    assert torch.allclose(img[1, ::8, ::8, 2], torch.arange(20.0).reshape(4, 5) / 19)


def test_five_d_latents_use_the_first_frame_and_bad_shapes_fail(preview):
    lat = torch.randn(1, 16, 3, 2, 2)
    assert torch.equal(preview(lat), preview(lat[:, :, 0]))
    with pytest.raises(ValueError, match=r"^PrecisionDemoPreview: expected a 4-D or 5-D latent"):
        preview(torch.zeros(3, 4))
