"""The precision claims' tables (docs), reproduced by this pack's own code in one run.

1. LoRA delta survival vs rms(ΔW)/rms(W) and rank, for a bf16 merge, a bf16 add of the bf16 delta, the
   fp32 delta added to the rounded base output, and the pack's fp32 unmerged layer
   (``probe.survival.delta_survival``, which runs ``lora.lowrank.lora_linear``).
2. Softmax scale: entropy / ln N and KL(softmax(S) ‖ softmax(bf16(S))) vs the multiplier of 1/sqrt(d)
   (q, k ~ N(0, 1), d = 128), and rows whose bf16 logits tie at the max.
3. Biased rounding of Ō = P̄V: bias/MAE of emulated low-precision attention (``attention.stable``'s
   ``emulate`` modes) against fp64, standard shift vs the stable shift, on sink-dominated rows with tied
   or near-tied maxima and on controls.

Run: ``.venv/bin/python bench/precision.py`` (full) or ``--quick`` (seconds, used by the tests).
Prints markdown tables.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import pure_packages  # noqa: E402  (the pure packages by their short names)

pure_packages.install()
from attention.config import default_scale  # noqa: E402
from attention.stable import TIE_TOLERANCE, StableOptions, stable_forward  # noqa: E402
from lora.config import LoRAConfig  # noqa: E402
from lora.lowrank import LoRAAdapter  # noqa: E402
from probe.survival import PATHS, delta_survival  # noqa: E402

FULL = {"width": 3072, "tokens": 256, "ranks": (4, 16, 64), "rhos": (1e-3, 3e-3, 1e-2, 3e-2),
        "mults": (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0), "rows": 512, "keys": 1024, "bias_rows": 4096}
QUICK = {"width": 256, "tokens": 64, "ranks": (4, 16), "rhos": (1e-3, 1e-2),
         "mults": (0.5, 1.0, 10.0), "rows": 64, "keys": 256, "bias_rows": 512}


def layer_with_rho(width: int, rank: int, rho: float, gen: torch.Generator) -> tuple[torch.Tensor, LoRAAdapter]:
    """bf16 W (width, width) with fan-in scaling and an fp32 adapter whose ΔW has rms(ΔW)/rms(W) = rho."""
    w = (torch.randn(width, width, generator=gen) / width**0.5).bfloat16()
    adapter = LoRAAdapter(width, width, LoRAConfig(rank=rank, alpha=float(rank)), init_generator=gen)
    with torch.no_grad():
        adapter.up.copy_(torch.randn(width, rank, generator=gen))
        dw = (adapter.up.double() @ adapter.down.double()) * adapter.scale
        adapter.up.mul_(float(rho * w.double().pow(2).mean().sqrt() / dw.pow(2).mean().sqrt()))
    adapter.requires_grad_(False)
    adapter.mark_modified()
    return w, adapter


def survival_table(cfg: dict, seed: int = 0, device: str = "cpu") -> list[dict]:
    """One row per (rank, rho): gains per path, fp32 path's relative error, merged elements changed.
    On CUDA the pack's layer uses a bf16 GEMM with fp32 output (``lora.linear.base_linear_fp32``)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg["tokens"], cfg["width"], generator=gen).bfloat16().to(device)
    rows = []
    for rank in cfg["ranks"]:
        for rho in cfg["rhos"]:
            w, adapter = layer_with_rho(cfg["width"], rank, rho, gen)
            s = delta_survival(x, w.to(device), None, (adapter.to(device),))
            rows.append({"rank": rank, "rho": rho, **{p: s.gains[p] for p in PATHS},
                         "err_fp32": s.rel_errors["fp32_unmerged"], "err_merge": s.rel_errors["merge"],
                         "changed": s.merge_changed})
    return rows


def entropy_ratio_dense(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) / ln(N) per row, fp64. logits (…, N) → (…)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1) / math.log(logits.shape[-1])


def scale_table(cfg: dict, head_dim: int = 128, seed: int = 0) -> list[dict]:
    """Per multiplier c of 1/sqrt(d): entropy/lnN, KL(p ‖ p from bf16 logits), bf16 max-logit tie rows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(cfg["rows"], head_dim, generator=gen)
    k = torch.randn(cfg["keys"], head_dim, generator=gen)
    raw = (q.double() @ k.double().t()) * default_scale(head_dim)
    rows = []
    for c in cfg["mults"]:
        s = (raw * c).float()
        sb = s.to(torch.bfloat16)
        logp = torch.log_softmax(s.double(), dim=-1)
        logp_b = torch.log_softmax(sb.double(), dim=-1)
        kl = (logp.exp() * (logp - logp_b)).sum(dim=-1)
        ties = (sb == sb.amax(dim=-1, keepdim=True)).sum(dim=-1) >= 2
        rows.append({"mult": c, "entropy": float(entropy_ratio_dense(s).mean()), "kl": float(kl.mean()),
                     "kl_max": float(kl.max()), "tie_rows": float(ties.double().mean())})
    return rows


def bias_logits(case: str, rows: int, keys: int, gen: torch.Generator, levels: int = 0,
                shuffle: bool = False) -> torch.Tensor:
    """(rows, keys) logits: a sink at 4 + N(0,1)·0.5 tied at 2 or 4 keys (exactly or within 0.0015), others
    N(0, 1) − 8, i.e. about 12 below the sink (sink-dominated rows); ``diffuse``: all N(0, 1)·0.1.
    ``levels`` > 0 puts the sink on that many distinct values (a coarse grid over [2.5, 5.5]).
    ``shuffle`` permutes each row's keys (the sinks land on different keys per row), so that a rounded
    (bf16) output does not round the same few values of V in every row."""
    s = torch.randn(rows, keys, generator=gen) - 8.0
    if case == "diffuse":
        return torch.randn(rows, keys, generator=gen) * 0.1
    ties = 4 if case.startswith("4") else 2
    sink = 4.0 + 0.5 * torch.randn(rows, 1, generator=gen)
    if levels > 0:
        step = 3.0 / levels
        sink = 2.5 + step * (torch.clamp(torch.floor((sink - 2.5) / step), 0, levels - 1) + 0.5)
    s[:, :ties] = sink
    if "near" in case:
        s[:, 1:ties] -= torch.rand(rows, ties - 1, generator=gen) * 0.0015
    if shuffle:
        s = torch.gather(s, 1, torch.rand(rows, keys, generator=gen).argsort(dim=1))
    return s


def split_bf16(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 inputs whose product reproduces fp32 logits: q = [hi, lo] (rows, 2·keys) with hi = bf16(s),
    lo = bf16(s − hi), and k = [I, I] (keys, 2·keys), so q·kᵀ = hi + lo = s within ~2^-16·|s| (an fp32
    accumulator adds it exactly). Keeps near-ties that bf16 logits would merge, for bf16 kernels."""
    hi = s.to(torch.bfloat16)
    lo = (s - hi.float()).to(torch.bfloat16)
    eye = torch.eye(s.shape[-1], dtype=torch.bfloat16)
    return torch.cat([hi, lo], dim=-1), torch.cat([eye, eye], dim=-1)


BIAS_CASES = (  # (label, logits case, emulation, V mean, V columns)
    ("2 tied maxima, paper-style bf16 Ō", "2tied", "paper", -1.5, 64),
    ("4 tied maxima, paper-style bf16 Ō", "4tied", "paper", -1.5, 64),
    ("4 near-ties (<= 0.0015), kernel-style fp32 Ō", "4near", "kernel", -1.5, 64),
    ("control: diffuse attention", "diffuse", "paper", -1.5, 64),
    ("control: 2 tied maxima, zero-mean V (1024 columns)", "2tied", "paper", 0.0, 1024),
)


def _bias(s: torch.Tensor, v: torch.Tensor, opts: StableOptions) -> float:
    """bias/MAE of the emulated output vs fp64 softmax(s)·v; keys are the identity so q = logits, scale 1."""
    eye = torch.eye(s.shape[-1])
    out, _lse, _t = stable_forward(s[None, None], eye[None, None], v[None, None], 1.0, None, opts)
    ref = torch.softmax(s.double(), dim=-1) @ v.double()
    err = out[0, 0].double() - ref
    return float(err.sum() / err.abs().sum())


def bias_table(cfg: dict, keys: int = 64, seed: int = 0) -> list[dict]:
    """Per case: bias/MAE with the standard shift, with the stable shift (tau 0.00196) and tau 1e-3."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for label, case, emulate, v_mean, columns in BIAS_CASES:
        s = bias_logits(case, cfg["bias_rows"], keys, gen)
        v = v_mean + 0.5 * torch.randn(keys, columns, generator=gen)
        standard = _bias(s, v, StableOptions(shift=False, emulate=emulate))
        fixed = _bias(s, v, StableOptions(beta=2.0, tau=TIE_TOLERANCE, emulate=emulate))
        paper_tau = _bias(s, v, StableOptions(beta=2.0, tau=1e-3, emulate=emulate))
        rows.append({"case": label, "standard": standard, "stable": fixed, "stable_tau_1e-3": paper_tau})
    return rows


def format_tables(survival: list[dict], scale: list[dict], bias: list[dict]) -> str:
    out = ["### LoRA delta survival (gain = projection of the realised output change on the intended one)", "",
           "| rank | rms(ΔW)/rms(W) | bf16 merge | bf16 delta, bf16 add | fp32 delta + rounded base | "
           "fp32 unmerged (ours) | ours rel. err | merge rel. err | merged weights changed |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in survival:
        out.append(f"| {r['rank']} | {r['rho']:.0e} | {r['merge']:.3f} | {r['add_bf16']:.3f} | {r['add_rounded']:.3f} | "
                   f"**{r['fp32_unmerged']:.3f}** | {r['err_fp32']:.2f} | {r['err_merge']:.2f} | {r['changed']:.1%} |")
    out += ["", "### Softmax scale multiplier c (d = 128, q, k ~ N(0, 1))", "",
            "| c | entropy / ln N | KL(p ‖ p from bf16 logits), mean | max | rows with a bf16 max-logit tie |",
            "|---|---|---|---|---|"]
    for r in scale:
        out.append(f"| {r['mult']:g} | {r['entropy']:.3f} | {r['kl']:.2e} | {r['kl_max']:.2e} | {r['tie_rows']:.1%} |")
    out += ["", "### Bias of low-precision Ō (bias / MAE; 0 = unbiased, -1 = every error negative)", "",
            "| case | standard | stable β=2, τ=0.00196 | stable β=2, τ=1e-3 (paper's) |", "|---|---|---|---|"]
    for r in bias:
        out.append(f"| {r['case']} | {r['standard']:+.2f} | {r['stable']:+.2f} | {r['stable_tau_1e-3']:+.2f} |")
    return "\n".join(out)


def run(quick: bool, device: str = "cpu") -> dict[str, list[dict]]:
    cfg = QUICK if quick else FULL
    return {"survival": survival_table(cfg, device=device), "scale": scale_table(cfg), "bias": bias_table(cfg)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds) for the test suite")
    ap.add_argument("--device", default="cpu", help="device of the LoRA survival table (cuda: GPU GEMM paths)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    tables = run(args.quick, args.device)
    print(format_tables(tables["survival"], tables["scale"], tables["bias"]))
    print(f"\n({'quick' if args.quick else 'full'} mode, survival on {args.device}, {time.perf_counter() - t0:.1f} s, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
