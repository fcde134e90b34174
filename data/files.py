"""A dataset folder -> images, captions and a report of every decision (docs/datasets.md). No ComfyUI.

Layout (the one ComfyUI's LoadImageTextDataSetFromFolder reads, kohya-style repeats included):
``<folder>/a.png`` with its caption ``<folder>/a.txt``; a subfolder ``<folder>/10_cat/`` adds its images 10
times (a name without a leading number: once). Files are taken in name order (the host node takes the
operating system's order). Each image is read once by ``image_reading.read_image``; the report names every
file for which something was decided: orientation, bit depth, palette, transparency, frames, a missing or
empty caption, a file that is not read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .image_reading import EXTENSIONS, read_image_and_alpha, read_mask

MISSING_CAPTION_CHOICES = ("train_empty", "refuse")
# Where the masks output comes from (masked loss: Train LoRA's mask input, through Resolution Buckets)
MASK_CHOICES = {
    "none": "every mask is the whole image (white)",
    "files": "<name>_mask.png (or another image type) beside each image, white = train here; an image without "
             "one: the whole image (named in the report)",
    "alpha": "each image's alpha channel (opaque = train here); an image without transparency: the whole image",
}
MASK_SUFFIX = "_mask"


@dataclass
class Dataset:
    """``images[i]`` (1, H, W, 3) float32 pairs with ``texts[i]``; ``lines`` is the report, header first."""

    images: list[torch.Tensor] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)  # (1, H, W) per image (ComfyUI's MASK), see MASK_CHOICES
    lines: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # image names (relative) without a caption


class DatasetError(ValueError):
    """A refusal; ``name`` is the file (relative to the dataset folder) it is about, or ''."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name} {message}" if name else message)
        self.name = name


def repeats_of(folder_name: str) -> int:
    """kohya's ``<N>_<name>`` folders repeat their images N times; any other folder once."""
    head = folder_name.split("_")[0]
    return int(head) if head.isdigit() and int(head) > 0 else 1


def list_images(root: str) -> tuple[list[tuple[str, int]], list[str]]:
    """(image name relative to ``root``, repeats) in name order, and report lines for what is not read."""
    found: list[tuple[str, int]] = []
    notes: list[str] = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isdir(path):
            n = repeats_of(name)
            inner = _images_in(root, name, notes)
            if inner and n > 1:
                notes.append(f"{name}/: {len(inner)} images x {n} repeats (the folder name's leading number)")
            found.extend((rel, n) for rel in inner)
        else:
            _sort_file(name, found, notes)
    return _without_masks(root, found, notes), notes


def _without_masks(root: str, found: list[tuple[str, int]], notes: list[str]) -> list[tuple[str, int]]:
    """``found`` without the mask files of other images (``<stem>_mask.<ext>`` beside ``<stem>.<ext>``)."""
    stems = {os.path.splitext(rel)[0] for rel, _ in found}
    kept = []
    for rel, n in found:
        stem = os.path.splitext(rel)[0]
        if stem.endswith(MASK_SUFFIX) and stem[:-len(MASK_SUFFIX)] in stems:
            notes.append(f"not read as an image: {rel} (the mask of {stem[:-len(MASK_SUFFIX)]}; mask='files' uses it)")
        else:
            kept.append((rel, n))
    return kept


def mask_file_of(root: str, rel: str) -> str | None:
    """The mask file beside image ``rel`` (``<stem>_mask`` with an image extension, .png first), or None."""
    stem = os.path.splitext(rel)[0] + MASK_SUFFIX
    for ext in (".png", *[e for e in EXTENSIONS if e != ".png"]):
        for name in (stem + ext, stem + ext.upper()):
            if os.path.isfile(os.path.join(root, name)):
                return name
    return None


def _mask(root: str, rel: str, image: torch.Tensor, alpha: torch.Tensor | None, mode: str,
          decided: list[str]) -> torch.Tensor:
    """The (1, H, W) mask of image ``rel`` (``MASK_CHOICES``); a mask file of another size is refused by name."""
    h, w = int(image.shape[1]), int(image.shape[2])
    if mode == "alpha" and alpha is not None:
        return alpha[None].float()
    if mode == "files":
        name = mask_file_of(root, rel)
        if name is None:
            decided.append(f"no mask ({os.path.splitext(rel)[0]}{MASK_SUFFIX}.png not found): trains on the whole image")
        else:
            try:
                mask = read_mask(os.path.join(root, name))
            except ValueError as exc:
                raise DatasetError(name, str(exc)) from None
            if tuple(mask.shape) != (h, w):
                raise DatasetError(name, f"is {mask.shape[1]}x{mask.shape[0]} px but its image {rel} is {w}x{h} px; "
                                         "save the mask at the image's size")
            decided.append(f"mask {name}: {100 * float(mask.mean()):.3g} % of the image")
            return mask[None]
    if mode == "alpha":
        decided.append("no transparency: the mask is the whole image")
    return torch.ones((1, h, w), dtype=torch.float32)


def _images_in(root: str, sub: str, notes: list[str]) -> list[str]:
    out: list[tuple[str, int]] = []
    for name in sorted(os.listdir(os.path.join(root, sub))):
        rel = f"{sub}/{name}"
        if os.path.isdir(os.path.join(root, sub, name)):
            notes.append(f"not read: folder {rel}/ (only the dataset folder and its direct subfolders are read)")
        else:
            _sort_file(rel, out, notes)
    return [rel for rel, _ in out]


def _sort_file(rel: str, found: list[tuple[str, int]], notes: list[str]) -> None:
    stem, ext = os.path.splitext(rel)
    if ext.lower() in EXTENSIONS:
        found.append((rel, 1))
    elif ext != ".txt":
        notes.append(f"not read: {rel} (not an image type this node reads: {', '.join(EXTENSIONS)})")


def caption_of(root: str, rel: str) -> str | None:
    """The stripped text of the image's ``.txt`` beside it, or None when there is none."""
    path = os.path.join(root, os.path.splitext(rel)[0] + ".txt")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read().strip()
    except UnicodeDecodeError as exc:
        raise DatasetError(os.path.splitext(rel)[0] + ".txt", f"is not UTF-8 text ({exc.reason} at byte "
                           f"{exc.start}); save the caption as UTF-8") from None


def orphan_captions(root: str, images: list[str]) -> list[str]:
    """Report lines for ``.txt`` files with no image of the same name (a renamed image loses its caption)."""
    stems = {os.path.splitext(rel)[0] for rel in images}
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if name.endswith(".txt") and rel.count("/") <= 1 and rel[:-4] not in stems:
                out.append(f"not used: {rel} (no image of the same name beside it)")
    return sorted(out)


def load_dataset(root: str, label: str, alpha: str = "white", animated: str = "first_frame",
                 missing_caption: str = "train_empty", mask: str = "none") -> Dataset:
    """Every image of the folder ``root`` (shown as ``label`` in the report) with its caption and its mask
    (``MASK_CHOICES``).

    Raises DatasetError naming the file for an unreadable or refused image, a caption that is not UTF-8,
    a missing caption when ``missing_caption="refuse"``, a mask file of another size than its image, or a
    folder without images.
    """
    if missing_caption not in MISSING_CAPTION_CHOICES:
        raise DatasetError("", f"missing_caption={missing_caption!r}: use one of {MISSING_CAPTION_CHOICES}")
    if mask not in MASK_CHOICES:
        raise DatasetError("", f"mask={mask!r}: use one of {tuple(MASK_CHOICES)}")
    listed, skipped = list_images(root)
    if not listed:
        raise DatasetError("", f"{label} holds no image ({', '.join(EXTENSIONS)}); put the images there, each "
                               "with a .txt caption of the same name")
    data, notes = Dataset(), []
    for rel, n in listed:
        try:
            image, decided, alpha_channel = read_image_and_alpha(os.path.join(root, rel), alpha, animated)
        except ValueError as exc:
            raise DatasetError(rel, str(exc)) from None
        image_mask = _mask(root, rel, image, alpha_channel, mask, decided)
        text = caption_of(root, rel)
        stem = os.path.splitext(rel)[0]
        if text is None or text == "":
            if missing_caption == "refuse":
                raise DatasetError(rel, f"has no caption ({stem}.txt {'is empty' if text == '' else 'not found'}) "
                                        "and missing_caption='refuse'; write the caption or set missing_caption "
                                        "to train_empty")
            decided.append(f"no caption ({stem}.txt {'is empty' if text == '' else 'not found'}): trains on the "
                           "empty caption")
            data.missing.append(rel)
        notes.extend(f"{rel}: {note}" for note in decided)
        data.images.extend([image] * n)
        data.texts.extend([text or ""] * n)
        data.masks.extend([image_mask] * n)
    header = (f"{len(data.images)} images from {label} ({len(listed)} files, name order): "
              f"{len(listed) - len(data.missing)} with a caption, {len(data.missing)} without")
    data.lines = [header, *notes, *skipped, *orphan_captions(root, [rel for rel, _ in listed])]
    return data


def folder_signature(root: str) -> tuple:
    """(relative name, size, mtime) of every file of the dataset folder and its subfolders: changes when an
    image or caption is added, removed or rewritten (the node's ``fingerprint_inputs``)."""
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            out.append((os.path.relpath(path, root), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))
