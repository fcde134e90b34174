"""Copy the README's screenshots from the browser tests' artifacts into docs/img (downscaled, 256 colours).

    .venv/bin/python -m pytest tests/browser -m browser      # writes artifacts/browser/*.png
    .venv/bin/python tests/browser/readme_images.py          # refreshes docs/img/*.png (each < 300 KB)

The real workflows' images come from tests/browser/test_first_lora_ui.py (README's "Your first LoRA" on real-size
VAE, CLIP-L and T5-XXL, tiny Flux), the demo ones from test_training_ui.py.
"""
from __future__ import annotations

import os
import sys

from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(ROOT, "artifacts", "browser")
DOCS_IMG = os.path.join(ROOT, "docs", "img")
# artifact -> (docs/img name, width or None to keep)
IMAGES = {
    "first_lora_02_trained.png": ("train_lora.png", 1440),
    "first_lora_03_image.png": ("inference_matching_scale.png", 1440),
    "train_05_finished.png": ("train_lora_demo.png", 1440),
    "train_04_stopped.png": ("loss_chart.png", None),
    "inference_done.png": ("inference_demo.png", 1440),
    "probe_done.png": ("precision_probe.png", 1440),
}
MAX_BYTES = 300_000


def main() -> int:
    os.makedirs(DOCS_IMG, exist_ok=True)
    missing = [src for src in IMAGES if not os.path.isfile(os.path.join(ARTIFACTS, src))]
    if missing:
        print(f"[Precision LoRA] run the browser tests first; missing in {ARTIFACTS}: {missing}", file=sys.stderr)
        return 1
    for src, (dst, width) in IMAGES.items():
        im = Image.open(os.path.join(ARTIFACTS, src)).convert("RGB")
        if width and im.width > width:
            im = im.resize((width, round(im.height * width / im.width)), Image.LANCZOS)
        im = im.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        path = os.path.join(DOCS_IMG, dst)
        im.save(path, optimize=True)
        size = os.path.getsize(path)
        if size > MAX_BYTES:
            print(f"[Precision LoRA] {dst} is {size} bytes (> {MAX_BYTES})", file=sys.stderr)
            return 1
        print(f"docs/img/{dst}: {im.width}x{im.height}, {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
