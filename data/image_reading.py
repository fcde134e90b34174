"""One image file -> an RGB IMAGE in [0, 1], with every decision it took (docs/datasets.md).

What ComfyUI's folder loaders got wrong, and what ``read_image`` does instead:

- EXIF orientation (phone photos store the pixels sideways plus a tag): applied, so the image trains upright.
- 16-bit grayscale (PIL mode ``I;16``, ``I;16B``...; 16-bit PNG and TIFF): scaled from 0..65535. Treating
  it as 8-bit clips almost every pixel to white. 32-bit integer (``I``) pixels within 0..65535 are read the
  same way; others, and float (``F``) pixels outside 0..1, have no known range and are refused.
- Palette (``P``) images: colours from the palette, transparency from the palette's transparent entry.
- Transparency (an alpha channel, or a transparent palette entry or colour key): composited over the chosen
  ``alpha`` background (white, black or gray) or refused; converting RGBA to RGB drops alpha and shows
  whatever colour the transparent pixels happen to store (often black).
- Animated images (GIF, WebP) and multi-page TIFFs: the first frame, or refused.
- CMYK: converted to RGB without a colour profile (said in the notes).

Shapes and dtypes: the result is (1, H, W, 3) float32, H x W the upright size. Notes are short phrases
without the file name; a refusal is a ``ValueError`` whose message is a phrase of the same kind.
"""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
BACKGROUNDS = {"white": 1.0, "black": 0.0, "gray": 0.5}
ALPHA_CHOICES = (*BACKGROUNDS, "refuse")
ANIMATED_CHOICES = ("first_frame", "refuse")
_ORIENTATION = {2: "mirrored left-right", 3: "turned 180°", 4: "mirrored top-bottom", 5: "transposed",
                6: "turned 90° clockwise", 7: "transversed", 8: "turned 90° counter-clockwise"}
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_WITH_ALPHA = ("RGBA", "LA", "PA", "RGBa", "La")


def read_image(path: str, alpha: str = "white", animated: str = "first_frame") -> tuple[torch.Tensor, list[str]]:
    """The image at ``path`` as (1, H, W, 3) float32 in [0, 1] and the notes of what was decided.

    ``alpha``: background for transparent pixels (``BACKGROUNDS``) or "refuse"; ``animated``: "first_frame"
    or "refuse". Raises ValueError (a phrase naming the problem and the fix) for unreadable or refused files.
    """
    image, notes, _ = read_image_and_alpha(path, alpha, animated)
    return image, notes


def read_image_and_alpha(path: str, alpha: str = "white",
                         animated: str = "first_frame") -> tuple[torch.Tensor, list[str], torch.Tensor | None]:
    """``read_image`` and the image's alpha channel as (H, W) float32 in [0, 1] (upright, as the image), or None
    for an image without transparency data."""
    if alpha not in ALPHA_CHOICES or animated not in ANIMATED_CHOICES:
        raise ValueError(f"alpha={alpha!r} / animated={animated!r}: use one of {ALPHA_CHOICES} / {ANIMATED_CHOICES}")
    try:
        with Image.open(path) as img:
            notes: list[str] = []
            frame = _first_frame(img, animated, notes)
            frame = _upright(frame, notes)
            pixels = _pixels(frame, notes)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"cannot be read as an image ({exc}); replace or remove the file") from None
    rgb = _composite(pixels, alpha, notes)
    alpha_channel = torch.from_numpy(np.ascontiguousarray(pixels[..., 3])) if pixels.shape[-1] == 4 else None
    return torch.from_numpy(np.ascontiguousarray(rgb))[None], notes, alpha_channel


def read_mask(path: str) -> torch.Tensor:
    """A mask image (white = 1) as (H, W) float32 in [0, 1], upright: its gray levels (colour images through
    their luminance; a transparent pixel counts as 0). ValueError for a file that is not an image."""
    try:
        with Image.open(path) as img:
            frame = _upright(_first_frame(img, "first_frame", []), [])
            pixels = _pixels(frame, [])
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"cannot be read as an image ({exc}); replace or remove the file") from None
    if pixels.shape[-1] == 1:
        gray = pixels[..., 0]
    else:
        gray = pixels[..., :3] @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
        if pixels.shape[-1] == 4:
            gray = gray * pixels[..., 3]
    return torch.from_numpy(np.ascontiguousarray(gray.astype(np.float32))).clamp(0.0, 1.0)


def _first_frame(img: Image.Image, animated: str, notes: list[str]) -> Image.Image:
    frames = int(getattr(img, "n_frames", 1) or 1)
    if frames > 1:
        if animated == "refuse":
            raise ValueError(f"has {frames} frames (animated or multi-page) and animated='refuse'; set animated "
                             "to first_frame or save one frame as its own file")
        img.seek(0)
        notes.append(f"{frames} frames (animated or multi-page): the first frame is read")
    img.load()
    return img


def _upright(img: Image.Image, notes: list[str]) -> Image.Image:
    orientation = img.getexif().get(0x0112, 1)
    if orientation not in _ORIENTATION:
        return img
    notes.append(f"EXIF orientation {orientation} applied ({_ORIENTATION[orientation]})")
    return ImageOps.exif_transpose(img)


def _pixels(img: Image.Image, notes: list[str]) -> np.ndarray:
    """(H, W, C) float32 in [0, 1]: C = 1 (gray), 3 (RGB) or 4 (RGBA, straight alpha)."""
    mode = img.mode
    if mode in _SIXTEEN_BIT:
        notes.append(f"16-bit grayscale ({mode}): scaled from 0..65535")
        return (np.asarray(img).astype(np.float32) / 65535.0)[..., None]
    if mode == "I":
        values = np.asarray(img)
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > 65535:
            raise ValueError(f"has 32-bit integer pixels from {low} to {high}, which have no known range; save "
                             "it as an 8- or 16-bit image")
        notes.append("32-bit integer grayscale (I) with values in 0..65535: read as 16-bit")
        return (values.astype(np.float32) / 65535.0)[..., None]
    if mode == "F":
        values = np.asarray(img, dtype=np.float32)
        if not np.isfinite(values).all() or values.min() < 0.0 or values.max() > 1.0:
            raise ValueError(f"has float pixels from {float(np.nanmin(values)):g} to {float(np.nanmax(values)):g}, "
                             "outside 0..1; normalise it or save it as an 8- or 16-bit image")
        notes.append("32-bit float grayscale (F): values used as 0..1")
        return values[..., None]
    if mode == "P":
        notes.append("palette image (P): colours from its palette")
    elif mode == "CMYK":
        notes.append("CMYK converted to RGB without a colour profile")
    if mode in _WITH_ALPHA or img.has_transparency_data:
        return np.asarray(img.convert("RGBA")).astype(np.float32) / 255.0
    return np.asarray(img.convert("RGB")).astype(np.float32) / 255.0


def _composite(pixels: np.ndarray, alpha: str, notes: list[str]) -> np.ndarray:
    """(H, W, 3) RGB: gray repeated, alpha composited over the background (or refused when any pixel is
    not opaque); a fully opaque alpha channel changes nothing and is not mentioned."""
    if pixels.shape[-1] == 1:
        return np.repeat(pixels, 3, axis=-1)
    if pixels.shape[-1] == 3:
        return pixels
    rgb, a = pixels[..., :3], pixels[..., 3:]
    see_through = float((a < 1.0).mean())
    if see_through == 0.0:
        return rgb
    share = f"{100.0 * see_through:.3g} % of the pixels"
    if alpha == "refuse":
        raise ValueError(f"has transparent pixels ({share}) and alpha='refuse'; choose a background in 'alpha' "
                         "(white, black, gray) or remove the transparency")
    notes.append(f"transparent pixels ({share}) composited on {alpha}")
    return (rgb * a + np.float32(BACKGROUNDS[alpha]) * (1.0 - a)).astype(np.float32)


def paired_masks(masks: list | None, images: list, source: str) -> list[torch.Tensor | None]:
    """One (B, H, W) float32 mask per image (IMAGE (B, H, W, C)), each the size of its image; None for every image
    when no masks are given. A ValueError naming the mask and its image when they do not pair; ``source`` names
    the node whose masks output goes with these images (the fix)."""
    if not masks:
        return [None] * len(images)
    fix = f"one mask per image, the masks of these images in the same order (the masks output of {source})"
    if len(masks) != len(images):
        raise ValueError(f"input 'masks' has {len(masks)} masks for {len(images)} images; connect {fix}")
    out = []
    for i, (m, image) in enumerate(zip(masks, images)):
        if not isinstance(m, torch.Tensor) or m.ndim not in (2, 3) or 0 in m.shape:
            shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"input 'masks': mask {i} (0-based) has shape {shape}, not a MASK (B, H, W); "
                             f"connect {fix}")
        m = m.reshape(-1, *m.shape[-2:]).float()
        (h, w) = m.shape[-2:]
        if isinstance(image, torch.Tensor) and (h, w) != tuple(image.shape[1:3]):
            raise ValueError(f"input 'masks': mask {i} (0-based) is {w}x{h} px but image {i} is "
                             f"{image.shape[2]}x{image.shape[1]} px; connect {fix}")
        out.append(m)
    return out
