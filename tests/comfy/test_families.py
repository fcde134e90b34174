"""Every tiny image/video family of tests/families.py (ComfyUI's own classes) trains with the default preset,
its LoRA stock-loads with every key used, and the softmax scale reaches every attention call; the family
table (docs/families.md) is this test's output, checked on each host.

Per family, one test: the default preset (``targets="attention"``, rank 4) and the community / all presets
are planned on the real module paths; one stock forward's attention calls are counted (ComfyUI's attention
functions and direct SDPA calls) against the calls a patched model's override sees; the default LoRA
memorises one latent (noise and noise level fixed, so without learning the loss would not move; 20 steps at
lr 1e-2: the mean of the last 3 losses must be below 0.8x the first 3's) with the scale
patched to 1.25x, then its file's keys go through ComfyUI's own LoRA loader (what LoraLoaderModelOnly
does) with no key left over. The resulting row must equal this host's row in docs/families.md; run with
``PRECISION_LORA_WRITE_FAMILIES=1`` to write the row instead.
"""
from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

import families

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                   "families.md")
HEADER = ("| family (ComfyUI class) | preset family | attention (default) | attention_mlp | community | all "
          "| left out of all at rank 16 | scale reaches | trains on 0.33 | trains on 0.3.75 |")
RANK, STEPS = 4, 20


def _host_column() -> int:
    """Index of this host's "trains on" column (8: 0.33, 9: 0.3.75)."""
    import comfyui_version

    return 9 if comfyui_version.__version__.startswith("0.3.") else 8


def _plan_counts(pack_module, model, name: str) -> list[str]:
    targets = pack_module("lora.targets")
    glue = pack_module("nodes.lora.glue")
    linears, family = glue.linear_layers(model), glue.model_family(model)
    cells = [targets.preset_family(family)]
    # Derived from ComfyUI's classes, not from paths: every Linear held directly by a module whose class
    # ComfyUI names an attention module is in the default preset (CogVideoX has no such class: its blocks
    # hold q/k/v/attn_out themselves, lora/presets.py's cogvideox table). AttentionPool modules (Mochi's and
    # HunyuanDiT's text pooling, once per forward) are not the blocks' attention: presets leave them out. A
    # class named a block (Wan VACE's VaceWanAttentionBlock) is a transformer block: the Linears it holds
    # itself (VACE's zero-initialised before_proj / after_proj, the control branch's in / out) are not
    # attention projections; its attention modules are matched by their own classes.
    attention_owned = {f"{owner}.{child}" if owner else child
                       for owner, module in model.model.diffusion_model.named_modules()
                       if re.search(r"Attention|Attn", type(module).__name__)
                       and not re.search(r"Pool|Block$", type(module).__name__)
                       for child, sub in module.named_children() if isinstance(sub, torch.nn.Linear)}
    missing = attention_owned - set(targets.select_targets(linears, family, "attention"))
    assert not missing, f"{name}: the attention preset misses {sorted(missing)[:5]}"
    for preset in ("attention", "attention_mlp", "community", "all"):
        cells.append(str(len(targets.select_targets(linears, family, preset, rank=RANK))))
    narrow = targets.plan_targets(linears, family, "all", rank=16).narrow
    cells.append(", ".join(t.path for t in narrow) or "none")
    return cells


def _scale_reach(pack_module, model, name: str) -> str:
    glue = pack_module("nodes.attention.glue")
    config = pack_module("attention.config").AttentionConfig
    with families.count_attention_calls() as counts:
        families.denoise(model, name)
    patched = glue.patch_attention(model, config(collect_stats=True))
    families.denoise(patched, name)
    seen = glue.get_attention_stats(patched).total().calls
    total = counts["comfy"] + counts["sdpa"]
    unreached = patched.model_options["transformer_options"][glue.OVERRIDE_KEY].unreached()
    assert seen + sum(unreached.values()) == total, (seen, unreached, counts)
    return f"{seen}/{total}" + (f" ({', '.join(unreached)})" if unreached else "")


def _memorise(pack_module, model, name: str, steps: int = STEPS, **settings_kw) -> tuple[list[float], object]:
    """The default LoRA trained on one latent with fixed noise (test_train_memorise's method): losses, set."""
    lglue, tglue, tdata = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.train.data"))
    loop, lora, aglue = pack_module("training.loop"), pack_module("lora.config"), pack_module("nodes.attention.glue")
    settings = pack_module("training.settings").TrainSettings(learning_rate=1e-2, **settings_kw)
    config = pack_module("attention.config").AttentionConfig
    latent = {"samples": families.latent(model, frames=families.FRAMES.get(name, 1),
                                         size=families.PIXELS.get(name, 32))}
    cond = families.conditioning(name, training=True)
    with torch.inference_mode():
        model = aglue.patch_attention(model, config(scale_mode="multiplier", scale_value=1.25))
        attached = lglue.attach_lora(model, lora.LoRAConfig(rank=RANK, alpha=RANK))
        out, lora_set = tglue.fork_lora(attached)
        with tglue.training_session(out, lora_set, settings) as device:
            samples = tdata.build_samples(out, [latent], [cond], None, device)
            base = tglue.model_fns(out, lora_set, settings, device)
            fixed = torch.randn((1, *samples[0].latent.shape), generator=torch.Generator().manual_seed(3)).to(device)
            fns = dataclasses.replace(base, noise_latent=lambda s, n, x0: base.noise_latent(s, fixed, x0),
                                      target=lambda s, n, x0: base.target(s, fixed, x0),
                                      sigma_of_u=lambda u: base.sigma_of_u(torch.full_like(u, 0.5)))
            result = loop.train(lora_set, samples, fns, settings, steps, seed=0)
    lora_set.learning = result.learning  # the learning guard's line (default learning_guard "warn")
    return [p["loss"] for p in result.state.history], lora_set


def _stock_loads(pack_module, model, lora_set, caplog) -> None:
    """The saved keys through comfy.lora.load_lora with the model's key map: every key used, none warned."""
    import logging

    import comfy.lora

    lfile, lglue = pack_module("lora.file"), pack_module("nodes.lora.glue")
    tensors = lfile.lora_state_dict(lora_set, lfile.default_key_style(lglue.model_family(model)))
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(tensors, key_map)
    assert not [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(patches) == len(lora_set.adapters())


def _doc_rows() -> dict[str, list[str]]:
    if not os.path.exists(DOC):
        return {}
    rows = {}
    for line in open(DOC, encoding="utf-8"):
        if line.startswith("| ") and not line.startswith(("| family", "|---")):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


def _write_row(row: list[str], column: int) -> None:
    rows = _doc_rows()
    old = rows.get(row[0], [row[0]] + [""] * 9)
    merged = row[:8] + old[8:10] if len(old) >= 10 else row[:8] + ["", ""]
    merged[column] = row[column]
    rows[row[0]] = merged
    text = open(DOC, encoding="utf-8").read() if os.path.exists(DOC) else ""
    head = text.split(HEADER)[0] if HEADER in text else text
    lines = [HEADER, "|" + "---|" * 10] + ["| " + " | ".join(rows[k]) + " |" for k in sorted(rows)]
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(head + "\n".join(lines) + "\n")


@pytest.mark.parametrize("name", sorted(families.TINY))
def test_family_row(pack_module, name, caplog):
    reason = families.available(name)
    if reason is not None:
        pytest.skip(reason)
    model = families.build(name)
    row = [name, *_plan_counts(pack_module, model, name), _scale_reach(pack_module, model, name)]
    losses, lora_set = _memorise(pack_module, model, name)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, f"{name}: loss {first:.4f} -> {last:.4f}"
    # a healthy run: the learning guard names nothing (every factor that got a gradient moved)
    assert lora_set.learning.startswith(f"learning: ok over {min(STEPS, 20)} steps"), (name, lora_set.learning)
    _stock_loads(pack_module, model, lora_set, caplog)
    column = _host_column()
    row += ["", ""]
    row[column] = f"yes ({first:.3g} -> {last:.3g})"
    if os.environ.get("PRECISION_LORA_WRITE_FAMILIES"):
        _write_row(row, column)
    doc = _doc_rows().get(name)
    assert doc is not None, f"{name}: no row in docs/families.md (PRECISION_LORA_WRITE_FAMILIES=1 writes it)"
    assert doc[:8] == row[:8], f"{name}: docs/families.md says {doc[:8]}, this host gives {row[:8]}"
    assert re.fullmatch(r"yes \(.*\)", doc[column]), doc


@pytest.mark.parametrize("name", ["ErnieImage", "PixArtAlpha"])
def test_checkpointed_recomputation_keeps_the_patched_scale(pack_module, name):
    """Activation checkpointing recomputes blocks during the backward pass, after the forward (and its reach
    wrapper) returned; the training session keeps the reach shims on, so a family whose attention is reached
    only through them (ErnieImage, PixArt: attention without transformer_options) trains to the same LoRA with
    and without checkpointing at a 1.25x scale."""
    reason = families.available(name)
    if reason is not None:
        pytest.skip(reason)
    runs = []
    for checkpointing in (False, True):
        losses, lora_set = _memorise(pack_module, families.build(name), name, steps=3,
                                     gradient_checkpointing=checkpointing)
        runs.append((losses, {k: v.detach().clone() for k, v in lora_set.state_dict().items()}))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)
    for key, value in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][key], value, rtol=1e-5, atol=1e-7)
    assert not pack_module("nodes.attention.reach").installed()


ATTACH = dict(alpha=16.0, include="", exclude="", blocks="", fp32_accumulation=True, dropout=0.0, rank_dropout=0.0,
              module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0, init_lora="none", dry_run=True)


def test_dry_run_names_the_module_narrower_than_the_rank_and_include_still_errors(pack_module):
    """Krea2's text-fusion projector is (text layers) -> 1, 2 -> 1 here: preset "all" at rank 16 leaves it
    out with a report line; naming it in include is an error that names it (issue 25)."""
    import comfy_harness

    reason = families.available("Krea2")
    if reason is not None:
        pytest.skip(reason)
    attach = comfy_harness.node_class("PrecisionAttachLoRA")
    model = families.build("Krea2")
    info = attach.execute(model, rank=16, targets="all", **ATTACH).result[1]
    assert info.startswith("dry run: 55 layers\n")
    assert info.splitlines()[-1] == "left out (narrower than rank 16): txtfusion.projector  (2 -> 1)"
    with pytest.raises(ValueError, match=r"PrecisionAttachLoRA.*include='projector' names 'txtfusion\.projector' "
                                         r"\(2 -> 1\), narrower than rank=16: use rank <= 1"):
        attach.execute(model, rank=16, targets="attention", **{**ATTACH, "include": "projector"})


@pytest.mark.parametrize("name", ["SD15", "SDXL"])
def test_tiny_unet_gains_are_near_one_so_its_output_is_not_damped(pack_module, name):
    """The UNets name their GroupNorms by index (``out.0``, ``in_layers.0``): filled as biases (0.02) they scaled
    the eps prediction to std 0.019 and no LoRA lowered the memorisation loss by more than ~2 % (issue 25). The
    builder finds gains by class; every gain is near 1 and the prediction at the check's noise level is of the
    noise's order (same rule and settings as every row: no per-family setting)."""
    model = families.build(name)
    gains = [m.weight for m in model.model.diffusion_model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(gains) >= 10 and all((g - 1).abs().max() < 0.5 for g in gains)
    sigma = model.model.model_sampling.percent_to_sigma(0.5)
    x0 = families.latent(model)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))
    cond = families.conditioning(name)
    extra = {"y": model.model.encode_adm(pooled_output=cond[0][1]["pooled_output"])} if name == "SDXL" else {}
    with torch.no_grad():
        x_t = x0 + sigma * noise
        eps = (x_t - model.model.apply_model(x_t, torch.tensor([sigma]), c_crossattn=cond[0][0], **extra)) / sigma
    assert eps.std() > 0.2, f"{name}: eps prediction std {eps.std():.3f}"


@pytest.mark.parametrize("name,kind", [("SD20", "V_PREDICTION"), ("SD21UnclipL", "V_PREDICTION"),
                                       ("SD21UnclipH", "V_PREDICTION"), ("SD_X4Upscaler", "V_PREDICTION"),
                                       ("SD15_instructpix2pix", "EPS"), ("SDXLRefiner", "EPS")])
def test_unet_variants_predict_what_their_released_files_are_detected_as(name, kind):
    """SD 2.x's model_type reads a norm bias of the file (768-v and unCLIP files: v-prediction); the builder hands
    it that probe, so the SD20 / unCLIP rows train the v-prediction model ComfyUI loads, not an eps one (#25)."""
    import comfy.model_sampling as cms

    sampling = families.build(name).model.model_sampling
    assert isinstance(sampling, getattr(cms, kind))
    if kind == "EPS":
        assert not isinstance(sampling, cms.V_PREDICTION)


def test_lotus_is_refused_by_train_lora_by_name_and_the_scale_reaches_its_attention(pack_module):
    """LotusD (ComfyUI's depth / normal estimator on SD 2's UNet) predicts the depth latent from the image latent
    in one step (IMG_TO_IMG: x0-prediction, no noise in its input): not a denoising objective Train LoRA fits. It
    is no table row; its attention still takes the patched scale, and training it fails by name (#25)."""
    reason = families.available("LotusD")
    if reason is not None:
        pytest.skip(reason)
    model = families.build("LotusD")
    assert _scale_reach(pack_module, model, "LotusD") == "14/14"
    with pytest.raises(ValueError, match=r"PrecisionTrainLoRA: x0-prediction models are not supported for training"):
        _memorise(pack_module, model, "LotusD", steps=1)
