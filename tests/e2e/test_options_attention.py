"""Every option of Patch Attention, Probe, Resolution Buckets and the demo data nodes through a real server's
/prompt, asserted on outputs: sampled latents (softclamp, fp32 softmax, stable beta, absolute scale against
their controls), the probe's report, the buckets' images / texts / report, latent and image shapes. The
input-list nodes (Probe, Resolution Buckets) get every widget from a linked Primitive node, as the documented
wiring (LoadImageTextDataSetFromFolder -> Resolution Buckets) does. Tiny Flux.1 dev and Cosmos."""
from __future__ import annotations

import math
import os
import re
import sys

import pytest
import safetensors
import torch
from PIL import Image

from attention.backends import available as attention_backends

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from options_lib import (AREAS, INPUT_LIST_NODES, MODEL_FILES, Graph, OptionsServer, coverage, out,  # noqa: E402
                         pack_nodes, unused_options)

pytestmark = pytest.mark.e2e

FLUX = MODEL_FILES["flux1_dev"]
ATTACH = dict(rank=4, alpha=4.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
              dry_run=False, init_lora="none")
PATCH = dict(backend="auto", scale_mode="default", scale_value=1.0, stable_beta=2.0, softclamp=0.0, fp32_softmax=False)
DATA = "options_buckets"
# name: (width, height, colour); the caption of each image is its name
IMAGES = {"wide": (100, 60, (200, 30, 30)), "tall": (60, 100, (30, 200, 30)), "square": (80, 80, (30, 30, 200))}


MIXED = "options_mixed"  # a transparent PNG, an animated GIF (red, then blue), an image without caption
MASKS = "options_masks"  # m.png with m_mask.png (its left half white), n.png transparent in its bottom half


def _write_images(base: str) -> None:
    folder = os.path.join(base, "input", DATA)
    os.makedirs(folder, exist_ok=True)
    for name, (w, h, colour) in IMAGES.items():
        Image.new("RGB", (w, h), colour).save(os.path.join(folder, f"{name}.png"))
        with open(os.path.join(folder, f"{name}.txt"), "w") as f:
            f.write(name)
    mixed = os.path.join(base, "input", MIXED)
    os.makedirs(mixed, exist_ok=True)
    Image.new("RGBA", (16, 16), (255, 0, 0, 0)).save(os.path.join(mixed, "c_clear.png"))
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(os.path.join(mixed, "a_anim.gif"), save_all=True, append_images=frames[1:], duration=100, loop=0)
    Image.new("RGB", (16, 16), (0, 255, 0)).save(os.path.join(mixed, "b_nocap.png"))
    for name in ("a_anim", "c_clear"):
        with open(os.path.join(mixed, f"{name}.txt"), "w") as f:
            f.write(name)
    masks = os.path.join(base, "input", MASKS)
    os.makedirs(masks, exist_ok=True)
    Image.new("RGB", (64, 64), (200, 30, 30)).save(os.path.join(masks, "m.png"))
    left = Image.new("L", (64, 64), 0)
    left.paste(255, (0, 0, 32, 64))
    left.save(os.path.join(masks, "m_mask.png"))
    top = Image.new("RGBA", (64, 64), (30, 30, 200, 0))
    top.paste((30, 30, 200, 255), (0, 0, 64, 32))
    top.save(os.path.join(masks, "n.png"))
    for name in ("m", "n"):
        with open(os.path.join(masks, f"{name}.txt"), "w") as f:
            f.write(name)


@pytest.fixture(scope="module")
def opts(comfy_server):
    view = OptionsServer.attach(comfy_server, prepare=_write_images)
    yield view
    view.close()


def sample(g: Graph, model: list, loader: str, key: str, cond: dict | None = None, latent: dict | None = None) -> str:
    c = g.add("PrecisionDemoConditioning", model=out(loader), **{"text": "sks", "seed": 0, "tokens": 8, **(cond or {})})
    lat = g.add("PrecisionDemoLatent", model=out(loader), **{"width": 32, "height": 32, "batch_size": 1, "seed": 1,
                                                              **(latent or {})})
    ks = g.add("KSampler", model=model, positive=out(c), negative=out(c), latent_image=out(lat), seed=3, steps=2,
               cfg=1.0, sampler_name="euler", scheduler="simple", denoise=1.0)
    return g.add("SaveLatent", samples=out(ks), filename_prefix=f"options_attention/{key}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_patch_attention_options_change_what_they_should(opts):
    g = Graph()
    fp32 = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="fp32")
    bf16 = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="bf16")
    variants = {  # key: (loader, patch inputs)
        "math": (fp32, {"backend": "math"}),
        "clamp": (fp32, {"backend": "math", "softclamp": 0.5}),
        "clamp_stable": (fp32, {"backend": "stable", "softclamp": 0.5}),
        "loose": (fp32, {"backend": "math", "softclamp": 1000.0}),
        "stable4": (fp32, {"backend": "stable", "stable_beta": 4.0}),
        "mult": (fp32, {"backend": "sdpa", "scale_mode": "multiplier", "scale_value": 2.0}),
        "auto_mult": (fp32, {"backend": "auto", "scale_mode": "multiplier", "scale_value": 2.0}),
        "bf16": (bf16, {"backend": "sdpa"}), "bf16_fp32": (bf16, {"backend": "sdpa", "fp32_softmax": True}),
    }
    nodes, saved = {}, {}
    for key, (loader, change) in variants.items():
        patch = g.add("PrecisionPatchAttention", model=out(loader), **{**PATCH, **change})
        nodes[key] = (g.add("PreviewAny", source=out(patch, 1)), sample(g, out(patch), loader, key))
        if key in ("clamp_stable", "stable4", "bf16_fp32"):  # a LoRA attached there records the settings
            attach = g.add("PrecisionAttachLoRA", model=out(patch), **ATTACH)
            saved[key] = g.add("PrecisionSaveLoRA", model=out(attach), filename_prefix=f"options/attention_{key}",
                               folder="loras", save_dtype="fp32", key_style="auto", use_counter=True, overwrite=False)
    info = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="fp32")
    head_dim_text = g.add("PreviewAny", source=out(info, 1))
    entry = opts.run(g)
    head_dim = int(re.search(r"head_dim: (\d+)", opts.text(entry, head_dim_text)).group(1))
    g = Graph()  # the absolute scale equal to the 2x multiplier, in a prompt of its own
    loader = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="fp32")
    patch = g.add("PrecisionPatchAttention", model=out(loader), **{**PATCH, "backend": "math", "scale_mode": "absolute",
                                                                   "scale_value": round(2 / math.sqrt(head_dim), 6)})
    save = sample(g, out(patch), loader, "absolute")
    absolute = opts.latent(opts.run(g), save)
    x = {k: opts.latent(entry, v[1]) for k, v in nodes.items()}
    text = {k: opts.text(entry, v[0]) for k, v in nodes.items()}
    assert rel(x["clamp"], x["math"]) > 1e-3 and "softclamp: 0.5" in text["clamp"]
    assert rel(x["clamp_stable"], x["clamp"]) < 1e-4  # two kernels, one softclamp formula
    assert 0 < rel(x["loose"], x["math"]) < 1e-3  # a wide clamp barely touches these logits
    assert rel(x["stable4"], x["math"]) < 1e-4 and "stable beta: 4" in text["stable4"]  # beta: same maths in fp32
    assert rel(x["mult"], x["math"]) > 1e-3 and rel(absolute, x["mult"]) < 1e-4
    assert rel(x["auto_mult"], x["mult"]) < 1e-4
    assert "fp32 softmax: on" in text["bf16_fp32"]
    if torch.cuda.is_available():  # bf16 compute: the upcast changes the softmax
        assert not torch.equal(x["bf16_fp32"], x["bf16"])
    else:  # ComfyUI computes bf16 weights in fp32 on a CPU (manual cast): q, k, v are fp32 already
        assert torch.equal(x["bf16_fp32"], x["bf16"])
    md = {k: opts.saved_lora(entry, v)[2] for k, v in saved.items()}
    assert (md["clamp_stable"]["ss_attn_mode"], float(md["clamp_stable"]["ss_attn_softclamp"])) == ("stable", 0.5)
    assert float(md["stable4"]["ss_attn_stable_beta"]) == 4.0 and md["bf16_fp32"]["ss_attn_fp32_softmax"] == "true"


def test_probe_with_linked_widgets_reports_its_settings(opts):
    g = Graph()
    loader = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="fp32")
    cond = g.add("PrecisionDemoConditioning", model=out(loader), text="sks", seed=0, tokens=8)
    latent = g.add("PrecisionDemoLatent", model=out(loader), width=32, height=32, batch_size=1, seed=1)
    probes = {}
    for key, (noise, seed, rows) in {"a": (0.3, 4, 16), "b": (0.8, 4, 16), "c": (0.3, 9, 16)}.items():
        probes[key] = g.add("PrecisionProbe", model=out(loader), latent=out(latent), conditioning=out(cond),
                            noise_level=g.primitive(noise), seed=g.primitive(seed), max_rows=g.primitive(rows))
    entry = opts.run(g)
    report = {k: "\n".join(entry["outputs"][v]["text"]) for k, v in probes.items()}
    sigma = {k: float(re.search(r"sigma[ =:]+([0-9.eE+-]+)", r).group(1)) for k, r in report.items()}
    assert 0 < sigma["a"] < sigma["b"] < 1.5 and sigma["c"] == sigma["a"]  # flux: sigma rises with the level
    assert report["c"] != report["a"]  # another seed, other noise, other statistics


def _bucket_graph(g: Graph, resolution, multiple, max_upscale, model: list | None = None) -> dict:
    data = g.add("LoadImageTextDataSetFromFolder", folder=DATA)
    inputs = dict(images=out(data, 0), texts=out(data, 1), resolution=resolution, multiple=multiple,
                  max_upscale=max_upscale)
    if model is not None:
        inputs["model"] = model
    buckets = g.add("PrecisionResolutionBuckets", **inputs)
    return {"buckets": buckets, "save": g.add("SaveImage", images=out(buckets, 0), filename_prefix="options/bucket"),
            "texts": g.add("PreviewAny", source=out(buckets, 1)), "report": g.add("PreviewAny", source=out(buckets, 2))}


def _sizes_and_texts(opts, entry: dict, ids: dict) -> list[tuple[str, tuple[int, int]]]:
    images = entry["outputs"][ids["save"]]["images"]
    sizes = [Image.open(opts.path("output", i["subfolder"], i["filename"])).size for i in images]
    return list(zip(entry["outputs"][ids["texts"]]["text"], sizes))


def test_resolution_buckets_through_the_loader_with_linked_widgets(opts):
    g = Graph()
    cosmos = g.add("PrecisionLoadDiffusionModel", model_name=MODEL_FILES["cosmos"], weight_dtype="fp32")
    from_model = _bucket_graph(g, g.primitive(64), g.primitive(0), g.primitive(2.0), model=out(cosmos))
    g2 = Graph()
    set_here = _bucket_graph(g2, g2.primitive(96), g2.primitive(32), g2.primitive(1.5))
    entries = opts.run_all({"model": g, "set": g2})
    # 64^2 px in multiples of 16 (Cosmos: patch 2 x VAE 8): 100x60 -> 80x48, 60x100 -> 48x80, 80x80 -> 64x64
    assert sorted(_sizes_and_texts(opts, entries["model"], from_model)) == \
        [("square", (64, 64)), ("tall", (48, 80)), ("wide", (80, 48))]
    report = opts.text(entries["model"], from_model["report"])
    assert "3 images -> 3 buckets" in report and "from the model" in report
    # 96^2 px in multiples of 32: 128x64, 64x128, 96x96 (up to 1.28x upscaling, below max_upscale 1.5)
    assert sorted(_sizes_and_texts(opts, entries["set"], set_here)) == \
        [("square", (96, 96)), ("tall", (64, 128)), ("wide", (128, 64))]
    assert "multiple 32 px (set on the node)" in opts.text(entries["set"], set_here["report"])
    g = Graph()
    _bucket_graph(g, g.primitive(96), g.primitive(32), g.primitive(1.1))
    message = opts.failure(g)
    assert "PrecisionResolutionBuckets" in message and "max_upscale 1.1" in message


def _dataset(g: Graph, **change) -> dict:
    inputs = {"folder": MIXED, "alpha": "white", "animated": "first_frame", "missing_caption": "train_empty", **change}
    data = g.add("PrecisionLoadImageDataset", **inputs)
    return {"save": g.add("SaveImage", images=out(data, 0), filename_prefix="options/dataset"),
            "texts": g.add("PreviewAny", source=out(data, 1)), "report": g.add("PreviewAny", source=out(data, 2))}


def test_load_image_dataset_alpha_animation_and_missing_captions(opts):
    graphs = {alpha: Graph() for alpha in ("black", "gray")}
    ids = {alpha: _dataset(g, alpha=alpha) for alpha, g in graphs.items()}
    entries = opts.run_all(graphs)
    for alpha, level in (("black", 0), ("gray", 128)):
        images = entries[alpha]["outputs"][ids[alpha]["save"]]["images"]
        pixels = [Image.open(opts.path("output", i["subfolder"], i["filename"])).convert("RGB").getpixel((8, 8))
                  for i in images]
        # name order: the GIF's first frame, the image without caption, the transparent one on the background
        assert pixels[:2] == [(255, 0, 0), (0, 255, 0)] and abs(pixels[2][0] - level) <= 1 and \
            pixels[2][0] == pixels[2][1] == pixels[2][2], (alpha, pixels)
        assert entries[alpha]["outputs"][ids[alpha]["texts"]]["text"] == ["a_anim", "", "c_clear"]
    refused = {}
    for key, change in {"c_clear.png": {"alpha": "refuse"}, "a_anim.gif": {"animated": "refuse"},
                        "b_nocap.png": {"missing_caption": "refuse"}}.items():
        g = Graph()
        _dataset(g, **change)
        refused[key] = opts.failure(g)
    for name, message in refused.items():
        assert "PrecisionLoadImageDataset" in message and name in message, (name, message)


def test_dataset_masks_follow_their_images_into_training(opts):
    """Load Image Dataset's mask (files, alpha, none) through /prompt: its masks, through Resolution Buckets' masks
    (cropped as their images), saved as images (ComfyUI's MaskToImage) show the mask file's left half and the
    alpha channel's top half; given to Train LoRA's mask they train the two demo samples masked (the saved LoRA's
    metadata)."""
    g = Graph()
    ids = {}
    for how in ("files", "alpha", "none"):
        data = g.add("PrecisionLoadImageDataset", folder=MASKS, alpha="white", animated="first_frame",
                     missing_caption="train_empty", mask=how)
        ids[how] = g.add("PrecisionResolutionBuckets", images=out(data, 0), texts=out(data, 1), resolution=64,
                         multiple=16, max_upscale=2.0, masks=out(data, 3))
        ids[how + "_save"] = g.add("SaveImage", images=out(g.add("MaskToImage", mask=out(ids[how], 3))),
                                   filename_prefix=f"options/masks_{how}")
    model = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="fp32")
    attach = g.add("PrecisionAttachLoRA", model=out(model), **ATTACH)
    cond = g.add("PrecisionDemoConditioning", model=out(model), text="sks", seed=0, tokens=8)
    latent = g.add("PrecisionDemoLatent", model=out(model), width=64, height=64, batch_size=2, seed=1)
    train = g.add("PrecisionTrainLoRA", model=out(attach), latents=out(latent), conditioning=out(cond), steps=1,
                  seed=0, name="options_masks", mask=out(ids["files"], 3))
    save = g.add("PrecisionSaveLoRA", model=out(train), filename_prefix="options/options_masks", folder="loras",
                 save_dtype="fp32", key_style="auto", use_counter=True, overwrite=False)
    entry = opts.run_all({"g": g})["g"]
    shown = {}
    for how in ("files", "alpha", "none"):
        images = entry["outputs"][ids[how + "_save"]]["images"]
        shown[how] = [Image.open(opts.path("output", i["subfolder"], i["filename"])).convert("L") for i in images]
    files, alpha = shown["files"], shown["alpha"]
    assert [files[0].getpixel(p) for p in ((8, 32), (56, 32))] == [255, 0]  # m_mask.png: the left half
    assert [files[1].getpixel(p) for p in ((8, 8), (56, 56))] == [255, 255]  # n.png has no mask file: whole
    assert [alpha[1].getpixel(p) for p in ((32, 8), (32, 56))] == [255, 0]  # n.png's opaque top half
    assert [alpha[0].getpixel(p) for p in ((8, 8), (56, 56))] == [255, 255]  # m.png is opaque
    assert all(im.getextrema() == (255, 255) for im in shown["none"])  # none: whole-image masks
    with safetensors.safe_open(entry["outputs"][save]["text"][0], "pt") as f:
        assert f.metadata()["precision_lora_mask"] == "2 of 2 samples masked, unmasked_weight 0"


def test_demo_nodes_shape_their_outputs(opts):
    g = Graph()
    loader = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="fp32")
    keys = {"base": ({}, {}), "text": ({"text": "a cat"}, {}), "seed": ({"seed": 3}, {}), "tokens": ({"tokens": 5}, {}),
            "latent": ({}, {"width": 48, "height": 32, "batch_size": 2, "seed": 5})}
    saves = {k: sample(g, out(loader), loader, k, cond, lat) for k, (cond, lat) in keys.items()}
    latent = g.add("PrecisionDemoLatent", model=out(loader), width=48, height=32, batch_size=2, seed=5)
    preview = g.add("PrecisionDemoPreview", samples=out(latent))
    image = g.add("SaveImage", images=out(preview), filename_prefix="options/demo_preview")
    entry = opts.run(g)
    x = {k: opts.latent(entry, v) for k, v in saves.items()}
    assert x["base"].shape == (1, 16, 4, 4) and x["latent"].shape == (2, 16, 4, 6)  # Flux.1: 8 px per latent cell
    for key in ("text", "seed", "tokens"):
        assert rel(x[key], x["base"]) > 1e-3, key
    files = entry["outputs"][image]["images"]
    assert [Image.open(opts.path("output", f["subfolder"], f["filename"])).size for f in files] == [(48, 32)] * 2


def test_the_areas_cover_every_pack_node(opts):
    """The option modules (and test_dataset_cache_e2e.py, area "dataset") split the pack's nodes between them:
    together they cover all the server lists, each node once, so a new node needs a case. The input-list
    nodes whose widgets must come through links are the ones the host says (where it says)."""
    nodes = pack_nodes(opts.server.object_info())
    covered = [n for area in AREAS.values() for n in area]
    assert len(nodes) >= 15 and set(nodes) == set(covered) and len(covered) == len(set(covered)), sorted(nodes)
    if any("is_input_list" in v for v in nodes.values()):  # 0.33; 0.3.75's /object_info has no such flag
        assert {n for n, v in nodes.items() if v["is_input_list"]} == INPUT_LIST_NODES


def test_every_attention_option_went_through_the_server(opts):
    """Runs last: every input of this area's nodes took a non-default value in a prompt queued above, and
    every widget of the input-list nodes (Probe, Resolution Buckets) came through a link; every option of the
    pack's own option lists was sent (but kernels this host does not have)."""
    info = opts.server.object_info()
    assert coverage(info, AREAS["attention"], opts.sent) == ([], [])
    cannot_run = {name for name, reason in attention_backends().items() if reason is not None}
    assert unused_options(info, AREAS["attention"], opts.sent, cannot_run) == []
