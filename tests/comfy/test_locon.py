"""Adapter 'locon' through the nodes on a tiny SDXL UNet built from ComfyUI's own classes (tests/sdxl_tiny.py):
the file Save LoRA writes stock-loads (LoraLoaderModelOnly) with no key left over and stock's output equals the
pack's; the pack's Load LoRA and init_lora read it back; training lowers a memorisation loss; a model without a
res-block Conv2d refuses it naming node, input, value and fix."""
from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from models import tiny_flux1
from sdxl_tiny import sdxl_conditioning, sdxl_denoise, tiny_sdxl

SAVE_ARGS = dict(folder="loras", save_dtype="fp32", key_style="auto", use_counter=True, overwrite=False)
LOAD_ARGS = dict(strength=1.0, mode="fp32", attention="apply_recorded", override_backend="auto",
                 override_scale_mode="default", override_scale_value=1.0)
ATTACH = dict(rank=4, alpha=3.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
              init_lora="none", dry_run=False)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def glue(pack_module):
    return pack_module("nodes.lora.glue")


def node(node_id):
    import comfy_harness

    return comfy_harness.node_class(node_id)


def lora_name(path: str) -> str:
    import folder_paths

    return os.path.relpath(path, folder_paths.get_folder_paths("loras")[0]).replace(os.sep, "/")


def attached(seed: int = 1):
    from models import randomize_lora

    base = tiny_sdxl()
    with torch.inference_mode():
        model, report = node("PrecisionAttachLoRA").execute(base, **{**ATTACH, "adapter": "locon"}).result
    randomize_lora(model.get_attachment("precision_lora"), seed, std=0.2)
    return base, model, report


def test_locon_file_stock_loads_every_key_with_the_packs_output(glue, caplog):
    import nodes as comfy_nodes
    from lora.file import read_lora_file

    base, model, report = attached()
    lora_set = glue.get_lora_set(model)
    convs = {p for p, a in lora_set.adapters().items() if type(a).__name__ == "LoConAdapter"}
    # kohya's LoCon choice: res-block 3x3 and 1x1 convs and the down/upsamplers, not the input / output convs
    assert "input_blocks.1.0.in_layers.2" in convs and "input_blocks.2.0.op" in convs
    assert "output_blocks.0.0.skip_connection" in convs and "output_blocks.1.2.conv" in convs
    assert "input_blocks.0.0" not in convs and "out.2" not in convs and len(convs) < len(lora_set.adapters())
    assert "input_blocks.1.0.in_layers.2  (32 -> 32)" in report
    expected = sdxl_denoise(model)
    # fp32 tolerance at this output's scale (|x0| up to ~400): a 1e-7 relative change of the res-block conv
    # weights alone moves it by ~2e-3, so stock's merged weight and the pack's separate delta differ that much
    tol = 1e-5 * float(expected.abs().max())
    assert float((expected - sdxl_denoise(base)).abs().max()) > 100 * tol, "the adapters must change the output"
    path = node("PrecisionSaveLoRA").execute(model, "locon/sdxl", **SAVE_ARGS).result[0]
    tensors, _md = read_lora_file(path)
    assert tensors["diffusion_model.input_blocks.1.0.in_layers.2.lora_down.weight"].shape == (4, 32, 3, 3)
    assert tensors["diffusion_model.input_blocks.1.0.in_layers.2.lora_up.weight"].shape == (32, 4, 1, 1)
    assert len(tensors) == 3 * len(lora_set.adapters())
    with caplog.at_level(logging.WARNING):
        stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, lora_name(path), 1.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]  # 0 keys left over
    assert len(stock.patches) == len(lora_set.adapters())
    torch.testing.assert_close(sdxl_denoise(stock), expected, rtol=1e-5, atol=tol)
    ours = node("PrecisionLoadLoRA").execute(base, lora_name(path), **LOAD_ARGS).result[0]
    torch.testing.assert_close(sdxl_denoise(ours), expected, rtol=1e-5, atol=tol)
    half_stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, lora_name(path), 0.5)[0]
    half = node("PrecisionLoadLoRA").execute(base, lora_name(path), **{**LOAD_ARGS, "strength": 0.5}).result[0]
    torch.testing.assert_close(sdxl_denoise(half), sdxl_denoise(half_stock), rtol=1e-5, atol=tol)
    with torch.inference_mode():
        again = node("PrecisionAttachLoRA").execute(base, **{**ATTACH, "adapter": "locon", "alpha": 2.0,
                                                             "init_lora": lora_name(path)}).result[0]
    torch.testing.assert_close(sdxl_denoise(again), expected, rtol=1e-5, atol=tol)


def test_locon_is_refused_on_a_model_without_res_block_convs():
    with pytest.raises(ValueError, match=r"PrecisionAttachLoRA: input 'adapter'='locon' adds LoRA to a UNet's Conv2d "
                                         r"layers, but this .* model has no res-block Conv2d layer: use adapter 'lora'"):
        with torch.inference_mode():
            node("PrecisionAttachLoRA").execute(tiny_flux1(), **{**ATTACH, "adapter": "locon"})


def test_tiny_sdxl_memorisation_loss_falls_with_locon(pack_module):
    """The fixed-noise, fixed-noise-level memorisation case of test_families.py on the tiny SDXL with LoCon (res-block
    convs + attention), 30 steps at 4e-3."""
    glue, tglue, tdata = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.train.data"))
    loop, lora = pack_module("training.loop"), pack_module("lora.config")
    settings = pack_module("training.settings").TrainSettings(learning_rate=4e-3)
    model = tiny_sdxl()
    latent = {"samples": torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(5))}
    with torch.inference_mode():
        out = glue.attach_lora(model, lora.LoRAConfig(rank=8, alpha=8, targets="attention", adapter="locon"))
        out, lora_set = tglue.fork_lora(out)
        with tglue.training_session(out, lora_set, settings) as device:
            samples = tdata.build_samples(out, [latent], [sdxl_conditioning()], None, device)
            base = tglue.model_fns(out, lora_set, settings, device)
            fixed = torch.randn((1, *samples[0].latent.shape), generator=torch.Generator().manual_seed(3)).to(device)
            fns = dataclasses.replace(base, noise_latent=lambda s, n, x0: base.noise_latent(s, fixed, x0),
                                      target=lambda s, n, x0: base.target(s, fixed, x0),
                                      sigma_of_u=lambda u: base.sigma_of_u(torch.full_like(u, 0.5)))
            result = loop.train(lora_set, samples, fns, settings, 30, seed=0)
    losses = [p["loss"] for p in result.state.history]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last <= 0.6 * first, f"first-5 mean {first:.4f}, last-5 mean {last:.4f}"
    convs = [a for a in lora_set.adapters().values() if type(a).__name__ == "LoConAdapter"]
    assert len(convs) == 23 and all(float(a.up.detach().abs().max()) > 0 for a in convs)  # the conv adapters trained too
