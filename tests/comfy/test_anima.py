"""Anima (ComfyUI 0.33+): load with either loader, patch attention, attach, train, save, load in stock ComfyUI.

The test model is ComfyUI's real Anima class: the tiny Cosmos-Predict2 DiT of the other tests (192 channels,
10 blocks, ~15 M parameters) plus the LLM adapter at its one real size (1024 wide, 6 layers, ~135 M
parameters). The adapter is kept full size because ComfyUI builds it at that fixed size whatever the file
holds: the stock ``UNETLoader`` cannot load a shrunken one, and the stock loader is what a user's graph and
the "loads in stock ComfyUI" checks need. One fp32 file (~600 MB) is written once for the module; both
loaders read it. Conditioning carries ``t5xxl_ids`` / ``t5xxl_weights`` as ComfyUI's Anima text encoder
writes them, so the adapter runs in every training forward (ComfyUI runs it inside the model outside
inference mode). On ComfyUI 0.3.75, which has no Anima, every test that needs the model skips with that
reason. Measured figures for docs/anima.md: run with ``-o log_cli=true --log-cli-level=INFO``.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import os

import pytest
import torch

from models import denoise, make_conditioning, make_latent, randomize_lora, tiny_anima_text_encoder, write_model_file
from tests.comfy.test_attention_coverage import SCALE_TOL, reference_forward
from tests.comfy.test_train_memorise import _eval_loss

log = logging.getLogger(__name__)

FILE = "test_anima_tiny.safetensors"
SCALE = 1.25  # multiplier of 1/sqrt(head_dim) the trained LoRA uses
ATTACH = dict(alpha=8.0, include="", exclude="", blocks="", fp32_accumulation=True, dropout=0.0, rank_dropout=0.0,
              module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0, init_lora="none", dry_run=False)
SAVE = dict(folder="loras", save_dtype="fp32", key_style="auto", use_counter=False, overwrite=True)
ADAPTER = r"llm_adapter\..*"


def node(node_id: str):
    import comfy_harness

    return comfy_harness.node_class(node_id)


@pytest.fixture(scope="module", autouse=True)
def one_thread_for_the_module():
    """As conftest's ``one_thread``, for the module-scoped fixtures that train too (they run before it)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def model_file(pack, pack_module):
    import folder_paths

    reason = pack_module("demo.tiny_models").anima_unavailable()
    if reason:
        pytest.skip(reason)
    path = os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], FILE)
    write_model_file("anima", path)
    yield FILE
    os.remove(path)  # 600 MB; the test base directory outlives the run


@pytest.fixture(scope="module")
def stock(model_file):
    import comfy.sd
    import folder_paths

    # UNETLoader's function with the dtype pinned: its "default" is bf16 on a bf16 GPU (issue #27, defect 4)
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        return comfy.sd.load_diffusion_model(folder_paths.get_full_path_or_raise("diffusion_models", model_file),
                                             model_options={"dtype": torch.float32})


@pytest.fixture(scope="module")
def ours(model_file):
    with torch.inference_mode():
        return node("PrecisionLoadDiffusionModel").execute(model_name=model_file, weight_dtype="fp32").args


@pytest.fixture(scope="module")
def mods(pack_module):
    class M:
        glue = pack_module("nodes.lora.glue")
        aglue = pack_module("nodes.attention.glue")
        tglue = pack_module("nodes.train.glue")
        tdata = pack_module("nodes.train.data")
        lora = pack_module("lora.config")
        AttentionConfig = pack_module("attention.config").AttentionConfig
        Settings = pack_module("training.settings").TrainSettings
    return M


def lora_name(path: str) -> str:
    import folder_paths

    return os.path.relpath(path, folder_paths.get_folder_paths("loras")[0]).replace(os.sep, "/")


def patch(model, backend: str = "sdpa", multiplier: float = SCALE):
    return node("PrecisionPatchAttention").execute(model, backend=backend, scale_mode="multiplier",
                                                  scale_value=multiplier, stable_beta=2.0, softclamp=0.0,
                                                  fp32_softmax=False).result[0]


def attach(model, targets: str, include: str = "", rank: int = 8):
    return node("PrecisionAttachLoRA").execute(model, rank=rank, targets=targets, **{**ATTACH, "include": include}).result[0]


def train(model, latent, cond, steps: int, settings):
    with torch.inference_mode():
        return node("PrecisionTrainLoRA").execute([model], [latent], [cond], [steps], [0], ["anima"],
                                                  settings=[settings]).result[:4]


def stock_patches(model, path: str, caplog, keep=lambda key: True):
    """comfy.lora.load_lora with the model's key map (what LoraLoaderModelOnly does): (patches, warnings)."""
    import comfy.lora
    import comfy.utils

    tensors = {k: v for k, v in comfy.utils.load_torch_file(path).items() if keep(k)}
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(tensors, key_map)
    return patches, [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]


def with_patches(model, patches):
    out = model.clone()
    out.add_patches(patches, 1.0)
    return out


def test_model_info_route_reads_anima_heads_from_the_header(model_file, pack_module):
    """GET /precision_lora/model/info (what Patch Attention's scale display asks): heads default to
    MiniTrainDIT's for Anima files too (they were left out, so the display showed no scale)."""
    import folder_paths

    info = pack_module("nodes.model.info").describe_file(folder_paths.get_full_path("diffusion_models", model_file))
    assert (info["family"], info["heads"], info["head_dim"]) == ("anima", 16, 12)
    assert info["default_scale"] == pytest.approx(12 ** -0.5)


def test_both_loaders_give_the_same_anima_with_the_full_adapter(stock, ours):
    model, info = ours
    assert type(stock.model).__name__ == type(model.model).__name__ == "Anima"
    assert "family: anima (Anima)" in info and "head_dim: 12" in info and "attention heads: 16" in info
    adapter = sum(p.numel() for p in model.model.diffusion_model.llm_adapter.parameters())
    assert 130e6 < adapter < 140e6  # the size ComfyUI builds (and the stock loader needs)
    a, b = stock.model.diffusion_model.state_dict(), model.model.diffusion_model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)
    torch.testing.assert_close(denoise(stock), denoise(model), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained(ours, mods, pack_module):
    """Load (ours) → PatchAttention (sdpa, 1.25/sqrt(d)) → AttachLoRA → TrainLoRA 50 steps → SaveLoRA, and the
    loss on fixed evaluation draws before and after (test_train_memorise's measure)."""
    base = patch(ours[0])
    latent, cond = make_latent(base, 1, width=32, height=32), make_conditioning(base, 1)
    settings = mods.Settings(learning_rate=2e-3)
    with torch.inference_mode():
        attached = attach(base, "attention_mlp")
    before = _eval_loss(pack_module, attached, latent, cond, settings)
    model, _state, losses, steps = train(attached, latent, cond, 50, settings)
    after = _eval_loss(pack_module, model, latent, cond, settings)
    with torch.inference_mode():
        path = node("PrecisionSaveLoRA").execute(model, "anima/trained", **SAVE).result[0]
    return {"model": model, "path": path, "before": before, "after": after, "steps": steps, "losses": losses}


def test_training_halves_the_loss_on_fixed_draws_within_50_steps(trained):
    assert trained["steps"] == 50 and all(math.isfinite(v) for v in trained["losses"]["loss"])
    log.info("[Precision LoRA] tiny Anima, 50 steps: loss on 16 fixed draws %.4f -> %.4f (x%.3f)",
             trained["before"], trained["after"], trained["after"] / trained["before"])
    assert trained["after"] <= 0.5 * trained["before"], f"{trained['before']:.4f} -> {trained['after']:.4f}"


def test_saved_lora_records_the_scale_and_loads_in_stock_comfyui(trained, stock, mods, caplog):
    import nodes as comfy_nodes
    from lora.file import read_lora_file

    tensors, md = read_lora_file(trained["path"])
    assert float(md["ss_attn_softmax_scale"]) == pytest.approx(SCALE / math.sqrt(12), rel=1e-6)
    assert md["ss_attn_mode"] == "sdpa" and md["ss_base_model_version"] == "anima"
    adapters = mods.glue.get_lora_set(trained["model"]).adapters()
    assert len(tensors) == 3 * len(adapters) and all(k.startswith("diffusion_model.blocks.") for k in tensors)
    patches, warnings = stock_patches(stock, trained["path"], caplog)
    assert warnings == [] and set(patches) == {f"diffusion_model.{p}.weight" for p in adapters}
    with caplog.at_level(logging.WARNING):
        loaded = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(stock, lora_name(trained["path"]), 1.0)[0]
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    plain, merged = denoise(patch(stock)), denoise(patch(loaded))
    assert (merged - plain).abs().max() > 1e-2 * plain.abs().max()  # the LoRA changes the output
    torch.testing.assert_close(merged, denoise(trained["model"]), rtol=1e-4, atol=1e-4)


class SdpaSpy:
    """Stands in for ``torch.nn.functional`` inside comfy.ldm.anima.model: counts the adapter's direct
    ``scaled_dot_product_attention`` calls (ComfyUI's attention functions and the override never see them)."""

    def __init__(self) -> None:
        self.calls = 0

    def scaled_dot_product_attention(self, *args, **kwargs):
        self.calls += 1
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)


def test_scale_reaches_every_attention_call_the_adapter_included(ours, mods, monkeypatch):
    """DiT attention: every call goes through the override. LLM adapter: it calls
    F.scaled_dot_product_attention itself, and while sampling ComfyUI runs it in ``Anima.extra_conds``
    (outside apply_model, once per prompt); Patch Attention's injection on the clone
    (``nodes/attention/reach.py: ConditioningInjection``) hands those calls to the override too. All 44 calls of
    one sampler step (20 DiT + 2 prompts x 12 adapter) take the scale, as a reference forward at that scale
    computes them, and the adapter's output changes with it."""
    import comfy.ldm.anima.model as anima_model
    from comfy.ldm.cosmos.predict2 import Attention as DitAttention

    model = ours[0]
    dm = model.model.diffusion_model
    dit_layers = sum(isinstance(m, DitAttention) for m in dm.modules())
    adapter_layers = sum(isinstance(m, anima_model.Attention) for m in dm.llm_adapter.modules())
    spy, adapter_out = SdpaSpy(), []
    monkeypatch.setattr(anima_model, "F", spy)
    hook = dm.llm_adapter.register_forward_hook(lambda m, args, out: adapter_out.append(out.detach().clone()))
    try:
        with reference_forward(multiplier=2.0) as ref:  # the adapter's direct SDPA calls at 2x too
            expected = denoise(model)
        runs = len(adapter_out)
        patched = mods.aglue.patch_attention(model, mods.AttentionConfig(backend="sdpa", scale_mode="multiplier",
                                                                         scale_value=2.0, collect_stats=True))
        got = denoise(patched)
        default = denoise(model)
    finally:
        hook.remove()
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert (dit_layers, adapter_layers, runs) == (20, 12, 2) and ref.calls == dit_layers + runs * adapter_layers
    assert mods.aglue.get_attention_stats(patched).total().calls == ref.calls == 44 and override.unreached() == {}
    assert spy.calls == 3 * runs * adapter_layers and len(adapter_out) == 3 * runs
    reference, scaled, stock = adapter_out[:runs], adapter_out[runs:2 * runs], adapter_out[2 * runs:]
    assert all(torch.equal(a, b) for a, b in zip(stock, stock[1:]))
    for ref_out, out, plain in zip(reference, scaled, stock):  # the scale reached the adapter
        assert (out - ref_out).abs().max() < SCALE_TOL * ref_out.abs().max()
        assert (out - plain).abs().max() > 100 * SCALE_TOL * plain.abs().max()
    err = (got - expected).abs().max().item() / expected.abs().max().item()
    assert err < SCALE_TOL, f"relative error {err:.2e} against the reference forward at 2x scale"
    assert (default - expected).abs().max().item() > 100 * SCALE_TOL * expected.abs().max().item()
    assert "extra_conds" not in vars(model.model)  # ejected: the source model samples with its own
    # a copy of the patched clone on another model (ComfyUI's deep copies) wraps that model's own extra_conds
    other = copy.copy(model.model)
    injection = patched.get_injections("precision_lora_attention_reach")[0]
    injection.inject(type("Patcher", (), {"model": other})())
    assert other.extra_conds.extra_conds.__self__ is other
    injection.eject(type("Patcher", (), {"model": other})())
    assert "extra_conds" not in vars(other)


def test_training_forward_sends_the_adapter_calls_to_the_override_too(ours, mods):
    """Outside inference mode (a training step) the adapter runs inside the model's forward: its 12 direct SDPA
    calls reach the override there as well, so training and sampling use the same adapter attention."""
    base = mods.aglue.patch_attention(ours[0], mods.AttentionConfig(backend="sdpa", scale_mode="multiplier",
                                                                    scale_value=1.25, collect_stats=True))
    with torch.inference_mode():
        model, lora_set = mods.tglue.fork_lora(attach(base, "attention", rank=4))
    latent, cond = make_latent(base, 1, width=32, height=32), make_conditioning(base, 1)
    settings = mods.Settings()
    stats = mods.aglue.get_attention_stats(model)
    with torch.inference_mode(), mods.tglue.training_session(model, lora_set, settings) as device:
        (sample,) = mods.tdata.build_samples(model, [latent], [cond], None, device)
        fns = mods.tglue.model_fns(model, lora_set, settings, device)
        x0 = sample.latent[None]
        noise, sigma = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0.6])
        before = stats.total().calls
        pred = fns.predict(fns.noise_latent(sigma, noise, x0), sigma, fns.collate([sample.cond]))
        calls = stats.total().calls - before
        pred.square().mean().backward()
    assert calls == 20 + 12  # DiT + the adapter, run inside this forward
    assert model.model_options["transformer_options"]["optimized_attention_override"].unreached() == {}


def test_presets_leave_the_adapter_out_and_include_adds_it(ours, mods):
    """The Cosmos presets match ``blocks\\.\\d+\\..+`` (fullmatch): never ``llm_adapter.blocks...``."""
    model = ours[0]
    for preset in ("attention", "attention_mlp", "all"):
        chosen = mods.glue.plan_targets(model, mods.lora.LoRAConfig(rank=4, targets=preset))
        assert chosen and not [p for p in chosen if p.startswith("llm_adapter.")], preset
    chosen = mods.glue.plan_targets(model, mods.lora.LoRAConfig(rank=4, targets="attention", include=ADAPTER))
    adapter = sorted(p for p in chosen if p.startswith("llm_adapter."))
    # 6 blocks x (self q,k,v,o + cross q,k,v,o + 2 MLP) + out_proj; the embedding is not a Linear
    assert len(adapter) == 61 and "llm_adapter.out_proj" in adapter and "llm_adapter.blocks.5.mlp.2" in adapter


@pytest.fixture(scope="module")
def adapter_lora(stock, mods):
    """From the stock UNETLoader: attention preset + include=llm_adapter, trained 4 steps, saved."""
    base = stock
    latent, cond = make_latent(base, 1, width=32, height=32), make_conditioning(base, 1)
    with torch.inference_mode():
        attached = attach(base, "attention", include=ADAPTER, rank=4)
    model, *_ = train(attached, latent, cond, 4, mods.Settings(learning_rate=1e-2))
    with torch.inference_mode():
        path = node("PrecisionSaveLoRA").execute(model, "anima/adapter", **SAVE).result[0]
    return model, path


def test_adapter_layers_train_and_stock_comfyui_loads_their_keys(adapter_lora, stock, mods, caplog):
    model, path = adapter_lora
    adapters = mods.glue.get_lora_set(model).adapters()
    untrained = [p for p, a in adapters.items() if p.startswith("llm_adapter.") and not a.up.abs().sum() > 0]
    assert untrained == []  # every adapter layer got gradients through the DiT's cross-attention
    patches, warnings = stock_patches(stock, path, caplog)
    assert warnings == [] and set(patches) == {f"diffusion_model.{p}.weight" for p in adapters}
    only_adapter, warnings = stock_patches(stock, path, caplog, keep=lambda k: ".llm_adapter." in k)
    assert warnings == [] and len(only_adapter) == 61
    plain = denoise(stock)
    changed = denoise(with_patches(stock, only_adapter))  # the adapter runs once, in extra_conds, when sampling
    assert (changed - plain).abs().max() > 1e-3 * plain.abs().max()
    torch.testing.assert_close(denoise(with_patches(stock, patches)), denoise(model), rtol=1e-4, atol=1e-4)


def test_no_in_place_residual_adds_in_the_dit_or_the_adapter(ours, mods):
    """Anima is in nodes.train.glue.CLEAN_FAMILIES (plain autograd, no saved-tensor copies). Autograd raises when a
    tensor it saved is later modified in place, so a plain backward through DiT and adapter that runs, and
    gives the same gradients as one with every saved tensor copied, shows there is no such add."""
    from training.grad import clone_saved_tensors

    base = ours[0]
    with torch.inference_mode():
        attached = attach(base, "all", include=ADAPTER, rank=4)
        model, lora_set = mods.tglue.fork_lora(attached)
    assert not mods.tglue.needs_in_place_fix(model)
    latent, cond = make_latent(base, 1, width=32, height=32), make_conditioning(base, 1)
    settings = mods.Settings()
    grads = []
    with torch.inference_mode(), mods.tglue.training_session(model, lora_set, settings) as device:
        (sample,) = mods.tdata.build_samples(model, [latent], [cond], None, device)
        fns = mods.tglue.model_fns(model, lora_set, settings, device)
        gen = torch.Generator().manual_seed(0)
        x0, noise = sample.latent[None], torch.randn((1, *sample.latent.shape), generator=gen)
        sigma = torch.tensor([0.6])
        randomize_lora(lora_set, seed=5)  # a zero up factor would give the down factors no gradient
        for saving in (contextlib.nullcontext, clone_saved_tensors):
            with saving():
                pred = fns.predict(fns.noise_latent(sigma, noise, x0), sigma, fns.collate([sample.cond]))
            (pred - fns.target(sigma, noise, x0)).pow(2).mean().backward()
            grads.append({(p, f): getattr(a, f).grad.clone() for p, a in lora_set.adapters().items()
                          for f in ("down", "up")})
            lora_set.zero_grad(set_to_none=True)
    plain, copied = grads
    assert sum(p.startswith("llm_adapter.") for p, _ in plain) == 2 * 61
    assert all(torch.equal(plain[k], copied[k]) for k in plain)
    assert all(g.abs().sum() > 0 for g in plain.values())


def test_the_tiny_anima_family_names_the_comfyui_it_needs(pack_module):
    """Runs on every host: where ComfyUI has no Anima (0.3.75) the family refuses with the reason."""
    tiny = pack_module("demo.tiny_models")
    reason = tiny.anima_unavailable()
    if reason is None:
        config = tiny.unet_config_for("anima")
        assert config["image_model"] == "anima" and config["model_channels"] == 192 and config["num_blocks"] == 10
    else:
        with pytest.raises(ValueError, match=rf"'anima': {reason}; use ComfyUI 0\.33 or newer"):
            tiny.unet_config_for("anima")


def test_tiny_qwen3_text_encoder_gives_a_conditioning_that_trains(stock, mods):
    """ComfyUI's text-encoder loader (with CLIPLoader's default type, stable_diffusion) detects a
    Qwen3-0.6B-shaped encoder and builds Anima's, whose CONDITIONING carries the T5 ids (as the T5 tokenizer
    gives them) and weights that the adapter maps; a LoRA trains on that conditioning."""
    import nodes as comfy_nodes

    clip = tiny_anima_text_encoder()
    assert type(clip.cond_stage_model).__module__ == "comfy.text_encoders.anima"
    with torch.inference_mode():
        (cond,) = comfy_nodes.CLIPTextEncode().encode(clip, "a photo of sks")
    context, extra = cond[0]
    t5_ids = [t for t, _w in clip.tokenize("a photo of sks")["t5xxl"][0]]
    assert context.shape[0] == 1 and context.shape[2] == 1024
    assert extra["t5xxl_ids"].tolist() == t5_ids and extra["t5xxl_ids"].dtype == torch.int32
    assert torch.equal(extra["t5xxl_weights"], torch.ones(len(t5_ids)))
    with torch.inference_mode():
        attached = attach(stock, "attention", rank=4)
    model, _state, losses, steps = train(attached, make_latent(stock, 1, width=32, height=32), cond, 3,
                                         mods.Settings(learning_rate=1e-2))
    assert steps == 3 and all(math.isfinite(v) for v in losses["loss"])
    assert all(a.up.abs().sum() > 0 for a in mods.glue.get_lora_set(model).adapters().values())
