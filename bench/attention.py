"""Attention overhead and kernel speed, measured side by side in one run (CPU or GPU).

For each shape, on identical inputs (fp32 on CPU, bf16 on CUDA), interleaved repeats, median time:
- ``stock``: ComfyUI's ``optimized_attention`` (whatever backend ComfyUI selected here), no override;
- ``override_default``: the same call through PrecisionPatchAttention's override at default settings;
- ``override_scale2x``: the override with backend auto and a 2x scale (q scaled in fp32 first);
- ``sdpa``: ``F.scaled_dot_product_attention(scale=)``; ``stable``: the pack's stable-softmax backend.
Ratios printed: override_default/stock (goal <= 1.02), override_scale2x/stock, stable/sdpa (goal <= 1.5 on CPU).

Run: ``.venv/bin/python bench/attention.py`` (Flux-size layer 24x128 heads, 4096 tokens, and a small one)
or ``--quick`` (tiny shapes, seconds; used by tests/comfy/test_attention_bench.py); ``--threads 1`` measures
without thread-pool barriers, which other processes on a shared machine otherwise stall (the stock and
sdpa kernels are one op each; the pack's stable backend is a loop of eager ops and suffers more).
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

FULL_SHAPES = (("flux layer", 1, 24, 4096, 128), ("small layer", 2, 8, 1024, 64))
QUICK_SHAPES = (("tiny a", 1, 2, 64, 16), ("tiny b", 2, 4, 128, 32))
RATIOS = (("override_default", "stock"), ("override_scale2x", "stock"), ("stable", "sdpa"))


def load_pack():
    """Load ComfyUI and the pack in this process; returns (comfy attention module, glue, config module)."""
    import comfy_bootstrap

    pack = comfy_bootstrap.load_pack_in_process(tempfile.mkdtemp(prefix="precision_lora_bench_"))
    glue = importlib.import_module(f"{pack.__name__}.nodes.attention_glue")
    config = importlib.import_module(f"{pack.__name__}.attention.config")
    stable = importlib.import_module(f"{pack.__name__}.attention.stable")
    import comfy.ldm.modules.attention as comfy_attn

    return comfy_attn, glue, config, stable


def variants(comfy_attn, glue, config, stable, heads: int, head_dim: int):
    """name -> fn(q, k, v) on (B, H, L, D) inputs."""
    stock = comfy_attn.optimized_attention
    default_opts = {"optimized_attention_override": glue.PrecisionAttentionOverride(config.AttentionConfig())}
    scaled_cfg = config.AttentionConfig(scale_mode="multiplier", scale_value=2.0)
    scaled_opts = {"optimized_attention_override": glue.PrecisionAttentionOverride(scaled_cfg)}
    scale = head_dim ** -0.5
    return {
        "stock": lambda q, k, v: stock(q, k, v, heads, skip_reshape=True, transformer_options={}),
        "override_default": lambda q, k, v: stock(q, k, v, heads, skip_reshape=True, transformer_options=default_opts),
        "override_scale2x": lambda q, k, v: stock(q, k, v, heads, skip_reshape=True, transformer_options=scaled_opts),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=scale),
        "stable": lambda q, k, v: stable.stable_attention(q, k, v, scale=scale),
    }


def _time(fn, args, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(fns: dict, args: tuple, repeats: int, device: str) -> dict[str, float]:
    """Median seconds per variant; variants interleaved in every repeat so load changes hit all alike."""
    for fn in fns.values():  # warm-up
        _time(fn, args, device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_time(fn, args, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few repeats (seconds)")
    parser.add_argument("--repeats", type=int, default=0, help="repeats per variant (default 5, quick 7)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice); "
                        "1 is least disturbed by other load on a shared machine")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    comfy_attn, glue, config, stable = load_pack()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    repeats = args.repeats or (7 if args.quick else 5)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    print(f"device: {device}, dtype: {str(dtype).replace('torch.', '')}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, stock ComfyUI backend: {comfy_attn.optimized_attention.__name__}, "
          f"repeats {repeats} (median)")
    print()
    names = [name for name in variants(comfy_attn, glue, config, stable, 1, 1)]
    header = ["shape (B, H, L, D)"] + [f"{n} ms" for n in names] + [f"{a}/{b}" for a, b in RATIOS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    gen = torch.Generator(device="cpu").manual_seed(0)
    for label, b, h, length, d in shapes:
        q, k, v = (torch.randn(b, h, length, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
        times = measure(variants(comfy_attn, glue, config, stable, h, d), (q, k, v), repeats, device)
        cells = [f"{label} ({b}, {h}, {length}, {d})"] + [f"{times[n] * 1e3:.3f}" for n in names]
        cells += [f"{times[a] / times[b_]:.3f}" for a, b_ in RATIOS]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
