"""Bar charts of a probe result drawn with PIL (no matplotlib): an IMAGE tensor (1, H, W, 3) float in [0, 1].

Panel 1: model-level LoRA gain per path (merge, bf16 add, fp32 delta on rounded output, fp32 unmerged).
Panel 2: per attention layer, entropy / ln N, max probability and the fraction of rows with two
bf16(P̄) == 1, each a bar in [0, 1].
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

WIDTH = 640
ROW_H = 14
LABEL_W = 190
MARGIN = 10
COLORS = ((70, 130, 180), (220, 120, 50), (90, 170, 90), (170, 80, 160))
BG, FG, GRID = (250, 250, 250), (20, 20, 20), (200, 200, 200)


def _bar_group(draw: ImageDraw.ImageDraw, top: int, label: str, values: Sequence[float]) -> int:
    """One labelled group of horizontal bars (values clipped to [0, 1.2]); returns the next top."""
    draw.text((MARGIN, top), label[:30], fill=FG)
    span = WIDTH - LABEL_W - 3 * MARGIN
    for i, value in enumerate(values):
        y = top + i * ROW_H
        length = int(span * min(max(value, 0.0), 1.2) / 1.2)
        draw.rectangle((LABEL_W, y + 2, LABEL_W + length, y + ROW_H - 2), fill=COLORS[i % len(COLORS)])
        draw.text((LABEL_W + length + 4, y), f"{value:.3f}", fill=FG)
    return top + max(len(values), 1) * ROW_H + 6


def _legend(draw: ImageDraw.ImageDraw, top: int, names: Sequence[str]) -> int:
    x = MARGIN
    for i, name in enumerate(names):
        draw.rectangle((x, top + 3, x + 10, top + 11), fill=COLORS[i % len(COLORS)])
        draw.text((x + 14, top), name, fill=FG)
        x += 14 + 7 * len(name) + 12
    return top + ROW_H + 4


def _unit_line(draw: ImageDraw.ImageDraw, top: int, bottom: int) -> None:
    """Vertical guide at value 1.0."""
    x = LABEL_W + int((WIDTH - LABEL_W - 3 * MARGIN) / 1.2)
    draw.line((x, top, x, bottom), fill=GRID)


def _height(lora_groups: int, attn_layers: int) -> int:
    return 2 * MARGIN + 4 * (ROW_H + 4) + (lora_groups * 4 + attn_layers * 3) * ROW_H + (lora_groups + attn_layers) * 6 + 40


def draw_probe_chart(lora_summary: Mapping[str, float], attention: Mapping[str, Mapping[str, float]]) -> torch.Tensor:
    """lora_summary: path → model-level gain (may be empty); attention: layer → stats dict."""
    height = _height(1 if lora_summary else 0, len(attention))
    img = Image.new("RGB", (WIDTH, height), BG)
    draw = ImageDraw.Draw(img)
    top = MARGIN
    draw.text((MARGIN, top), "LoRA effect kept (gain, 1 = full)", fill=FG)
    top += ROW_H + 4
    if lora_summary:
        names = list(lora_summary)
        top = _legend(draw, top, names)
        start = top
        top = _bar_group(draw, top, "model", [lora_summary[n] for n in names])
        _unit_line(draw, start, top)
    else:
        draw.text((MARGIN, top), "no LoRA attached / zero delta", fill=FG)
        top += ROW_H + 4
    draw.text((MARGIN, top), "Attention per layer", fill=FG)
    top += ROW_H + 4
    top = _legend(draw, top, ["entropy/lnN", "max p", "rows bf16(P)==1 x2"])
    start = top
    for label, d in attention.items():
        top = _bar_group(draw, top, label, [d["entropy_ratio"], d["max_prob"], d["bf16_one_fraction"]])
    _unit_line(draw, start, top)
    array = np.asarray(img, dtype=np.float32) / 255.0
    return torch.from_numpy(array).unsqueeze(0)
