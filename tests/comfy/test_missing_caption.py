"""One missing caption among captioned images is named (issue 23 item 5), and the images MakeTrainingDataset
encodes from PrecisionLoadImageDataset are what the files show (issue 23 item 4, through to the latents).

A caption cannot be read back from its conditioning, so Train LoRA's report finds the samples that train on
the empty caption by comparing with ``empty_conditioning`` when it is connected; Resolution Buckets sees the
texts themselves; PrecisionLoadImageDataset names the files (tests/comfy/test_image_reading.py).
"""
from __future__ import annotations

import asyncio
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from comfy_harness import node_class, pack_module
from models import make_conditioning, make_latent, tiny_cosmos

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(pack):
    class E:
        td = pack_module("nodes.train.data")
        model = tiny_cosmos()
    return E


def _conds(model, captions):
    return [make_conditioning(model, 1, text=c) for c in captions]


def _report(env, captions, empty=None):
    latent = make_latent(env.model, len(captions), width=32, height=32)
    with torch.inference_mode():
        _, report = env.td.build_dataset(env.model, [latent], _conds(env.model, captions), None,
                                         torch.device("cpu"), empty)
    return report.lines()


def test_one_empty_caption_among_captions_is_named_by_its_sample(env):
    lines = _report(env, ["a cat", "", "a dog"], empty=[make_conditioning(env.model, 1, text="")])
    assert ("sample 2 of 3 train on the empty caption (equal to empty_conditioning) while the others have captions: "
            "an image without its .txt caption (PrecisionLoadImageDataset's report names the file); write the "
            "caption or check that the .txt names match the images") in lines
    lines = _report(env, ["", "a cat", "", "a dog"], empty=[make_conditioning(env.model, 1, text="")])
    assert any(line.startswith("samples 1, 3 of 4 train on the empty caption") for line in lines)


def test_no_line_when_every_caption_is_there_or_every_one_is_empty(env):
    empty = [make_conditioning(env.model, 1, text="")]
    assert not any("empty caption (equal to" in line for line in _report(env, ["a cat", "a dog"], empty))
    assert not any("empty caption (equal to" in line for line in _report(env, ["", ""], empty))
    # without empty_conditioning the conditioning alone cannot say which text it came from
    assert not any("empty caption (equal to" in line for line in _report(env, ["a cat", "", "a dog"]))


def test_train_lora_shows_the_line_with_empty_conditioning_connected(env):
    glue, train = pack_module("nodes.lora.glue"), pack_module("nodes.train.node")
    Settings = pack_module("training.settings").TrainSettings
    with torch.inference_mode():
        model = glue.attach_lora(env.model, pack_module("lora.config").LoRAConfig(rank=2, alpha=2))
        latents = [make_latent(env.model, 1, width=32, height=32, seed=i) for i in range(3)]
        out = train.PrecisionTrainLoRA.execute(
            [model], latents, _conds(env.model, ["a cat", "a dog", ""]), [1], [0], ["missing_caption"],
            settings=[Settings(learning_rate=1e-4)], empty_conditioning=[make_conditioning(env.model, 1, text="")])
    summary = glue.get_lora_set(out.result[0]).info["precision_lora_dataset"]
    assert "sample 3 of 3 train on the empty caption (equal to empty_conditioning)" in summary, summary


def test_resolution_buckets_names_the_empty_texts(pack):
    node = node_class("PrecisionResolutionBuckets")
    images = [torch.full((1, 64, 64, 3), 0.5) for _ in range(3)]
    report = node.execute(images, [64], [16], [2.0], texts=["a cat", " ", "a dog"]).result[2]
    assert report.endswith("; texts 1 (0-based, the images' order) are empty while the others are not: those "
                           "images train on the empty caption (a missing .txt?)"), report
    full = node.execute(images, [64], [16], [2.0], texts=["a", "b", "c"]).result[2]
    assert "empty" not in full


class ColourVAE:
    """Encodes an image [1, H, W, 3] to a Cosmos latent whose first 3 channels hold its mean colour."""

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        h, w = pixels.shape[1] // 8, pixels.shape[2] // 8
        latent = torch.zeros(1, 16, 1, h, w)
        latent[:, :3] = pixels[0].mean(dim=(0, 1)).reshape(1, 3, 1, 1, 1)
        return latent


class TextCLIP:
    def __init__(self, model):
        self.model = model

    def tokenize(self, text: str) -> str:
        return text

    def encode_from_tokens_scheduled(self, text: str) -> list:
        return make_conditioning(self.model, 1, text=text)


def test_the_latents_made_from_the_node_hold_what_the_files_show(env):
    """16-bit gray at half scale encodes as 0.5 (not white), a transparent image on white as white, and an
    EXIF-rotated image keeps its upright size through MakeTrainingDataset into Train LoRA's samples."""
    import folder_paths
    import nodes as comfy_nodes

    extras = os.path.join(os.path.dirname(os.path.abspath(comfy_nodes.__file__)), "comfy_extras", "nodes_dataset.py")
    assert asyncio.run(comfy_nodes.load_custom_node(extras, module_parent="comfy_extras"))
    root = os.path.join(folder_paths.get_input_directory(), "precision_latent_kinds")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    try:
        Image.fromarray(np.full((32, 32), 32768, dtype=np.uint16)).save(os.path.join(root, "a_gray16.png"))
        Image.new("RGBA", (32, 32), (0, 0, 0, 0)).save(os.path.join(root, "b_clear.png"))
        tall = Image.new("RGB", (48, 32), (255, 0, 0))
        exif = tall.getexif()
        exif[0x0112] = 6
        tall.save(os.path.join(root, "c_rotated.png"), exif=exif)
        images, texts, _, _ = node_class("PrecisionLoadImageDataset").execute(
            "precision_latent_kinds", "white", "first_frame", "train_empty").result
        latents, conds = node_class("MakeTrainingDataset").execute(
            images=images, vae=[ColourVAE()], clip=[TextCLIP(env.model)], texts=texts).result[:2]
        with torch.inference_mode():
            samples = env.td.build_samples(env.model, latents, conds, None, torch.device("cpu"))
        colours = [env.model.model.process_latent_out(s.latent.unsqueeze(0))[0][:3].reshape(3, -1)[:, 0]
                   for s in samples]
        torch.testing.assert_close(colours[0], torch.full((3,), 32768 / 65535), atol=1e-5, rtol=0)
        torch.testing.assert_close(colours[1], torch.ones(3), atol=1e-5, rtol=0)
        torch.testing.assert_close(colours[2], torch.tensor([1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
        assert tuple(samples[2].latent.shape[-2:]) == (48 // 8, 32 // 8)  # upright: 32 wide, 48 high
    finally:
        shutil.rmtree(root, ignore_errors=True)
