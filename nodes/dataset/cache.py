"""PrecisionCachedTrainingDataset: ComfyUI's Make Training Dataset with an on-disk cache (docs/dataset_cache.md).

Takes what MakeTrainingDataset takes (IMAGE list, VAE, CLIP, texts) and returns what it returns (one LATENT
and one CONDITIONING per image, the inputs of Train LoRA), encoded by the same VAE / CLIP calls
(``cache_glue.py``). Each latent and each caption's text-encoder output is kept in
``<base>/cache/precision_lora/dataset/{latents,text}/<sha256>.safetensors``, keyed by the image's pixels
(hence its resolution) and the VAE's identity, or by the caption, its tokens and the text encoder's identity
(``data.encode_cache``). A later run, in any workflow and after a server restart, reads the entry
instead of encoding; a changed image, caption, resolution or encoder has another key. A file that does not
verify is encoded again and overwritten, never used. The report says how many items were encoded and how
many came from the cache.

With ``masks`` (one MASK per image, Precision Resolution Buckets' ``masks``), each image's mask is brought to its
latent's grid (``training.masks.to_grid``, the area average Train LoRA uses) and rides on its LATENT as
``noise_mask`` (ComfyUI's convention, as Set Latent Noise Mask), so Train LoRA trains it masked with the mask
paired to its own image whatever happens to the order later. The grid masks are cache entries too
(``masks/<sha256>``, keyed by the image's latent key and the mask's pixels).

``outside_mask`` says what the VAE sees outside the masks. ``keep``: the whole image (the model reads the
region outside the mask as context, and the loss weighs it by Train LoRA's ``unmasked_weight``; at weight 0
those pixels still change the LoRA through the VAE encoder's and the model's receptive fields). A colour
(``data.image_reading.BACKGROUNDS``): each pixel becomes ``mask * pixel + (1 - mask) * colour`` before encoding,
so a pixel where its mask is 0 never reaches the latent, the model or the LoRA (docs/datasets.md).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...data.encode_cache import BadEntry, EntryStore, NotCacheable, digest, pack_conditioning, unpack_conditioning
from . import cache_glue as glue
from ...data.frames import frames_problem, vae_family, vae_frame_step
from ...data.image_reading import BACKGROUNDS, paired_masks
from ...training.masks import OUTSIDE_KEY, to_grid
from ..checks.gate import PrecisionNode
from ..host import page
from ..host.comfy_io import io, ui

log = logging.getLogger(__name__)
NODE = "PrecisionCachedTrainingDataset"
MODES = ("use", "rebuild", "off")  # read+write / encode everything and overwrite / no disk at all
OUTSIDE = ("keep", *BACKGROUNDS)  # what the VAE sees where a mask is 0: the image, or a colour


def _err(message: str) -> ValueError:
    return ValueError(f"{NODE}: {message}")


@dataclass
class CacheReport:
    """What one run did: per kind (``latents`` = images, ``text`` = distinct captions) items encoded and
    read from the cache, entries that failed verification, and why results were not stored (if so)."""

    folder: str
    mode: str
    images: int = 0
    captions: int = 0
    encoded: dict[str, int] = field(default_factory=lambda: {"latents": 0, "text": 0, "masks": 0})
    cached: dict[str, int] = field(default_factory=lambda: {"latents": 0, "text": 0, "masks": 0})
    masks: int = 0  # images with a mask
    rejected: list[str] = field(default_factory=list)
    not_stored: list[str] = field(default_factory=list)
    seconds: float = 0.0
    clips: str = ""  # with a video VAE: what the clips are and the latent frames they encode to
    outside: str = "keep"  # outside_mask

    def summary(self) -> str:
        n_img, n_txt = self.encoded["latents"] + self.cached["latents"], self.encoded["text"] + self.cached["text"]
        parts = [f"{self.images} images ({n_img} distinct): {self.encoded['latents']} encoded, "
                 f"{self.cached['latents']} from cache",
                 f"{self.captions} captions ({n_txt} distinct): {self.encoded['text']} encoded, "
                 f"{self.cached['text']} from cache"]
        if self.masks:
            n_mask = self.encoded["masks"] + self.cached["masks"]
            parts.append(f"{self.masks} masks ({n_mask} distinct, on their latents as noise_mask): "
                         f"{self.encoded['masks']} computed, {self.cached['masks']} from cache")
        if self.outside != "keep":
            parts.append(f"pixels outside the masks set to {self.outside} before encoding")
        if self.clips:
            parts.append(self.clips)
        if self.rejected:
            parts.append(f"{len(self.rejected)} cache entries failed verification and were encoded again")
        parts += self.not_stored
        where = "cache off" if self.mode == "off" else f"cache {self.folder}"
        return "; ".join(parts) + f"; {where} ({self.mode}); {self.seconds:.1f} s"


@dataclass
class _Item:
    kind: str  # "latents", "text" or "masks"
    key: str
    source: Any  # the image (B, H, W, 3), the caption's (text, tokens) or the mask's (B, H, W) and its latent's key
    value: Any = None  # the latent tensor, the CONDITIONING or the grid mask (B, 1, h, w)


def _texts(texts: list | None, n: int) -> list[str]:
    """MakeTrainingDataset's rule: none -> "" for all, one -> for all, else exactly one per image."""
    texts = list(texts or []) or [""]
    if len(texts) == 1:
        return texts * n
    if len(texts) != n:
        raise _err(f"input 'texts' has {len(texts)} captions for {n} images; connect one caption per image (the "
                   "folder loader's texts), a single caption for all, or none")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise _err(f"input 'texts': caption {i} is a {type(t).__name__}, not text; connect STRING captions")
    return texts


def _images(images: list) -> list[torch.Tensor]:
    if not images:
        raise _err("input 'images' is empty: connect an image list (LoadImageTextDataSetFromFolder's images)")
    for i, image in enumerate(images):
        if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] < 3 or 0 in image.shape:
            shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise _err(f"input 'images': image {i} (0-based) has shape {shape}; connect IMAGEs (B, H, W, 3 or 4)")
    return images


def _masks(masks: list | None, images: list[torch.Tensor], video: bool) -> list[torch.Tensor | None]:
    """Each image's mask as (B, H, W) (B: 1, or the image batch's size with an image VAE), None for all when no
    masks are connected; a mask that does not pair with its image is refused naming both."""
    try:
        paired = paired_masks(masks, images, "Precision Resolution Buckets")
    except ValueError as exc:
        raise _err(str(exc)) from None
    for i, (m, image) in enumerate(zip(paired, images)):
        frames = 1 if video else int(image.shape[0])
        if m is not None and m.shape[0] not in (1, frames):
            what = "one mask for the clip" if video else f"one mask for all {frames} images of the batch or one each"
            raise _err(f"input 'masks': mask {i} (0-based) has {m.shape[0]} masks for image {i}; give {what}")
    return paired


def _fill_outside(images: list[torch.Tensor], masks: list[torch.Tensor | None], outside: str) -> list[torch.Tensor]:
    """The images with every pixel blended toward the ``outside`` colour by its mask (0: the colour exactly, 1: the
    pixel exactly); an image without a mask is unchanged. A mask (1, H, W) covers every image (frame) of its batch."""
    if outside == "keep":
        return images
    if all(m is None for m in masks):
        raise _err(f"input 'outside_mask' is {outside!r} but no masks are connected; connect masks (Precision "
                   "Resolution Buckets' masks) or set outside_mask to keep")
    colour = BACKGROUNDS[outside]
    out = []
    for image, m in zip(images, masks):
        if m is not None:
            m = m.to(image.device, image.dtype).unsqueeze(-1)
            image = torch.cat([image[..., :3] * m + colour * (1 - m), image[..., 3:]], dim=-1)
        out.append(image)
    return out


def _check_frames(images: list[torch.Tensor], vae: Any) -> str:
    """With a video VAE (each IMAGE batch is one clip, encoded to one video latent): refuses a clip whose
    frame count the VAE does not encode whole, and says what the clips are; '' for an image VAE."""
    step = vae_frame_step(vae)
    if step is None:
        return ""
    lengths = [int(image.shape[0]) for image in images]
    for i, n in enumerate(lengths):
        problem = frames_problem(vae, n)
        if problem is not None:
            raise _err(f"input 'images': clip {i} (0-based, in the loader's order) {problem}")
    shown = sorted(set(lengths))
    return (f"{vae_family(vae)} video VAE ({step}k+1 frames): each image batch is one clip; frames "
            f"{', '.join(f'{n} -> {(n - 1) // step + 1} latent' for n in shown)}")


def _plan(images: list[torch.Tensor], texts: list[str], vae: Any, clip: Any,
          masks: list[torch.Tensor | None]) -> tuple[list[str], list[str], list[str | None], dict]:
    """Keys of every image, caption and mask (None: no mask), and the distinct items by key (images before
    captions)."""
    vae_id = glue.vae_identity(vae)
    clip_id = glue.clip_identity(clip)
    items: dict[str, _Item] = {}
    image_keys, text_keys = [], []
    for image in images:
        key = digest("latents", vae_id, image[:, :, :, :3])
        items.setdefault(key, _Item("latents", key, image))
        image_keys.append(key)
    tokens_of: dict[str, str] = {}
    for text in texts:
        if text not in tokens_of:
            tokens = glue.tokenize(clip, text)
            tokens_of[text] = key = digest("text", clip_id, text, tokens)
            items.setdefault(key, _Item("text", key, (text, tokens)))
        text_keys.append(tokens_of[text])
    mask_keys: list[str | None] = []
    for image_key, m in zip(image_keys, masks):
        key = None if m is None else digest("masks", image_key, m)
        if key is not None:
            items.setdefault(key, _Item("masks", key, (m, image_key)))
        mask_keys.append(key)
    return image_keys, text_keys, mask_keys, items


def _read(store: EntryStore, item: _Item, report: CacheReport) -> bool:
    try:
        entry = store.load(item.kind, item.key)
    except BadEntry as exc:
        log.warning("%s: %s; encoding it again", NODE, exc)
        report.rejected.append(str(exc))
        return False
    if entry is None:
        return False
    tensors, layout = entry
    device = glue.output_device()
    tensors = {k: v.to(device) for k, v in tensors.items()}
    item.value = unpack_conditioning(tensors, layout) if item.kind == "text" else tensors["samples"]
    return True


def _grid(mask: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """(B, H, W) pixel masks on the grid of their ``latent`` (B', C, [T,] h, w), as (B, 1, h, w)."""
    return torch.stack([to_grid(row, tuple(latent.shape[1:])).reshape(1, *latent.shape[-2:]) for row in mask])


def _encode(item: _Item, vae: Any, clip: Any, items: dict) -> None:
    if item.kind == "latents":
        item.value = glue.encode_image(vae, item.source)
    elif item.kind == "masks":
        item.value = _grid(item.source[0], items[item.source[1]].value)
    else:
        item.value = glue.encode_tokens(clip, item.source[1])


def _write(store: EntryStore, item: _Item, report: CacheReport) -> None:
    try:
        if item.kind == "latents":
            tensors, layout, info = {"samples": item.value}, None, {"image": list(item.source.shape)}
        elif item.kind == "masks":
            tensors, layout, info = {"samples": item.value}, None, {"mask": list(item.source[0].shape)}
        else:
            (tensors, layout), info = pack_conditioning(item.value), {"caption": item.source[0]}
        store.store(item.kind, item.key, tensors, layout, info)
    except (NotCacheable, OSError) as exc:
        note = f"not stored: {item.kind} ({type(exc).__name__}: {exc})"
        log.warning("%s: %s", NODE, note)
        if note not in report.not_stored:
            report.not_stored.append(note)


def build(images: list, texts: list | None, vae: Any, clip: Any, mode: str, folder: str,
          node_id: str | None = None, send_text=None,
          masks: list | None = None, outside: str = "keep") -> tuple[list[dict], list[list], CacheReport]:
    """The dataset (one LATENT dict, with its image's mask as ``noise_mask`` when ``masks`` are given, and one
    CONDITIONING per image, in order) and what the cache did. ``outside``: ``OUTSIDE``, what the VAE sees where
    a mask is 0 (``_fill_outside``)."""
    began = time.monotonic()
    images = _images(images)
    texts = _texts(texts, len(images))
    clips = _check_frames(images, vae)
    pixel_masks = _masks(masks, images, video=vae_frame_step(vae) is not None)
    images = _fill_outside(images, pixel_masks, outside)
    image_keys, text_keys, mask_keys, items = _plan(images, texts, vae, clip, pixel_masks)
    report = CacheReport(folder, mode, images=len(images), captions=len(texts), clips=clips,
                         masks=sum(k is not None for k in mask_keys), outside=outside)
    store = EntryStore(folder)
    hooks = glue.clip_hooks(clip)
    if hooks is not None:
        report.not_stored.append(hooks)
    usable = lambda it: mode == "use" and not (it.kind == "text" and hooks)  # noqa: E731
    todo = [it for it in items.values() if not (usable(it) and _read(store, it, report))]
    # captions first: the text encoder leaves memory before the VAE; masks last, on their encoded latents
    todo.sort(key=lambda it: ("text", "latents", "masks").index(it.kind))
    for it in items.values():
        if it.value is not None:
            report.cached[it.kind] += 1
    label = {"text": "caption", "latents": "image", "masks": "mask"}
    progress = glue.Progress(NODE, node_id, len(items), {label[k]: sum(it.kind == k for it in todo) for k in label},
                             send_text)
    progress.hit(len(items) - len(todo))
    for it in todo:
        glue.check_interrupt()
        t0 = time.monotonic()
        _encode(it, vae, clip, items)
        report.encoded[it.kind] += 1
        if mode != "off" and not (it.kind == "text" and hooks):
            _write(store, it, report)
        progress.encoded_one(label[it.kind], time.monotonic() - t0)
    filled = {} if outside == "keep" else {OUTSIDE_KEY: outside}
    latents = [{"samples": items[k].value, **({} if m is None else {"noise_mask": items[m].value, **filled})}
               for k, m in zip(image_keys, mask_keys)]
    conditioning = [items[k].value for k in text_keys]
    report.seconds = time.monotonic() - began
    return latents, conditioning, report


class PrecisionCachedTrainingDataset(PrecisionNode):
    NODE = NODE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE, display_name="Cached Training Dataset (Precision)", category="precision_lora/data",
            description="Make Training Dataset with a disk cache: encodes every image with the VAE and every "
                        "caption with the text encoder exactly as ComfyUI's Make Training Dataset does, keeps each "
                        "result in <ComfyUI>/cache/precision_lora/dataset, and reads it back on later runs (any "
                        "workflow, after restarts) instead of encoding again. A changed image, caption, "
                        "resolution or encoder encodes that item again. With masks, each image's mask rides on its "
                        "LATENT as noise_mask (masked loss). Outputs go to Train LoRA's latents and conditioning.",
            is_input_list=True, is_output_node=True,
            inputs=[
                io.Image.Input("images", tooltip="The images to train on (LoadImageTextDataSetFromFolder's images, or "
                                                 "Precision Resolution Buckets' images). With a video VAE (Wan, "
                                                 "HunyuanVideo, LTXV, Mochi) each IMAGE batch is one clip (Precision "
                                                 "Load Video Dataset's clips, Get Video Components' images): its "
                                                 "frames must number 4k+1 (Wan, HunyuanVideo), 8k+1 (LTXV) or 6k+1 "
                                                 "(Mochi)."),
                io.Vae.Input("vae", tooltip="The VAE that encodes each image to its latent (e.g. Flux's ae)."),
                io.Clip.Input("clip", tooltip="The text encoder(s) that encode each caption (e.g. DualCLIPLoader's "
                                              "clip_l + t5xxl)."),
                io.String.Input("texts", optional=True, force_input=True,
                                tooltip="The captions: one per image (the folder loader's texts), one for all, or "
                                        "none (every image gets the empty caption), as Make Training Dataset."),
                io.Combo.Input("cache", options=list(MODES), default=MODES[0], optional=True,
                               tooltip="use: read results from the cache and store new ones. rebuild: encode "
                                       "everything again and overwrite the entries. off: encode without the cache."),
                io.Mask.Input("masks", optional=True,
                              tooltip="One mask per image at the image's size (Precision Resolution Buckets' masks, "
                                      "white = train here): each rides on its image's LATENT as noise_mask, so "
                                      "Train LoRA trains it masked (masked loss, Train Settings' unmasked_weight). "
                                      "A mask whose size is not its image's is refused."),
                io.Combo.Input("outside_mask", options=list(OUTSIDE), default=OUTSIDE[0], optional=True,
                               tooltip="What the VAE sees where a mask is 0. keep: the whole image; the model reads "
                                       "the background as context, so it still shapes the LoRA even at "
                                       "unmasked_weight 0. gray / white / black: those pixels are set to the colour "
                                       "before encoding (soft mask edges blend), so they never reach the LoRA; use "
                                       "with unmasked_weight 0, else the LoRA learns the colour there. Needs masks."),
            ],
            outputs=[
                io.Latent.Output(display_name="latents", is_output_list=True,
                                 tooltip="One LATENT per image, in order (with its image's mask as noise_mask when "
                                         "masks are connected): connect to Train LoRA's latents."),
                io.Conditioning.Output(display_name="conditioning", is_output_list=True,
                                       tooltip="One CONDITIONING per image, in order: connect to Train LoRA's conditioning."),
                io.String.Output(display_name="report",
                                 tooltip="Items encoded and read from the cache, and where the cache is."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, images, vae, clip, texts=None, cache=None, masks=None, outside_mask=None) -> io.NodeOutput:
        mode = (cache or [MODES[0]])[0]
        outside = (outside_mask or [OUTSIDE[0]])[0]
        node_id = page.executing_ids(getattr(getattr(cls, "hidden", None), "unique_id", None))[0]
        folder = glue.cache_folder()
        latents, conditioning, report = build(images, texts, vae[0], clip[0], mode, folder, node_id,
                                              (lambda text: page.show_on_node(text, node_id)), masks, outside)
        text = report.summary()
        log.info("%s: %s", NODE, text)
        return io.NodeOutput(latents, conditioning, text, ui=ui.PreviewText(text))


NODES = [PrecisionCachedTrainingDataset]
