"""PrecisionLoadImageDataset: every image kind read as the user sees it, every decision in the report.

Issue 23 items 4 and 5: 16-bit grayscale trained as white, transparent PNGs on black, EXIF-rotated photos
sideways, .gif skipped, one missing caption unnoticed. Fixtures are generated here with PIL in a folder
under ComfyUI's input/; the decoded pixels are compared with what each file shows.
"""
from __future__ import annotations

import os
import shutil
import uuid

import numpy as np
import pytest
import torch
from PIL import Image

import comfy_harness

RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 255, 0)


@pytest.fixture(scope="module")
def node(pack):
    return comfy_harness.node_class("PrecisionLoadImageDataset")


def _input_dir() -> str:
    import folder_paths

    return folder_paths.get_input_directory()


@pytest.fixture
def folder(pack):
    name = f"ds_{uuid.uuid4().hex[:8]}"
    path = os.path.join(_input_dir(), name)
    os.makedirs(path)
    yield name, path
    shutil.rmtree(path, ignore_errors=True)


def _caption(path: str, stem: str, text: str) -> None:
    with open(os.path.join(path, stem + ".txt"), "w", encoding="utf-8") as f:
        f.write(text)


def _write_kinds(path: str) -> None:
    """One file per kind the host node misreads; captions for all but ``nocap.png``."""
    # EXIF orientation 6: stored 4 wide x 2 high, shown turned 90° clockwise (2 wide x 4 high)
    sideways = Image.new("RGB", (4, 2), BLUE)
    sideways.putpixel((0, 0), RED)
    exif = sideways.getexif()
    exif[0x0112] = 6
    sideways.save(os.path.join(path, "a_rotated.png"), exif=exif)
    # 16-bit grayscale: 0, 1/4, 1/2, full
    Image.fromarray(np.array([[0, 16384, 32768, 65535]] * 2, dtype=np.uint16)).save(os.path.join(path, "b_gray16.png"))
    # transparent left half (stored black), opaque green right half, one half-transparent pixel
    rgba = np.zeros((2, 4, 4), dtype=np.uint8)
    rgba[:, 2:] = (0, 255, 0, 255)
    rgba[0, 1] = (0, 0, 255, 102)  # 40 % opaque blue
    Image.fromarray(rgba, "RGBA").save(os.path.join(path, "c_alpha.png"))
    # animated GIF: red frame, then blue
    frames = [Image.new("RGB", (4, 4), RED), Image.new("RGB", (4, 4), BLUE)]
    frames[0].save(os.path.join(path, "d_anim.gif"), save_all=True, append_images=frames[1:], duration=100)
    # palette image: index 0 red, 1 green
    pal = Image.new("P", (2, 2), 0)
    pal.putpalette([*RED, *GREEN] + [0] * 762)
    pal.putpixel((1, 1), 1)
    pal.save(os.path.join(path, "e_palette.png"))
    Image.new("RGB", (3, 3), (10, 20, 30)).save(os.path.join(path, "f_plain.bmp"))
    Image.fromarray(np.full((2, 2), 0.25, dtype=np.float32)).save(os.path.join(path, "g_float.tiff"))
    Image.new("RGB", (2, 2), GREEN).save(os.path.join(path, "h_nocap.png"))
    for stem in ("a_rotated", "b_gray16", "c_alpha", "d_anim", "e_palette", "f_plain", "g_float"):
        _caption(path, stem, f"photo of {stem}\n")
    with open(os.path.join(path, "notes.md"), "w") as f:
        f.write("not an image")


def _load_stock_extras(*files: str) -> None:
    """Register ComfyUI's own extra nodes as its start-up does (the in-process harness loads only the pack)."""
    import asyncio

    import nodes as comfy_nodes

    folder = os.path.join(os.path.dirname(os.path.abspath(comfy_nodes.__file__)), "comfy_extras")
    for name in files:
        assert asyncio.run(comfy_nodes.load_custom_node(os.path.join(folder, name), module_parent="comfy_extras"))


def _load(node, name, alpha="white", animated="first_frame", missing_caption="train_empty"):
    return node.execute(name, alpha, animated, missing_caption).result[:3]


def test_each_image_kind_decodes_to_what_the_file_shows(node, folder):
    name, path = folder
    _write_kinds(path)
    images, texts, report = _load(node, name)
    assert len(images) == len(texts) == 8
    assert all(i.dtype == torch.float32 and i.ndim == 4 and i.shape[0] == 1 and i.shape[-1] == 3 for i in images)
    rotated, gray16, alpha, anim, palette, plain, floaty, nocap = (i[0] for i in images)
    # upright: 2 wide x 4 high, the stored top-left (red) now top-right
    assert tuple(rotated.shape) == (4, 2, 3)
    assert rotated[0, 1].tolist() == [1.0, 0.0, 0.0] and rotated[0, 0].tolist() == [0.0, 0.0, 1.0]
    # 16-bit: the gradient, not white
    torch.testing.assert_close(gray16[0, :, 0], torch.tensor([0.0, 16384 / 65535, 32768 / 65535, 1.0]))
    assert torch.equal(gray16[..., 0], gray16[..., 2])
    # transparency on white: transparent pixels white, the 40 % blue one blended, opaque green kept
    assert alpha[1, 0].tolist() == [1.0, 1.0, 1.0]
    torch.testing.assert_close(alpha[0, 1], torch.tensor([0.6, 0.6, 1.0]), atol=1e-6, rtol=0)
    assert alpha[0, 3].tolist() == [0.0, 1.0, 0.0]
    assert anim[0, 0].tolist() == [1.0, 0.0, 0.0]  # first frame: red
    assert palette[0, 0].tolist() == [1.0, 0.0, 0.0] and palette[1, 1].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(plain[0, 0], torch.tensor([10, 20, 30]) / 255.0)
    torch.testing.assert_close(floaty, torch.full((2, 2, 3), 0.25))
    assert nocap[0, 0].tolist() == [0.0, 1.0, 0.0]
    assert texts[:3] == ["photo of a_rotated", "photo of b_gray16", "photo of c_alpha"] and texts[7] == ""
    lines = report.splitlines()
    assert lines[0] == f"8 images from input/{name} (8 files, name order): 7 with a caption, 1 without"
    for expected in ("a_rotated.png: EXIF orientation 6 applied (turned 90° clockwise)",
                     "b_gray16.png: 16-bit grayscale (I;16): scaled from 0..65535",
                     "c_alpha.png: transparent pixels (50 % of the pixels) composited on white",
                     "d_anim.gif: 2 frames (animated or multi-page): the first frame is read",
                     "e_palette.png: palette image (P): colours from its palette",
                     "g_float.tiff: 32-bit float grayscale (F): values used as 0..1",
                     "h_nocap.png: no caption (h_nocap.txt not found): trains on the empty caption",
                     "not read: notes.md (not an image type this node reads: .png, .jpg, .jpeg, .webp, .bmp, .gif, "
                     ".tif, .tiff)"):
        assert expected in lines, (expected, lines)
    assert not any(line.startswith("f_plain.bmp") for line in lines)  # nothing decided for a plain RGB file


@pytest.mark.parametrize("background, value", [("black", 0.0), ("gray", 0.5)])
def test_transparency_goes_on_the_chosen_background(node, folder, background, value):
    name, path = folder
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)
    Image.fromarray(rgba, "RGBA").save(os.path.join(path, "x.png"))
    images, _, report = _load(node, name, alpha=background)
    assert images[0][0, 0, 0].tolist() == [1.0, 0.0, 0.0]
    assert images[0][0, 1, 1].tolist() == [value] * 3
    assert f"x.png: transparent pixels (75 % of the pixels) composited on {background}" in report


def test_a_fully_opaque_alpha_channel_changes_nothing(node, folder):
    name, path = folder
    Image.new("RGBA", (2, 2), (10, 20, 30, 255)).save(os.path.join(path, "x.png"))
    _caption(path, "x", "cap")
    images, _, report = _load(node, name, alpha="refuse")
    torch.testing.assert_close(images[0][0, 0, 0], torch.tensor([10, 20, 30]) / 255.0)
    assert report.splitlines()[1:] == []


def test_jpeg_exif_orientation_8_is_turned_counter_clockwise(node, folder):
    name, path = folder
    stored = Image.new("RGB", (16, 8), BLUE)
    stored.paste(RED, (0, 0, 8, 8))  # left half red
    exif = stored.getexif()
    exif[0x0112] = 8
    stored.save(os.path.join(path, "p.jpg"), exif=exif, quality=95)
    images, _, report = _load(node, name)
    shown = images[0][0]
    assert tuple(shown.shape) == (16, 8, 3)  # upright: 8 wide, 16 high; the left half is now the bottom
    assert shown[12, 4, 0] > 0.9 and shown[12, 4, 2] < 0.1 and shown[3, 4, 2] > 0.9 and shown[3, 4, 0] < 0.1
    assert "p.jpg: EXIF orientation 8 applied (turned 90° counter-clockwise)" in report


@pytest.mark.parametrize("kind, option, message", [
    ("alpha", {"alpha": "refuse"}, r"input 'folder'='{name}': x\.png has transparent pixels \(25 % of the pixels\) "
                                   r"and alpha='refuse'; choose a background"),
    ("anim", {"animated": "refuse"}, r"input 'folder'='{name}': x\.gif has 2 frames \(animated or multi-page\) and "
                                     r"animated='refuse'; set animated to first_frame"),
    ("nocap", {"missing_caption": "refuse"}, r"input 'folder'='{name}': x\.png has no caption \(x\.txt not found\) "
                                             r"and missing_caption='refuse'; write the caption"),
    ("broken", {}, r"input 'folder'='{name}': x\.png cannot be read as an image \(.*\); replace or remove the file"),
    ("int32", {}, r"input 'folder'='{name}': x\.tiff has 32-bit integer pixels from -5 to 70000, which have no known range"),
])
def test_refusals_name_node_file_and_fix(node, folder, kind, option, message):
    name, path = folder
    if kind == "alpha":
        rgba = np.full((2, 2, 4), 255, dtype=np.uint8)
        rgba[0, 0, 3] = 0
        Image.fromarray(rgba, "RGBA").save(os.path.join(path, "x.png"))
    elif kind == "anim":
        frames = [Image.new("RGB", (2, 2), RED), Image.new("RGB", (2, 2), BLUE)]
        frames[0].save(os.path.join(path, "x.gif"), save_all=True, append_images=frames[1:])
    elif kind == "broken":
        with open(os.path.join(path, "x.png"), "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\nnot really")
    elif kind == "int32":
        Image.fromarray(np.array([[-5, 70000]], dtype=np.int32)).save(os.path.join(path, "x.tiff"))
    else:
        Image.new("RGB", (2, 2), RED).save(os.path.join(path, "x.png"))
    args = {"alpha": "white", "animated": "first_frame", "missing_caption": "train_empty", **option}
    with pytest.raises(ValueError, match=r"^\[Precision LoRA\] PrecisionLoadImageDataset: " + message.format(name=name)):
        node.execute(name, **args)


def test_empty_caption_file_and_kohya_repeats_are_reported(node, folder):
    name, path = folder
    os.makedirs(os.path.join(path, "3_cat"))
    Image.new("RGB", (2, 2), RED).save(os.path.join(path, "3_cat", "c.png"))
    _caption(os.path.join(path, "3_cat"), "c", "a cat")
    Image.new("RGB", (2, 2), BLUE).save(os.path.join(path, "e.webp"), lossless=True)
    _caption(path, "e", "  \n")
    _caption(path, "orphan", "caption of a renamed image")
    images, texts, report = _load(node, name)
    assert texts == ["a cat"] * 3 + [""] and len(images) == 4
    assert images[3][0, 0, 0].tolist() == [0.0, 0.0, 1.0]
    lines = report.splitlines()
    assert lines[0] == f"4 images from input/{name} (2 files, name order): 1 with a caption, 1 without"
    assert "e.webp: no caption (e.txt is empty): trains on the empty caption" in lines
    assert "3_cat/: 1 images x 3 repeats (the folder name's leading number)" in lines
    assert "not used: orphan.txt (no image of the same name beside it)" in lines


def test_folders_outside_input_are_refused(node, folder, tmp_path):
    name, path = folder
    Image.new("RGB", (2, 2), RED).save(os.path.join(tmp_path, "secret.png"))
    os.symlink(str(tmp_path), os.path.join(path, "link"))
    outside = "../" + os.path.basename(os.path.dirname(_input_dir()))
    for bad in (outside, str(tmp_path)):
        message = node.validate_inputs(folder=bad, alpha="white", animated="first_frame", missing_caption="train_empty")
        assert message.startswith("[Precision LoRA] PrecisionLoadImageDataset: input 'folder'=") and \
            "is not an option; choose one of [" in message and bad[-12:] not in message.split("choose")[1]
    dataset = comfy_harness.pack_module("nodes.dataset.node")
    for bad in (outside, str(tmp_path), f"{name}/link"):  # what reaches execute past validation, symlink included
        with pytest.raises(ValueError, match=r"PrecisionLoadImageDataset: input 'folder'=.* is not a folder inside "
                                             r"ComfyUI's input folder"):
            dataset.dataset_root(bad)


def test_a_changed_file_changes_the_fingerprint(node, folder):
    name, path = folder
    Image.new("RGB", (2, 2), RED).save(os.path.join(path, "x.png"))
    before = node.fingerprint_inputs(folder=name)
    _caption(path, "x", "new caption")
    assert node.fingerprint_inputs(folder=name) != before


def test_trigger_word_recipe_through_comfyui_validation(folder):
    """docs/datasets.md: Concatenate Text (StringConcatenate, on both hosts; AddTextPrefix is deprecated on 0.33)
    runs once per caption of the list, so every caption gets the trigger word, in the images' order."""
    name, path = folder
    _load_stock_extras("nodes_string.py")
    for stem, colour in (("a", RED), ("b", BLUE)):
        Image.new("RGB", (32, 32), colour).save(os.path.join(path, stem + ".png"))
        _caption(path, stem, f"a {stem} square")
    prompt = {
        "1": {"class_type": "PrecisionLoadImageDataset", "inputs": {
            "folder": name, "alpha": "white", "animated": "first_frame", "missing_caption": "train_empty"}},
        "2": {"class_type": "StringConcatenate", "inputs": {"string_a": "mytrigger", "string_b": ["1", 1],
                                                            "delimiter": ", "}},
    }
    out = comfy_harness.run_graph(prompt, outputs=["2"])
    assert out["success"], out["messages"]
    assert out["outputs"]["2"][0] == ["mytrigger, a a square", "mytrigger, a b square"]
    images = out["outputs"]["1"][0]
    assert len(images) == 2 and images[1][0, 0, 0].tolist() == [0.0, 0.0, 1.0]
