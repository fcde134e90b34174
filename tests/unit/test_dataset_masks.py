"""Masks from a dataset folder (data/files.py MASK_CHOICES, PrecisionLoadImageDataset's mask input): a
``<name>_mask.png`` beside its image (and never read as an image itself), an image's alpha channel, the whole image
where there is none (said in the report), and a mask file of another size refused by its name."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from data.files import DatasetError, load_dataset


def _folder(tmp_path) -> str:
    left = np.zeros((24, 32), dtype=np.uint8)
    left[:, :16] = 255
    Image.new("RGB", (32, 24), (200, 30, 30)).save(tmp_path / "a.png")
    Image.fromarray(left, "L").save(tmp_path / "a_mask.png")
    clear = np.zeros((24, 32, 4), dtype=np.uint8)
    clear[:12] = (0, 0, 255, 255)  # the top half opaque
    Image.fromarray(clear, "RGBA").save(tmp_path / "b.png")
    Image.new("RGB", (32, 24), (0, 200, 0)).save(tmp_path / "c.png")
    for stem in "abc":
        (tmp_path / f"{stem}.txt").write_text(stem)
    return str(tmp_path)


def test_mask_files_alpha_and_the_whole_image(tmp_path):
    root = _folder(tmp_path)
    files = load_dataset(root, "input/x", mask="files")
    assert files.texts == ["a", "b", "c"] and len(files.images) == 3  # a_mask.png is no training image
    assert "not read as an image: a_mask.png (the mask of a; mask='files' uses it)" in files.lines
    expected = torch.zeros(1, 24, 32)
    expected[..., :16] = 1.0
    torch.testing.assert_close(files.masks[0], expected, atol=1e-6, rtol=0)
    assert torch.equal(files.masks[1], torch.ones(1, 24, 32)) and torch.equal(files.masks[2], torch.ones(1, 24, 32))
    assert "a.png: mask a_mask.png: 50 % of the image" in files.lines
    assert "c.png: no mask (c_mask.png not found): trains on the whole image" in files.lines
    alpha = load_dataset(root, "input/x", mask="alpha")
    top = torch.zeros(1, 24, 32)
    top[:, :12] = 1.0
    assert torch.equal(alpha.masks[1], top) and torch.equal(alpha.masks[0], torch.ones(1, 24, 32))
    assert "c.png: no transparency: the mask is the whole image" in alpha.lines
    none = load_dataset(root, "input/x")
    assert all(torch.equal(m, torch.ones(1, 24, 32)) for m in none.masks)


def test_a_mask_file_of_another_size_is_refused_by_name(tmp_path):
    root = _folder(tmp_path)
    Image.new("L", (16, 16), 255).save(tmp_path / "c_mask.png")
    with pytest.raises(DatasetError, match=r"^c_mask.png is 16x16 px but its image c.png is 32x24 px; save the mask "
                                           r"at the image's size"):
        load_dataset(root, "input/x", mask="files")
    with pytest.raises(DatasetError, match=r"mask='outline': use one of \('none', 'files', 'alpha'\)"):
        load_dataset(root, "input/x", mask="outline")
