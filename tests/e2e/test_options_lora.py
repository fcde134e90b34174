"""Every option of Load Diffusion Model, Attach LoRA, Save LoRA and Load LoRA through a real server's /prompt,
asserted on what it must change: weight dtypes, the saved LoRA's keys / shapes / alpha / dtypes / metadata /
location, and the sampled latent (strength, merge, recorded or overridden attention, foreign formats, DoRA)
against stock ComfyUI's LoraLoaderModelOnly or the model without the LoRA. Tiny Flux.1 dev throughout."""
from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest
import safetensors.torch
import torch

from attention.backends import available as attention_backends
from lora.file import save_lora_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from options_lib import (AREAS, ATTACH, LOAD, MODEL_FILES, SAVE, Graph, OptionsServer, coverage, out,  # noqa: E402
                         unused_options)

pytestmark = pytest.mark.e2e

FLUX = MODEL_FILES["flux1_dev"]
INIT = "options_init.safetensors"


def _flux_linears(base: str) -> dict[str, tuple[int, int]]:
    sd = safetensors.torch.load_file(os.path.join(base, "models", "diffusion_models", FLUX))
    return {k[: -len(".weight")]: (v.shape[1], v.shape[0]) for k, v in sd.items()
            if k.endswith(".weight") and v.ndim == 2}


def _write_loras(base: str) -> None:
    """A non-zero rank-4 LoRA on the attention of double block 0 (ours), the same factors in diffusers/PEFT
    names, and a DoRA file (magnitude vector) in ComfyUI names."""
    lin = _flux_linears(base)
    g = torch.Generator().manual_seed(0)
    ours, dora = {}, {}
    for path in ("double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj", "single_blocks.0.linear1"):
        n_in, n_out = lin[path]
        prefix = "diffusion_model." + path
        ours[prefix + ".lora_down.weight"] = torch.randn(4, n_in, generator=g) * 0.2
        ours[prefix + ".lora_up.weight"] = torch.randn(n_out, 4, generator=g) * 0.2
        ours[prefix + ".alpha"] = torch.tensor(4.0)
    loras = os.path.join(base, "models", "loras")
    save_lora_file(os.path.join(loras, INIT), ours, {}, overwrite=True)
    n_in, n_out = lin["double_blocks.0.img_attn.qkv"]
    h = n_out // 3
    peft = {}
    for part in ("to_q", "to_k", "to_v"):
        peft[f"transformer.transformer_blocks.0.attn.{part}.lora_A.weight"] = torch.randn(4, n_in, generator=g) * 0.2
        peft[f"transformer.transformer_blocks.0.attn.{part}.lora_B.weight"] = torch.randn(h, 4, generator=g) * 0.2
    safetensors.torch.save_file(peft, os.path.join(loras, "options_peft.safetensors"))
    n_in, n_out = lin["double_blocks.0.img_attn.proj"]
    dora["diffusion_model.double_blocks.0.img_attn.proj.lora_A.weight"] = torch.randn(4, n_in, generator=g) * 0.2
    dora["diffusion_model.double_blocks.0.img_attn.proj.lora_B.weight"] = torch.randn(n_out, 4, generator=g) * 0.2
    dora["diffusion_model.double_blocks.0.img_attn.proj.dora_scale"] = 1.0 + 0.5 * torch.rand(n_out, 1, generator=g)
    safetensors.torch.save_file(dora, os.path.join(loras, "options_dora.safetensors"))


@pytest.fixture(scope="module")
def opts(comfy_server):
    view = OptionsServer.attach(comfy_server, families=("sdxl",), prepare=_write_loras)
    yield view
    view.close()


def base_graph(dtype: str = "fp32") -> tuple[Graph, str]:
    g = Graph()
    return g, g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype=dtype)


def sample(g: Graph, model: list, loader: str, prefix: str) -> str:
    """KSampler (1 step) on ``model`` with demo data of ``loader``; returns the SaveLatent node id."""
    cond = g.add("PrecisionDemoConditioning", model=out(loader), text="sks", seed=0, tokens=8)
    latent = g.add("PrecisionDemoLatent", model=out(loader), width=32, height=32, batch_size=1, seed=1)
    ks = g.add("KSampler", model=model, positive=out(cond), negative=out(cond), latent_image=out(latent), seed=3,
               steps=1, cfg=1.0, sampler_name="euler", scheduler="simple", denoise=1.0)
    return g.add("SaveLatent", samples=out(ks), filename_prefix=f"options_lora/{prefix}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_weight_dtypes_load_and_sample(opts):
    g = Graph()
    nodes = {}
    for dtype in ("fp32", "bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2", "default"):
        loader = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype=dtype)
        nodes[dtype] = (g.add("PreviewAny", source=out(loader, 1)), sample(g, out(loader), loader, dtype))
    entry = opts.run(g)
    named = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8_e4m3fn": "float8_e4m3fn",
             "fp8_e5m2": "float8_e5m2"}
    for dtype, word in named.items():
        assert f"weight dtype: {word}" in opts.text(entry, nodes[dtype][0]), dtype
    latents = {k: opts.latent(entry, v[1]) for k, v in nodes.items()}
    ref = latents["fp32"]
    assert torch.equal(latents["default"], ref)  # a CPU host: ComfyUI's default is fp32
    for dtype, (lo, hi) in {"bf16": (1e-6, 0.05), "fp16": (1e-7, 0.01), "fp8_e4m3fn": (1e-4, 0.5),
                            "fp8_e5m2": (1e-4, 0.8)}.items():
        assert lo < rel(latents[dtype], ref) < hi, (dtype, rel(latents[dtype], ref))
    # e5m2 keeps 2 mantissa bits to e4m3fn's 3: its weights, so its sample, are further from fp32
    assert rel(latents["fp8_e5m2"], ref) > rel(latents["fp8_e4m3fn"], ref)


def _attach_save(g: Graph, loader: str, key: str, **attach) -> tuple[str, str]:
    if key.startswith("cosmos"):  # self_attention is a preset of Cosmos / Anima (Flux has no separate one)
        loader = g.add("PrecisionLoadDiffusionModel", model_name=MODEL_FILES["cosmos"], weight_dtype="fp32")
    node = g.add("PrecisionAttachLoRA", model=out(loader), **{**ATTACH, **attach})
    return node, g.add("PrecisionSaveLoRA", model=out(node), filename_prefix=f"options/attach_{key}",
                       **{**SAVE, "key_style": "diffusion_model"})


def test_attach_options_shape_the_saved_lora(opts):
    g, loader = base_graph()
    variants = {
        "base": {}, "seed": {"seed": 7},
        "rs": {"rank": 8, "alpha": 2.0, "rslora": True, "param_dtype": "bf16", "fp32_accumulation": False,
               "dropout": 0.1, "rank_dropout": 0.2, "module_dropout": 0.3},
        "mlp": {"targets": "attention_mlp"}, "all": {"targets": "all"}, "community": {"targets": "community"},
        "cosmos_attention": {}, "cosmos_self": {"targets": "self_attention"},
        "include": {"targets": "none", "include": r"double_blocks\.0\.img_attn\.qkv"},
        "exclude": {"exclude": "img_attn"}, "blocks": {"blocks": "double_blocks:1, single_blocks:0"},
        "init": {"init_lora": INIT},
    }
    nodes = {k: _attach_save(g, loader, k, **v) for k, v in variants.items()}
    dry = g.add("PrecisionAttachLoRA", model=out(loader), **{**ATTACH, "dry_run": True})
    dry_text = g.add("PreviewAny", source=out(dry, 1))
    dry_sample, base_sample = sample(g, out(dry), loader, "dry"), sample(g, out(loader), loader, "plain")
    bf16 = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="bf16")
    accumulated = {acc: sample(g, out(g.add("PrecisionAttachLoRA", model=out(bf16), **{
        **ATTACH, "init_lora": INIT, "fp32_accumulation": acc})), bf16, f"acc_{acc}") for acc in (True, False)}
    entry = opts.run(g)
    files = {k: opts.saved_lora(entry, v[1]) for k, v in nodes.items()}
    mods = {k: {key.rsplit(".lora_", 1)[0] for key in t if ".lora_" in key} for k, (_, t, _) in files.items()}
    base, rs = files["base"][1], files["rs"][1]
    assert len(mods["base"]) > 4 and mods["seed"] == mods["base"] and mods["rs"] == mods["base"]
    down = next(k for k in base if k.endswith("lora_down.weight"))
    assert base[down].shape[0] == 4 and rs[down].shape[0] == 8
    assert not torch.equal(files["seed"][1][down], base[down])
    alpha = down.replace("lora_down.weight", "alpha")
    assert float(rs[alpha]) == pytest.approx(2.0 * math.sqrt(8), rel=1e-6)  # rsLoRA: scale alpha / sqrt(rank)
    assert all(torch.equal(t, t.bfloat16().float()) for k, t in rs.items() if ".lora_" in k)  # bf16 parameters
    args = json.loads(files["rs"][2]["ss_network_args"])
    assert (args["rslora"], args["param_dtype"], args["fp32_accumulation"]) == (True, "bf16", False)
    assert (args["dropout"], args["rank_dropout"], args["module_dropout"]) == (0.1, 0.2, 0.3)
    assert files["rs"][2]["ss_lora_fp32_accumulation"] == "False"
    assert mods["base"] < mods["mlp"] < mods["all"]
    assert mods["community"] == mods["all"]  # Flux's community preset (musubi-tuner's): every block Linear
    assert mods["cosmos_self"] < mods["cosmos_attention"] and all(".self_attn." in m for m in mods["cosmos_self"])
    assert [m.split(".", 1)[1] for m in mods["include"]] == ["double_blocks.0.img_attn.qkv"]
    assert mods["exclude"] == {m for m in mods["base"] if "img_attn" not in m} != mods["base"]
    assert mods["blocks"] and all(".double_blocks.1." in m or ".single_blocks.0." in m for m in mods["blocks"])
    init = safetensors.torch.load_file(opts.path("models", "loras", INIT))
    assert all(torch.equal(files["init"][1][k], init[k]) for k in init if ".lora_" in k)
    text = opts.text(entry, dry_text)
    assert text.startswith(f"dry run: {len(mods['base'])} layers")
    assert torch.equal(opts.latent(entry, dry_sample), opts.latent(entry, base_sample))  # the model unchanged
    fp32_acc, bf16_acc = (opts.latent(entry, accumulated[acc]) for acc in (True, False))
    if torch.cuda.is_available():  # bf16 compute: the LoRA's delta is added in fp32 or in bf16
        assert not torch.equal(fp32_acc, bf16_acc)
    else:  # ComfyUI computes bf16 weights in fp32 on a CPU (manual cast): both paths add in fp32
        assert torch.equal(fp32_acc, bf16_acc)


def test_attach_dropouts_change_training(opts):
    def trained(key: str, **attach) -> tuple[Graph, str]:
        g, loader = base_graph()
        node = g.add("PrecisionAttachLoRA", model=out(loader), **{**ATTACH, **attach})
        cond = g.add("PrecisionDemoConditioning", model=out(loader), text="sks", seed=0, tokens=8)
        latent = g.add("PrecisionDemoLatent", model=out(loader), width=32, height=32, batch_size=2, seed=1)
        train = g.add("PrecisionTrainLoRA", model=out(node), latents=out(latent), conditioning=out(cond), steps=2,
                      seed=0, name=f"o_drop_{key}")
        return g, g.add("PrecisionSaveLoRA", model=out(train), filename_prefix=f"options/drop_{key}", **SAVE)

    graphs = {"base": trained("base"), "dropout": trained("dropout", dropout=0.5),
              "rank": trained("rank", rank_dropout=0.5), "module": trained("module", module_dropout=0.5)}
    entries = opts.run_all({k: g for k, (g, _) in graphs.items()})
    loras = {k: opts.saved_lora(entries[k], graphs[k][1])[1] for k in graphs}
    for key in ("dropout", "rank", "module"):
        assert loras[key].keys() == loras["base"].keys()
        assert all(torch.isfinite(t).all() for t in loras[key].values())
        assert max(float((loras[key][k] - loras["base"][k]).abs().max()) for k in loras[key]) > 1e-6, key


def test_save_options_dtype_keys_folder_counter_overwrite_and_state(opts):
    g, loader = base_graph()
    attach = g.add("PrecisionAttachLoRA", model=out(loader), **{**ATTACH, "init_lora": INIT})
    bf16 = g.add("PrecisionSaveLoRA", model=out(attach), filename_prefix="options/sub/bf16_kohya", folder="output",
                 save_dtype="bf16", key_style="kohya", use_counter=False, overwrite=False)
    fp16 = g.add("PrecisionSaveLoRA", model=out(attach), filename_prefix="options/fp16_dm", folder="loras",
                 save_dtype="fp16", key_style="diffusion_model", use_counter=True, overwrite=False)
    cond = g.add("PrecisionDemoConditioning", model=out(loader), text="sks", seed=0, tokens=8)
    latent = g.add("PrecisionDemoLatent", model=out(loader), width=32, height=32, batch_size=1, seed=1)
    train = g.add("PrecisionTrainLoRA", model=out(attach), latents=out(latent), conditioning=out(cond), steps=1,
                  seed=0, name="o_save_state")
    state = g.add("PrecisionSaveLoRA", model=out(train, 0), training_state=out(train, 1),
                  filename_prefix="options/with_state", **SAVE)
    entry = opts.run(g)
    init = {k: v for k, v in safetensors.torch.load_file(opts.path("models", "loras", INIT)).items() if ".lora_" in k}
    path, tensors, metadata = opts.saved_lora(entry, bf16)
    assert path == opts.path("output", "options", "sub", "bf16_kohya.safetensors")
    assert metadata["ss_save_dtype"] == "bf16" and metadata["ss_key_style"] == "kohya"
    kohya = {}
    for key, value in init.items():  # diffusion_model.double_blocks.0.x.lora_up.weight -> lora_unet_double_blocks_0_x...
        module, factor = key[len("diffusion_model."):].rsplit(".lora_", 1)
        kohya["lora_unet_" + module.replace(".", "_") + ".lora_" + factor] = value
    assert tensors.keys() >= kohya.keys()
    assert all(torch.equal(tensors[k], v.bfloat16()) for k, v in kohya.items())
    path, tensors, _ = opts.saved_lora(entry, fp16)
    assert path == opts.path("models", "loras", "options", "fp16_dm_00001_.safetensors")
    assert all(torch.equal(tensors[k], v.half()) for k, v in init.items())
    paths = entry["outputs"][state]["text"]
    assert len(paths) == 2 and paths[1].endswith(".trainstate") and os.path.isfile(paths[1])
    # overwrite: the same name again, now the LoRA with other values
    g, loader = base_graph()
    attach = g.add("PrecisionAttachLoRA", model=out(loader), **{**ATTACH, "seed": 3})
    again = g.add("PrecisionSaveLoRA", model=out(attach), filename_prefix="options/sub/bf16_kohya", folder="output",
                  save_dtype="bf16", key_style="kohya", use_counter=False, overwrite=True)
    path2, tensors2, _ = opts.saved_lora(opts.run(g), again)
    assert path2 == path.replace(opts.path("models", "loras", "options", "fp16_dm_00001_.safetensors"), path2)
    assert path2 == opts.path("output", "options", "sub", "bf16_kohya.safetensors")
    assert tensors2.keys() != kohya.keys() or any(not torch.equal(tensors2[k], v.bfloat16()) for k, v in kohya.items())


def _load(g: Graph, loader: str, name: str, **change) -> str:
    return g.add("PrecisionLoadLoRA", model=out(loader), lora_name=name, **{**LOAD, **change})


def test_load_lora_strength_modes_attention_and_formats(opts):
    # a LoRA whose file records a 2x softmax scale (attached on a patched model)
    g, loader = base_graph()
    patched = g.add("PrecisionPatchAttention", model=out(loader), backend="auto", scale_mode="multiplier",
                    scale_value=2.0, stable_beta=2.0, softclamp=0.0, fp32_softmax=False)
    attach = g.add("PrecisionAttachLoRA", model=out(patched), **{**ATTACH, "init_lora": INIT})
    g.add("PrecisionSaveLoRA", model=out(attach), filename_prefix="options/recorded", **{**SAVE, "use_counter": False})
    info = g.add("PreviewAny", source=out(loader, 1))
    head_dim = int(re.search(r"head_dim: (\d+)", opts.text(opts.run(g), info)).group(1))
    g, loader = base_graph()
    recorded = "options/recorded.safetensors"
    cases = {
        "base": out(loader),
        "fp32": out(_load(g, loader, INIT)), "zero": out(_load(g, loader, INIT, strength=0.0)),
        "half": out(_load(g, loader, INIT, strength=0.5)),
        "half_merge": out(_load(g, loader, INIT, strength=0.5, mode="merge")),
        "neg": out(_load(g, loader, INIT, strength=-1.0)),
        "recorded": out(_load(g, loader, "options/recorded.safetensors")),
        "ignore": out(_load(g, loader, "options/recorded.safetensors", attention="ignore")),
        "override": out(_load(g, loader, recorded, attention="override", override_backend="math",
                              override_scale_mode="multiplier", override_scale_value=2.0)),
        "override_sdpa": out(_load(g, loader, recorded, attention="override", override_backend="sdpa",
                                   override_scale_mode="multiplier", override_scale_value=2.0)),
        "override_abs": out(_load(g, loader, recorded, attention="override", override_backend="stable",
                                  override_scale_mode="absolute", override_scale_value=round(2 / head_dim ** 0.5, 4))),
        "peft": out(_load(g, loader, "options_peft.safetensors")),
        "stock_peft": out(g.add("LoraLoaderModelOnly", model=out(loader), lora_name="options_peft.safetensors",
                                strength_model=1.0)),
        "dora": out(_load(g, loader, "options_dora.safetensors", mode="merge")),
        "stock_dora": out(g.add("LoraLoaderModelOnly", model=out(loader), lora_name="options_dora.safetensors",
                                strength_model=1.0)),
    }
    saves = {k: sample(g, link, loader, k) for k, link in cases.items()}
    entry = opts.run(g)
    x = {k: opts.latent(entry, v) for k, v in saves.items()}
    base = x["base"]
    assert torch.equal(x["zero"], base)
    for key in ("fp32", "half", "neg", "recorded", "peft", "dora"):
        assert rel(x[key], base) > 1e-3, key
    assert rel(x["half_merge"], x["half"]) < 1e-4  # merged into the weights = applied unmerged
    assert rel(x["fp32"], x["half"]) > 1e-3 and rel(x["neg"], x["fp32"]) > 1e-3
    assert rel(x["ignore"], x["fp32"]) < 1e-5  # the same factors, without the recorded 2x scale
    assert rel(x["recorded"], x["ignore"]) > 1e-3 and rel(x["override"], x["recorded"]) < 1e-4
    assert rel(x["override_sdpa"], x["override"]) < 1e-4 and rel(x["override_abs"], x["override"]) < 1e-3
    assert rel(x["peft"], x["stock_peft"]) < 1e-4 and rel(x["dora"], x["stock_dora"]) < 1e-5


ADAPTER_KEYS = {"lokr": {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"},
                "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
                "dora": {"lora_down.weight", "lora_up.weight", "dora_scale", "alpha"}}


def _write_adapter_inits(base: str) -> dict[str, str]:
    """A non-zero LoKr (factor 4) / LoHa / DoRA on double block 0's attention, written by the pack's own set."""
    from lora.config import LoRAConfig
    from lora.file import lora_state_dict
    from lora.layer import LoRASet

    sd = safetensors.torch.load_file(os.path.join(base, "models", "diffusion_models", FLUX))
    paths = ("double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj")
    shapes = {p: (sd[p + ".weight"].shape[1], sd[p + ".weight"].shape[0]) for p in paths}
    names = {}
    for n, kind in enumerate(ADAPTER_KEYS):
        s = LoRASet(LoRAConfig(rank=4, alpha=4.0, adapter=kind, lokr_factor=4), shapes,
                    weights={p: sd[p + ".weight"].float() for p in paths})
        g = torch.Generator().manual_seed(n)
        with torch.no_grad():
            for name, t in s.named_parameters():
                if name.endswith("magnitude"):
                    t.mul_(1 + 0.05 * torch.randn(t.shape, generator=g))
                else:
                    t.add_(0.2 * torch.randn(t.shape, generator=g))
        names[kind] = f"options_init_{kind}.safetensors"
        save_lora_file(os.path.join(base, "models", "loras", names[kind]), lora_state_dict(s, "kohya"), {}, overwrite=True)
    return names


def test_attach_adapter_kinds_continue_save_and_sample_like_stock(opts):
    """Attach LoRA's adapter (lora named explicitly, lokr with lokr_factor 4, loha, dora) through /prompt, each
    continuing from a file of its kind: the model samples as stock ComfyUI's LoraLoaderModelOnly makes it with
    that file, and as the pack's Load LoRA does; the saved file holds the kind's stock keys, the file's values
    among them."""
    inits = _write_adapter_inits(opts.server.base_dir)
    g, loader = base_graph()
    base = sample(g, out(loader), loader, "adapter_base")
    cases, saves = {}, {}
    for kind, init in {"lora": INIT, **inits}.items():
        extra = {"lokr_factor": 4} if kind == "lokr" else {}
        node = g.add("PrecisionAttachLoRA", model=out(loader), **{**ATTACH, "adapter": kind, "init_lora": init, **extra})
        saves[kind] = g.add("PrecisionSaveLoRA", model=out(node), filename_prefix=f"options/adapter_{kind}", **SAVE)
        stock = g.add("LoraLoaderModelOnly", model=out(loader), lora_name=init, strength_model=1.0)
        cases[kind] = {"attached": sample(g, out(node), loader, f"adapter_{kind}"),
                       "stock": sample(g, out(stock), loader, f"adapter_stock_{kind}"),
                       "loaded": sample(g, out(_load(g, loader, init)), loader, f"adapter_loaded_{kind}")}
    entry = opts.run(g)
    plain = opts.latent(entry, base)
    for kind, ids in cases.items():
        x = {k: opts.latent(entry, v) for k, v in ids.items()}
        assert rel(x["stock"], plain) > 1e-3, kind
        assert rel(x["attached"], x["stock"]) < 1e-4 and rel(x["loaded"], x["stock"]) < 1e-4, kind
    for kind, init in inits.items():
        _, tensors, md = opts.saved_lora(entry, saves[kind])
        assert {k.split(".", 1)[1] for k in tensors} == ADAPTER_KEYS[kind]
        written = safetensors.torch.load_file(opts.path("models", "loras", init))
        assert written.keys() < tensors.keys()  # the file's two modules among the attention preset's
        assert all(torch.allclose(tensors[k], written[k], rtol=1e-6, atol=1e-7) for k in written), kind
        args = json.loads(md["ss_network_args"])
        assert args["adapter"] == kind and md["ss_network_module"] == "lycoris.kohya"
        assert args.get("factor") == (4 if kind == "lokr" else None)


LOCON_INIT = "options_init_locon.safetensors"
LOCON_CONVS = ("input_blocks.1.0.in_layers.2", "output_blocks.0.0.skip_connection")


def _write_locon_init(base: str) -> None:
    """A non-zero rank-4 LoCon on two of the tiny SDXL's res-block convs (3x3 and 1x1), by the pack's own set."""
    from lora.config import LoRAConfig
    from lora.file import lora_state_dict
    from lora.layer import LoRASet

    sd = safetensors.torch.load_file(os.path.join(base, "models", "diffusion_models", MODEL_FILES["sdxl"]))
    shapes = {p: (w.shape[1], w.shape[0], w.shape[2], w.shape[3]) for p in LOCON_CONVS for w in [sd[p + ".weight"]]}
    s = LoRASet(LoRAConfig(rank=4, alpha=4.0, adapter="locon"), shapes)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in s.parameters():
            t.add_(0.2 * torch.randn(t.shape, generator=g))
    save_lora_file(os.path.join(base, "models", "loras", LOCON_INIT), lora_state_dict(s, "diffusion_model"), {},
                   overwrite=True)


def test_attach_adapter_locon_on_a_tiny_sdxl_samples_like_stock(opts):
    """adapter=locon on a tiny SDXL file (ComfyUI's SDXL class, tests/comfy/test_locon.py has the in-process
    cases) through /prompt, continuing from a LoCon file: the model samples as stock LoraLoaderModelOnly makes it
    with that file and as the pack's Load LoRA does; the saved file holds the file's conv factors in stock's
    layout (down (4, in, kh, kw), up (out, 4, 1, 1)) among the res-block convs and the attention Linear layers."""
    _write_locon_init(opts.server.base_dir)
    g = Graph()
    loader = g.add("PrecisionLoadDiffusionModel", model_name=MODEL_FILES["sdxl"], weight_dtype="fp32")
    node = g.add("PrecisionAttachLoRA", model=out(loader), **{**ATTACH, "adapter": "locon", "init_lora": LOCON_INIT})
    save = g.add("PrecisionSaveLoRA", model=out(node), filename_prefix="options/adapter_locon_sdxl", **SAVE)
    stock = g.add("LoraLoaderModelOnly", model=out(loader), lora_name=LOCON_INIT, strength_model=1.0)
    ids = {"plain": sample(g, out(loader), loader, "locon_base"), "attached": sample(g, out(node), loader, "locon"),
           "stock": sample(g, out(stock), loader, "locon_stock"),
           "loaded": sample(g, out(_load(g, loader, LOCON_INIT)), loader, "locon_loaded")}
    entry = opts.run(g)
    x = {k: opts.latent(entry, v) for k, v in ids.items()}
    assert rel(x["stock"], x["plain"]) > 1e-3
    assert rel(x["attached"], x["stock"]) < 1e-4 and rel(x["loaded"], x["stock"]) < 1e-4
    _, tensors, md = opts.saved_lora(entry, save)
    written = safetensors.torch.load_file(opts.path("models", "loras", LOCON_INIT))
    assert written.keys() < tensors.keys() and all(torch.equal(tensors[k], written[k]) for k in written)
    up = tensors["diffusion_model.output_blocks.0.0.skip_connection.lora_up.weight"]
    assert tensors["diffusion_model.input_blocks.1.0.in_layers.2.lora_down.weight"].shape == (4, 32, 3, 3)
    assert up.shape[1:] == (4, 1, 1)
    assert any(".attn1.to_q." in k for k in tensors) and json.loads(md["ss_network_args"])["adapter"] == "locon"


def test_attach_adapter_locon_is_refused_on_a_model_without_res_block_convs(opts):
    """adapter=locon (LoRA plus the UNet's res-block Conv2d layers, tests/comfy/test_locon.py on a tiny SDXL) on
    the tiny Flux.1, which has no Conv2d: the prompt fails at Attach LoRA naming the input, its value and the fix,
    and nothing is saved."""
    g, loader = base_graph()
    node = g.add("PrecisionAttachLoRA", model=out(loader), **{**ATTACH, "adapter": "locon"})
    g.add("PrecisionSaveLoRA", model=out(node), filename_prefix="options/refused_locon", **SAVE)
    message = opts.failure(g)
    assert re.search(r"PrecisionAttachLoRA: input 'adapter'='locon' adds LoRA to a UNet's Conv2d layers, but this "
                     r"\S+ model has no res-block Conv2d layer: use adapter 'lora'", message), message
    folder = opts.path("models", "loras", "options")
    assert not any(n.startswith("refused_locon") for n in (os.listdir(folder) if os.path.isdir(folder) else ()))


def test_every_lora_option_went_through_the_server(opts):
    """Runs last: every input of this area's nodes took a non-default value in a prompt queued above, and every
    option of the pack's own option lists was sent (but kernels this host does not have)."""
    info = opts.server.object_info()
    assert coverage(info, AREAS["lora"], opts.sent) == ([], [])
    cannot_run = {name for name, reason in attention_backends().items() if reason is not None}
    assert unused_options(info, AREAS["lora"], opts.sent, cannot_run) == []
