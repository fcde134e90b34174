"""LATENT / CONDITIONING inputs -> training samples: batches, dataset-node lists, and their pairing."""
from __future__ import annotations

import pytest
import torch

from models import make_conditioning, make_latent, tiny_cosmos


@pytest.fixture(scope="module")
def env(pack_module):
    class E:
        td = pack_module("precision_nodes.train_data")
        model = tiny_cosmos()
    return E


def _ctx(sample) -> torch.Tensor:
    return sample.cond["c_crossattn"].cond


def test_one_batch_one_conditioning_is_shared(env):
    latent = make_latent(env.model, 3, width=32, height=32)
    cond = make_conditioning(env.model, 1)
    with torch.inference_mode():
        samples = env.td.build_samples(env.model, [latent], [cond], None, torch.device("cpu"))
    assert len(samples) == 3
    expected = env.model.model.process_latent_in(latent["samples"].clone())
    assert all(torch.equal(s.latent, expected[i]) for i, s in enumerate(samples))
    assert all(not s.latent.is_inference() and not _ctx(s).is_inference() for s in samples)
    assert all(torch.equal(_ctx(s), cond[0][0]) for s in samples)
    assert len({s.group for s in samples}) == 1


def test_dataset_lists_pair_one_conditioning_per_latent(env):
    latents = [make_latent(env.model, 1, width=32, height=32, seed=i) for i in range(3)]
    conds = [make_conditioning(env.model, 1, text=f"caption {i}") for i in range(3)]
    with torch.inference_mode():
        samples = env.td.build_samples(env.model, latents, conds, None, torch.device("cpu"))
    assert [torch.equal(_ctx(s), c[0][0]) for s, c in zip(samples, conds)] == [True, True, True]


def test_batched_conditioning_rows_pair_with_batched_latent_rows(env):
    latent = make_latent(env.model, 2, width=32, height=32)
    a, b = make_conditioning(env.model, 1, text="a"), make_conditioning(env.model, 1, text="b")
    both = [[torch.cat([a[0][0], b[0][0]]), {"pooled_output": None}]]
    with torch.inference_mode():
        samples = env.td.build_samples(env.model, [latent], [both], None, torch.device("cpu"))
    assert torch.equal(_ctx(samples[0]), a[0][0]) and torch.equal(_ctx(samples[1]), b[0][0])


def test_mixed_resolutions_form_separate_groups(env):
    latents = [make_latent(env.model, 1, width=32, height=32), make_latent(env.model, 1, width=48, height=32)]
    with torch.inference_mode():
        samples = env.td.build_samples(env.model, latents, [make_conditioning(env.model, 1)], None,
                                       torch.device("cpu"))
    assert samples[0].latent.shape != samples[1].latent.shape
