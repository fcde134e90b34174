"""Training on the quantized bases ComfyUI loads (issue 29 item 4): plain fp8 (e4m3fn, e5m2), ComfyUI's scaled
fp8 (``scaled_fp8`` marker + per-layer ``scale_weight``) and the per-layer formats of ``comfy.quant_ops``.

Files are written at test time in ComfyUI's formats from a tiny model's fp32 weights; the reference for each
adapted layer is the dequantized weight in fp32 plus the fp32 LoRA delta. Tiny Flux.1 files carry their config
in metadata (the pack's loader), tiny Cosmos files load through ComfyUI's stock UNETLoader.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch

from models import denoise, make_conditioning, make_latent, memorise, randomize_lora

pytestmark = pytest.mark.usefixtures("one_thread")

MOD = {"glue": "nodes.lora.glue", "quant": "nodes.host.quantized", "tiny": "demo.tiny_models",
       "tglue": "nodes.train.glue", "tdata": "nodes.train.data", "load": "nodes.model.load"}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@pytest.fixture(scope="module")
def m(pack_module):
    class M:
        pass
    for name, module in MOD.items():
        setattr(M, name, pack_module(module))
    M.LoRAConfig = pack_module("lora.config").LoRAConfig
    M.loop = pack_module("training.loop")
    M.Settings = pack_module("training.settings").TrainSettings
    return M


def _folder() -> str:
    import folder_paths

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    os.makedirs(folder, exist_ok=True)
    return folder


def _linear_weights(model) -> list[str]:
    dm = model.model.diffusion_model
    return [f"{n}.weight" for n, mod in dm.named_modules() if isinstance(mod, torch.nn.Linear)]


def _quantize(w: torch.Tensor, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({suffix: tensor} as the file stores the layer, the dequantized weight in fp32) for one fp32 weight."""
    if fmt in ("fp8_e4m3fn", "fp8_e5m2"):  # plain fp8: the weight cast, no scale
        q = w.to(getattr(torch, "float8_" + fmt[4:]))
        return {"weight": q}, q.float()
    if fmt == "int8_tensorwise":
        scale = w.abs().amax() / 127.0
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale.reshape(())}, q.float() * scale
    dtype = torch.float8_e5m2 if fmt.endswith("e5m2") else torch.float8_e4m3fn
    scale = w.abs().amax() / FP8_MAX[dtype]
    q = (w / scale).to(dtype)
    if fmt == "scaled_fp8":  # ComfyUI's scaled fp8 as its own saving writes it (scale_input 1: not used)
        return {"weight": q, "scale_weight": scale.reshape(()), "scale_input": torch.ones(())}, q.float() * scale
    return {"weight": q, "weight_scale": scale.reshape(())}, q.float() * scale  # per-layer float8_*


def write_quantized(m, family: str, fmt: str, name: str) -> dict[str, torch.Tensor]:
    """Write tiny ``family``'s weights in ``fmt`` as models/diffusion_models/``name``; returns the reference
    state dict: every Linear weight dequantized in fp32, the rest as stored."""
    import safetensors.torch

    model = m.tiny.build_tiny_model(family)
    sd, ref, layers = m.tiny.tiny_state_dict(model), {}, {}
    for key in _linear_weights(model):
        layer = key[: -len(".weight")]
        stored, ref[key] = _quantize(sd.pop(key), fmt)
        sd.update({f"{layer}.{suffix}": t for suffix, t in stored.items()})
        layers[layer] = {"format": fmt}
    if fmt.startswith("fp8_"):  # a plain fp8 file stores every float tensor in fp8
        sd = {k: v.to(ref[k].dtype if k in ref and v.dtype in FP8_MAX else getattr(torch, "float8_" + fmt[4:]))
              if v.is_floating_point() else v for k, v in sd.items()}
    ref.update({k: v.float() for k, v in sd.items() if k not in ref and ".scale" not in k and "weight_scale" not in k})
    metadata = {}
    if family not in m.tiny.STOCK_DETECTABLE:
        metadata[m.load.UNET_CONFIG_KEY] = json.dumps(m.tiny.unet_config_for(family))
    if fmt == "scaled_fp8":
        sd["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    elif not fmt.startswith("fp8_"):
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    safetensors.torch.save_file(sd, os.path.join(_folder(), name), metadata=metadata)
    return ref


def load(m, loader: str, name: str, weight_dtype: str = "default"):
    import comfy_harness
    import nodes as comfy_nodes

    with torch.inference_mode():  # as ComfyUI's executor runs every node
        if loader == "stock":
            return comfy_nodes.UNETLoader().load_unet(name, weight_dtype)[0]
        return comfy_harness.node_class("PrecisionLoadDiffusionModel").execute(
            model_name=name, weight_dtype=weight_dtype).args[0]


def _stored_quantized(m, module) -> bool:
    return m.quant.is_quantized(module.weight) or module.weight.dtype in m.quant.FP8_DTYPES


def host_lacks(fmt: str) -> str | None:
    """Why this ComfyUI cannot load per-layer format ``fmt`` (its comfy.quant_ops has no such layout), or None."""
    import comfy.quant_ops

    if fmt in ("scaled_fp8", "fp8_e4m3fn", "fp8_e5m2") or fmt in comfy.quant_ops.QUANT_ALGOS:
        return None
    return (f"ComfyUI {comfy_harness_version()}'s comfy.quant_ops.QUANT_ALGOS has no {fmt!r} "
            f"(it has {sorted(comfy.quant_ops.QUANT_ALGOS)}): a host limit, not the pack's")


def comfy_harness_version() -> str:
    import comfyui_version

    return comfyui_version.__version__


# loader -> (tiny family, the loader it goes through): Cosmos files are stock-detectable, so the pack's loader
# takes them through ComfyUI's own detection as it does a user's file; tiny Flux.1 carries its config.
LOADERS = {"stock": ("cosmos", "stock"), "pack": ("flux1_dev", "pack"), "pack_detected": ("cosmos", "pack")}
FORMATS = ["scaled_fp8", "fp8_e4m3fn", "fp8_e5m2", "float8_e4m3fn", "float8_e5m2", "int8_tensorwise"]
CASES = [(loader, fmt) for loader in ("stock", "pack") for fmt in FORMATS] + [
    ("pack_detected", fmt) for fmt in ("scaled_fp8", "fp8_e5m2", "float8_e4m3fn")]


@pytest.mark.parametrize("loader, fmt", CASES)
def test_each_adapted_layer_equals_dequantized_weight_plus_fp32_delta(m, loader, fmt):
    family, via = LOADERS[loader]
    reason = host_lacks(fmt)
    if reason:
        pytest.skip(reason)
    name = f"quant_{loader}_{fmt}.safetensors"
    ref = write_quantized(m, family, fmt, name)
    weight_dtype = fmt if fmt.startswith("fp8_") else "default"  # plain fp8 files are kept fp8 when asked
    model = load(m, via, name, weight_dtype)
    with torch.inference_mode():
        patched = m.glue.attach_lora(model, m.LoRAConfig(rank=4, alpha=4, targets="all"))
    adapters = m.glue.get_lora_set(patched).adapters()
    randomize_lora(m.glue.get_lora_set(patched), seed=1)
    dm = model.model.diffusion_model
    modules = dict(dm.named_modules())
    assert set(adapters) == {k[: -len(".weight")] for k in ref if k[: -len(".weight")] in adapters}
    assert all(_stored_quantized(m, modules[p]) for p in adapters), "the base was not loaded quantized"
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for path, adapter in adapters.items():
        x = torch.randn(3, adapter.in_features, generator=gen)
        with torch.no_grad():
            out = patched.object_patches[f"diffusion_model.{path}.forward"](x)
            w, b = ref[f"{path}.weight"].double(), modules[path].bias
            if b is not None:  # as the host stores it (ComfyUI 0.3.75's scaled fp8 layers store it in fp8)
                b = ref[f"{path}.bias"].to(b.dtype)
            expect = x.double() @ w.t() + (0 if b is None else b.double())
            expect += adapter.scale * (x.double() @ adapter.down.double().t()) @ adapter.up.double().t()
        assert out.dtype == torch.float32
        worst = max(worst, float((out.double() - expect).abs().max() / expect.abs().max()))
    assert worst < 1e-5, f"{fmt} via {loader}: worst relative error {worst:.3g}"


@pytest.mark.parametrize("loader", ["stock", "pack"])
def test_scaled_fp8_trains_and_its_lora_stock_loads_on_fp8_and_bf16(m, loader, caplog):
    """Issue 29's acceptance: training on a scaled-fp8 checkpoint written in ComfyUI's format: the loss falls,
    the base stays as loaded, and the saved LoRA loads with stock LoraLoaderModelOnly with no missing key
    onto the scaled-fp8 model and onto the bf16 model, where it changes the output as the trained LoRA does."""
    import comfy_harness
    import folder_paths
    import nodes as comfy_nodes

    family, via = LOADERS[loader]
    name = f"train_{family}_scaled_fp8.safetensors"
    write_quantized(m, family, "scaled_fp8", name)
    model = load(m, via, name)
    before = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}
    losses, trained = memorise(model, 12, 4e-3)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, f"loss did not fall: first-3 mean {first:.4f}, last-3 mean {last:.4f} ({losses})"
    after = model.model.diffusion_model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k].float(), after[k].float()) for k in before)
    with torch.inference_mode():
        saved = comfy_harness.node_class("PrecisionSaveLoRA").execute(
            trained, f"quant_{loader}", folder="loras", save_dtype="fp32", key_style="auto", use_counter=True,
            overwrite=False).result[0]
    lora = os.path.relpath(saved, folder_paths.get_folder_paths("loras")[0]).replace(os.sep, "/")
    bf16 = m.tiny.build_tiny_model(family, dtype=torch.bfloat16)
    n_adapters = len(m.glue.get_lora_set(trained).adapters())
    for base, bound in ((model, 0.6), (bf16, 0.1)):
        caplog.clear()
        with caplog.at_level(logging.WARNING), torch.inference_mode():
            stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, lora, 1.0)[0]
        assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
        assert len(stock.patches) == n_adapters
        ours = m.glue.install(base, m.glue.get_lora_set(trained).copy())  # the pack's fp32 LoRA on this base
        plain, with_ours, with_stock = denoise(base), denoise(ours), denoise(stock)
        # the stock-merged LoRA moves the output where ours does; merging rounds the sum to the stored dtype
        # (fp8: about the LoRA's own size after 20 steps; bf16 much less)
        ratio = float((with_stock - with_ours).norm() / (plain - with_ours).norm())
        assert ratio < bound, f"stock LoRA on {base.model.diffusion_model.dtype if hasattr(base.model.diffusion_model, 'dtype') else base}: {ratio:.3f}"


def test_a_gguf_file_names_comfyui_ggufs_loader(m):
    """A GGUF file given to the pack's loader by path (found by its magic bytes): the message names ComfyUI-GGUF's
    Unet Loader (GGUF), whose MODEL trains (docs/quantized.md; tests/comfy/test_gguf_loader.py for the node)."""
    path = os.path.join(_folder(), "refused.gguf")
    with open(path, "wb") as f:
        f.write(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match=r"PrecisionLoadDiffusionModel: input 'model_name'='refused.gguf' is a GGUF "
                                         r"file, which this loader does not read; .*Unet Loader \(GGUF\)"):
        m.load.load_model_file(path)


class GGMLTensor(torch.Tensor):
    """What ComfyUI-GGUF's loader leaves in a layer: a tensor subclass of this name carrying ``tensor_type`` and
    ``tensor_shape`` (city96/ComfyUI-GGUF, ops.py), made here without the pack, in a plain Linear."""


def test_a_gguf_weight_outside_comfyui_ggufs_layers_is_refused_when_attaching(m):
    """A GGUF weight in a layer that is not one of ComfyUI-GGUF's (which dequantize their own weights; GGUF bases
    train through them: tests/comfy/test_gguf_base.py) is refused before anything is attached."""
    model = m.tiny.build_tiny_model("flux1_dev")
    layer = model.model.diffusion_model.double_blocks[0].img_attn.qkv
    weight = layer.weight.detach().as_subclass(GGMLTensor)
    weight.tensor_type, weight.tensor_shape = type("Q", (), {"name": "Q4_K"})(), layer.weight.shape
    layer._parameters["weight"] = weight
    with pytest.raises(ValueError, match=r"layer 'double_blocks.0.img_attn.qkv' holds a GGUF \(Q4_K\) weight in a "
                                         r"Linear, not in one of ComfyUI-GGUF's layers.*Unet Loader \(GGUF\)"):
        m.glue.attach_lora(model, m.LoRAConfig(rank=4, alpha=4, targets="attention"))
    assert not model.object_patches  # nothing attached


def test_the_train_node_runs_on_a_scaled_fp8_base_and_leaves_it_quantized(m, pack_module):
    """PrecisionTrainLoRA itself (as ComfyUI's executor calls it) on the pack-loaded scaled-fp8 tiny Flux: the
    same losses as the same node on a model loaded from a second copy of the file (deterministic), finite,
    the LoRA trained, and the base weights still quantized and bit-identical afterwards."""
    train = pack_module("nodes.train.node").PrecisionTrainLoRA
    write_quantized(m, "flux1_dev", "scaled_fp8", "node_flux_scaled_fp8.safetensors")
    results = []
    for _ in range(2):
        model = load(m, "pack", "node_flux_scaled_fp8.safetensors")
        dm = model.model.diffusion_model
        before = {k: v.clone() for k, v in dm.state_dict().items()}
        with torch.inference_mode():
            attached = m.glue.attach_lora(model, m.LoRAConfig(rank=4, alpha=4, targets="all"))
            out = train.execute([attached], [make_latent(model, 1, width=32, height=32)], [make_conditioning(model, 1)],
                                [3], [0], ["quant_node"], settings=[m.Settings(learning_rate=1e-2)])
        trained, _, losses, steps = out.result[:4]
        assert steps == 3 and all(torch.isfinite(torch.tensor(losses["loss"])))
        assert any(float(a.up.detach().abs().sum()) > 0 for a in m.glue.get_lora_set(trained).adapters().values())
        qkv = dm.double_blocks[0].img_attn.qkv
        assert _stored_quantized(m, qkv)
        after = dm.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k].float(), after[k].float()) for k in before)
        results.append(losses["loss"])
    assert results[0] == results[1]


def test_compiled_blocks_on_an_fp8_base_give_the_gradients_eager_gives(m, pack_module):
    """compile 'blocks' (training/regional_compile.py) on the pack-loaded fp8_e4m3fn tiny Flux with the LoRA on the
    attention only: the blocks' other Linears (MLP, modulation) are fp8 layers inside the compiled graphs,
    ComfyUI's cast traced; one step's LoRA gradients equal eager's within the fp32 tolerance, graphs were built,
    the base stays fp8."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "bench"))
    import compile_families
    import memory

    write_quantized(m, "flux1_dev", "fp8_e4m3fn", "compile_flux_fp8.safetensors")
    grads, reports = {}, {}
    for compile in ("off", "blocks"):
        torch.manual_seed(0)
        model = load(m, "pack", "compile_flux_fp8.safetensors", weight_dtype="fp8_e4m3fn")
        with torch.inference_mode():
            out, lora_set = m.tglue.fork_lora(m.glue.attach_lora(model, m.LoRAConfig(rank=4, alpha=4,
                                                                                     targets="attention")))
        randomize_lora(lora_set, 3)
        x0, cond = memory._inputs(out, 32, 8)
        grads[compile], reports[compile], _ = compile_families.lora_gradients(pack_module, out, x0, cond, compile)
        assert _stored_quantized(m, out.model.diffusion_model.double_blocks[0].img_mlp[0])
    assert grads["off"].keys() == grads["blocks"].keys() and len(grads["off"]) >= 8
    rc = pack_module("training.regional_compile")
    worst = rc.worst_difference(grads["off"], grads["blocks"])
    assert worst <= rc.GRADIENT_TOLERANCE[torch.float32], worst
    assert reports["blocks"].graphs > 0, reports["blocks"].line()


def test_compile_is_refused_by_name_on_per_layer_quantized_weights(m):
    """A block holding a per-layer quantized weight (here a GGUF weight; ComfyUI's QuantizedTensor alike): compile
    'blocks' is refused before anything loads, naming the input, the block, the weight and the fix."""
    model = m.tiny.build_tiny_model("flux1_dev")
    layer = model.model.diffusion_model.single_blocks[0].linear2
    weight = layer.weight.detach().as_subclass(GGMLTensor)
    weight.tensor_type, weight.tensor_shape = type("Q", (), {"name": "Q4_K"})(), layer.weight.shape
    layer._parameters["weight"] = weight
    settings = m.Settings(compile="blocks")
    with pytest.raises(ValueError, match=r"PrecisionTrainSettings: input 'compile'='blocks' cannot compile this "
                                         r"model's quantized layers \(SingleStreamBlock weight 'linear2.weight' is a "
                                         r"GGUF Q4_K\).*set compile to off"):
        with m.tglue.compiled_training(model, settings):
            pass
    assert not any("forward" in b.__dict__ for b in model.model.diffusion_model.single_blocks)
