"""PrecisionLoadVideoDataset: a folder of video clips (and still images) with captions, cut to frame counts
the family's video VAE encodes (docs/video.md).

Outputs an IMAGE list (one frame batch (T, H, W, 3) per clip, as ComfyUI's Get Video Components gives a
video's frames) and the captions, so it feeds PrecisionResolutionBuckets and PrecisionCachedTrainingDataset
like the image loader does: a video VAE (Wan, HunyuanVideo, LTXV, Mochi) encodes each clip to one video
latent (B=1, C, T', H, W); a still image is a one-frame clip (T' = 1).
"""
from __future__ import annotations

import logging
from typing import Any

import folder_paths

from ..checks.gate import PrecisionNode
from ..host.comfy_io import io
from ...data.files import MISSING_CAPTION_CHOICES, DatasetError, folder_signature
from ...data.frames import FRAME_RULES
from .node import dataset_root
from ...data.video_files import STILL_EXTENSIONS, VIDEO_EXTENSIONS, load_clips

log = logging.getLogger(__name__)
NODE = "PrecisionLoadVideoDataset"


def _root(folder: str) -> str:
    try:
        return dataset_root(folder)
    except ValueError as exc:
        raise ValueError(str(exc).replace("PrecisionLoadImageDataset", NODE)) from None


def decode_video(path: str, frames: int) -> tuple[Any, int, float]:
    """The first ``frames`` frames of the video (all when it is shorter) as ComfyUI's Load Video + Get Video
    Components decode them (comfy_api's VideoFromFile), its frame count and frame rate. Where VideoFromFile can
    trim (0.33: start_time / duration) only the frames needed are decoded."""
    from comfy_api.latest import InputImpl

    video = InputImpl.VideoFromFile(path)
    try:
        fps, total = float(video.get_frame_rate()), int(video.get_frame_count())
    except Exception as exc:  # av's errors, a file without a video stream
        raise ValueError(f"cannot be read as a video ({exc}); replace or remove the file") from None
    if fps > 0 and frames < total:
        try:
            video = InputImpl.VideoFromFile(path, start_time=0, duration=frames / fps)
        except TypeError:  # 0.3.75: no trimming; everything is decoded and cut after
            pass
    try:
        images = video.get_components().images
    except Exception as exc:
        raise ValueError(f"cannot be read as a video ({exc}); replace or remove the file") from None
    return images, total, fps


class PrecisionLoadVideoDataset(PrecisionNode):
    NODE = NODE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE, display_name="Precision Load Video Dataset", category="precision_lora/data",
            description="Loads a folder of video clips with their .txt captions from ComfyUI's input/ folder for "
                        "training video models (Wan 2.1/2.2, HunyuanVideo, LTXV, Mochi). Each clip is decoded as "
                        "ComfyUI's Load Video decodes it and cut to a frame count the family's VAE encodes "
                        "(4k+1, 8k+1, 6k+1); still images in the folder train as one-frame clips. Connect clips "
                        "and texts to Cached Training Dataset (with the family's VAE) like the image loader's "
                        f"outputs. Reads {', '.join(VIDEO_EXTENSIONS)} and {', '.join(STILL_EXTENSIONS)}.",
            inputs=[
                io.Combo.Input("folder", options=folder_paths.get_input_subfolders(),
                               tooltip="A folder under ComfyUI's input/: clips, each with a .txt caption of the "
                                       "same name; subfolders named <N>_<name> repeat their clips N times."),
                io.Combo.Input("frame_rule", options=list(FRAME_RULES), default=next(iter(FRAME_RULES)),
                               tooltip="Frame counts the model's VAE encodes: Wan 2.1/2.2 and HunyuanVideo 4k+1 "
                                       "(1, 5, 9, ..., 81), LTXV 8k+1, Mochi 6k+1; 24k+1 fits all. Each clip keeps "
                                       "its first frames up to the longest count that fits (said in the report)."),
                io.Int.Input("max_frames", default=33, min=1, max=1025,
                             tooltip="At most this many frames per clip (after frame_stride), from the start. "
                                     "Longer clips cost memory and time per step roughly in proportion."),
                io.Int.Input("frame_stride", default=1, min=1, max=64,
                             tooltip="Read every n-th frame (2 halves the frame rate: a 30 fps clip trains at "
                                     "15 fps and covers twice the time in the same frames)."),
                io.Combo.Input("missing_caption", options=list(MISSING_CAPTION_CHOICES), default="train_empty",
                               tooltip="A clip without a .txt (or with an empty one): train it on the empty "
                                       "caption (named in the report) or refuse the dataset."),
            ],
            outputs=[
                io.Image.Output(display_name="clips", is_output_list=True,
                                tooltip="One frame batch (frames, H, W, 3) per clip, RGB in 0..1, in name order; "
                                        "a still image is a batch of one frame."),
                io.String.Output(display_name="texts", is_output_list=True,
                                 tooltip="The captions, one per clip in the same order (\"\" where none)."),
                io.String.Output(display_name="report",
                                 tooltip="What was read: clips, their frame counts and sizes, every clip cut to "
                                         "the frame rule, missing captions and files not read."),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, folder: Any = None, **_: Any) -> Any:
        """Re-read when a clip or caption in the folder changes, not only when the inputs do."""
        try:
            return folder, folder_signature(dataset_root(folder))
        except ValueError:
            return folder

    @classmethod
    def execute(cls, folder: str, frame_rule: str, max_frames: int, frame_stride: int,
                missing_caption: str) -> io.NodeOutput:
        import comfy.utils

        root = _root(folder)
        if frame_rule not in FRAME_RULES:
            raise ValueError(f"{NODE}: input 'frame_rule'={frame_rule!r} is not one of "
                             f"{list(FRAME_RULES)}; pick one from the list")
        bar = comfy.utils.ProgressBar(1)
        try:
            data = load_clips(root, f"input/{folder}", FRAME_RULES[frame_rule], max_frames, frame_stride,
                              decode_video, missing_caption, progress=lambda done, total: bar.update_absolute(done, total))
        except DatasetError as exc:
            raise ValueError(f"{NODE}: input 'folder'={folder!r}: {exc}") from None
        for line in data.lines:
            log.info("%s: %s", NODE, line)
        if data.missing:
            log.warning("%s: %d clips without a caption train on the empty caption: %s", NODE,
                        len(data.missing), ", ".join(data.missing))
        return io.NodeOutput(data.clips, data.texts, "\n".join(data.lines))


NODES = [PrecisionLoadVideoDataset]
