"""LATENT / CONDITIONING inputs -> training samples: batches, dataset-node lists, and their pairing."""
from __future__ import annotations

import pytest
import torch

from models import make_conditioning, make_latent, tiny_cosmos


@pytest.fixture(scope="module")
def env(pack_module):
    class E:
        td = pack_module("nodes.train.data")
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


def test_mixed_resolutions_form_separate_groups(env, pack_module, one_thread):
    """Two 32x32 samples and one 48x32: two buckets in the report, and one training step with a batch of
    all three runs one forward per bucket (2 rows at 4x4 latent cells, 1 row at 4x6), not one per sample and
    not one for all."""
    sizes = [(32, 32), (48, 32), (32, 32)]
    latents = [make_latent(env.model, 1, width=w, height=h, seed=i) for i, (w, h) in enumerate(sizes)]
    cond = make_conditioning(env.model, 1)
    with torch.inference_mode():
        samples, report = env.td.build_dataset(env.model, latents, [cond], None, torch.device("cpu"))
    keys = [(s.group, tuple(s.latent.shape)) for s in samples]
    assert keys[0] == keys[2] and keys[0] != keys[1]
    assert [k[1][-2:] for k in keys] == [(4, 4), (4, 6), (4, 4)]
    assert report.buckets == 2 and report.sizes == {"32x32 px": 2, "48x32 px": 1}

    glue, train = pack_module("nodes.lora.glue"), pack_module("nodes.train.node")
    Settings = pack_module("training.settings").TrainSettings
    with torch.inference_mode():
        model = glue.attach_lora(env.model, pack_module("lora.config").LoRAConfig(rank=2, alpha=2))
    forwards = []
    handle = model.model.diffusion_model.register_forward_hook(
        lambda module, args, out: forwards.append(tuple(args[0].shape)))
    try:
        with torch.inference_mode():
            train.PrecisionTrainLoRA.execute([model], latents, [cond], [1], [0], ["groups"],
                                             settings=[Settings(batch_size=3, learning_rate=1e-3)])
    finally:
        handle.remove()
    assert sorted((f[0], f[-2:]) for f in forwards) == [(1, (4, 6)), (2, (4, 4))]
