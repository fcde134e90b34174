"""Training on GGUF bases (issue 36 item 4): a MODEL from ComfyUI-GGUF's *Unet Loader (GGUF)*, the real pack from
../shared/custom_nodes/ imported into the in-process ComfyUI (tests/other_packs.py).

The tiny Cosmos-Predict2 (tests/gguf_models.py: 256 channels, so every block Linear quantizes in every type) is
written at test time as bf16 safetensors (the original) and converted from it to GGUF files of each type tested:
F16, BF16, Q8_0, Q4_0, Q5_0 (gguf-py's own quantizers) and Q4_K, Q5_K (tests/gguf_models.py's encoder). ComfyUI-GGUF
loads them into its layers (``GGMLTensor`` weights, dequantized per call); the pack's LoRA forward computes the base
output on the weight the layer's own ``cast_bias_weight`` gives, so each adapted layer must equal that dequantized
weight in fp32 plus the fp32 delta, and training must leave every stored block as it was.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import pytest
import torch

import gguf_models
import other_packs
from models import denoise, make_conditioning, make_latent, memorise, randomize_lora

pytestmark = pytest.mark.usefixtures("one_thread")

TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K"]
ORIGINAL = "gguf_tiny_cosmos_bf16.safetensors"


@dataclasses.dataclass
class Env:
    """The pack's modules, ComfyUI-GGUF's module and the tiny original's state dict (bf16)."""

    glue: object
    tglue: object
    tdata: object
    loop: object
    LoRAConfig: type
    Settings: type
    gguf: object
    original: dict


@pytest.fixture(scope="module")
def env(pack_module) -> Env:
    import folder_paths
    import safetensors.torch

    tiny = pack_module("demo.tiny_models")
    original = {k: v.to(torch.bfloat16) for k, v in tiny.tiny_state_dict(gguf_models.tiny_cosmos(tiny)).items()}
    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    os.makedirs(folder, exist_ok=True)
    safetensors.torch.save_file(original, os.path.join(folder, ORIGINAL))
    return Env(pack_module("nodes.lora.glue"), pack_module("nodes.train.glue"), pack_module("nodes.train.data"),
               pack_module("training.loop"), pack_module("lora.config").LoRAConfig,
               pack_module("training.settings").TrainSettings, other_packs.load_in_process(other_packs.GGUF), original)


_WRITTEN: dict[str, dict[str, str]] = {}


def gguf_file(env: Env, qtype: str) -> tuple[str, dict[str, str]]:
    """(file name in models/diffusion_models, {tensor: stored type}) of the original converted to ``qtype``."""
    import folder_paths

    name = f"gguf_tiny_cosmos_{qtype}.gguf"
    if name not in _WRITTEN:
        path = os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], name)
        _WRITTEN[name] = gguf_models.write_gguf(env.original, path, qtype)
    return name, _WRITTEN[name]


def load_gguf(env: Env, qtype: str):
    """The MODEL ComfyUI-GGUF's Unet Loader (GGUF) gives for the ``qtype`` file (inside inference mode, as a node)."""
    name, _ = gguf_file(env, qtype)
    with torch.inference_mode():
        return env.gguf.nodes.UnetLoaderGGUF().load_unet(name)[0]


def load_original():
    import nodes as comfy_nodes

    with torch.inference_mode():
        return comfy_nodes.UNETLoader().load_unet(ORIGINAL, "default")[0]


@contextlib.contextmanager
def counting_dequantizations(env: Env):
    """Counts every weight ComfyUI-GGUF's layers dequantize (``GGMLLayer.get_weight`` on a quantized tensor):
    yields a list that gets one (layer, logical numel) entry per dequantization."""
    layer = env.gguf.ops.GGMLLayer
    original = layer.get_weight
    calls: list[tuple[int, int]] = []

    def get_weight(self, tensor, dtype):
        if tensor is not None and env.gguf.dequant.is_quantized(tensor):
            calls.append((id(self), int(torch.Size(tensor.tensor_shape).numel())))
        return original(self, tensor, dtype)

    layer.get_weight = get_weight
    try:
        yield calls
    finally:
        layer.get_weight = original


def _gguf_layers(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.model.diffusion_model.named_modules()
            if type(getattr(m, "weight", None)).__name__ == "GGMLTensor"}


@pytest.mark.parametrize("qtype", TYPES)
def test_each_adapted_layer_equals_the_dequantized_weight_plus_fp32_delta(env, qtype):
    """Every adapted Linear of the GGUF model (each stored in ``qtype`` where its rows allow it) computes
    x·W_deq^T + scale·x·A^T·B^T in fp32, W_deq being ComfyUI-GGUF's own dequantization of that layer's blocks
    (``dequantize_tensor``, computed apart here): within 1e-5 relative in fp64, one dequantization per call."""
    model = load_gguf(env, qtype)
    _, types = gguf_file(env, qtype)
    with torch.inference_mode():
        patched = env.glue.attach_lora(model, env.LoRAConfig(rank=4, alpha=4, targets="all"))
    lora_set = env.glue.get_lora_set(patched)
    randomize_lora(lora_set, seed=1)
    modules = dict(model.model.diffusion_model.named_modules())
    adapters = lora_set.adapters()
    assert {types[f"{p}.weight"] for p in adapters} >= {qtype}, "no adapted layer is stored in the file's type"
    gen, worst = torch.Generator().manual_seed(0), 0.0
    for path, adapter in adapters.items():
        weight = modules[path].weight
        assert type(weight).__name__ == "GGMLTensor" and weight.tensor_type.name == types[f"{path}.weight"]
        x = torch.randn(3, adapter.in_features, generator=gen)
        with torch.no_grad(), counting_dequantizations(env) as calls:
            out = patched.object_patches[f"diffusion_model.{path}.forward"](x)
            w = env.gguf.dequant.dequantize_tensor(weight, torch.float32).double()
            delta = (x.double() @ adapter.down.double().t()) @ adapter.up.double().t()
            expect = x.double() @ w.t() + adapter.scale * delta
        quantized = env.gguf.dequant.is_quantized(weight)
        assert calls == ([(id(modules[path]), weight.tensor_shape.numel())] if quantized else [])
        assert out.dtype == torch.float32 and type(out) is torch.Tensor
        worst = max(worst, float((out.double() - expect).abs().max() / expect.abs().max()))
    assert worst < 1e-5, f"{qtype}: worst relative error {worst:.3g}"


def _raw(model) -> dict[str, torch.Tensor]:
    """Every GGUF parameter's stored blocks (a copy, as a plain tensor: ``GGMLTensor.clone`` returns itself)."""
    with torch.inference_mode():
        return {n: p.as_subclass(torch.Tensor).clone() for n, p in model.model.diffusion_model.named_parameters()
                if type(p).__name__ == "GGMLTensor"}


def save_lora(model, prefix: str) -> str:
    """PrecisionSaveLoRA as the executor runs it; returns the file's name in models/loras."""
    import comfy_harness
    import folder_paths

    with torch.inference_mode():
        saved = comfy_harness.node_class("PrecisionSaveLoRA").execute(
            model, prefix, folder="loras", save_dtype="fp32", key_style="auto", use_counter=True,
            overwrite=False).result[0]
    return os.path.relpath(saved, folder_paths.get_folder_paths("loras")[0]).replace(os.sep, "/")


def stock_load(base, lora: str, caplog):
    """ComfyUI's LoraLoaderModelOnly on ``base``; fails on any 'lora key not loaded' warning (a key left over)."""
    import nodes as comfy_nodes

    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, lora, 1.0)[0]
    left = [r.getMessage() for r in caplog.records if "lora key not loaded" in r.getMessage()]
    assert not left, f"{lora}: keys left over on {type(base.model.diffusion_model).__name__}: {left[:3]}"
    return stock


STEPS, LR = 6, 4e-3
_TRAINED: dict[str, tuple[list[float], object]] = {}  # qtype -> (losses, trained model): the gap test reuses them


def trained(env: Env, qtype: str, model=None):
    """(losses, trained model) of ``memorise`` on ``model``, by default the ``qtype`` GGUF model ("original": the bf16
    safetensors); trained once per module."""
    if qtype not in _TRAINED:
        if model is None:
            model = load_original() if qtype == "original" else load_gguf(env, qtype)
        _TRAINED[qtype] = memorise(model, STEPS, LR)
    return _TRAINED[qtype]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_lora_trains_on_a_gguf_base_and_stock_loads_on_it_and_on_the_original(env, qtype, caplog):
    """Issue 36's acceptance: on ComfyUI-GGUF's MODEL the memorisation loss falls, every stored block is left as
    loaded (still a GGMLTensor, bit-identical), a training step dequantizes only per layer call, and the saved LoRA
    loads with stock LoraLoaderModelOnly with no key left over onto the GGUF model and onto the bf16 safetensors
    original, moving the output where the pack's own fp32 LoRA does."""
    model = load_gguf(env, qtype)
    before = _raw(model)
    with counting_dequantizations(env) as calls:
        losses, lora_model = trained(env, qtype, model)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, f"{qtype}: the loss did not fall: first-3 mean {first:.4f}, last-3 {last:.4f} {losses}"
    after = _raw(model)
    changed = [k for k in before if k not in after or not torch.equal(before[k], after[k])]
    assert not changed and after.keys() == before.keys(), f"stored GGUF blocks changed or replaced: {changed[:3]}"
    names = {id(m): n for n, m in _gguf_layers(model).items() if env.gguf.dequant.is_quantized(m.weight)}
    per_layer = {n: sum(1 for c in calls if c[0] == i) for i, n in names.items()}
    # one dequantization per layer call: each forward once (fp32 on a CPU: the backward keeps autograd's copy)
    odd = {n: k for n, k in per_layer.items() if k != STEPS}
    assert calls and not odd and {c[0] for c in calls} <= names.keys(), (
        f"dequantizations per layer in {STEPS} steps, expected one per forward: {dict(list(odd.items())[:4])}")
    lora = save_lora(lora_model, f"gguf_{qtype}")
    lora_set = env.glue.get_lora_set(lora_model)
    for base, bound in ((model, 0.05), (load_original(), 0.05)):
        ours = env.glue.install(base, lora_set.copy())  # the pack's fp32 LoRA on this base
        plain, with_ours = denoise(base), denoise(ours)
        stock = stock_load(base, lora, caplog)
        assert len(stock.patches) == len(lora_set.adapters())
        ratio = float((denoise(stock) - with_ours).norm() / (plain - with_ours).norm())
        assert ratio < bound, f"stock LoRA on {type(base).__name__}: {ratio:.3f} of the fp32 LoRA's move off it"


def test_a_lora_trained_on_q8_0_moves_the_output_like_the_one_trained_on_the_bf16_original(env):
    """The same training (seed, data, steps) on the Q8_0 GGUF file and on the bf16 safetensors it was converted
    from; both LoRAs applied to the bf16 original: the Q8_0 LoRA's move of the output is within 10% of the bf16
    LoRA's. Measured: 0.0123 (1.2%) on ComfyUI 0.33.0 and 0.3.75 (docs/quantized.md); a dequantization that put
    the rows in the wrong order gave 0.955."""
    original = load_original()
    plain = denoise(original)
    moved = {}
    for qtype in ("original", "Q8_0"):
        lora_set = env.glue.get_lora_set(trained(env, qtype)[1])
        moved[qtype] = denoise(env.glue.install(original, lora_set.copy())) - plain
    gap = float((moved["Q8_0"] - moved["original"]).norm() / moved["original"].norm())
    assert gap < 0.1, f"the Q8_0 LoRA moves the output {gap:.3f} of the bf16 LoRA's move away from it"


def test_compile_on_a_gguf_base_from_comfyui_ggufs_loader_is_refused_by_name(env, pack_module):
    """compile 'blocks' on a model from ComfyUI-GGUF's Unet Loader (GGUF): Train LoRA refuses before training,
    naming the input, the block, the GGUF weight and the fix (training/regional_compile.py: such weights stay
    inference tensors a compiled backward would save); the same model trains with compile off (above)."""
    model = load_gguf(env, "Q8_0")
    train = pack_module("nodes.train.node").PrecisionTrainLoRA
    with torch.inference_mode():
        attached = env.glue.attach_lora(model, env.LoRAConfig(rank=4, alpha=4, targets="attention"))
        with pytest.raises(ValueError, match=r"PrecisionTrainSettings: input 'compile'='blocks' cannot compile this "
                                             r"model's quantized layers \(\w+ weight '[\w.]+' is a GGUF Q8_0\).*set "
                                             r"compile to off"):
            train.execute([attached], [make_latent(model, 1, width=32, height=32)], [make_conditioning(model, 1)],
                          [1], [0], ["gguf_compile"], settings=[env.Settings(learning_rate=1e-3, compile="blocks")])
    assert not any("forward" in b.__dict__ for b in model.model.diffusion_model.blocks)
