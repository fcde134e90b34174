"""Time ComfyUI's stock text-encoder path on Flux.1's pair at real size: DualCLIPLoader (type flux) on CLIP-L
and T5-XXL (4.76 B parameters, float8_e4m3fn; the random-weight files of tests/real_arch.py --t5), then
CLIPTextEncode of the captions the real-workflow tests train on. Prints the load time, each caption's
encode time, the process's peak resident memory, and the encode time next to CLIP-L alone (CLIPLoader,
the tests' fast variant) measured in the same run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 .venv/bin/python bench/text_encoder.py

The T5-XXL file is written once into .cache/real_arch (about a minute); the other files into a temporary
ComfyUI base directory.
"""
from __future__ import annotations

import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def main() -> None:
    import comfy_bootstrap
    import real_arch

    base = comfy_bootstrap.temporary_base("precision_bench_te_")
    real_arch._BASE.append(base)
    real_arch._pack_module("demo")  # ComfyUI (CPU) imported with this base directory
    t0 = time.perf_counter()
    real_arch.write_all(base, t5=True)
    print(f"files ready in {time.perf_counter() - t0:.1f} s (T5-XXL cached in {real_arch.CACHE})")

    import nodes

    captions = [caption for *_, caption in real_arch.IMAGES]
    rows = []
    for label, load in (
        ("CLIP-L alone (CLIPLoader)", lambda: nodes.CLIPLoader().load_clip(real_arch.CLIP_L_NAME, "stable_diffusion")),
        ("CLIP-L + T5-XXL fp8 (DualCLIPLoader, flux)",
         lambda: nodes.DualCLIPLoader().load_clip(real_arch.CLIP_L_NAME, real_arch.T5_NAME, "flux")),
    ):
        t0 = time.perf_counter()
        (clip,) = load()
        loaded = time.perf_counter() - t0
        times = []
        for caption in captions:
            t0 = time.perf_counter()
            (cond,) = nodes.CLIPTextEncode().encode(clip, caption)
            times.append(time.perf_counter() - t0)
        shape = tuple(cond[0][0].shape)
        rows.append((label, loaded, times, shape))
        del clip, cond
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{'text encoder':45s} {'load s':>7s} {'encode s per caption':>28s}  tokens x width")
    for label, loaded, times, shape in rows:
        print(f"{label:45s} {loaded:7.1f} {' '.join(f'{t:6.1f}' for t in times):>28s}  {shape[1]} x {shape[2]}")
    ratio = (sum(rows[1][2]) / len(captions)) / (sum(rows[0][2]) / len(captions))
    print(f"T5 pair / CLIP-L alone, mean encode time: {ratio:.0f}x; peak resident memory {peak_gb:.1f} GB; "
          f"{os.cpu_count()} CPU cores")


if __name__ == "__main__":
    main()
