"""PrecisionLossGraph: loss history -> learning-curve image (raw + smoothed), saved as PNG + CSV.

Accepts ComfyUI's ``LOSS_MAP`` (``{"loss": [float, ...]}``) from PrecisionTrainLoRA or ComfyUI's own
TrainLoraNode. Non-finite values are dropped; a single point or a constant curve is drawn with a padded
value range; log scale needs positive values (zeros are clamped to a tenth of the smallest positive).
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from ...training.files import atomic_write
from ..checks.gate import PrecisionNode
from ..host.comfy_io import io, ui
from ..host.types import LossMapType

NODE = "PrecisionLossGraph"
MARGIN = (56, 16, 16, 36)  # left, top, right, bottom (pixels)


def _err(message: str) -> ValueError:
    return ValueError(f"{NODE}: {message}")


def finite_losses(loss_map: object) -> list[float]:
    """The finite values of ``loss_map["loss"]``; ValueError naming the input when there are none."""
    values = loss_map.get("loss") if isinstance(loss_map, dict) else None
    if not isinstance(values, (list, tuple)):
        raise _err("input 'loss' must be a LOSS_MAP {'loss': [...]}, from PrecisionTrainLoRA or TrainLoraNode")
    out = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not out:
        raise _err(f"input 'loss' has no finite values ({len(values)} entries); train at least one step first")
    return out


def smooth(values: list[float], factor: float) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard): factor 0 = raw, 0.99 = very smooth."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = factor * avg + (1.0 - factor) * v
        out.append(avg / (1.0 - factor ** (i + 1)) if factor > 0 else v)
    return out


def value_range(values: list[float], log_scale: bool) -> tuple[list[float], float, float]:
    """Transformed values and a non-empty (lo, hi) range for them."""
    if log_scale:
        positive = [v for v in values if v > 0]
        floor = min(positive) / 10 if positive else 1e-12
        values = [math.log10(max(v, floor)) for v in values]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        pad = max(abs(hi) * 0.05, 1e-6)
        lo, hi = lo - pad, hi + pad
    return values, lo, hi


def to_pixels(values: list[float], lo: float, hi: float, width: int, height: int) -> list[tuple[float, float]]:
    left, top, right, bottom = MARGIN
    w, h = width - left - right, height - top - bottom
    n = len(values)
    return [(left + (w * i / (n - 1) if n > 1 else w / 2), top + h * (1 - (v - lo) / (hi - lo))) for i, v in enumerate(values)]


def draw_curve(losses: list[float], factor: float, log_scale: bool, width: int, height: int) -> Image.Image:
    raw, lo, hi = value_range(losses, log_scale)
    smoothed, _, _ = value_range(smooth(losses, factor), log_scale)
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    left, top, right, bottom = MARGIN
    d.rectangle([left, top, width - right, height - bottom], outline="black")
    font = ImageFont.load_default()
    fmt = (lambda v: f"1e{v:.2f}") if log_scale else (lambda v: f"{v:.4g}")
    d.text((4, top), fmt(hi), fill="black", font=font)
    d.text((4, height - bottom - 12), fmt(lo), fill="black", font=font)
    d.text((left, height - bottom + 6), "step 1", fill="black", font=font)
    d.text((width - right - 70, height - bottom + 6), f"step {len(losses)}", fill="black", font=font)
    for series, colour, size in ((raw, (150, 180, 230), 1), (smoothed, (230, 110, 20), 2)):
        pts = to_pixels(series, lo, hi, width, height)
        if len(pts) == 1:
            x, y = pts[0]
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        else:
            d.line(pts, fill=colour, width=size)
    return img



def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:  # closed before atomic_write fsyncs and renames it
        f.write(text)


def save_curve(img: Image.Image, losses: list[float], smoothed: list[float], prefix: str,
               validation: dict[int, float] | None = None) -> tuple[str, str, str]:
    """Write ``<prefix>_NNNNN_.png`` and ``.csv`` (step, loss, smoothed, and val_loss on the steps that measured it
    when the run validated) into the output folder. Returns (png filename, subfolder, png path)."""
    import folder_paths

    out_dir = folder_paths.get_output_directory()
    folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(prefix, out_dir, img.width, img.height)
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, f"{name}_{counter:05}_")
    atomic_write(base + ".png", lambda tmp: img.save(tmp, format="PNG"))
    if validation:
        rows = "step,loss,smoothed,val_loss\n" + "".join(
            f"{i + 1},{v!r},{s!r},{validation[i + 1]!r}\n" if i + 1 in validation else f"{i + 1},{v!r},{s!r},\n"
            for i, (v, s) in enumerate(zip(losses, smoothed)))
    else:
        rows = "step,loss,smoothed\n" + "".join(f"{i + 1},{v!r},{s!r}\n" for i, (v, s) in enumerate(zip(losses, smoothed)))
    atomic_write(base + ".csv", lambda tmp: _write_text(tmp, rows))
    return os.path.basename(base + ".png"), subfolder, base + ".png"


class PrecisionLossGraph(PrecisionNode):
    NODE = NODE
    FILE_NAME_INPUTS = {"filename_prefix": (True, False)}

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE, display_name="Precision Loss Graph", category="precision_lora/train",
            description="Draws the loss history (raw + smoothed) and saves the learning curve as PNG and CSV (with "
                        "the validation loss, when the run measured one).",
            inputs=[
                LossMapType.Input("loss", tooltip="loss_map from PrecisionTrainLoRA (or ComfyUI's TrainLoraNode)."),
                io.Float.Input("smoothing", default=0.9, min=0.0, max=0.999, step=0.001,
                               tooltip="EMA factor of the smoothed curve (0 = raw)."),
                io.Boolean.Input("log_scale", default=False, tooltip="Logarithmic loss axis."),
                io.Int.Input("width", default=768, min=128, max=4096, step=8, tooltip="Image width in pixels."),
                io.Int.Input("height", default=384, min=96, max=4096, step=8, tooltip="Image height in pixels."),
                io.String.Input("filename_prefix", default="precision_lora/loss",
                                tooltip="Output file prefix (PNG + CSV) inside the output folder."),
            ],
            outputs=[io.Image.Output(display_name="image", tooltip="The learning curve as an IMAGE.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, loss, smoothing: float, log_scale: bool, width: int, height: int,
                filename_prefix: str) -> io.NodeOutput:
        losses = finite_losses(loss)
        img = draw_curve(losses, smoothing, log_scale, width, height)
        curve = loss.get("val_loss") if isinstance(loss, dict) else None
        validation = {int(st): float(v) for st, v in curve} if curve else None
        name, subfolder, _ = save_curve(img, losses, smooth(losses, smoothing), filename_prefix, validation)
        tensor = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)[None]
        return io.NodeOutput(tensor, ui=ui.SavedImages([ui.SavedResult(name, subfolder, io.FolderType.output)]))


NODES = [PrecisionLossGraph]
