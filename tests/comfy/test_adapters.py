"""LoKr / LoHa / DoRA through the nodes: a file saved by PrecisionSaveLoRA loads in stock ComfyUI
(LoraLoaderModelOnly) with no key left unloaded and gives the pack's output; the pack's loader (fp32 mode and
merge mode) and init_lora read it back; the tiny Flux.1 memorisation case trains with each adapter."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys

import pytest
import torch

from models import denoise, fixed_noise_fns, make_conditioning, make_latent, tiny_flux1

KINDS = ("lokr", "loha", "dora")
SAVE_ARGS = dict(folder="loras", save_dtype="fp32", key_style="auto", use_counter=True, overwrite=False)
LOAD_ARGS = dict(strength=1.0, mode="fp32", attention="apply_recorded", override_backend="auto",
                 override_scale_mode="default", override_scale_value=1.0)
SUFFIXES = {"lokr": (".lokr_w1", ".lokr_w2_a", ".lokr_w2_b", ".alpha"),
            "loha": (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b", ".alpha"),
            "dora": (".lora_down.weight", ".lora_up.weight", ".dora_scale", ".alpha")}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def glue(pack_module):
    return pack_module("nodes.lora.glue")


@pytest.fixture(scope="module")
def cfg_cls(pack_module):
    return pack_module("lora.config").LoRAConfig


def node(node_id):
    import comfy_harness

    return comfy_harness.node_class(node_id)


def lora_name(path: str) -> str:
    import folder_paths

    return os.path.relpath(path, folder_paths.get_folder_paths("loras")[0]).replace(os.sep, "/")


def randomize(lora_set, seed: int) -> None:
    """Every factor moved off its init (the zero one included), DoRA's magnitude by a few per cent."""
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode(False), torch.no_grad():
        for a in lora_set.adapters().values():
            for name, p in a.named_parameters():
                noise = torch.randn(p.shape, generator=g).to(p.device)
                if name == "magnitude":
                    p.mul_(1 + 0.05 * noise)
                else:
                    p.add_(noise * 0.2)
            a.mark_modified()


def attached(glue, cfg_cls, kind: str, seed: int = 1, **cfg):
    model = tiny_flux1()
    with torch.inference_mode():
        out = glue.attach_lora(model, cfg_cls(**{"rank": 4, "alpha": 3.0, "targets": "attention_mlp",
                                                "adapter": kind, "lokr_factor": 4, **cfg}))
    randomize(glue.get_lora_set(out), seed)
    return model, out


@pytest.mark.parametrize("kind", KINDS)
def test_saved_file_stock_loads_every_key_with_the_packs_output(kind, glue, cfg_cls, caplog):
    import nodes as comfy_nodes
    from lora.file import read_lora_file

    base, model = attached(glue, cfg_cls, kind)
    expected = denoise(model)
    assert not torch.allclose(expected, denoise(base), atol=1e-3), "the adapters must change the output"
    path = node("PrecisionSaveLoRA").execute(model, f"adapters/{kind}", **SAVE_ARGS).result[0]
    tensors, md = read_lora_file(path)
    n = len(glue.get_lora_set(model).adapters())
    assert sorted({k[k.index("."):] for k in tensors}) == sorted(SUFFIXES[kind]) and len(tensors) == n * len(SUFFIXES[kind])
    assert f'"adapter": "{kind}"' in md["ss_network_args"] and md["ss_network_module"] == "lycoris.kohya"
    with caplog.at_level(logging.WARNING):
        stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, lora_name(path), 1.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]  # 0 missing keys
    assert len(stock.patches) == n
    torch.testing.assert_close(denoise(stock), expected, rtol=1e-4, atol=1e-4)
    ours = node("PrecisionLoadLoRA").execute(base, lora_name(path), **LOAD_ARGS).result[0]
    torch.testing.assert_close(denoise(ours), expected, rtol=1e-5, atol=1e-5)
    half_stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, lora_name(path), 0.5)[0]
    half = node("PrecisionLoadLoRA").execute(base, lora_name(path), **{**LOAD_ARGS, "strength": 0.5}).result[0]
    torch.testing.assert_close(denoise(half), denoise(half_stock), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_init_lora_continues_from_a_saved_adapter_file(kind, glue, cfg_cls):
    base, model = attached(glue, cfg_cls, kind, seed=2)
    path = node("PrecisionSaveLoRA").execute(model, f"adapters/init_{kind}", **SAVE_ARGS).result[0]
    cfg = cfg_cls(rank=4, alpha=2.0, targets="attention_mlp", adapter=kind, lokr_factor=4)
    with torch.inference_mode():
        again = glue.attach_lora(base, cfg, init_file=path)
    torch.testing.assert_close(denoise(again), denoise(model), rtol=1e-5, atol=1e-5)
    other = "loha" if kind != "loha" else "lokr"
    with pytest.raises(ValueError, match=rf"init_lora .* holds {kind} adapters but adapter={other!r}: set adapter to {kind!r}"):
        with torch.inference_mode():
            glue.attach_lora(base, dataclasses.replace(cfg, adapter=other), init_file=path)


@pytest.mark.parametrize("kind, lr", [("lokr", 2e-2), ("loha", 4e-3), ("dora", 4e-3)])
def test_tiny_flux_memorisation_loss_falls_with_each_adapter(kind, lr, pack_module):
    """The fixed-noise memorisation case of test_train_memorise.py (tiny Flux.1, one latent) per adapter, 30 steps.
    LoKr trains ~10x fewer parameters here (the tiny widths give full 8x8 Kronecker factors) and, as LyCORIS
    advises, at a higher learning rate; at 4e-3 its loss falls by a quarter in 30 steps."""
    glue, tglue, tdata = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.train.data"))
    loop, lora = pack_module("training.loop"), pack_module("lora.config")
    settings = pack_module("training.settings").TrainSettings(learning_rate=lr)
    model = tiny_flux1()
    latent, cond = make_latent(model, 1, width=32, height=32), make_conditioning(model, 1)
    with torch.inference_mode():
        out = glue.attach_lora(model, lora.LoRAConfig(rank=8, alpha=8, targets="attention_mlp", adapter=kind))
        out, lora_set = tglue.fork_lora(out)
        with tglue.training_session(out, lora_set, settings) as device:
            samples = tdata.build_samples(out, [latent], [cond], None, device)
            base = tglue.model_fns(out, lora_set, settings, device)
            fns, _ = fixed_noise_fns(base, samples, device)
            result = loop.train(lora_set, samples, fns, settings, 30, seed=0)
    losses = [p["loss"] for p in result.state.history]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last <= 0.6 * first, f"{kind}: first-5 mean {first:.4f}, last-5 mean {last:.4f}"


def test_dora_on_a_scaled_fp8_base_uses_the_dequantized_weight(pack_module, glue, cfg_cls):
    """DoRA's magnitude starts at the column norms of the weight the layer computes with (ComfyUI's scaled fp8:
    fp8 values times scale_weight), and the adapted layer equals that weight plus DoRA's delta."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_quantized_base as tq  # its quantized-file writer and loader

    class M:
        tiny, load = pack_module("demo.tiny_models"), pack_module("nodes.model.load")
    ref = tq.write_quantized(M, "flux1_dev", "scaled_fp8", "adapters_dora_scaled_fp8.safetensors")
    model = tq.load(M, "pack", "adapters_dora_scaled_fp8.safetensors")
    with torch.inference_mode():
        patched = glue.attach_lora(model, cfg_cls(rank=2, alpha=2.0, targets="attention", adapter="dora"))
    lora_set = glue.get_lora_set(patched)
    for path, a in lora_set.adapters().items():
        norms = ref[f"{path}.weight"].norm(dim=0, keepdim=True) + torch.finfo(torch.float32).eps
        torch.testing.assert_close(a.magnitude.detach(), norms, rtol=1e-6, atol=0)
    randomize(lora_set, 4)
    gen = torch.Generator().manual_seed(0)
    for path, a in lora_set.adapters().items():
        w = ref[f"{path}.weight"]
        x = torch.randn(3, a.in_features, generator=gen)
        with torch.no_grad():
            out = patched.object_patches[f"diffusion_model.{path}.forward"](x)
            expect = x.double() @ (w.double() + a.delta_weight(w).double()).t()
            bias = dict(model.model.diffusion_model.named_modules())[path].bias
            if bias is not None:  # as the host stores it (ComfyUI 0.3.75's scaled fp8 layers: in fp8)
                expect += ref[f"{path}.bias"].to(bias.dtype).double()
        assert float((out.double() - expect).abs().max() / expect.abs().max()) < 1e-5, path
