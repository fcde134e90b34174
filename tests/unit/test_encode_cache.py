"""data/encode_cache.py: model identities, exact conditioning round trips, verified entry files."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from data.encode_cache import (BLOCK_BYTES, BadEntry, EntryStore, NotCacheable, model_identity,
                                   pack_conditioning, unpack_conditioning)


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"big.weight": torch.randn(512, 1024, generator=gen), "norm.weight": torch.ones(64),
            "emb.weight": torch.randn(1000, 64, generator=gen).to(torch.bfloat16)}


def _id(sd: dict, extra=None) -> str:
    return model_identity(list(sd.items()), extra)


def test_identity_is_stable_and_follows_names_shapes_dtypes_weights_and_extras():
    sd = _weights()
    base = _id(sd)
    assert _id({k: v.clone() for k, v in reversed(list(sd.items()))}) == base  # order and copies do not matter
    changed = {
        "a weight inside a sampled block": {**sd, "big.weight": sd["big.weight"].clone().index_put_(
            (torch.tensor([0]), torch.tensor([3])), torch.tensor(0.5))},
        "a whole tensor scaled (a fine-tune)": {**sd, "big.weight": sd["big.weight"] * 1.001},
        "a small tensor, any element": {**sd, "norm.weight": sd["norm.weight"].clone().index_fill_(0, torch.tensor([37]), 2.0)},
        "a dtype": {**sd, "big.weight": sd["big.weight"].half()},
        "a name": {("renamed" if k == "norm.weight" else k): v for k, v in sd.items()},
        "a shape": {**sd, "norm.weight": torch.ones(65)},
    }
    for what, other in changed.items():
        assert _id(other) != base, what
    assert _id(sd, {"layer_idx": -2}) != _id(sd, {"layer_idx": None})
    assert _id(sd, {"patches": {"k": [(1.0, (torch.ones(3),))]}}) != _id(sd, {"patches": {"k": [(1.0, (torch.zeros(3),))]}})


def test_identity_reads_blocks_not_whole_large_tensors():
    """The trade-off (docs/dataset_cache.md): an element of a large tensor between the sampled blocks is not
    read. This is what keeps a 10 GB T5-XXL's identity at milliseconds."""
    sd = _weights()
    middle = sd["big.weight"].clone()
    middle.view(-1)[BLOCK_BYTES // 4 + 7] += 1.0  # just past the first block
    assert _id({**sd, "big.weight": middle}) == _id(sd)


class Quantized(torch.Tensor):
    """Stand-in for comfy-kitchen's QuantizedTensor: data in ``_qdata``, scales in ``_params``."""


def _quantized(data: torch.Tensor, scale: float) -> torch.Tensor:
    t = torch.Tensor._make_subclass(Quantized, torch.empty(data.shape))
    t._qdata, t._params = data, {"scale": torch.tensor(scale)}
    return t


def test_identity_of_quantized_weights_reads_their_stored_data_and_scales():
    data = torch.randint(0, 255, (256, 512), dtype=torch.uint8)
    base = _id({"w": _quantized(data, 0.5)})
    assert _id({"w": _quantized(data.clone(), 0.5)}) == base
    assert _id({"w": _quantized(data, 0.25)}) != base
    assert _id({"w": _quantized(data ^ 1, 0.5)}) != base


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b and type(a) is type(b)


def test_conditioning_round_trips_exactly_through_an_entry_file(tmp_path):
    cond = [[torch.randn(1, 77, 64, dtype=torch.bfloat16),
             {"pooled_output": torch.randn(1, 64), "attention_mask": torch.ones(1, 77, dtype=torch.bool),
              "t5xxl_ids": torch.arange(8, dtype=torch.int32), "guidance": 3.5, "note": None, "area": (1, 2)}],
            [torch.randn(1, 4, 64), {"pooled_output": None, "strength": 1.0}]]
    store = EntryStore(str(tmp_path))
    tensors, layout = pack_conditioning(cond)
    path = store.store("text", "k" * 64, tensors, layout, {"caption": "x"})
    assert path == os.path.join(str(tmp_path), "text", "k" * 64 + ".safetensors")
    loaded, loaded_layout = store.load("text", "k" * 64)
    _same(unpack_conditioning(loaded, loaded_layout), cond)
    assert store.load("text", "m" * 64) is None
    assert [n for n in os.listdir(os.path.join(str(tmp_path), "text")) if n.endswith(".partial")] == []


def test_an_extra_the_file_cannot_hold_exactly_is_not_cached():
    with pytest.raises(NotCacheable, match="conditioning extra 'hooks' is a object"):
        pack_conditioning([[torch.zeros(1, 2, 3), {"hooks": object()}]])
    with pytest.raises(NotCacheable, match="conditioning extra 'x' is a float"):
        pack_conditioning([[torch.zeros(1, 2, 3), {"x": float("nan")}]])


def test_an_entry_under_another_name_is_refused(tmp_path):
    store = EntryStore(str(tmp_path))
    store.store("latents", "a" * 64, {"samples": torch.ones(1, 4, 2, 2)}, None)
    shutil.copy(store.path("latents", "a" * 64), store.path("latents", "b" * 64))
    with pytest.raises(BadEntry, match="is not the entry its name says"):
        store.load("latents", "b" * 64)
    assert torch.equal(store.load("latents", "a" * 64)[0]["samples"], torch.ones(1, 4, 2, 2))
