"""LoRA precision and cost, measured side by side in one run.

1. Delta survival: for rms(dW)/rms(W) in {1e-3, 3e-3, 1e-2} on a bf16 linear (bf16 input and output), the
   projection gain <d_out, ideal> / <ideal, ideal> of the realised output change on the intended one
   (ideal = x dW^T in fp64), for four paths: plain bf16 LoRA, fp32 delta added to the rounded bf16 output,
   a bf16 weight merge (what ComfyUI's merge does), and this pack's fp32 path (sum before rounding).
2. Cost: forward+backward time of the fp32-accumulating layer vs the plain bf16 LoRA layer, both
   including the base linear (3072x3072, rank 16, 4096 tokens by default), interleaved, median of N.

Run: ``.venv/bin/python bench/lora.py`` (full size) or ``--quick`` (small sizes, for the unit test).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import pure_packages  # noqa: E402  (the pure packages by their short names)

pure_packages.install()
from lora.config import LoRAConfig  # noqa: E402
from lora.lowrank import LoRAAdapter, lora_linear  # noqa: E402

RHOS = (1e-3, 3e-3, 1e-2)
PATHS = ("plain_bf16", "fp32_delta_rounded_base", "bf16_merge", "fp32_accumulation")


def make_layer(width: int, tokens: int, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, LoRAAdapter]:
    """x (tokens, width) bf16, W (width, width) bf16, and an fp32 adapter with random (non-zero) factors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g).bfloat16()
    w = (torch.randn(width, width, generator=g) / width**0.5).bfloat16()
    adapter = LoRAAdapter(width, width, LoRAConfig(rank=rank, alpha=float(rank)), init_generator=g)
    with torch.no_grad():
        adapter.up.copy_(torch.randn(width, rank, generator=g))
    adapter.mark_modified()
    return x, w, adapter


def _set_rho(adapter: LoRAAdapter, w: torch.Tensor, rho: float) -> torch.Tensor:
    """Rescale ``up`` so rms(dW)/rms(W) = rho; returns dW in fp64."""
    with torch.no_grad():
        dw = (adapter.up.double() @ adapter.down.double()) * adapter.scale
        factor = rho * w.double().pow(2).mean().sqrt() / dw.pow(2).mean().sqrt()
        adapter.up.mul_(factor.float())
    return (adapter.up.double() @ adapter.down.double()) * adapter.scale


def path_outputs(x: torch.Tensor, w: torch.Tensor, adapter: LoRAAdapter) -> dict[str, torch.Tensor]:
    """bf16 output of each path for the same layer."""
    with torch.no_grad():
        base = F.linear(x, w)
        delta32 = adapter.delta_fp32(x)
        dw32 = (adapter.up.float() @ adapter.down.float()) * adapter.scale
        adapter.fp32_accumulation = False
        plain = lora_linear(x, w, None, (adapter,))
        adapter.fp32_accumulation = True
        return {
            "plain_bf16": plain,
            "fp32_delta_rounded_base": (base.float() + delta32).bfloat16(),
            "bf16_merge": F.linear(x, (w.float() + dw32).bfloat16()),
            "fp32_accumulation": lora_linear(x, w, None, (adapter,)),
        }


def gain_table(width: int = 3072, tokens: int = 256, rank: int = 16, rhos: tuple[float, ...] = RHOS,
               seed: int = 0) -> dict[float, dict[str, float]]:
    """rho -> path -> projection gain of (out - base_bf16_out) on the fp64 ideal change."""
    x, w, adapter = make_layer(width, tokens, rank, seed)
    adapter.requires_grad_(False)
    base = F.linear(x, w).double()
    table: dict[float, dict[str, float]] = {}
    for rho in rhos:
        dw = _set_rho(adapter, w, rho)
        ideal = x.double() @ dw.t()
        denom = (ideal * ideal).sum()
        outs = path_outputs(x, w, adapter)
        table[rho] = {name: float(((out.double() - base) * ideal).sum() / denom) for name, out in outs.items()}
    return table


def format_gain_table(table: dict[float, dict[str, float]]) -> str:
    lines = ["rms(dW)/rms(W) | " + " | ".join(PATHS)]
    for rho, gains in table.items():
        lines.append(f"{rho:.0e} | " + " | ".join(f"{gains[p]:.3f}" for p in PATHS))
    return "\n".join(lines)


def _step(x: torch.Tensor, w: torch.Tensor, adapter: LoRAAdapter, fp32: bool) -> float:
    adapter.fp32_accumulation = fp32
    xin = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    out = lora_linear(xin, w, None, (adapter,))
    out.float().square().mean().backward()
    if x.is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    adapter.zero_grad(set_to_none=True)
    return elapsed


def cost_ratio(width: int, tokens: int, rank: int, repeats: int, device: str) -> tuple[float, float]:
    """Median seconds of one forward+backward (input grad + LoRA grads) for (plain bf16, fp32 accumulation)."""
    x, w, adapter = make_layer(width, tokens, rank)
    x, w = x.to(device), w.to(device)
    adapter.to(device).train()
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(repeats + 1):
        for fp32 in (False, True) if i % 2 == 0 else (True, False):
            t = _step(x, w, adapter, fp32)
            if i > 0:  # first round is warm-up
                times[fp32].append(t)
    return statistics.median(times[False]), statistics.median(times[True])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (width 512, 64 tokens) for tests")
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens for the cost measurement")
    ap.add_argument("--gain-tokens", type=int, default=256, help="tokens for the gain table")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.tokens, args.gain_tokens, args.repeats = 512, 64, 64, 2
    print(f"delta survival gain (width {args.width}, {args.gain_tokens} tokens, rank {args.rank}, CPU):")
    print(format_gain_table(gain_table(args.width, args.gain_tokens, args.rank)))
    plain, fp32 = cost_ratio(args.width, args.tokens, args.rank, args.repeats, args.device)
    print(f"forward+backward incl. base linear ({args.width}x{args.width}, rank {args.rank}, {args.tokens} tokens, "
          f"{args.device}, median of {args.repeats}): plain bf16 {plain * 1e3:.2f} ms, fp32 accumulation "
          f"{fp32 * 1e3:.2f} ms, ratio fp32/bf16 = {fp32 / plain:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
