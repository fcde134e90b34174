"""PrecisionResolutionBuckets: images to training sizes the model can take, bucketed by aspect ratio.

Sits between ComfyUI's image folder loader (LoadImageTextDataSetFromFolder) and the VAE encode
(MakeTrainingDataset): every image is scaled (aspect kept) to cover the bucket nearest its aspect ratio
and center-cropped to it. Buckets have about ``resolution``^2 pixels and sides that are multiples of the
model's pixel multiple (patch size x VAE downscale), so every latent fits the model's patch grid. Images
and their texts keep their order (the caption of image i stays text i).

Also ``size_problem``: the check PrecisionTrainLoRA runs on every latent before training, so a latent
off the patch grid is named (index, shape, fix) instead of failing inside the model.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ...data.image_reading import paired_masks
from ..checks.gate import PrecisionNode
from ..host.comfy_io import io
from ..model.info import describe_model

log = logging.getLogger(__name__)
NODE = "PrecisionResolutionBuckets"
MAX_ASPECT = 4.0  # buckets span aspect ratios 1:4 .. 4:1; a more extreme image is cropped to the nearest
# Families whose DiT pads its input to the patch grid itself (ComfyUI's pad_to_patch_size): a latent off
# the grid trains there (on a padded border), so it is reported, not refused. Others fail in the model.
_PADDING_FAMILIES = {"flux1", "flux2", "chroma"}
# VAE downscale of latent formats that do not state it (ComfyUI 0.3.75 has no spacial_downscale_ratio).
_DOWNSCALE_BY_FORMAT = {"Flux2": 16, "Wan22": 16}


def _int_of(value: Any) -> int | None:
    if isinstance(value, (list, tuple)) and value:
        value = value[-1]  # (temporal, height, width) or (height, width) patch sizes: the spatial one
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def latent_multiple(model: Any) -> int:
    """The model's spatial patch size in latent pixels (1 when it has none)."""
    cfg = dict(model.model.model_config.unet_config)
    dm = model.model.diffusion_model
    for key in ("patch_size", "patch_spatial"):
        found = _int_of(cfg.get(key)) or _int_of(getattr(dm, key, None))
        if found:
            return found
    return 1


def vae_downscale(model: Any) -> int:
    fmt = model.model.latent_format
    ratio = getattr(fmt, "spacial_downscale_ratio", None)
    return int(ratio) if ratio else _DOWNSCALE_BY_FORMAT.get(type(fmt).__name__, 8)


def pixel_multiple(model: Any) -> int:
    """Image sides must be multiples of this for the model's latents to fit its patch grid."""
    return latent_multiple(model) * vae_downscale(model)


def size_problem(model: Any, samples: torch.Tensor) -> str | None:
    """Why a LATENT's (..., H, W) is off ``model``'s patch grid (the phrase the training node prefixes with
    the latent's index), or None. Families that pad their input are only logged."""
    m = latent_multiple(model)
    h, w = int(samples.shape[-2]), int(samples.shape[-1])
    if m <= 1 or (h % m == 0 and w % m == 0):
        return None
    px = m * vae_downscale(model)
    family = describe_model(model).family
    msg = (f"has shape {tuple(samples.shape)}: {h} x {w} latent pixels (about {h * vae_downscale(model)} x "
           f"{w * vae_downscale(model)} image pixels), but this model ({family}) needs multiples of {m} latent "
           f"pixels ({px} image pixels); put PrecisionResolutionBuckets between the image loader and the VAE "
           f"encode (MakeTrainingDataset), or resize the image to multiples of {px} px")
    if family in _PADDING_FAMILIES:
        log.warning("PrecisionTrainLoRA: a latent %s; the model pads it, so it trains", msg)
        return None
    return msg


def buckets(resolution: int, multiple: int) -> list[tuple[int, int]]:
    """(width, height) pairs, multiples of ``multiple``, of at most ``resolution``^2 pixels and as close to it
    as the multiple allows, from aspect 1:MAX_ASPECT to MAX_ASPECT:1."""
    area = resolution * resolution
    out = set()
    for w in range(multiple, area // multiple + 1, multiple):
        h = (area // w) // multiple * multiple
        if h >= multiple and max(w, h) / min(w, h) <= MAX_ASPECT:
            out.add((w, h))
    return sorted(out)


def nearest_bucket(width: int, height: int, choices: list[tuple[int, int]]) -> tuple[int, int]:
    ratio = math.log(width / height)
    return min(choices, key=lambda b: (abs(math.log(b[0] / b[1]) - ratio), -b[0] * b[1]))


def _err(message: str) -> ValueError:
    return ValueError(f"{NODE}: {message}")


def _image(i: int, image: Any) -> torch.Tensor:
    """The IMAGE tensor (B, H, W, C) of item ``i``, or an error naming it."""
    where = f"input 'images': image {i} (0-based, in the loader's order)"
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in (1, 3, 4):
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise _err(f"{where} is unreadable ({shape}); connect IMAGEs (B, H, W, C) from an image loader")
    if image.shape[0] == 0 or image.shape[1] == 0 or image.shape[2] == 0:
        raise _err(f"{where} has zero size {tuple(image.shape)}; remove the file or replace it")
    if image.is_floating_point() and not bool(torch.isfinite(image).all()):
        raise _err(f"{where} holds NaN/inf; replace the file")
    return image


def fit(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``image`` (B, H, W, C) scaled (aspect kept) to cover ``size`` (width, height), center-cropped to it."""
    w, h = size
    src_h, src_w = int(image.shape[1]), int(image.shape[2])
    scale = max(w / src_w, h / src_h)
    new_w, new_h = max(w, math.ceil(src_w * scale - 1e-6)), max(h, math.ceil(src_h * scale - 1e-6))
    x = image.movedim(-1, 1).float()
    if (new_h, new_w) != (src_h, src_w):
        x = torch.nn.functional.interpolate(x, size=(new_h, new_w), mode="bicubic", antialias=True,
                                            align_corners=False).clamp(0.0, 1.0)
    top, left = (new_h - h) // 2, (new_w - w) // 2
    return x[:, :, top:top + h, left:left + w].movedim(1, -1).to(image.dtype).contiguous()


def resolve_multiple(multiple: int, model: Any | None) -> tuple[int, str]:
    if multiple > 0:
        return multiple, "set on the node"
    if model is None:
        return 16, "default (no model connected)"
    m, d = latent_multiple(model), vae_downscale(model)
    return m * d, f"from the model ({describe_model(model).family}: patch {m} x VAE {d})"


def bucket_images(images: list[Any], resolution: int, multiple: int, max_upscale: float) -> tuple[list[torch.Tensor], dict]:
    """Each image fitted to its bucket (same order) and {bucket: count}."""
    choices = buckets(resolution, multiple)
    if not choices:
        raise _err(f"input 'resolution'={resolution} is smaller than the multiple {multiple} px; raise resolution")
    out, counts = [], {}
    for i, raw in enumerate(images):
        image = _image(i, raw)
        src_h, src_w = int(image.shape[1]), int(image.shape[2])
        size = nearest_bucket(src_w, src_h, choices)
        need = max(size[0] / src_w, size[1] / src_h)
        if need > max_upscale + 1e-9:
            raise _err(f"input 'images': image {i} (0-based, in the loader's order) is {src_w} x {src_h} px, too "
                       f"small for resolution {resolution}: its bucket {size[0]} x {size[1]} needs {need:.2f}x "
                       f"upscaling (max_upscale {max_upscale}); lower resolution, raise max_upscale, or remove the image")
        out.append(fit(image, size))
        counts[size] = counts.get(size, 0) + 1
    return out, counts


def _empty_texts(texts: list[Any]) -> str:
    """A report sentence naming the empty texts among non-empty ones (an image without its .txt caption
    trains on the empty caption), or ''."""
    empty = [i for i, t in enumerate(texts) if isinstance(t, str) and not t.strip()]
    if not empty or len(empty) == len(texts):
        return ""
    which = ", ".join(str(i) for i in empty)
    return (f"; texts {which} (0-based, the images' order) are empty while the others are not: those images "
            "train on the empty caption (a missing .txt?)")


class PrecisionResolutionBuckets(PrecisionNode):
    NODE = NODE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE, display_name="Precision Resolution Buckets", category="precision_lora/data",
            description="Resizes a folder's images to a training resolution: each image is scaled (aspect kept) "
                        "and center-cropped to the bucket nearest its aspect ratio; bucket sides are multiples of "
                        "the model's patch size x VAE downscale, so every latent fits the model. Texts pass "
                        "through in the same order. Connect between LoadImageTextDataSetFromFolder and "
                        "MakeTrainingDataset.",
            is_input_list=True,
            inputs=[
                io.Image.Input("images", tooltip="The image list of PrecisionLoadImageDataset or LoadImageTextDataSetFromFolder (or any IMAGEs)."),
                io.Int.Input("resolution", default=1024, min=64, max=8192, step=16,
                             tooltip="Target side: every bucket has about resolution x resolution pixels (512, 768, 1024 ...)."),
                io.Int.Input("multiple", default=0, min=0, max=512, step=1,
                             tooltip="Bucket sides are multiples of this many pixels. 0 = from the connected model "
                                     "(patch size x VAE downscale: 16 for Flux.1, Cosmos and Anima), 16 without one."),
                io.Float.Input("max_upscale", default=2.0, min=1.0, max=16.0, step=0.1,
                               tooltip="Refuse (by index) an image that must be enlarged more than this to fill its bucket."),
                io.String.Input("texts", optional=True, force_input=True,
                                tooltip="The captions of PrecisionLoadImageDataset or LoadImageTextDataSetFromFolder: passed through in the same order."),
                io.Model.Input("model", optional=True, tooltip="The model to train: sets the multiple when 'multiple' is 0."),
                io.Mask.Input("masks", optional=True,
                              tooltip="One mask per image at the image's size (PrecisionLoadImageDataset's masks): "
                                      "scaled and cropped exactly as its image, for Cached Training Dataset's "
                                      "masks (or Train LoRA's mask)."),
            ],
            outputs=[
                io.Image.Output(display_name="images", is_output_list=True, tooltip="The images at their bucket sizes, in input order."),
                io.String.Output(display_name="texts", is_output_list=True, tooltip="The texts, unchanged and in the same order."),
                io.String.Output(display_name="report", tooltip="Buckets and their image counts, and where the multiple came from."),
                io.Mask.Output(display_name="masks", is_output_list=True,
                               tooltip="The masks at their images' bucket sizes, in input order (the whole image "
                                       "where none is connected): connect to Cached Training Dataset's "
                                       "masks (each rides on its image's latent), or to Train LoRA's mask."),
            ],
        )

    @classmethod
    def execute(cls, images, resolution, multiple, max_upscale, texts=None, model=None, masks=None) -> io.NodeOutput:
        resolution, multiple, max_upscale = resolution[0], multiple[0], max_upscale[0]
        model = model[0] if model else None
        texts = list(texts) if texts else []
        if not images:
            raise _err("input 'images' is empty: connect LoadImageTextDataSetFromFolder's images")
        if texts and len(texts) != len(images):
            raise _err(f"input 'texts' has {len(texts)} entries for {len(images)} images; connect the loader's "
                       "texts output (one per image)")
        try:
            masks = paired_masks(list(masks) if masks else [], images, "Precision Load Image Dataset")
        except ValueError as exc:
            raise _err(str(exc)) from None
        step, source = resolve_multiple(multiple, model)
        fitted, counts = bucket_images(images, resolution, step, max_upscale)
        fitted_masks = [fit(m[..., None], (int(f.shape[2]), int(f.shape[1])))[..., 0] if m is not None
                        else torch.ones(f.shape[:3], dtype=torch.float32) for m, f in zip(masks, fitted)]
        rows = ", ".join(f"{w}x{h} ({n})" for (w, h), n in sorted(counts.items(), key=lambda kv: -kv[1]))
        report = (f"{len(fitted)} images -> {len(counts)} buckets of about {resolution}^2 px: {rows}; "
                  f"multiple {step} px ({source})")
        report += _empty_texts(texts)
        log.info("%s: %s", NODE, report)
        return io.NodeOutput(fitted, texts, report, fitted_masks)


NODES = [PrecisionResolutionBuckets]
