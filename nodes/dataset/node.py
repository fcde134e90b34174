"""PrecisionLoadImageDataset: a folder of images and captions under ComfyUI's input/, read right.

A drop-in for ComfyUI's LoadImageTextDataSetFromFolder (same outputs: an IMAGE list and a text list, in
pairs), which reads 16-bit grayscale as white, drops transparency to black, ignores EXIF orientation, skips
.gif/.bmp/.tiff and lets a missing caption train on "" without a word (docs/datasets.md). This node
applies orientation, converts bit depths and palettes, composites transparency on the chosen background (or
refuses it), reads the first frame of animations (or refuses them) and returns a report naming every file
something was decided for. Like ComfyUI 0.33 (and unlike 0.3.75) it refuses folders outside input/.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import folder_paths

from ..checks.gate import PrecisionNode
from ..host.comfy_io import io
from ...data.files import MASK_CHOICES, MISSING_CAPTION_CHOICES, DatasetError, folder_signature, load_dataset
from ...data.image_reading import ALPHA_CHOICES, ANIMATED_CHOICES, EXTENSIONS

log = logging.getLogger(__name__)
NODE = "PrecisionLoadImageDataset"


def dataset_root(folder: str) -> str:
    """The real path of ``folder`` inside ComfyUI's input directory, or ValueError when it resolves outside
    it (``..``, an absolute path, a symlink leaving it) or is not a folder."""
    base = os.path.realpath(folder_paths.get_input_directory())
    root = os.path.realpath(os.path.join(base, folder)) if isinstance(folder, str) and folder else base
    if root == base or os.path.commonpath([base, root]) != base:
        raise ValueError(f"{NODE}: input 'folder'={folder!r} is not a folder inside ComfyUI's input "
                         f"folder ({base}); put the dataset in a subfolder of input/ and pick it from the list")
    if not os.path.isdir(root):
        raise ValueError(f"{NODE}: input 'folder'={folder!r} does not exist in {base}; create it "
                         "there (or refresh the node list) and pick it from the list")
    return root


class PrecisionLoadImageDataset(PrecisionNode):
    NODE = NODE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE, display_name="Precision Load Image Dataset", category="precision_lora/data",
            description="Loads a folder of images with their .txt captions from ComfyUI's input/ folder, as "
                        "LoadImageTextDataSetFromFolder does (same outputs, so it can replace it), but reads "
                        "every image right: EXIF orientation applied, 16-bit and palette images converted, "
                        "transparency composited on a background you choose, animations read as their first "
                        "frame; the report names every file something was decided for and every missing caption. "
                        f"Reads {', '.join(EXTENSIONS)}.",
            inputs=[
                io.Combo.Input("folder", options=folder_paths.get_input_subfolders(),
                               tooltip="A folder under ComfyUI's input/: images, each with a .txt caption of the "
                                       "same name; subfolders named <N>_<name> repeat their images N times."),
                io.Combo.Input("alpha", options=list(ALPHA_CHOICES), default="white",
                               tooltip="Background for transparent pixels (white, black, gray), or refuse images "
                                       "that have any."),
                io.Combo.Input("animated", options=list(ANIMATED_CHOICES), default="first_frame",
                               tooltip="Animated images (GIF, WebP) and multi-page TIFFs: read the first frame "
                                       "(said in the report) or refuse them."),
                io.Combo.Input("missing_caption", options=list(MISSING_CAPTION_CHOICES), default="train_empty",
                               tooltip="An image without a .txt (or with an empty one): train it on the empty "
                                       "caption (named in the report) or refuse the dataset."),
                io.Combo.Input("mask", options=list(MASK_CHOICES), default="none", optional=True,
                               tooltip="Where the masks output comes from (masked loss: connect it through "
                                       "Resolution Buckets' masks to Cached Training Dataset's masks or Train LoRA's mask). "
                                       + "; ".join(f"{k}: {v}" for k, v in MASK_CHOICES.items()) + "."),
            ],
            outputs=[
                io.Image.Output(display_name="images", is_output_list=True,
                                tooltip="The images in name order, RGB in 0..1, each at its own size."),
                io.String.Output(display_name="texts", is_output_list=True,
                                 tooltip="The captions, one per image in the same order (\"\" where none)."),
                io.String.Output(display_name="report",
                                 tooltip="What was read: counts, then one line per file something was decided "
                                         "for (orientation, bit depth, transparency, frames, missing caption) "
                                         "and the files not read."),
                io.Mask.Output(display_name="masks", is_output_list=True,
                               tooltip="One mask per image, at the image's size (see the mask input): connect to "
                                       "Resolution Buckets' masks, then to Cached Training Dataset's masks (or "
                                       "Train LoRA's mask)."),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, folder: Any = None, **_: Any) -> Any:
        """Re-read when an image or caption in the folder changes, not only when the inputs do."""
        try:
            return folder, folder_signature(dataset_root(folder))
        except ValueError:
            return folder

    @classmethod
    def execute(cls, folder: str, alpha: str, animated: str, missing_caption: str, mask: str = "none") -> io.NodeOutput:
        root = dataset_root(folder)
        try:
            data = load_dataset(root, f"input/{folder}", alpha, animated, missing_caption, mask)
        except DatasetError as exc:
            raise ValueError(f"{NODE}: input 'folder'={folder!r}: {exc}") from None
        for line in data.lines:
            log.info("%s: %s", NODE, line)
        if data.missing:
            log.warning("%s: %d images without a caption train on the empty caption: %s", NODE,
                        len(data.missing), ", ".join(data.missing))
        return io.NodeOutput(data.images, data.texts, "\n".join(data.lines), data.masks)


NODES = [PrecisionLoadImageDataset]
