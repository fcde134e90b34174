"""Captions reach the images they belong to (issue 14 item 2), or the node says why not, and the run
reports its dataset (item 9) and logs its progress (item 10).

The dataset comes from ComfyUI's own LoadImageTextDataSetFromFolder and MakeTrainingDataset over a folder
written here; MakeTrainingDataset gets a stand-in VAE (each image's colour becomes its latent) and a
stand-in text encoder (each caption's seeded demo conditioning), so which caption went with which image is
read back from the tensors.
"""
from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from comfy_harness import node_class, pack_module, run_graph
from models import make_conditioning, make_latent, tiny_cosmos, write_model_file

# name -> (colour, caption or None for an image without a .txt)
FOLDER = {"a_red": ((255, 0, 0), "a red square"), "b_green": ((0, 255, 0), "a green square"),
          "c_blue": ((0, 0, 255), None), "d_white": ((255, 255, 255), None)}


def _out(result):
    return getattr(result, "result", result)


class ColourVAE:
    """Encodes an image [1, H, W, 3] to a Cosmos latent whose first 3 channels hold its mean colour."""

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        h, w = pixels.shape[1] // 8, pixels.shape[2] // 8
        latent = torch.zeros(1, 16, 1, h, w)
        latent[:, :3] = pixels[0].mean(dim=(0, 1)).reshape(1, 3, 1, 1, 1)
        return latent


class CaptionCLIP:
    """Encodes a caption to the seeded demo conditioning of that text (distinct texts, distinct tensors)."""

    def __init__(self, model):
        self.model = model

    def tokenize(self, text: str) -> str:
        return text

    def encode_from_tokens_scheduled(self, text: str) -> list:
        return make_conditioning(self.model, 1, text=text)


def _load_stock_extras(*files: str) -> None:
    """Register ComfyUI's own extra nodes the way ComfyUI's start-up does (LatentBatch's module needs
    kornia, not installed here: its equal-size batch is a concatenation, done by hand below)."""
    import asyncio

    import nodes as comfy_nodes

    folder = os.path.join(os.path.dirname(os.path.abspath(comfy_nodes.__file__)), "comfy_extras")
    for name in files:
        assert asyncio.run(comfy_nodes.load_custom_node(os.path.join(folder, name), module_parent="comfy_extras"))


@pytest.fixture(scope="module")
def env(pack_module):
    import folder_paths

    _load_stock_extras("nodes_dataset.py")

    class E:
        td = pack_module("nodes.train.data")
        model = tiny_cosmos()
    root = os.path.join(folder_paths.get_input_directory(), "precision_captions")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    for name, (colour, caption) in FOLDER.items():
        Image.fromarray(np.full((32, 32, 3), colour, dtype=np.uint8)).save(os.path.join(root, f"{name}.png"))
        if caption is not None:
            with open(os.path.join(root, f"{name}.txt"), "w", encoding="utf-8") as f:
                f.write(caption)
    images, texts = _out(node_class("LoadImageTextDataSetFromFolder").execute(folder="precision_captions"))
    E.latents, E.conds = _out(node_class("MakeTrainingDataset").execute(
        images=images, vae=[ColourVAE()], clip=[CaptionCLIP(E.model)], texts=texts))
    yield E
    shutil.rmtree(root, ignore_errors=True)


def _colour(sample, model) -> tuple[int, ...]:
    """The colour a sample's latent was encoded from (undoing the model's latent scaling)."""
    raw = model.model.process_latent_out(sample.latent.unsqueeze(0))[0]
    return tuple(int(round(float(v) * 255)) for v in raw[:3].reshape(3, -1)[:, 0])


def _caption(sample, model) -> str:
    """The caption whose encoding the sample trains on, found by tensor equality."""
    ctx = sample.cond["c_crossattn"].cond
    found = [c or "" for _, c in FOLDER.values()
             if torch.equal(ctx, make_conditioning(model, 1, text=c or "")[0][0])]
    assert len(found) >= 1, "the sample's conditioning is none of the captions"
    return found[0]


def test_folder_captions_reach_their_own_images(env):
    with torch.inference_mode():
        samples, report = env.td.build_dataset(env.model, env.latents, env.conds, None, torch.device("cpu"))
    assert len(samples) == 4
    pairs = {_colour(s, env.model): _caption(s, env.model) for s in samples}
    assert pairs == {colour: caption or "" for colour, caption in FOLDER.values()}
    # two images without a .txt share the empty caption: named, with the fix
    assert report.captions == 3 and report.samples == 4 and report.buckets == 1
    text = "\n".join(report.lines())
    assert "4 samples from 4 LATENT inputs; sizes 32x32 px x4; 1 bucket" in text
    assert "captions: 3 distinct for 4 samples" in text
    uncaptioned = sorted(i + 1 for i, s in enumerate(samples) if pairs[_colour(s, env.model)] == "")
    assert len(uncaptioned) == 2  # the loader's order is the folder listing's
    assert f"samples {uncaptioned[0]}, {uncaptioned[1]} have the same caption: images without a .txt caption" in text


def test_one_latent_batch_and_a_list_of_captions_pair_in_order(env):
    """CLIPTextEncode over a list of texts gives one CONDITIONING per text; with one LATENT batch of as
    many images they pair in order (image i, caption i)."""
    batch = {"samples": torch.cat([latent["samples"] for latent in env.latents[:3]])}
    with torch.inference_mode():
        samples = env.td.build_samples(env.model, [batch], env.conds[:3], None, torch.device("cpu"))
    truth = {colour: caption or "" for colour, caption in FOLDER.values()}
    assert len(samples) == 3
    assert [_caption(s, env.model) for s in samples] == [truth[_colour(s, env.model)] for s in samples]


def test_combined_captions_pair_one_per_latent_row(env):
    """Two images in one LATENT batch (LatentBatch) and ConditioningCombine of two captions: one entry per
    image, in order (as ResolutionBucket hands per-image captions on); it used to train both on the first
    caption."""
    colours = [tuple(int(round(float(v) * 255)) for v in latent["samples"][0, :3, 0, 0, 0]) for latent in env.latents]
    i, j = colours.index(FOLDER["a_red"][0]), colours.index(FOLDER["b_green"][0])
    ci, cj = env.conds[i][0][0], env.conds[j][0][0]
    assert not torch.equal(ci, cj)
    batch = {"samples": torch.cat([env.latents[i]["samples"], env.latents[j]["samples"]])}
    combined = _out(node_class("ConditioningCombine")().combine(env.conds[j], env.conds[i]))[0]
    assert len(combined) == 2
    with torch.inference_mode():
        samples = env.td.build_samples(env.model, [batch], [combined], None, torch.device("cpu"))
    assert [torch.equal(s.cond["c_crossattn"].cond, c) for s, c in zip(samples, (cj, ci))] == [True, True]


def _count_graph(name: str, images: int) -> dict:
    """Tiny Cosmos + LoRA; one LATENT batch of ``images`` images; two captions through ConditioningCombine."""
    return {
        "1": {"class_type": "PrecisionLoadDiffusionModel", "inputs": {"model_name": name, "weight_dtype": "default"}},
        "2": {"class_type": "PrecisionAttachLoRA", "inputs": {
            "model": ["1", 0], "rank": 2, "alpha": 2, "targets": "attention", "include": "", "exclude": "",
            "blocks": "", "fp32_accumulation": True, "dropout": 0, "rank_dropout": 0, "module_dropout": 0,
            "rslora": False, "param_dtype": "fp32", "seed": 0, "init_lora": "none", "dry_run": False}},
        "3": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["1", 0], "text": "a", "seed": 0, "tokens": 8}},
        "4": {"class_type": "PrecisionDemoConditioning", "inputs": {"model": ["1", 0], "text": "b", "seed": 0, "tokens": 8}},
        "5": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["3", 0], "conditioning_2": ["4", 0]}},
        "6": {"class_type": "PrecisionDemoLatent", "inputs": {"model": ["1", 0], "width": 32, "height": 32,
                                                              "batch_size": images, "seed": 0}},
        "9": {"class_type": "PrecisionTrainLoRA", "inputs": {"model": ["2", 0], "latents": ["6", 0],
                                                             "conditioning": ["5", 0], "steps": 1, "seed": 0,
                                                             "name": "captions_graph", "resume_from": ""}},
    }


def test_combined_captions_that_do_not_match_the_images_are_refused_with_the_counts(pack):
    import folder_paths

    name = "captions_tiny_cosmos.safetensors"
    write_model_file("cosmos", f"{folder_paths.get_folder_paths('diffusion_models')[0]}/{name}")
    run = run_graph(_count_graph(name, 3), outputs=["9"])
    assert not run["success"]
    errors = [m for m in run["messages"] if m[0] == "execution_error"]
    assert len(errors) == 1
    message = errors[0][1]["exception_message"]
    assert message.startswith("[Precision LoRA] PrecisionTrainLoRA: input 'conditioning': 2 conditioning rows for "
                              "3 latent samples (1 CONDITIONING input with 2 entries; 1 LATENT input): the captions "
                              "cannot be matched to the images; connect one conditioning for all samples, one per "
                              "sample in the latents' order"), message


def test_a_list_of_conditionings_that_does_not_fit_its_latent_list_names_the_item(env):
    latents = [make_latent(env.model, 2, width=32, height=32), make_latent(env.model, 1, width=32, height=32)]
    two = [[make_conditioning(env.model, 1, text=t)[0][0], {}] for t in "ab"]
    conds = [make_conditioning(env.model, 1, text="x"), [[torch.cat([two[0][0], two[1][0]]), {}]]]
    with torch.inference_mode(), pytest.raises(ValueError, match=(
            r"^PrecisionTrainLoRA: input 'conditioning': item 1 has 2 conditioning rows \(1 "
            r"entries\) for the 1 samples of LATENT 1: the captions cannot be matched to the images")):
        env.td.build_samples(env.model, latents, conds, None, torch.device("cpu"))
    # item 0's one row is shared by its LATENT's two samples when item 1 fits
    conds[1] = make_conditioning(env.model, 1, text="y")
    with torch.inference_mode():
        samples = env.td.build_samples(env.model, latents, conds, None, torch.device("cpu"))
    texts = [torch.equal(s.cond["c_crossattn"].cond, make_conditioning(env.model, 1, text=t)[0][0])
             for s, t in zip(samples, "xxy")]
    assert texts == [True, True, True]


def test_train_node_logs_the_dataset_report_and_keeps_it_in_the_lora_metadata(env, caplog):
    glue, lora = pack_module("nodes.lora.glue"), pack_module("lora.config")
    train = pack_module("nodes.train.node")
    with torch.inference_mode():
        model = glue.attach_lora(env.model, lora.LoRAConfig(rank=2, alpha=2))
    with caplog.at_level(logging.INFO), torch.inference_mode():
        out = _out(train.PrecisionTrainLoRA.execute([model], env.latents, env.conds, [2], [0], ["captions_report"]))
    lines = [r.getMessage() for r in caplog.records]
    assert any("PrecisionTrainLoRA: dataset: 4 samples from 4 LATENT inputs" in m for m in lines)
    assert sum("have the same caption: images without a .txt caption" in m for m in lines) == 1
    info = glue.get_lora_set(out[0]).info["precision_lora_dataset"]
    assert info.startswith("dataset: 4 samples") and "captions: 3 distinct for 4 samples" in info
    # one console line per step here (2 steps: every step), with loss, lr, it/s and ETA
    steps = [m for m in lines if "PrecisionTrainLoRA: step " in m]
    assert len(steps) == 2 and steps[-1].startswith("[Precision LoRA] PrecisionTrainLoRA: step 2/2 loss ")
    assert " (smoothed) lr 0.0001 " in steps[-1] and " it/s ETA 0:00:00" in steps[-1]
