"""Training previews of video families are sized with the VAE's spatial ratio.

ComfyUI's video VAEs state their downscale as (frames function, height ratio, width ratio); the preview's size
check read only an int ratio and otherwise fell back to the latent format's, which ComfyUI 0.3.75's Wan 2.2
format does not state: previews of Wan 2.2 5B were checked against 8 px per latent cell instead of 16. The
patch size of video DiTs is (frames, height, width): it was read only as an int, so their previews were not
held to the patch grid at all."""
from __future__ import annotations

import pytest

import families
from video_vaes import tiny_video_vae

CASES = [  # (family model, its video VAE, pixels per latent cell, preview multiple: ratio x patch 2)
    ("WAN22_T2V", "wan22", 16, 32),
    ("WAN21_T2V", "wan21", 8, 16),
    ("HunyuanVideo", "hunyuan_video", 8, 16),
]


@pytest.mark.parametrize("name,vae_family,down,multiple", CASES)
def test_preview_multiple_uses_the_video_vaes_spatial_ratio(name, vae_family, down, multiple, pack_module):
    reason = families.available(name)
    if reason:
        pytest.skip(reason)
    preview = pack_module("nodes.train.preview")
    vae = tiny_video_vae(vae_family)
    assert isinstance(vae.downscale_ratio, tuple) and vae.downscale_ratio[-1] == down
    assert preview._multiple(families.build(name), vae) == (down, multiple)
