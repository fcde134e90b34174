"""Conditioning that does not fit the model is named with the widths and the encoder the family needs
(issue 14 item 6), and per-row extras are split without cutting shared 1-D ones."""
from __future__ import annotations

import pytest
import torch

from models import make_conditioning, tiny_cosmos, tiny_flux1


@pytest.fixture(scope="module")
def env(pack_module):
    class E:
        td = pack_module("nodes.train.data")
        checks = pack_module("nodes.model.data_checks")
        flux, cosmos = tiny_flux1(), tiny_cosmos()
    return E


def test_a_text_encoder_of_the_wrong_width_names_both_widths_and_the_encoder(env):
    """A CLIP-L-only conditioning (154 tokens x 768) into Flux.1 failed with "mat1 and mat2 shapes cannot be
    multiplied (154x768 and 64x64)"."""
    clip_l = [[torch.randn(1, 154, 768), {"pooled_output": torch.randn(1, 768)}]]
    problem = env.checks.conditioning_problem(env.flux, clip_l)
    assert problem.startswith("has context shape (1, 154, 768) but this model (flux1) expects (B, tokens, 64)")
    assert "(expected width 64, got width 768); Flux.1 needs CLIP-L + T5-XXL (DualCLIPLoader, type flux)" in problem
    cosmos_problem = env.checks.conditioning_problem(env.cosmos, make_conditioning(env.flux, 1))
    assert "(expected width 1024, got width 64); Cosmos-Predict2 needs the old T5-XXL (CLIPLoader, type cosmos)" \
        in cosmos_problem
    with torch.inference_mode(), pytest.raises(ValueError, match=(
            r"^PrecisionTrainLoRA: input 'conditioning': item 0 has context shape \(1, 154, 768\)")):
        env.td.build_samples(env.flux, [{"samples": torch.randn(1, 16, 4, 4)}], [clip_l], None, torch.device("cpu"))


def test_flux1_conditioning_without_the_pooled_output_is_named(env):
    """Flux.1 reads CLIP-L's pooled output; without it ComfyUI trains on zeros, silently."""
    cond = make_conditioning(env.flux, 1)
    cond = [[cond[0][0], {**cond[0][1], "pooled_output": None}]]
    problem = env.checks.conditioning_problem(env.flux, cond)
    assert problem.startswith("has no pooled_output, which this model (flux1) reads (width 32, from CLIP-L)")
    assert problem.endswith("Flux.1 needs CLIP-L + T5-XXL (DualCLIPLoader, type flux)")
    assert env.checks.conditioning_problem(env.flux, make_conditioning(env.flux, 1)) is None


def test_every_entry_of_a_combined_conditioning_is_checked(env):
    good, bad = make_conditioning(env.cosmos, 1), make_conditioning(env.flux, 1)
    assert env.checks.conditioning_problem(env.cosmos, good + bad).startswith("has context shape (1, 8, 64)")


def test_shared_1d_extras_are_not_cut_when_the_batch_equals_the_token_count(env):
    """Anima's t5xxl_ids (tokens,) is one row for the whole batch: with 2 captions of 2 tokens it was sliced
    to one token per sample."""
    ctx = torch.randn(2, 2, 1024)
    ids, pooled = torch.tensor([5, 7], dtype=torch.int32), torch.randn(2, 3)
    rows = env.td._cond_rows(env.cosmos, [[[ctx, {"t5xxl_ids": ids, "pooled_output": pooled}]]], "conditioning")
    assert len(rows) == 2
    for r, (row_ctx, extra) in enumerate(rows):
        assert torch.equal(row_ctx, ctx[r:r + 1])
        assert torch.equal(extra["t5xxl_ids"], ids)  # shared, whole
        assert torch.equal(extra["pooled_output"], pooled[r:r + 1])  # batched, per row


def test_a_flux2_model_given_the_wrong_encoder_names_klein_s_encoders_too(env):
    """Flux.2 klein users were told to load Mistral-Small-3 (Flux.2 dev's encoder); klein 4B/9B use Qwen3."""
    from models import tiny_flux2

    problem = env.checks.conditioning_problem(tiny_flux2(), [[torch.randn(1, 8, 768), {}]])
    assert problem.endswith("Flux.2 needs its own text encoder (CLIPLoader, type flux2: Mistral-Small-3 for "
                            "Flux.2 dev, Qwen3-4B for Flux.2 klein 4B, Qwen3-8B for klein 9B)"), problem
