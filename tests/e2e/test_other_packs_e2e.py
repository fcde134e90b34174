"""The pack beside the other packs users run, through a real server's /prompt: ComfyUI-KJNodes' attention-override
nodes that run on a CPU before and after Patch Attention, before Load LoRA (Precision) and without any pack
attention node, with Train LoRA and with KSampler; under ComfyUI's default CPU attention (the session server) and
under ``--use-pytorch-cross-attention`` (a second server of this module), where KJNodes' overrides reach SDPA,
which the pack's shim used to hand back to them (RecursionError).

The servers have ComfyUI-KJNodes and ComfyUI-GGUF installed (tests/other_packs.py). The other override here is
NABLA_AttentionKJ's (torch_compile off; its latent input only gives a video shape: for the tiny Flux.1's short
sequences it runs ComfyUI's ``optimized_attention``). KJNodes' GGUF loader, whose ``sdpa`` override is the other one
that runs on a CPU, does not load any model beside ComfyUI-GGUF 795e451 (it unpacks ``gguf_sd_loader``'s state
dict as a (state dict, metadata) pair: "too many values to unpack"), with or without this pack; its override
function itself is tested in process (tests/comfy/test_other_overrides.py). What must hold for every graph: it succeeds (no RecursionError anywhere in the log);
Train LoRA's saved LoRA says what ran (the pack's override on every attention call, the other override's calls as
the kernel, or the other override alone with ComfyUI's default scale); KSampler's latent equals the same graph
without the other override (it runs the same attention, with the pack's scale applied on top).
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from options_lib import ATTACH, LOAD, MODEL_FILES, SAVE, Graph, OptionsServer, out  # noqa: E402

pytestmark = pytest.mark.e2e

FLUX = MODEL_FILES["flux1_dev"]
HALF = dict(backend="auto", scale_mode="multiplier", scale_value=0.5, stable_beta=2.0, softclamp=0.0,
            fp32_softmax=False)
NABLA = "NABLA_AttentionKJ.patch.attention_override_nabla (ComfyUI-KJNodes, nodes/model_optimization_nodes.py)"
HEAD_DIM = 32  # tiny Flux.1


@pytest.fixture(scope="module")
def pytorch_server(tmp_path_factory):
    """A second server with the same packs, started with --use-pytorch-cross-attention."""
    import other_packs
    from server_harness import ComfyServer

    base = str(tmp_path_factory.mktemp("pytorch_attention_base"))
    other_packs.install(base)
    server = ComfyServer.start(base, extra_args=["--use-pytorch-cross-attention"])
    try:
        assert server.pack_import_errors() == []
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["default", "pytorch"])
def view(request, comfy_server):
    server = comfy_server if request.param == "default" else request.getfixturevalue("pytorch_server")
    assert "NABLA_AttentionKJ" in server.object_info(), "ComfyUI-KJNodes is not installed on the test server"
    v = OptionsServer.attach(server)
    yield v
    v.close()


def _model(g: Graph, placement: str, lora: str | None = None) -> str:
    """Load the tiny Flux.1 -> the pack's attention node and NABLA in the order ``placement`` names."""
    model = g.add("PrecisionLoadDiffusionModel", model_name=FLUX, weight_dtype="fp32")
    video = g.add("EmptyHunyuanLatentVideo", width=64, height=64, length=1, batch_size=1)

    def nabla(m: str) -> str:
        return g.add("NABLA_AttentionKJ", model=out(m), latent=out(video), window_time=11, window_width=3,
                     window_height=3, sparsity=0.9, torch_compile=False)

    def pack(m: str) -> str:
        if placement.endswith("load_lora"):
            return g.add("PrecisionLoadLoRA", model=out(m), lora_name=lora, **LOAD)
        return g.add("PrecisionPatchAttention", model=out(m), **HALF)

    if placement == "stock":
        return model
    if placement == "alone":
        return nabla(model)
    if placement == "none":
        return pack(model)
    if placement.startswith("before"):
        return pack(nabla(model))
    return nabla(pack(model))


def _train_graph(placement: str, name: str, lora: str | None = None) -> tuple[Graph, str]:
    g = Graph()
    model = _model(g, placement, lora)
    attach = g.add("PrecisionAttachLoRA", model=out(model), **ATTACH)
    cond = g.add("PrecisionDemoConditioning", model=out("1"), text="sks", seed=0, tokens=8)
    latent = g.add("PrecisionDemoLatent", model=out("1"), width=32, height=32, batch_size=1, seed=1)
    settings = g.add("PrecisionTrainSettings", **_settings())
    train = g.add("PrecisionTrainLoRA", model=out(attach), latents=out(latent), conditioning=out(cond),
                  settings=out(settings), steps=2, seed=0, name=name)
    save = g.add("PrecisionSaveLoRA", model=out(train), filename_prefix=f"other_packs/{name}", **SAVE)
    return g, save


def _settings() -> dict:
    from training.settings import TrainSettings

    return TrainSettings(learning_rate=1e-3, gradient_checkpointing=True).to_dict()


def _sample_graph(placement: str, name: str, lora: str | None = None) -> tuple[Graph, str]:
    g = Graph()
    model = _model(g, placement, lora)
    cond = g.add("PrecisionDemoConditioning", model=out("1"), text="a photo of sks", seed=0, tokens=8)
    latent = g.add("PrecisionDemoLatent", model=out("1"), width=64, height=64, batch_size=1, seed=1)
    ks = g.add("KSampler", model=out(model), positive=out(cond), negative=out(cond), latent_image=out(latent), seed=3,
               steps=2, cfg=1.0, sampler_name="euler", scheduler="simple", denoise=1.0)
    saved = g.add("SaveLatent", samples=out(ks), filename_prefix=f"other_packs/{name}")
    return g, saved


def _no_recursion(view) -> None:
    assert "RecursionError" not in view.server.log_text()


def _recorded_half(view) -> str:
    """A LoRA trained under Patch Attention at 0.5x (its file records the scale), as the LoRA lists name it."""
    trained, save = _train_graph("none", "recorded_half")
    return os.path.relpath(view.saved_lora(view.run(trained), save)[0], view.path("models", "loras"))


def test_train_lora_beside_nabla_in_every_order(view):
    """Train LoRA (checkpointed) with NABLA alone, before and after Patch Attention, and before Load LoRA
    (Precision) applying a file's 0.5x scale: each run succeeds and its LoRA says what ran."""
    lora = _recorded_half(view)
    graphs = {p: _train_graph(p, f"nabla_{p}", lora) for p in ("alone", "before", "after", "before_load_lora")}
    entries = view.run_all({p: g for p, (g, _) in graphs.items()})
    _no_recursion(view)
    md = {p: view.saved_lora(entries[p], graphs[p][1])[2] for p in graphs}
    assert md["alone"]["precision_lora_attention_other_override"] == NABLA
    assert float(md["alone"]["ss_attn_softmax_scale"]) == pytest.approx(1 / math.sqrt(HEAD_DIM))
    assert lora in md["before_load_lora"]["precision_lora_trained_over"]  # trained over the loaded LoRA
    for p in ("before", "after", "before_load_lora"):
        ours, total = map(int, md[p]["precision_lora_attention_calls"].split("/"))
        assert ours == total > 0, md[p]
        assert md[p]["precision_lora_attention_kept_override"] == f"{NABLA}: kernel, {ours} calls"
        assert float(md[p]["ss_attn_softmax_scale"]) == pytest.approx(0.5 / math.sqrt(HEAD_DIM))


def test_ksampler_beside_nabla_in_every_order(view):
    """KSampler after NABLA and Patch Attention (both orders), after NABLA and Load LoRA (Precision) applying a
    file's recorded 0.5x scale, and NABLA alone: each equals the same graph without NABLA."""
    lora = _recorded_half(view)
    placements = {"alone": "stock", "before": "none", "after": "none", "before_load_lora": "none_load_lora"}
    graphs = {p: _sample_graph(p, f"ks_{p}", lora) for p in placements}
    graphs.update({f"ref_{r}": _sample_graph(r, f"ks_ref_{r}", lora) for r in set(placements.values())})
    entries = view.run_all({k: g for k, (g, _) in graphs.items()})
    _no_recursion(view)
    latents = {k: view.latent(entries[k], node) for k, (_, node) in graphs.items()}
    for p, ref in placements.items():
        # NABLA runs ComfyUI's own attention function here: float32 kernel differences at most
        torch.testing.assert_close(latents[p], latents[f"ref_{ref}"], rtol=1e-4, atol=1e-4, msg=p)
    assert (latents["before"] - latents["ref_stock"]).abs().max() > 1e-3  # the half scale changed the output

