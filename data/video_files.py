"""A folder of video clips (and still images) with captions -> frame batches and a report. No ComfyUI.

Layout as the image loader's (``files.py``): ``<folder>/walk.mp4`` with its caption ``<folder>/walk.txt``;
``<N>_<name>/`` subfolders repeat their clips N times; name order. A video is decoded by the ``decode``
the node passes (ComfyUI's own VideoFromFile, so frames equal Load Video + Get Video Components' bit for bit on
each host), every ``stride``-th frame kept up to ``max_frames``; then cut to the longest count that fits the
frame rule (4k+1 for Wan / HunyuanVideo, ...). A still image is a one-frame clip (read by
``image_reading.read_image``, so orientation, bit depth and transparency are handled as the image loader
does). Every cut, and every file not read, is a line of the report.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from .files import DatasetError, caption_of, orphan_captions, repeats_of
from .frames import fit_count
from .image_reading import read_image

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v", ".gif")
STILL_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


@dataclass
class Clips:
    """``clips[i]`` (T, H, W, 3) float32 pairs with ``texts[i]``; ``lines`` is the report, header first."""

    clips: list[torch.Tensor] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def _kind(name: str) -> str | None:
    ext = os.path.splitext(name)[1].lower()
    return "video" if ext in VIDEO_EXTENSIONS else "still" if ext in STILL_EXTENSIONS else None


def list_clips(root: str) -> tuple[list[tuple[str, int]], list[str]]:
    """(file relative to ``root``, repeats) in name order, and report lines for the files not read."""
    found, notes = [], []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        entries = [(name, 1)]
        if os.path.isdir(path):
            n = repeats_of(name)
            entries = []
            for inner in sorted(os.listdir(path)):
                rel = f"{name}/{inner}"
                if os.path.isdir(os.path.join(root, rel)):
                    notes.append(f"not read: folder {rel}/ (only the dataset folder and its direct subfolders are read)")
                else:
                    entries.append((rel, n))
        for rel, n in entries:
            if _kind(rel) is not None:
                found.append((rel, n))
            elif not rel.endswith(".txt"):
                notes.append(f"not read: {rel} (not a video {', '.join(VIDEO_EXTENSIONS)} or image "
                             f"{', '.join(STILL_EXTENSIONS)})")
    return found, notes


def read_video(decode: Callable[[str, int], tuple[torch.Tensor, int, float]], path: str, stride: int,
               max_frames: int) -> tuple[torch.Tensor, int, bool, float]:
    """Every ``stride``-th frame from the start, at most ``max_frames``, as (T, H, W, 3) float32 in [0, 1]; the
    frames read, whether the file has more, and the frame rate. ``decode(path, n)``: the first n frames (at
    least; all when the file is shorter), the file's frame count and its frame rate (ComfyUI's decode)."""
    frames, total, fps = decode(path, max_frames * stride)
    if frames.ndim != 4 or frames.shape[0] == 0:
        raise ValueError("has no frames; replace or remove the file")
    picked = frames[::stride][:max_frames]
    more = total > stride * (picked.shape[0] - 1) + 1 and picked.shape[0] == max_frames
    return picked[..., :3].float().contiguous(), int(picked.shape[0]), more, fps


def load_clips(root: str, label: str, step: int, max_frames: int, stride: int,
               decode: Callable[[str, int], tuple[torch.Tensor, int, float]], missing_caption: str = "train_empty",
               progress=None) -> Clips:
    """Every clip of the folder ``root`` (shown as ``label``) cut to the frame rule, with its caption.
    ``step``: the rule's frames per latent frame (4 for 4k+1; 1: any count). Raises DatasetError naming the
    file for an unreadable video, a caption that is not UTF-8, a refused missing caption, an empty folder."""
    listed, skipped = list_clips(root)
    if not listed:
        raise DatasetError("", f"{label} holds no video ({', '.join(VIDEO_EXTENSIONS)}) or image; put the clips "
                               "there, each with a .txt caption of the same name")
    data, notes, lengths = Clips(), [], []
    for done, (rel, n) in enumerate(listed):
        path = os.path.join(root, rel)
        try:
            if _kind(rel) == "video":
                clip, read, more, fps = read_video(decode, path, stride, max_frames)
                keep = fit_count(read, step, max_frames)
                if keep != read or more:
                    every = f"frame_stride {stride}: " if stride > 1 else ""
                    why = f"max_frames {max_frames}" if more and keep == read else "the frame rule"
                    notes.append(f"{rel}: {every}{read}{'+' if more else ''} frames at {fps:g} fps -> kept the "
                                 f"first {keep} ({why})")
                clip = clip[:keep]
            else:
                clip, decided = read_image(path)
                notes.extend(f"{rel}: {note}" for note in decided)
                notes.append(f"{rel}: still image, trains as a one-frame clip")
        except ValueError as exc:
            raise DatasetError(rel, str(exc)) from None
        text = caption_of(root, rel)
        stem = os.path.splitext(rel)[0]
        if not text:
            state = "is empty" if text == "" else "not found"
            if missing_caption == "refuse":
                raise DatasetError(rel, f"has no caption ({stem}.txt {state}) and missing_caption='refuse'; write "
                                        "the caption or set missing_caption to train_empty")
            notes.append(f"{rel}: no caption ({stem}.txt {state}): trains on the empty caption")
            data.missing.append(rel)
        data.clips.extend([clip] * n)
        data.texts.extend([text or ""] * n)
        lengths.extend([int(clip.shape[0])] * n)
        if progress is not None:
            progress(done + 1, len(listed))
    sizes = sorted({(int(c.shape[0]), int(c.shape[2]), int(c.shape[1])) for c in data.clips})
    shapes = ", ".join(f"{t} frames {w}x{h}" for t, w, h in sizes)
    header = (f"{len(data.clips)} clips from {label} ({len(listed)} files, name order): {len(listed) - len(data.missing)} "
              f"with a caption, {len(data.missing)} without; {len(sizes)} clip shape{'s' if len(sizes) != 1 else ''} "
              f"({shapes}; each shape trains as its own bucket)")
    data.lines = [header, *notes, *skipped, *orphan_captions(root, [rel for rel, _ in listed])]
    return data
