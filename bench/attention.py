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

Fused-kernel section (full mode, or ``--kernel-only``, which needs no ComfyUI; ``--sweep`` adds tile configs):
on a CUDA GPU, bf16, the fused Triton stable kernel vs SDPA (flash) vs the PyTorch stable path, forward and
forward+backward, Flux (1, 24, 4096, 128) and Anima / Cosmos-Predict2 2B (1, 16, 4096, 128) layers, ratio
fused/sdpa_flash (goal <= 1.15 forward+backward); then bias/MAE of the bf16 output on bench/precision.py's
scenarios. Without a GPU it says so and prints the CPU figures (PyTorch stable path).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import precision  # noqa: E402  (bench/precision.py: the bias scenarios)
from attention import stable as pt_stable  # noqa: E402
from attention.config import default_scale  # noqa: E402

FULL_SHAPES = (("flux layer", 1, 24, 4096, 128), ("small layer", 2, 8, 1024, 64))
QUICK_SHAPES = (("tiny a", 1, 2, 64, 16), ("tiny b", 2, 4, 128, 32))
RATIOS = (("override_default", "stock"), ("override_scale2x", "stock"), ("stable", "sdpa"))


def load_pack():
    """Load ComfyUI and the pack in this process; returns (comfy attention module, glue, config module)."""
    import comfy_bootstrap

    pack = comfy_bootstrap.load_pack_in_process(comfy_bootstrap.temporary_base("precision_lora_bench_"))
    glue = importlib.import_module(f"{pack.__name__}.nodes.attention.glue")
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
    scale = config.default_scale(head_dim)
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


KERNEL_SHAPES = (("flux layer", 1, 24, 4096, 128), ("anima layer (Cosmos-Predict2 2B)", 1, 16, 4096, 128))
KERNEL_QUICK_SHAPES = (("tiny", 1, 2, 256, 64),)
CPU_KERNEL_SHAPES = (("small layer", 1, 8, 1024, 64),)
# (block_m, block_n, num_warps, num_stages); a first sweep on an H100 also tried (128, 64, 4, 3), (128, 32, 4, 3),
# (128, 128, 8, 2), (64, 128, 4, 3) forward, (32, 128, 4, 3), (64, 128, 4, 2), (32, 128, 8, 2) dK/dV, (64, 32, 4, 3),
# (128, 32, 8, 2), (128, 64, 4, 2) dQ: none was faster (docs/benchmarks.md).
FWD_CANDIDATES = ((128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4))
DKDV_CANDIDATES = ((64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 8, 3))
DQ_CANDIDATES = ((128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3))
COARSE_BIAS = (("2tied", 1), ("2tied", 9), ("4near", 1), ("4near", 9), ("4near", 128))
CASE_NAMES = {"2tied": "2 tied maxima", "4near": "4 near-ties (<= 0.0015)"}


def _event_time(fn: Callable[[], object]) -> float:
    """Seconds of one call, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _wall_time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_times(fns: dict[str, Callable[[], object]], repeats: int, cuda: bool) -> dict[str, float]:
    """Median seconds per closure, interleaved per repeat, after two warm-up calls each."""
    timer = _event_time if cuda else _wall_time
    for fn in fns.values():
        fn(), fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timer(fn))
    return {name: statistics.median(v) for name, v in samples.items()}


def attention_fns(cuda: bool, scale: float, cfg=None) -> dict[str, Callable]:
    """name -> fn(q, k, v) (bhld): SDPA (flash kernel on CUDA), the fused kernel (GPU), the PyTorch path."""
    def sdpa(q, k, v):
        if not cuda:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, scale=scale)

    fns = {"sdpa_flash" if cuda else "sdpa": sdpa}
    if cuda:
        from attention.stable_triton import fused_stable_attention

        off = pt_stable.StableOptions(shift=False)
        fns["fused"] = lambda q, k, v: fused_stable_attention(q, k, v, scale=scale, config=cfg)
        fns["fused_shift_off"] = lambda q, k, v: fused_stable_attention(q, k, v, scale=scale, options=off, config=cfg)
    fns["stable_pytorch"] = lambda q, k, v: pt_stable.stable_attention(q, k, v, scale=scale)
    return fns


def pass_closures(fns: dict[str, Callable], q, k, v, backward: bool) -> dict[str, Callable[[], object]]:
    """Closures for one pass: forward under no_grad, or forward + backward through autograd.grad."""
    if not backward:
        def fwd(fn):
            def run():
                with torch.no_grad():
                    return fn(q, k, v)
            return run
        return {name: fwd(fn) for name, fn in fns.items()}
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    grad = torch.randn_like(q)
    return {name: (lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, grad)) for name, fn in fns.items()}


def warm_gpu(seconds: float = 0.5) -> None:
    """Busy the GPU for a while so that its clocks are up before timing."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
        torch.cuda.synchronize()


def kernel_timing_table(shapes, repeats: int, cuda: bool) -> None:
    """Times of every variant, forward and forward+backward, with ratios to SDPA. The kernels are
    timed interleaved; the PyTorch path (hundreds of ms of small launches, which let the GPU clock
    down) separately, 3 repeats."""
    base = "sdpa_flash" if cuda else "sdpa"
    names = list(attention_fns(cuda, 1.0))
    others = [n for n in names if n != base]
    header = ["shape (B, H, L, D)", "pass"] + [f"{n} ms" for n in names] + [f"{n}/{base}" for n in others]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    for label, b, h, length, d in shapes:
        q, k, v = (torch.randn(b, h, length, d, generator=gen).to("cuda" if cuda else "cpu", dtype) for _ in range(3))
        for backward in (False, True):
            fns = pass_closures(attention_fns(cuda, default_scale(d)), q, k, v, backward)
            slow = {"stable_pytorch": fns.pop("stable_pytorch")}
            times = median_times(slow, 3, cuda)
            if cuda:
                warm_gpu()
            times.update(median_times(fns, repeats, cuda))
            cells = [f"{label} ({b}, {h}, {length}, {d})", "fwd+bwd" if backward else "fwd"]
            cells += [f"{times[n] * 1e3:.3f}" for n in names] + [f"{times[n] / times[base]:.3f}" for n in others]
            print("| " + " | ".join(cells) + " |", flush=True)


def sweep(repeats: int) -> None:
    """Fused-kernel tile configs on the Flux layer, each group timed interleaved: forward alone, then
    forward+backward for dK/dV configs and for dQ configs (the other kernels at their defaults)."""
    from attention.stable_triton import FusedConfig, KernelConfig, default_config

    base = default_config(128)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 4096, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    groups = {
        "forward": ([FusedConfig(KernelConfig(*c), base.dkdv, base.dq) for c in FWD_CANDIDATES], False),
        "dkdv": ([FusedConfig(base.forward, KernelConfig(*c), base.dq) for c in DKDV_CANDIDATES], True),
        "dq": ([FusedConfig(base.forward, base.dkdv, KernelConfig(*c)) for c in DQ_CANDIDATES], True)}
    print(f"default: {base}\n\n| kernel | (block_m, block_n, warps, stages) | pass | ms |\n|---|---|---|---|")
    for kernel, (configs, backward) in groups.items():
        fns = {}
        for cfg in configs:
            c = getattr(cfg, kernel)
            fns[str((c.block_m, c.block_n, c.num_warps, c.num_stages))] = attention_fns(True, default_scale(128), cfg)["fused"]
        warm_gpu()
        times = median_times(pass_closures(fns, q, k, v, backward), repeats, True)
        for name, t in times.items():
            print(f"| {kernel} | {name} | {'fwd+bwd' if backward else 'fwd'} | {t * 1e3:.3f} |", flush=True)


@contextlib.contextmanager
def row_jitter(value: float) -> Iterator[None]:
    """Temporarily set the stable shift's per-row jitter (0 = no per-row jitter; docs/attention.md, "Shift diversity")."""
    old = pt_stable.ROW_JITTER
    pt_stable.ROW_JITTER = value
    try:
        yield
    finally:
        pt_stable.ROW_JITTER = old


def bias_cases() -> list[tuple[str, str, float, int, int]]:
    """(label, logits case, V mean, V columns, sink levels): bench/precision.py's cases (V at most 256
    columns, the kernel's head-dim limit) and coarse-grid sinks (levels = distinct row maxima)."""
    cases = []
    for label, case, _emulate, v_mean, columns in precision.BIAS_CASES:  # real bf16 here, no emulation
        label = label.split(", paper-style")[0].split(", kernel-style")[0].replace("(1024 columns)", "(256 columns)")
        cases.append((label, case, v_mean, min(columns, 256), 0))
    return cases + [(f"{CASE_NAMES[case]}, sink on {levels} value{'s' * (levels > 1)}", case, -1.5, 64, levels)
                    for case, levels in COARSE_BIAS]


def _rounding_of_shift(s: torch.Tensor, jitter: float) -> float:
    """Mean relative bf16 rounding error of the tied P̄ = exp(−Δ) over rows whose shift fires (β = 2)."""
    r = s.amax(dim=-1)
    tied = (s >= r[:, None] - pt_stable.TIE_TOLERANCE).sum(dim=-1) > 1
    j = pt_stable.row_jitter(torch.arange(s.shape[0])) * (jitter / pt_stable.ROW_JITTER)
    p = torch.exp(-pt_stable.row_shift(r, 2.0, j)[tied].double())
    return float(((p.float().bfloat16().double() - p) / p).mean()) if bool(tied.any()) else float("nan")


def bias_table(device: str, rows: int, seeds: int = 5) -> None:
    """bias/MAE of the bf16 output (worst of seeds 0..seeds-1) per method, and the mean relative bf16
    rounding of exp(−Δ) without / with the per-row jitter. Inputs: ``precision.split_bf16`` of the logits,
    keys shuffled per row (else a bf16 output rounds the same few values of V in every row, whose
    rounding errors do not average out: ±0.07 of noise on bias/MAE)."""
    methods = bias_methods(device)
    print("| case | " + " | ".join(methods) + " | mean rel. rounding of exp(−Δ), no jitter | with jitter |")
    print("|" + "---|" * (len(methods) + 3))
    for label, case, v_mean, columns, levels in bias_cases():
        worst = {m: 0.0 for m in methods}
        rounding = {0.0: [], pt_stable.ROW_JITTER: []}
        for seed in range(seeds):
            gen = torch.Generator().manual_seed(seed)
            s = precision.bias_logits(case, rows, 64, gen, levels=levels, shuffle=True)
            v = (v_mean + 0.5 * torch.randn(64, columns, generator=gen)).to(torch.bfloat16)
            q, k = precision.split_bf16(s)
            ref = torch.softmax((q.double() @ k.double().t()), dim=-1) @ v.double()
            for name, (fn, jitter) in methods.items():
                with row_jitter(jitter):
                    out = fn(*(t[None, None].to(device) for t in (q, k, v)))[0, 0].double().cpu()
                ratio = float((out - ref).sum() / (out - ref).abs().sum())
                worst[name] = ratio if abs(ratio) > abs(worst[name]) else worst[name]
            for jitter in rounding:
                rounding[jitter].append(_rounding_of_shift(s, jitter))
        cells = [f"{worst[m]:+.3f}" for m in methods] + [f"{statistics.mean(v):+.1e}" for v in rounding.values()]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def bias_methods(device: str) -> dict[str, tuple[Callable, float]]:
    """Method label -> (fn(q, k, v), row jitter)."""
    opts = {"standard": pt_stable.StableOptions(shift=False), "stable": pt_stable.StableOptions()}
    jit = pt_stable.ROW_JITTER
    pt = lambda o: (lambda q, k, v: pt_stable.stable_attention(q, k, v, scale=1.0, options=o))  # noqa: E731
    methods = {}
    if device == "cuda":
        from attention.stable_triton import fused_stable_attention

        fu = lambda o: (lambda q, k, v: fused_stable_attention(q, k, v, scale=1.0, options=o))  # noqa: E731
        methods.update({"fused standard": (fu(opts["standard"]), jit),
                        "fused stable, no jitter": (fu(opts["stable"]), 0.0), "fused stable": (fu(opts["stable"]), jit)})
    methods.update({f"pytorch standard ({device})": (pt(opts["standard"]), jit),
                    f"pytorch stable, no jitter ({device})": (pt(opts["stable"]), 0.0),
                    f"pytorch stable ({device})": (pt(opts["stable"]), jit)})
    return methods


def kernel_section(quick: bool, repeats: int, do_sweep: bool) -> None:
    """The fused-kernel timings (GPU) or the CPU figures, then the bf16 bias table."""
    cuda = torch.cuda.is_available()
    print("\n## Fused stable kernel\n")
    if cuda:
        import triton

        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
              f"bf16, repeats {repeats} (median, CUDA events, interleaved)\n")
        kernel_timing_table(KERNEL_QUICK_SHAPES if quick else KERNEL_SHAPES, repeats, True)
        if do_sweep:
            print()
            sweep(max(5, repeats // 2))
    else:
        print("No CUDA GPU available: the fused Triton kernel needs one, so no fused/SDPA ratio can be measured "
              "here. CPU figures follow (fp32 timings; the bias table runs the PyTorch path on bf16 inputs).\n")
        kernel_timing_table(KERNEL_QUICK_SHAPES if quick else CPU_KERNEL_SHAPES, repeats, False)
    print("\n### bias/MAE of the bf16 output (worst of seeds 0-4; 0 = unbiased)\n")
    bias_table("cuda" if cuda else "cpu", 512 if quick else 4096)


def overhead_table(args: argparse.Namespace) -> None:
    """The override-overhead table (loads ComfyUI)."""
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few repeats (seconds)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="repeats per variant (default 5, quick 7; GPU kernels 30)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice); "
                        "1 is least disturbed by other load on a shared machine")
    parser.add_argument("--kernel-only", action="store_true", help="only the fused-kernel section (no ComfyUI)")
    parser.add_argument("--sweep", action="store_true", help="also time fused-kernel tile configs (GPU)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not args.kernel_only:
        overhead_table(args)
    if args.kernel_only or not args.quick:  # --quick alone keeps the one table the comfy test reads
        gpu_repeats = 30 if torch.cuda.is_available() else 3
        kernel_section(args.quick, args.repeats or gpu_repeats, args.sweep)


if __name__ == "__main__":
    main()
