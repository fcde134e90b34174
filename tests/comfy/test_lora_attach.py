"""Attach/detach through ModelPatcher on tiny Flux.1 / Flux.2 / Cosmos: identity at init, no leak into the
shared module, independent clones, fp32 parameters through ComfyUI's loading and sampling, node errors."""
from __future__ import annotations

import pytest
import torch

from models import denoise, randomize_lora, tiny_cosmos, tiny_flux1, tiny_flux2

FAMILIES = {"flux1": tiny_flux1, "flux2": tiny_flux2, "cosmos": tiny_cosmos}




@pytest.fixture(scope="module")
def glue(pack_module):
    return pack_module("nodes.lora.glue")


@pytest.fixture(scope="module")
def LoRAConfig(pack_module):
    return pack_module("lora.config").LoRAConfig


@pytest.mark.parametrize("family", list(FAMILIES))
def test_identity_then_delta_then_base_restored_bit_exact(family, glue, LoRAConfig):
    base = FAMILIES[family]()
    before = denoise(base)
    adapted = glue.attach_lora(base, LoRAConfig(rank=4, targets="attention_mlp"))
    assert torch.equal(denoise(adapted), before), "a fresh LoRA must leave the output bit-equal"
    randomize_lora(glue.get_lora_set(adapted), 1)
    changed = denoise(adapted)
    assert (changed - before).abs().max() > 1e-3
    assert torch.equal(denoise(base), before), "the shared module kept a LoRA after the clone was used"
    assert torch.equal(denoise(glue.detach_lora(adapted)), before)
    assert glue.get_lora_set(base) is None and glue.get_lora_set(glue.detach_lora(adapted)) is None


def test_two_clones_with_different_loras_do_not_interfere(glue, LoRAConfig):
    base = tiny_flux1()
    a = glue.attach_lora(base, LoRAConfig(rank=2, seed=1))
    b = glue.attach_lora(base, LoRAConfig(rank=4, seed=2, targets="all"))
    randomize_lora(glue.get_lora_set(a), 1)
    randomize_lora(glue.get_lora_set(b), 2)
    out_a, out_b = denoise(a), denoise(b)
    assert not torch.equal(out_a, out_b)
    assert torch.equal(denoise(a), out_a) and torch.equal(denoise(b), out_b)
    assert glue.get_lora_set(a) is not glue.get_lora_set(b)


def test_fp32_params_survive_bf16_model_loading_and_sampling(glue, LoRAConfig):
    base = tiny_cosmos(dtype=torch.bfloat16)
    adapted = glue.attach_lora(base, LoRAConfig(rank=4))
    lora_set = glue.get_lora_set(adapted)
    randomize_lora(lora_set, 3)
    params = {n: p for n, p in lora_set.named_parameters()}
    out = denoise(adapted)
    assert torch.isfinite(out).all()
    assert all(p.dtype == torch.float32 for p in lora_set.parameters())
    assert {n: p for n, p in lora_set.named_parameters()} == params  # the same Parameter objects
    assert not any(p.is_inference() for p in lora_set.parameters()), "trainable params must not be inference tensors"


def bf16_compute_model(pack_module, family: str = "flux2"):
    """A tiny model whose weights *and compute* are bf16 (ComfyUI's CPU default would compute in fp32)."""
    import comfy.model_detection
    import comfy.model_patcher

    tiny = pack_module("demo.tiny_models")
    sd = tiny.tiny_state_dict(tiny.build_tiny_model(family))
    with torch.inference_mode(False):
        cfg = comfy.model_detection.model_config_from_unet_config(tiny.unet_config_for(family), None)
        cfg.set_inference_dtype(torch.bfloat16, None)
        model = cfg.get_model({}, "")
        model.diffusion_model.load_state_dict({k: v.bfloat16() for k, v in sd.items()})
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def _layer_errors(glue, model) -> tuple[float, float]:
    """Sample ``model`` once (ComfyUI's sampler, object patches applied) and compare every LoRA'd layer's
    output with the same layer in fp64 (its bf16 weights and its input, base plus scale·x·Aᵀ·Bᵀ):
    (Σ|out − ref| / Σ|ref|, fraction of outputs that are not the fp64 value rounded once to bf16)."""
    lora_set, dm, sums, handles = glue.get_lora_set(model), model.model.diffusion_model, [0.0, 0.0, 0, 0], []

    def hook(module, args, out, adapter):
        x = args[0].double()
        bias = None if module.bias is None else module.bias.double()
        ref = torch.nn.functional.linear(x, module.weight.double(), bias)
        ref = ref + adapter.scale * (x @ adapter.down.double().T @ adapter.up.double().T)
        assert out.dtype == torch.bfloat16
        sums[0] += float((out.double() - ref).abs().sum())
        sums[1] += float(ref.abs().sum())
        sums[2] += int((out != ref.to(torch.bfloat16)).sum())
        sums[3] += out.numel()

    for path, adapter in lora_set.adapters().items():
        handles.append(dm.get_submodule(path).register_forward_hook(
            lambda m, a, o, adapter=adapter: hook(m, a, o, adapter)))
    try:
        denoise(model)
    finally:
        for h in handles:
            h.remove()
    assert len(handles) >= 4 and sums[1] > 0
    return sums[0] / sums[1], sums[2] / sums[3]


def test_fp32_path_is_more_accurate_than_plain_bf16_path_in_a_bf16_compute_model(glue, LoRAConfig, pack_module):
    """In a model whose weights and compute are bf16, every LoRA'd layer on the real sampling path is compared
    with that layer in fp64: the fp32-accumulating path rounds once (its output is the fp64 value rounded to
    bf16, but for the rare value within fp32 accumulation error of a rounding boundary), the plain bf16 path
    rounds base, delta and sum (about twice the error). The whole model is no yardstick: its bf16 timestep
    embedding alone moves the output by ~20 %."""
    base = bf16_compute_model(pack_module)
    assert base.model.manual_cast_dtype is None and base.model.get_dtype() == torch.bfloat16
    before = denoise(base)
    assert torch.equal(denoise(glue.attach_lora(base, LoRAConfig(rank=4))), before)
    fp32 = glue.attach_lora(base, LoRAConfig(rank=4, seed=5))
    plain = glue.attach_lora(base, LoRAConfig(rank=4, seed=5, fp32_accumulation=False))
    for m in (fp32, plain):
        randomize_lora(glue.get_lora_set(m), 4, std=0.2)
    err_fp32, off_fp32 = _layer_errors(glue, fp32)
    err_plain, off_plain = _layer_errors(glue, plain)
    assert off_fp32 < 0.01, f"fp32 path: {off_fp32:.1%} of outputs are not the fp64 value rounded once"
    assert off_plain > 0.1  # the yardstick sees the plain path's extra roundings
    assert err_fp32 < 0.75 * err_plain, f"relative error: fp32 path {err_fp32:.2e}, plain bf16 {err_plain:.2e}"


def test_stacked_attach_keeps_both_adapters(glue, LoRAConfig):
    base = tiny_flux1()
    one = glue.attach_lora(base, LoRAConfig(rank=2, seed=1))
    randomize_lora(glue.get_lora_set(one), 1)
    two = glue.attach_lora(one, LoRAConfig(rank=2, seed=2))
    key = "diffusion_model.double_blocks.0.img_attn.qkv.forward"
    assert len(two.object_patches[key].adapters) == 2 and len(one.object_patches[key].adapters) == 1
    assert torch.equal(denoise(two), denoise(one))  # the second LoRA is still at its zero init


def test_attach_errors_name_the_problem(glue, LoRAConfig):
    base = tiny_flux1()
    with pytest.raises(ValueError, match=r"no module matches targets='none' include='nothing_here'.*e\.g\. .*double_blocks"):
        glue.attach_lora(base, LoRAConfig(targets="none", include="nothing_here"))
    with pytest.raises(ValueError, match=r"rank=100 exceeds the width of '.*' \(.*\): use rank <= 64"):
        glue.attach_lora(base, LoRAConfig(rank=100))
    assert glue.get_lora_set(base) is None and not base.object_patches


def test_attach_node_dry_run_and_errors(pack):
    import comfy_harness

    node = comfy_harness.node_class("PrecisionAttachLoRA")
    base = tiny_flux1()
    args = dict(rank=4, alpha=4.0, targets="attention", include="", exclude="", blocks="single_blocks:0",
                fp32_accumulation=True, dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False,
                param_dtype="fp32", seed=0, init_lora="none", dry_run=True)
    out = node.execute(base, **args)
    assert out.result[0] is base
    assert out.result[1].splitlines()[1:] == ["single_blocks.0.linear1  (64 -> 448)", "single_blocks.0.linear2  (320 -> 64)"]
    with pytest.raises(ValueError, match=r"^\[Precision LoRA\] PrecisionAttachLoRA: input 'alpha'=0.0 is below the minimum"):
        node.execute(base, **{**args, "alpha": 0.0})
    with pytest.raises(ValueError, match=r"^\[Precision LoRA\] PrecisionAttachLoRA: no module matches"):
        node.execute(base, **{**args, "blocks": "single_blocks:5"})
    assert node.validate_inputs(targets="attention", include="(", exclude="", blocks="", param_dtype="fp32").startswith(
        "[Precision LoRA] PrecisionAttachLoRA: include regex '(' is invalid")
