"""Training over a frozen adapter (a LoRA under the one trained, as on distilled or turbo bases), through a real
server's /prompt: the saved LoRA names the adapter (file and strength) in its metadata, and Load LoRA (Precision)
warns by name when that LoRA is loaded without the adapter under it, and not when it is there."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from options_lib import ATTACH, LOAD, MODEL_FILES, SAVE, Graph, OptionsServer, out  # noqa: E402

pytestmark = pytest.mark.e2e

FLUX = MODEL_FILES["flux1_dev"]


@pytest.fixture(scope="module")
def view(comfy_server):
    v = OptionsServer.attach(comfy_server)
    yield v
    v.close()


def _train(view, name: str, adapter: str | None = None, strength: float = 0.8) -> tuple[str, dict]:
    """Load -> [LoraLoaderModelOnly(adapter)] -> Attach -> Train (2 steps) -> Save; (LoRA list name, metadata)."""
    g = Graph()
    model = loader = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="fp32")
    if adapter is not None:
        model = g.add("LoraLoaderModelOnly", model=out(loader), lora_name=adapter, strength_model=strength)
    attach = g.add("PrecisionAttachLoRA", model=out(model), **ATTACH)
    cond = g.add("PrecisionDemoConditioning", model=out(loader), text="sks", seed=0, tokens=8)
    latent = g.add("PrecisionDemoLatent", model=out(loader), width=32, height=32, batch_size=1, seed=1)
    train = g.add("PrecisionTrainLoRA", model=out(attach), latents=out(latent), conditioning=out(cond), steps=2,
                  seed=0, name=name)
    save = g.add("PrecisionSaveLoRA", model=out(train), filename_prefix=f"adapters/{name}", **SAVE)
    path, _, md = view.saved_lora(view.run(g), save)
    return os.path.relpath(path, view.path("models", "loras")), md


def _load_info(view, lora: str, adapter: str | None) -> str:
    g = Graph()
    model = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="fp32")
    if adapter is not None:
        model = g.add("LoraLoaderModelOnly", model=out(model), lora_name=adapter, strength_model=0.8)
    load = g.add("PrecisionLoadLoRA", model=out(model), lora_name=lora, **LOAD)
    shown = g.add("PreviewAny", source=out(load, 1))
    return view.text(view.run(g), shown)


def test_a_lora_trained_over_an_adapter_names_it_and_loading_it_alone_warns(view):
    adapter, plain_md = _train(view, "turbo_adapter")
    assert "precision_lora_trained_over" not in plain_md and "precision_lora_base_patches" not in plain_md
    over, md = _train(view, "over_adapter", adapter=adapter)
    assert json.loads(md["precision_lora_trained_over"]) == [
        {"lora": adapter, "strength": 0.8, "node": "LoraLoaderModelOnly"}]
    alone = _load_info(view, over, adapter=None)
    assert f"warning: {over} was trained on top of {adapter} (strength 0.8), which is not loaded under this node" \
        in alone
    assert "warning" not in _load_info(view, over, adapter=adapter)
    assert "warning" not in _load_info(view, adapter, adapter=None)  # trained over nothing
