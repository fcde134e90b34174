"""A LoRA recorded with a backend that is not installed here loads with auto and the same scale."""
from __future__ import annotations

import logging

import torch

from attention.config import AttentionConfig
from models import make_conditioning, make_latent, tiny_flux1


def test_unavailable_recorded_backend_falls_back_to_auto_with_same_scale(pack_module, caplog):
    glue = pack_module("nodes.lora.glue")
    attn = pack_module("nodes.attention.glue")
    from attention.backends import available

    missing = next((n for n, r in available().items() if r is not None), None)
    assert missing is not None  # on this CPU machine flash / sage / xformers are not installed
    model = tiny_flux1()
    recorded = AttentionConfig(backend=missing, scale_mode="multiplier", scale_value=1.5)
    md = recorded.to_metadata(32)
    with caplog.at_level(logging.WARNING):
        patched, note = glue.apply_attention_policy(model, md, "apply_recorded", None, "demo.safetensors")
    cfg = attn.get_attention_config(patched)
    assert cfg.backend == "auto" and cfg.scale_mode == "multiplier" and cfg.scale_value == 1.5
    assert missing in note and "unavailable" in note
    assert any(missing in r.getMessage() and "unavailable" in r.getMessage() for r in caplog.records)
    # and it runs: same output as the same scale set by hand on auto
    by_hand = attn.patch_attention(model, AttentionConfig(scale_mode="multiplier", scale_value=1.5))
    latent = make_latent(model)["samples"]
    cond = make_conditioning(model)
    outs = []
    for m in (patched, by_hand, model):
        with torch.no_grad():
            outs.append(m.model.apply_model(latent, torch.tensor([0.6]), c_crossattn=cond[0][0],
                                            y=cond[0][1]["pooled_output"], guidance=torch.tensor([3.5]),
                                            transformer_options=m.model_options["transformer_options"]))
    assert torch.equal(outs[0], outs[1])
    assert not torch.allclose(outs[0], outs[2])  # the recorded scale really applies
