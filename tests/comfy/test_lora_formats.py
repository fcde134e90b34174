"""LoRA files from other trainers (issue 14 item 7): every module name stock ComfyUI maps onto a linear of
Flux.1 / Flux.2 / Cosmos-Predict2 / Anima is mapped to the same rows of the same layer by ``lora.formats``;
a file of each format, made here from a known LoRA, gives the same output in Load LoRA (Precision) (fp32 and
merge) and as Attach LoRA's ``init_lora`` as in stock ``LoraLoaderModelOnly``; unknown keys are refused."""
from __future__ import annotations

import logging
import os
import zlib

import pytest
import torch

from models import denoise, tiny_anima, tiny_cosmos, tiny_flux1, tiny_flux2

FAMILIES = {"flux1": tiny_flux1, "flux2": tiny_flux2, "cosmos": tiny_cosmos, "anima": tiny_anima}
# Stock ComfyUI merges the delta into the fp32 weight, the fp32 adapter adds x·down·up to x·W: a different
# rounding order, so outputs agree to fp32 rounding of a one-step denoise on the tiny models.
TOL = dict(rtol=1e-4, atol=1e-4)
LOAD_ARGS = dict(strength=1.0, attention="ignore", override_backend="auto", override_scale_mode="default",
                 override_scale_value=1.0)
# (format, module-name rule, down suffix, up suffix, writes .alpha): Flux diffusers names come from stock
# ComfyUI's own key map, so this test does not reuse the mapping it checks.
FORMATS = {
    "kohya": ("lora_unet_", ".lora_down.weight", ".lora_up.weight", True),
    "comfyui": ("diffusion_model.", ".lora_A.weight", ".lora_B.weight", False),
    "comfyui_lora_dot": ("diffusion_model.", ".lora.down.weight", ".lora.up.weight", True),
    "diffusers_peft": ("transformer.", ".lora_A.weight", ".lora_B.weight", False),
    "ai_toolkit": ("transformer.", ".lora_A.weight", ".lora_B.weight", True),
    "onetrainer": ("lora_transformer_", ".lora_down.weight", ".lora_up.weight", True),
    "diffsynth": ("", ".lora_A.default.weight", ".lora_B.default.weight", False),
}
FLUX_ONLY = {"diffusers_peft", "ai_toolkit", "onetrainer", "diffsynth"}


def node(node_id):
    import comfy_harness

    return comfy_harness.node_class(node_id)


@pytest.fixture(scope="module")
def formats(pack_module):
    return pack_module("lora.formats")


def base_model(family):
    if family == "anima":
        import comfy_harness

        reason = comfy_harness.pack_module("demo.tiny_models").anima_unavailable()
        if reason:
            pytest.skip(reason)
    return FAMILIES[family]()


def linears(model) -> dict[str, tuple[int, int]]:
    dm = model.model.diffusion_model
    return {n: (m.in_features, m.out_features) for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear)}


def stock_targets(model) -> dict[str, tuple[str, tuple[int, int] | None, bool]]:
    """Stock ComfyUI's LoRA module names that land on a linear weight: name -> (path, rows, swapped halves)."""
    import comfy.lora

    lin = linears(model)
    out = {}
    for name, to in comfy.lora.model_lora_keys_unet(model.model, {}).items():
        key, rows, swap = (to, None, False) if isinstance(to, str) else (to[0], to[1], len(to) > 2)
        path = key[len("diffusion_model."):-len(".weight")] if key.endswith(".weight") else None
        if path in lin:
            out[name] = (path, None if rows is None else (rows[1], rows[2]), swap)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_module_names_equal_stock_comfyui_key_map(family, formats):
    model = base_model(family)
    ours = {n: (t.path, t.rows, t.swap_halves) for n, t in formats.module_names(linears(model)).items()}
    stock = stock_targets(model)
    assert not set(stock) - set(ours), sorted(set(stock) - set(ours))[:5]
    assert not [n for n in stock if ours[n] != stock[n]], [(n, ours[n], stock[n]) for n in stock if ours[n] != stock[n]][:5]
    import comfy.model_base

    if hasattr(comfy.model_base, "Anima"):  # ComfyUI 0.33: the same names; 0.3.75 knows fewer Flux spellings
        assert set(ours) == set(stock), sorted(set(ours) - set(stock))[:5]
    if family.startswith("flux"):  # the split q/k/v rows ComfyUI patches in the fused layer
        assert stock["transformer.transformer_blocks.0.attn.to_k"][1] is not None


def module_sources(model, fmt: str) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """Module names for a file of ``fmt`` (one per target rows), taken from stock ComfyUI's key map."""
    prefix = FORMATS[fmt][0]
    stock = stock_targets(model)
    if fmt == "diffsynth":
        names = [n for n in stock if "transformer." + n in stock]
    elif fmt in ("kohya", "comfyui", "comfyui_lora_dot"):
        names = [n for n in stock if n.startswith(prefix) and not n.endswith("_qkv")]
    else:
        names = [n for n in stock if n.startswith(prefix)]
    if not names:
        pytest.skip(f"this ComfyUI loads no {fmt} names")
    seen, out = set(), {}
    for n in sorted(names):
        path, rows, _swap = stock[n]
        if (path, rows) not in seen:
            seen.add((path, rows))
            out[n] = (path, rows)
    return out


def write_file(model, family: str, fmt: str) -> str:
    """A LoRA of ``fmt`` with seeded factors; ranks 2..4 and alphas vary per module (split q/k/v parts too)."""
    import folder_paths
    from safetensors.torch import save_file

    _prefix, down_sfx, up_sfx, with_alpha = FORMATS[fmt]
    lin = linears(model)
    g = torch.Generator().manual_seed(zlib.crc32(f"{family}/{fmt}".encode()))
    sd = {}
    for i, (name, (path, rows)) in enumerate(module_sources(model, fmt).items()):
        n_in, n_out = lin[path]
        rank = 2 + i % 3
        sd[name + down_sfx] = torch.randn(rank, n_in, generator=g) * 0.2
        sd[name + up_sfx] = torch.randn(n_out if rows is None else rows[1], rank, generator=g) * 0.2
        if with_alpha:
            sd[name + ".alpha"] = torch.tensor(float(1 + i % 4))
    folder = os.path.join(folder_paths.get_folder_paths("loras")[0], "formats")
    os.makedirs(folder, exist_ok=True)
    save_file(sd, os.path.join(folder, f"{family}_{fmt}.safetensors"))
    return f"formats/{family}_{fmt}.safetensors"


def attach_every_linear(base, init: str):
    """Attach LoRA over every linear of the model (include '.'), starting from ``init``; call with the rank."""
    args = dict(alpha=8.0, targets="none", include=".", exclude="", blocks="", fp32_accumulation=True, dropout=0.0,
                rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0, init_lora=init,
                dry_run=False)
    return lambda rank: node("PrecisionAttachLoRA").execute(base, rank=rank, **args)


CASES = [(f, fmt) for f in FAMILIES for fmt in FORMATS if f.startswith("flux") or fmt not in FLUX_ONLY]


@pytest.mark.parametrize("family,fmt", CASES)
def test_foreign_file_loads_like_stock_in_both_modes_and_as_init_lora(family, fmt, formats, caplog):
    import comfy_harness
    import folder_paths
    import nodes as comfy_nodes

    base = base_model(family)
    name = write_file(base, family, fmt)
    with caplog.at_level(logging.WARNING):
        stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, name, 1.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    expected = denoise(stock)
    assert (expected - denoise(base)).abs().max() > 1e-3, "the LoRA must change the output"
    for mode in ("fp32", "merge"):
        loaded = node("PrecisionLoadLoRA").execute(base, name, mode=mode, **LOAD_ARGS).result[0]
        torch.testing.assert_close(denoise(loaded), expected, **TOL, msg=f"mode {mode}")
    read = comfy_harness.pack_module("lora.file").read_lora_file
    factors = formats.parse_lora(read(folder_paths.get_full_path("loras", name))[0], linears(base))
    rank = max(f.rank for f in factors.values())
    attach = attach_every_linear(base, name)
    started = attach(rank).result[0]
    torch.testing.assert_close(denoise(started), expected, **TOL, msg="init_lora")
    if len({f.rank for f in factors.values()}) > 1:  # the rank the file asks for is named in the refusal
        with pytest.raises(ValueError, match=rf"init_lora '.*{fmt}.safetensors': its modules have ranks .* set rank to {rank}"):
            attach(rank - 1)


def test_unknown_keys_and_other_families_are_refused_clearly(formats):
    flux, cosmos = tiny_flux1(), tiny_cosmos()
    name = write_file(flux, "flux1", "diffusers_peft")
    load = node("PrecisionLoadLoRA").execute
    for mode in ("fp32", "merge"):
        with pytest.raises(ValueError, match=r"PrecisionLoadLoRA: .*none of its \d+ keys .* another model family"):
            load(cosmos, name, mode=mode, **LOAD_ARGS)
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match=r"1 of its 3 keys match no linear layer of this model .*transformer\.nope"):
        formats.parse_lora({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": x,
                            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 2),
                            "transformer.nope.lora_A.weight": x}, linears(flux))


def test_dora_file_is_refused_in_fp32_and_merges_as_stock_comfyui_does(formats):
    """A DoRA file (magnitudes not 1, so the DoRA normalisation matters): refused in fp32 mode; in merge mode
    the model samples as stock ComfyUI's LoraLoaderModelOnly makes it, and unlike the same file without its
    magnitudes."""
    import folder_paths
    import nodes as comfy_nodes
    from safetensors.torch import save_file

    flux = tiny_flux1()
    lin = linears(flux)
    n_in, n_out = lin["double_blocks.0.img_attn.proj"]
    gen = torch.Generator().manual_seed(0)
    key = "diffusion_model.double_blocks.0.img_attn.proj"
    plain = {f"{key}.lora_A.weight": torch.randn(2, n_in, generator=gen),
             f"{key}.lora_B.weight": torch.randn(n_out, 2, generator=gen) * 0.1}
    sd = {**plain, f"{key}.dora_scale": 0.5 + torch.rand(n_out, 1, generator=gen)}
    folder = os.path.join(folder_paths.get_folder_paths("loras")[0], "formats")
    os.makedirs(folder, exist_ok=True)
    save_file(sd, os.path.join(folder, "dora.safetensors"))
    save_file(plain, os.path.join(folder, "dora_without_magnitudes.safetensors"))
    load = node("PrecisionLoadLoRA").execute
    with pytest.raises(ValueError, match=r"'diffusion_model\.double_blocks\.0\.img_attn\.proj\.dora_scale' is a DoRA "
                                         r"magnitude tensor, .* mode 'merge'"):
        load(flux, "formats/dora.safetensors", mode="fp32", **LOAD_ARGS)
    merged = load(flux, "formats/dora.safetensors", mode="merge", **LOAD_ARGS).result[0]
    assert len(merged.patches) == 1
    stock = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(flux, "formats/dora.safetensors", 1.0)[0]
    ours = denoise(merged)
    torch.testing.assert_close(ours, denoise(stock), rtol=1e-5, atol=1e-5)
    without = load(flux, "formats/dora_without_magnitudes.safetensors", mode="merge", **LOAD_ARGS).result[0]
    assert (ours - denoise(without)).abs().max() > 1e-3, "the DoRA magnitudes changed nothing"
    assert (ours - denoise(flux)).abs().max() > 1e-3, "the DoRA file changed nothing"
