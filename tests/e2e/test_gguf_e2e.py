"""Training on a GGUF base through a real server's /prompt (issue 36 item 4), with the real ComfyUI-GGUF installed
beside the pack (tests/other_packs.py, the session server of tests/conftest.py): the pack's demo Cosmos converted to
Q8_0 (tests/gguf_models.py), loaded by ComfyUI-GGUF's Unet Loader (GGUF), Attach LoRA, Train LoRA (the loss falls),
Save LoRA; then stock LoraLoaderModelOnly loads the saved LoRA onto that GGUF model and onto the safetensors original
with no key left over, the GGUF sample matching the one of the model Train LoRA returned. The numerics are tested in
process (tests/comfy/test_gguf_base.py)."""
from __future__ import annotations

import os
import sys

import pytest
import safetensors.torch
import torch

import gguf_models
from training.settings import TrainSettings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from options_lib import ATTACH, MODEL_FILES, Graph, OptionsServer, out  # noqa: E402

pytestmark = pytest.mark.e2e

SOURCE = MODEL_FILES["cosmos"]  # the demo Cosmos (192 wide: every block Linear's rows split into Q8_0's 32-blocks)
GGUF = "e2e_tiny_cosmos_Q8_0.gguf"
STEPS = 16


def _write_gguf(base: str) -> None:
    folder = os.path.join(base, "models", "diffusion_models")
    source = safetensors.torch.load_file(os.path.join(folder, SOURCE))
    types = gguf_models.write_gguf(source, os.path.join(folder, GGUF), "Q8_0")
    assert sum(1 for t in types.values() if t == "Q8_0") >= 100, types


@pytest.fixture(scope="module")
def opts(comfy_server):
    view = OptionsServer.attach(comfy_server, prepare=_write_gguf)
    yield view
    view.close()


def _sample(g: Graph, model: list, cond: str, latent: str, prefix: str) -> str:
    sampled = g.add("KSampler", model=model, positive=out(cond), negative=out(cond), latent_image=out(latent), seed=3,
                    steps=1, cfg=1.0, sampler_name="euler", scheduler="simple", denoise=1.0)
    return g.add("SaveLatent", samples=out(sampled), filename_prefix=prefix)


def _inputs(g: Graph, model: list) -> tuple[str, str]:
    cond = g.add("PrecisionDemoConditioning", model=model, text="sks", seed=0, tokens=8)
    return cond, g.add("PrecisionDemoLatent", model=model, width=16, height=16, batch_size=1, seed=1)


def test_a_lora_trains_on_a_gguf_model_and_stock_loads_on_it_and_on_the_original(opts):
    g = Graph()
    base = g.add("UnetLoaderGGUF", unet_name=GGUF)
    attached = g.add("PrecisionAttachLoRA", model=out(base), **ATTACH)
    cond, latent = _inputs(g, out(base))
    settings = g.add("PrecisionTrainSettings", **TrainSettings(learning_rate=1e-2).to_dict())
    train = g.add("PrecisionTrainLoRA", model=out(attached), latents=out(latent), conditioning=out(cond),
                  settings=out(settings), steps=STEPS, seed=0, name="e2e_gguf")
    save = g.add("PrecisionSaveLoRA", model=out(train), filename_prefix="e2e_gguf/lora", folder="loras",
                 save_dtype="fp32", key_style="auto", use_counter=True, overwrite=False)
    trained_sample = _sample(g, out(train), cond, latent, "e2e_gguf/trained")
    entry = opts.run(g)
    losses = [s["loss"] for s in opts.steps(entry, train)]
    assert len(losses) == STEPS
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.75 * first, f"the loss did not fall on the GGUF base: first-4 mean {first:.3f}, last-4 {last:.3f}"
    path, tensors, _ = opts.saved_lora(entry, save)
    name = os.path.relpath(path, opts.path("models", "loras")).replace(os.sep, "/")
    trained = opts.latent(entry, trained_sample)

    before = opts.server.log_text().count("lora key not loaded")
    s = Graph()
    gguf_base, original = s.add("UnetLoaderGGUF", unet_name=GGUF), s.add("UNETLoader", unet_name=SOURCE,
                                                                         weight_dtype="default")
    samples = {}
    for key, model in (("gguf", gguf_base), ("original", original)):
        stock = s.add("LoraLoaderModelOnly", model=out(model), lora_name=name, strength_model=1.0)
        cond, latent = _inputs(s, out(model))
        samples[key] = _sample(s, out(stock), cond, latent, f"e2e_gguf/stock_{key}")
        samples[f"{key}_base"] = _sample(s, out(model), cond, latent, f"e2e_gguf/base_{key}")
    stock_entry = opts.run(s)
    assert opts.server.log_text().count("lora key not loaded") == before == 0, "a LoRA key was left over"
    got = {k: opts.latent(stock_entry, v) for k, v in samples.items()}
    move = (trained - got["gguf_base"]).norm()
    assert move > 1e-2, "the trained LoRA must change the sample for the match to mean anything"
    assert float((got["gguf"] - trained).norm() / move) < 0.01  # stock merge on the dequantized weight, fp32
    assert float((got["original"] - got["original_base"]).norm() / move) > 0.5  # it moves the original too
    assert all(torch.isfinite(t).all() for t in got.values())
    assert len({k.split(".lora_")[0] for k in tensors if ".lora_" in k}) == 8 * 10  # 8 attention Linears x 10 blocks


def test_the_packs_loader_names_unet_loader_gguf_for_a_gguf_file(opts):
    """/prompt with Load Diffusion Model (Precision) given the GGUF file that is in models/diffusion_models: refused
    at validation naming ComfyUI-GGUF's loader (installed here, so no install advice), not "not in the folder"."""
    g = Graph()
    loader = g.add("PrecisionLoadDiffusionModel", model_name=GGUF, weight_dtype="default")
    _, latent = _inputs(g, out(loader))
    g.add("SaveLatent", samples=out(latent), filename_prefix="e2e_gguf/never")  # an output: ComfyUI validates upstream
    status, data = opts.server.request("/prompt", {"prompt": g.nodes})
    assert status == 400, data
    details = [e["details"] for e in data["node_errors"]["1"]["errors"]]
    assert any(f"input 'model_name'='{GGUF}' is a GGUF file" in d and "Unet Loader (GGUF)\" node (UnetLoaderGGUF)" in d
               and "not loaded in this ComfyUI" not in d for d in details), details
    assert not any("is not in models/diffusion_models" in d for d in details), details
