"""A real-size training step on real tensors, on the CPU, beside the fake-tensor estimate of the same step.

``bench/memory.py`` estimates a released model's training step under fake tensors (shapes only), and the
training node plans ``vram_budget_gb`` with the same code (``nodes/train/memory_estimate.py``); its check
against real tensors (``tests/comfy/test_memory_estimator.py``) runs small models. This builds the released
architecture at its real config (``bench/memory_models.py``) with random weights (values do not change the
memory), attaches the pack's LoRA, and runs two real training steps of the pack's step (``memory_estimate.run_step``:
the loss, backward, optimizer with fp32 masters, under the training session's ``step_context``: checkpointing,
block inputs in host memory, block swap) on the CPU, the host and the device being the same memory.

For each plan (``--plans``; plain, ckpt, offload = checkpointing with the block inputs in host memory, swapN =
checkpointing with N blocks swapped) it prints:

- ``est``: the fake-tensor estimate of the same configuration as the CPU runs it (the CPU's base GEMM upcasts its
  bf16 operands to fp32, a temporary CUDA's fp32-output GEMM does not make: ``cuda_kernels`` off), its tracked peak,
  and the plan's host side (``training.memory_plan``: the block inputs the offload takes off the device, the
  swapped blocks' host copies) beside the device figure (weights less swapped blocks plus the ring of slots);
- ``tracked``: torch's MemTracker peak over the second step of the real run (the tracker the estimate uses, here on
  real tensors), and its difference from the estimate's tracked peak (goal: within 3 %); not shown for offload and
  swap plans, whose host copies and ring slots are made before the tracked step and reassigned to the weights
  outside any operator, which the tracker does not follow;
- ``rss``: what the machine gave: the process's peak resident memory over the tracked step (``VmHWM``, reset
  before it) above its resident memory before the model was built, compared with the estimate's device + host
  figure plus the attached LoRA set the run forks from (``est. total``). glibc's ``malloc`` runs with a fixed
  mmap threshold so that freed tensors go back to the system (a dynamic threshold keeps freed blocks mapped);
  what remains is the heap's small objects, the libraries' lazily loaded kernels and Python's own objects;
- the tracked step's wall time (the CPU's, with the tracker: a figure of this machine, not of a GPU).

Then the LoRA the last plan trained is saved with the pack's writer and loaded into the real-size model by stock
ComfyUI (``comfy.sd.load_lora_for_models``, what LoraLoaderModelOnly calls): the keys it leaves over (its
"lora key not loaded" warnings) and the patches it makes are printed.

What a CPU cannot stand in for (docs/memory.md, "Real size on real tensors"): the CUDA caching allocator's
reserved-but-unused memory, the CUDA context and workspaces (the estimate's overhead line), kernels whose saved
tensors differ on CUDA (the fp32-output GEMM above; attention runs SDPA's flash kernel on both), the copy stream
and pinned memory of offload and swap (here synchronous host-to-host copies: their time says nothing of PCIe), and
every time figure.

Usage::

    .venv/bin/python bench/realsize.py --model flux2-klein-4b --size 512 --plans plain,ckpt,offload,swap4
    .venv/bin/python bench/realsize.py --model sdxl --size 1024 --plans plain,ckpt --json
    .venv/bin/python bench/realsize.py --model sdxl --size 1024 --estimate-only   # seconds, no real model
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import re
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import memory  # noqa: E402  (bench/memory.py)

GIB = 2**30
GOAL = 0.03  # tracked peak vs estimate: what a real-size run must show (docs/memory.md, Real size on real tensors)


def fixed_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """glibc's ``malloc``: allocations of ``nbytes`` and more are mapped and unmapped on free (a fixed threshold
    turns off the dynamic one, which rises to 32 MiB and keeps freed tensors in the heap). False where the C
    library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    """The process's resident memory now (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The process's peak resident memory since the last ``reset_peak_rss`` (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Start ``VmHWM`` again from the resident memory now (Linux: ``/proc/self/clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


PLAN_RE = re.compile(r"^(plain|ckpt|offload|swap(\d+))$")


def parse_plans(text: str) -> list[tuple[str, bool, bool, int]]:
    """``"plain,ckpt,offload,swap4"`` -> (name, checkpointing, inputs in host memory, blocks swapped) each;
    ValueError naming the entry otherwise."""
    plans = []
    for name in (p.strip() for p in text.split(",") if p.strip()):
        m = PLAN_RE.match(name)
        if m is None or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"bench/realsize.py: --plans entry {name!r}: give plain, ckpt, offload or swapN "
                             "(N >= 1 blocks swapped, with checkpointing), separated by commas")
        swap = int(m.group(2)) if m.group(2) else 0
        plans.append((name, name != "plain", name == "offload", swap))
    if not plans:
        raise ValueError("bench/realsize.py: --plans is empty; give e.g. plain,ckpt")
    return plans


def estimate(args: argparse.Namespace, plans: list) -> dict[str, dict]:
    """The fake-tensor estimate of each plan as the CPU runs it: tracked peak, device and host figures (bytes)."""
    mp = memory._pack("training.memory_plan")
    runs: dict[tuple[bool, bool], dict] = {}

    def run(ckpt: bool, offload: bool) -> dict:
        if (ckpt, offload) not in runs:
            runs[ckpt, offload] = memory.tracked(args.model, args.size, args.rank, args.base, ckpt, args.targets,
                                                 offload, cuda_kernels=False)
        return runs[ckpt, offload]

    out = {}
    for name, ckpt, offload, swap in plans:
        cost = memory.step_cost(run(ckpt, offload))
        if swap > len(cost.blocks):
            raise ValueError(f"bench/realsize.py: --plans {name}: {args.model} has {len(cost.blocks)} blocks that "
                             "can be swapped (every checkpointed block)")
        plan = mp.plan(cost, ckpt, swap, offload)
        host = mp.host_cost(plan, cost, memory.step_cost(run(True, False)) if offload else None)
        device = cost.peak + cost.upstream - host.swapped + mp.ring_bytes(cost.blocks, swap)  # plan()'s, in bytes
        out[name] = {"tracked": cost.peak, "device": device, "host_inputs": host.block_inputs,
                     "host_swapped": host.swapped, "total": device + host.block_inputs + host.swapped,
                     "upstream": cost.upstream, "plan": plan.describe(), "blocks": len(cost.blocks),
                     "flops": run(ckpt, offload)["matmul_flops"] + run(ckpt, offload)["attention_flops"]}
    return out


def real_model(args: argparse.Namespace) -> Any:
    """The released architecture at its real config, random weights (fan-in scaled), weights resident."""
    import torch

    import memory_models

    weight, compute = (getattr(torch, d) if d else None for d in memory.BASES[args.base])
    model = memory_models.build(memory_models.unet_config(args.model), weight, compute,
                                memory._pack("nodes.host.comfy_compat").fit_flux_config)
    memory._pack("demo.tiny_models")._init_weights(model.model.diffusion_model, 0)
    model.load_device = None
    return model


def measure(args: argparse.Namespace, model: Any, plan: tuple, keep: dict) -> dict:
    """Two real steps of ``plan`` on ``model``: MemTracker's peak, the peak resident memory over the tracked step
    (bytes, absolute) and its wall time."""
    import memory_models

    name, ckpt, offload, swap = plan
    began: list[float] = []

    def second_step() -> None:
        gc.collect()
        reset_peak_rss()
        began.append(time.perf_counter())

    run = memory.run_step(model, size=args.size, rank=args.rank, checkpointing=ckpt, targets=args.targets,
                          tokens=memory_models.MODELS[args.model].text_tokens, on_second_step=second_step,
                          offload=offload, swap_blocks=swap, keep=keep)
    seconds = time.perf_counter() - began[0]
    return {"tracked": run["peak"], "rss_peak": peak_rss_bytes(), "seconds": seconds}


def stock_load(model: Any, keep: dict) -> dict:
    """Save the trained LoRA with the pack's writer and load it into the real-size ``model`` as stock ComfyUI's
    LoraLoaderModelOnly does: the keys left over and the patches made."""
    import comfy.sd

    glue, info = memory._pack("nodes.lora.glue"), memory._pack("nodes.model.info")
    files = memory._pack("lora.file")
    trained, lora_set = keep["model"], keep["lora_set"]
    described = info.describe_model(trained)
    with tempfile.TemporaryDirectory(prefix="precision_lora_realsize_") as folder:
        path = glue.write_lora(os.path.join(folder, "realsize.safetensors"), trained, described, lora_set,
                               files.default_key_style(described.family))
        tensors, _ = files.read_lora_file(path)
        size = os.path.getsize(path)
    left: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "lora key not loaded" in text:
                left.append(text.rsplit(" ", 1)[-1])

    catch = Catch(logging.WARNING)
    logging.getLogger().addHandler(catch)
    try:
        stock, _ = comfy.sd.load_lora_for_models(model, None, tensors, 1.0, 0)
    finally:
        logging.getLogger().removeHandler(catch)
    return {"keys": len(tensors), "file_bytes": size, "left_over": left, "patches": len(stock.patches),
            "adapters": len(lora_set.adapters())}


def _gib(n: float) -> str:
    return f"{n / GIB:6.2f}"


def _pct(a: float, b: float) -> str:
    return f"{a / b - 1:+.1%}"


def report(args: argparse.Namespace, est: dict, real: dict, baseline: int, lora: dict | None) -> dict:
    """Print the table; the result as a dict (GiB, rounded) for --json."""
    print(f"[Precision LoRA] bench/realsize.py {args.model} {args.size} px rank {args.rank} {args.base} base, "
          f"targets {args.targets}, on the CPU (real tensors; host = device)")
    print("  plan      est.tracked  tracked    diff   est.device  est.host  est.total   rss     diff   step s")
    rows = {}
    for name, e in est.items():
        r = real.get(name)
        host = e["host_inputs"] + e["host_swapped"]
        line = f"  {name:<9} {_gib(e['tracked'])}    "
        row = {"plan": e["plan"], "est_tracked_gib": round(e["tracked"] / GIB, 3),
               "est_device_gib": round(e["device"] / GIB, 3), "est_host_gib": round(host / GIB, 3),
               "est_total_gib": round(e["total"] / GIB, 3), "tflop": round(e["flops"] / 1e12, 1)}
        if r is None:
            line += "     -        -   " + f"   {_gib(e['device'])}    {_gib(host)}   {_gib(e['total'])}"
        else:
            rss = r["rss_peak"] - baseline
            direct = e["host_inputs"] == 0 and e["host_swapped"] == 0
            tracked = f"{_gib(r['tracked'])}  {_pct(r['tracked'], e['tracked']):>7}" if direct else \
                "     -        -"
            line += (f"{tracked}     {_gib(e['device'])}    {_gib(host)}   {_gib(e['total'])}  {_gib(rss)}  "
                     f"{_pct(rss, e['total']):>7}  {r['seconds']:7.1f}")
            row.update(rss_gib=round(rss / GIB, 3), rss_vs_est=round(rss / e["total"] - 1, 4), seconds=round(r["seconds"], 1))
            if direct:
                row.update(tracked_gib=round(r["tracked"] / GIB, 3), tracked_vs_est=round(r["tracked"] / e["tracked"] - 1, 4))
        print(line)
        rows[name] = row
    print(f"  (est. total = device + host + the attached LoRA set the run forks from; rss = peak resident memory over "
          f"the tracked step above {_gib(baseline).strip()} GiB before the model was built; goal: tracked within "
          f"{GOAL:.0%} of the estimate)")
    if lora is not None:
        print(f"  LoRA of the last plan: {lora['keys']} keys, {lora['file_bytes'] / 2**20:.1f} MiB; stock "
              f"load_lora_for_models on the real-size model: {lora['patches']} patches for {lora['adapters']} "
              f"adapters, {len(lora['left_over'])} keys left over")
    return {"model": args.model, "size": args.size, "rank": args.rank, "base": args.base, "targets": args.targets,
            "baseline_rss_gib": round(baseline / GIB, 3), "plans": rows, "lora": lora}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import memory_models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, choices=list(memory_models.MODELS))
    p.add_argument("--size", type=int, default=1024, help="square image size in pixels")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--base", default="bf16", choices=list(memory.BASES), help="base weights: bf16, or fp8 e4m3fn "
                   "computed in bf16")
    p.add_argument("--targets", default="attention", help="LoRA targets preset (lora/targets.py)")
    p.add_argument("--plans", default="plain,ckpt", help="comma-separated: plain, ckpt, offload (checkpointing, "
                   "block inputs in host memory), swapN (checkpointing, N blocks swapped)")
    p.add_argument("--estimate-only", action="store_true", help="the estimates only (no real model: seconds)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    try:
        args.plan_list = parse_plans(args.plans)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> dict:
    memory._setup_paths()
    args = parse_args(argv)
    import comfy_harness

    comfy_harness.pack()
    fixed = fixed_mmap_threshold()
    est = estimate(args, args.plan_list)
    real: dict[str, dict] = {}
    lora = None
    gc.collect()
    baseline = rss_bytes()
    if not args.estimate_only:
        import torch

        if not fixed:
            print("[Precision LoRA] bench/realsize.py: not glibc: freed tensors may stay mapped, rss reads high")
        with torch.inference_mode(False):
            model = real_model(args)
            keep: dict = {}
            for plan in args.plan_list:
                keep.clear()
                print(f"[Precision LoRA] {plan[0]}: two real steps ({est[plan[0]]['flops'] / 1e12:.1f} TFLOP each) ...",
                      flush=True)
                real[plan[0]] = measure(args, model, plan, keep)
            lora = stock_load(model, keep)
    result = report(args, est, real, baseline, lora)
    if args.json:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
