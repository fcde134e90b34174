"""The GPU defects of docs/benchmarks.md section 5 (issue #27): each cause shown on the CPU where it can be,
and a `gpu` test naming the suspected cause and the tolerance argument where only a GPU can decide.

1. saved LoRA vs stock loader, fp32 outputs 2e-3..7e-3 apart (1e-4 allowed)  -> TF32 tolerance argument (CPU)
   + gpu test with TF32 off
2. stock Flux.1 loader vs ours, 0.62 apart (0.02 allowed)                    -> cause shown on CPU (stock picks
   bf16 on a bf16 GPU); test_stock_flux_slow now pins the stock load to fp32
3. dynamic VRAM: a layer's weight is an inference tensor at forward time     -> gpu test (the boundary clone)
4. Anima: state-dict keys, adapter LoRA vs stock off by 0.1, token ids on CPU -> cause 2 for the values (stock
   fixture pinned to fp32), gpu test for the rest
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from models import denoise, randomize_lora, tiny_cosmos, tiny_flux1, tiny_flux2, write_model_file

FAMILIES = {"flux1": tiny_flux1, "flux2": tiny_flux2, "cosmos": tiny_cosmos}
SAVE_ARGS = dict(folder="loras", save_dtype="fp32", key_style="auto", use_counter=True, overwrite=False)


def tf32(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 to TF32 (10 mantissa bits, round to nearest) as tensor cores read fp32 GEMM operands."""
    if t.dtype != torch.float32:
        return t
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@contextlib.contextmanager
def tf32_linears():
    """Every F.linear of the model with TF32-rounded operands and an fp32 accumulator (a CUDA fp32 Linear with
    torch.backends.cuda.matmul.allow_tf32 = True), on the CPU."""
    import torch.nn.functional as F

    real = F.linear
    F.linear = lambda x, w, b=None: real(tf32(x), tf32(w), b)
    try:
        yield
    finally:
        F.linear = real


def _save_and_stock(pack_module, family):
    import comfy_harness
    import folder_paths
    import nodes as comfy_nodes
    from lora.config import LoRAConfig

    glue = pack_module("nodes.lora.glue")
    base = FAMILIES[family]()
    model = glue.attach_lora(base, LoRAConfig(rank=4, targets="attention_mlp"))
    randomize_lora(glue.get_lora_set(model), 1)
    path = comfy_harness.node_class("PrecisionSaveLoRA").execute(model, f"gpu_defects/{family}", **SAVE_ARGS).result[0]
    name = os.path.relpath(path, folder_paths.get_folder_paths("loras")[0]).replace(os.sep, "/")
    stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, name, 1.0)[0]
    return model, stock


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tf32_operands_alone_break_the_1e4_tolerance_of_the_saved_lora_test(family, pack_module):
    """Defect 1's tolerance argument. In fp32 the saved LoRA through the stock loader equals ours to 1e-4
    (test_lora_files); with the stock side's Linear operands rounded to TF32, as a GPU does when TF32 is on,
    the difference is of the 2e-3..7e-3 order seen on the H100. So that GPU failure is explained by TF32 GEMMs
    (or any equally coarse product) on one side, and the GPU comparison must run with TF32 off to mean 1e-4."""
    model, stock = _save_and_stock(pack_module, family)
    expected = denoise(model)
    exact = (denoise(stock) - expected).abs().max().item()
    with tf32_linears():
        rounded = (denoise(stock) - expected).abs().max().item()
    print(f"[defect 1] {family}: max |stock - ours| fp32 {exact:.2e}, stock with TF32 operands {rounded:.2e}")
    assert exact <= 1e-4
    assert 5e-4 < rounded < 3e-2, f"{family}: TF32 gives {rounded:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_saved_lora_equals_stock_on_cuda_with_tf32_off(family, pack_module):
    """Defect 1 on the GPU. Suspected cause: TF32 fp32 GEMMs/convolutions on one side (ComfyUI 0.33 passes
    allow_tf32=True to cudnn_convolution in comfy/ops.py; torch's matmul default is IEEE, so something in the
    process may switch it on) or the mem-efficient SDPA kernel's fp32 path. Tolerance argument: with IEEE fp32
    on both sides the only differences are summation orders (merged W+BA vs unmerged Wx+B(Ax)), ~1e-6 relative
    after a handful of layers, so 1e-4 holds; TF32 rounds operands to 2^-11 relative, 2e-3..7e-3 here
    (test_tf32_operands_alone_break_the_1e4_tolerance_of_the_saved_lora_test). The TF32 flags are recorded in
    the failure message so the run says which case it was."""
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    try:
        model, stock = _save_and_stock(pack_module, family)
        diff = (denoise(stock) - denoise(model)).abs().max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    assert diff <= 1e-4, f"{family}: {diff:.2e} with TF32 off (flags before: matmul, cudnn = {flags})"


@pytest.mark.gpu
def test_fp32_matmul_on_cuda_is_ieee_in_this_process():
    """Defect 1's first suspect on the machine itself: an fp32 GEMM whose operands are rounded to TF32. torch's
    flags default to IEEE and ComfyUI does not change them, but TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 (set in
    NGC-style images) or NVIDIA_TF32_OVERRIDE forces TF32 in cuBLAS whatever the flags say. Tolerance argument:
    a 512-long fp32 dot product is exact to ~1e-6 relative (of the largest output) against fp64; TF32 operands
    (2^-11 relative each) give ~1e-3, so 1e-5 separates the two by two orders of magnitude either way."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=gen, dtype=torch.float64), torch.randn(512, 512, generator=gen, dtype=torch.float64)
    ref = a @ b
    got = (a.float().cuda() @ b.float().cuda()).double().cpu()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    state = {"allow_tf32": torch.backends.cuda.matmul.allow_tf32, "precision": torch.get_float32_matmul_precision(),
             **{k: os.environ.get(k) for k in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")}}
    assert rel < 1e-5, f"fp32 GEMM rel. error {rel:.1e}: TF32 in use ({state})"


def _stock_and_ours(name: str):
    import comfy.sd
    import comfy_harness
    import folder_paths
    import nodes as comfy_nodes

    with torch.inference_mode():
        (default,) = comfy_nodes.UNETLoader().load_unet(name, "default")
        pinned = comfy.sd.load_diffusion_model(folder_paths.get_full_path_or_raise("diffusion_models", name),
                                               model_options={"dtype": torch.float32})
        ours, _ = comfy_harness.node_class("PrecisionLoadDiffusionModel").execute(model_name=name,
                                                                                  weight_dtype="fp32").args
    return default, pinned, ours


def test_stock_loader_picks_bf16_on_a_bf16_gpu_and_pinned_fp32_matches_ours(pack, monkeypatch):
    """Defects 2 and 4 (values): UNETLoader's "default" lets comfy.model_management.unet_dtype choose, which
    is fp32 on the CPU but bf16 wherever should_use_bf16(device) is True (an H100): the stock-vs-ours tests
    then compared a bf16 model to an fp32 one (0.62 on the 389 M Flux.1, 0.1 on Anima's adapter). Emulated
    here by answering should_use_bf16 as a bf16 GPU does. The fix is in the tests: the stock side is loaded
    by the stock function (comfy.sd.load_diffusion_model, what UNETLoader calls) with its dtype pinned to fp32,
    which matches ours to 1e-5 whatever the machine picks by default."""
    import comfy.model_management as mm
    import folder_paths

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    path = write_model_file("cosmos", os.path.join(folder, "gpu_defects_cosmos.safetensors"))
    try:
        monkeypatch.setattr(mm, "should_use_bf16", lambda *a, **k: True)
        default, pinned, ours = _stock_and_ours("gpu_defects_cosmos.safetensors")
        assert default.model.get_dtype() == torch.bfloat16  # what the GPU run compared against fp32
        assert pinned.model.get_dtype() == ours.model.get_dtype() == torch.float32
        gap = (denoise(default) - denoise(ours)).abs().max().item()
        torch.testing.assert_close(denoise(pinned), denoise(ours), rtol=1e-5, atol=1e-5)
    finally:
        os.remove(path)
    print(f"[defect 2] bf16 stock vs fp32 ours: max difference {gap:.3e}")
    assert gap > 1e-3, f"bf16 stock vs fp32 ours only {gap:.2e} apart"


@pytest.mark.gpu
def test_dynamic_vram_weights_reach_the_lora_layer_as_ordinary_tensors_in_training(pack_module):
    """Defect 3. Suspected cause: with dynamic VRAM (comfy-aimdo, ComfyUI 0.33's default on CUDA) a layer's
    weight is not the module's parameter but a view into a VRAM buffer that comfy.ops.cast_bias_weight /
    resolve_cast_module_with_vbar hands out per forward; made inside inference mode it is an inference tensor,
    whatever nodes.train.glue.normal_weights did to the parameters at load. The pack's boundary is LoRALinear.__call__
    (nodes/lora/glue.py): with grad on it clones such a weight before lora_linear, so autograd never
    saves an inference tensor. Asserted where it matters: the weight lora_linear receives under grad is never an
    inference tensor, the LoRA gradients are finite and non-zero, and no LoRA parameter is an inference tensor.
    No tolerance: a boolean property."""
    import folder_paths
    import nodes as comfy_nodes

    glue = pack_module("nodes.lora.glue")
    layer = pack_module("lora.layer")
    from lora.config import LoRAConfig
    from models import make_conditioning, make_latent

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    write_model_file("cosmos", os.path.join(folder, "gpu_dyn_cosmos.safetensors"))
    with torch.inference_mode():
        (stock,) = comfy_nodes.UNETLoader().load_unet("gpu_dyn_cosmos.safetensors", "default")
        model = glue.attach_lora(stock, LoRAConfig(rank=4, targets="attention_mlp"))
    lora_set = glue.get_lora_set(model)
    seen, real = [], layer.lora_linear

    def spy(x, weight, bias, adapters):
        if torch.is_grad_enabled():
            seen.append(weight.is_inference())
        return real(x, weight, bias, adapters)

    glue_mod = pack_module("nodes.lora.glue")
    old = glue_mod.lora_linear
    glue_mod.lora_linear = spy
    try:
        import comfy_harness

        settings = pack_module("training.settings").TrainSettings()
        with torch.inference_mode():
            out = comfy_harness.node_class("PrecisionTrainLoRA").execute([model], [make_latent(stock, 1, width=32, height=32)],
                                                   [make_conditioning(stock, 1)], [2], [0], ["cosmos"],
                                                   settings=[settings]).result
    finally:
        glue_mod.lora_linear = old
    assert out is not None and seen and not any(seen)
    assert not any(p.is_inference() for p in lora_set.parameters())


@pytest.mark.gpu
def test_anima_token_ids_follow_the_model_device_in_training_conds(pack_module):
    """Defect 4 (token ids). Cause, read in ComfyUI 0.33's comfy/model_base.py (Anima.extra_conds): outside
    inference mode (training) it returns t5xxl_ids as a CONDRegular on the device the conditioning came on,
    i.e. the CPU; only inside inference mode does it run the adapter itself with the ids moved to the model's
    device. The pack's nodes.train.data._encode moves every processed cond tensor to the training device; the GPU
    failure was a test that called the DiT with CPU ids. Asserted: every tensor of a built training sample's
    conds is on the model's device. The other Anima GPU differences (adapter LoRA vs stock off by 0.1; the two
    loaders' state-dict keys) are cause 2, the stock loader's bf16 default on a bf16 GPU: test_anima's stock
    fixture now pins fp32 (test_stock_loader_picks_bf16_on_a_bf16_gpu_and_pinned_fp32_matches_ours); if the
    keys still differ on a GPU, the next suspect is dynamic VRAM's ModelPatcherDynamic state dict."""
    import comfy.model_management as mm
    from models import make_conditioning, make_latent, tiny_anima

    tdata = pack_module("nodes.train.data")
    model = tiny_anima()
    device = mm.get_torch_device()
    (sample,) = tdata.build_samples(model, [make_latent(model, 1, width=32, height=32)],
                                    [make_conditioning(model, 1)], None, device)
    tensors = {k: c.cond for k, c in sample.cond.items() if isinstance(getattr(c, "cond", None), torch.Tensor)}
    assert tensors and all(t.device.type == device.type for t in tensors.values()), \
        {k: str(t.device) for k, t in tensors.items()}


@contextlib.contextmanager
def _dynamic_vram_construction(monkeypatch):
    """ComfyUI 0.33's model construction as it runs with dynamic VRAM (comfy-aimdo) on a GPU, on the CPU:
    ``comfy.memory_management.aimdo_enabled`` on, so that comfy.ops' Linear and Embedding are built without
    weights (``weight = None``) and take them from the file in ``_lazy_load_from_state_dict`` (a Linear's bias
    is created as zeros when the file lacks it). Files are still read by the ordinary safetensors path: the
    aimdo mmap reader needs the CUDA library. Yields the list of module prefixes the lazy loader filled."""
    import comfy.memory_management as cmm
    import comfy.ops
    import comfy.utils

    filled = []
    lazy = comfy.ops.disable_weight_init._lazy_load_from_state_dict
    read = comfy.utils.load_torch_file

    def counting(module, state_dict, prefix, *args, **kwargs):
        filled.append(prefix)
        return lazy(module, state_dict, prefix, *args, **kwargs)

    def plain_read(*args, **kwargs):
        cmm.aimdo_enabled = False
        try:
            return read(*args, **kwargs)
        finally:
            cmm.aimdo_enabled = True

    monkeypatch.setattr(comfy.ops.disable_weight_init, "_lazy_load_from_state_dict", staticmethod(counting))
    monkeypatch.setattr(comfy.utils, "load_torch_file", plain_read)
    monkeypatch.setattr(cmm, "aimdo_enabled", True)
    yield filled


def test_anima_loaders_agree_when_built_as_dynamic_vram_builds_them(pack, pack_module, monkeypatch):
    """Defect 4 (state-dict keys): on the H100 the stock and the pack's loader gave Anima diffusion models with
    different state-dict keys. One GPU-only difference is how 0.33 builds models there (dynamic VRAM: weightless
    Linear/Embedding filled lazily from the file, zero biases for missing ones); emulated here, both loaders
    give the same keys, shapes and values (and the same ones as without it), so that construction is not the
    cause. What stays GPU-only (ModelPatcherDynamic's load: weights staged into VRAM buffers, small modules
    force-loaded) is the gpu test below."""
    reason = pack_module("demo.tiny_models").anima_unavailable()
    if reason:
        pytest.skip(reason)
    import folder_paths

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    path = write_model_file("anima", os.path.join(folder, "gpu_defects_anima.safetensors"))
    try:
        _, plain_stock, plain_ours = _stock_and_ours("gpu_defects_anima.safetensors")
        reference = plain_stock.model.diffusion_model.state_dict()
        with _dynamic_vram_construction(monkeypatch) as filled:
            _, stock, ours = _stock_and_ours("gpu_defects_anima.safetensors")
    finally:
        os.remove(path)
    # the lazy path really built both (each Linear/Embedding of both models, the adapter's included)
    assert sum(p.startswith("llm_adapter.") for p in filled) >= 2 * 6, filled[:5]
    a, b = stock.model.diffusion_model.state_dict(), ours.model.diffusion_model.state_dict()
    assert sorted(a) == sorted(b) == sorted(reference)
    bad = [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k]) or not torch.equal(a[k], reference[k])]
    assert not bad, bad[:5]


@pytest.mark.gpu
def test_anima_loaders_agree_on_cuda_after_dynamic_vram_loads_them(pack, pack_module):
    """Defect 4 (state-dict keys), what only a GPU can decide. The CPU test above rules out dynamic VRAM's model
    construction; the remaining suspect is ModelPatcherDynamic.load (comfy/model_patcher.py): it stages weights
    into VRAM buffers, force-loads small modules through patch_weight_to_device and casts non-comfy-op
    parameters with set_attr_param, and keeps backups it restores later. Both models are loaded to the GPU by
    model management as a sampler would, then their diffusion models' state dicts compared by key, shape and
    value (fp32 both; tolerance 0: the same file, the same dtype)."""
    reason = pack_module("demo.tiny_models").anima_unavailable()
    if reason:
        pytest.skip(reason)
    import comfy.model_management as mm
    import folder_paths

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    path = write_model_file("anima", os.path.join(folder, "gpu_defects_anima.safetensors"))
    try:
        _, stock, ours = _stock_and_ours("gpu_defects_anima.safetensors")
    finally:
        os.remove(path)
    for patcher in (stock, ours):
        mm.load_models_gpu([patcher])
        a = {k: v.detach().float().cpu() for k, v in stock.model.diffusion_model.state_dict().items()}
        b = {k: v.detach().float().cpu() for k, v in ours.model.diffusion_model.state_dict().items()}
        assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:10]
        assert not [k for k in a if not torch.equal(a[k], b[k])]
