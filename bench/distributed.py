"""Data-parallel step time: the training loop at 1 and 2 processes (torch.distributed), and the share of each
step the LoRA-gradient all-reduce takes.

The model is a pure-torch stand-in (no ComfyUI): ``--depth`` frozen residual MLP blocks of ``--width``
channels over ``--tokens`` tokens per sample, a rank-``--rank`` LoRA on both linears of every block, trained
by ``training.loop.train`` with the same global batch at every process count; each configuration runs under
``torchrun`` (``python -m torch.distributed.run``) in its own processes. Measured on rank 0: the median
optimizer-step time after ``--warmup`` steps, and the median time inside ``DataParallel.reduce`` (the
all-reduce of the LoRA gradients and the loss, bucketed), as a share of the step.

Read the CPU numbers for what they are: the processes share the machine's cores, so 2 processes can at best
use the cores one process with as many threads already uses; the comparison that matters on a CPU is
"1 process x 2 threads" against "2 processes x 1 thread" (both rows are printed), and on a 2-core machine
shared with other work neither is a clean measurement. On a host with N >= 2 GPUs the ranks use NCCL, one
GPU each, and the speed-up and the all-reduce share are the numbers that carry over to real training.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 .venv/bin/python bench/distributed.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="global batch (samples per optimizer step)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--procs", default="1,2", help="process counts to compare")
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (a smoke run)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.tokens, args.steps, args.warmup = 64, 2, 32, 5, 2
    return args


# ---- one rank ----

def _worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import pure_packages

    pure_packages.install()
    import torch
    from torch import nn

    from training import distributed
    from training.loop import Hooks, ModelFns, Sample, train
    from training.settings import TrainSettings

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    par = distributed.activate(device)
    times: list[float] = []

    class Timed(distributed.DataParallel):
        def reduce(self, params, scalars):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = super().reduce(params, scalars)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            return out

    timed = Timed(par.rank, par.world)
    g = torch.Generator().manual_seed(0)
    w, r = args.width, args.rank
    base = [(torch.randn(w, w, generator=g) / w**0.5, torch.randn(w, w, generator=g) / w**0.5) for _ in range(args.depth)]
    base = [(a.to(device), b.to(device)) for a, b in base]

    class LoRA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down = nn.ParameterList([nn.Parameter(torch.randn(r, w, generator=g) / w**0.5) for _ in range(2 * args.depth)])
            self.up = nn.ParameterList([nn.Parameter(torch.zeros(w, r)) for _ in range(2 * args.depth)])

    lora = LoRA().to(device)

    def predict(x, sigma, cond):
        h = x + sigma.view(-1, 1, 1) + cond.view(-1, 1, 1)
        for i, (a, b) in enumerate(base):
            z = h @ a.T + (h @ lora.down[2 * i].T) @ lora.up[2 * i].T
            z = torch.nn.functional.gelu(z)
            h = h + z @ b.T + (z @ lora.down[2 * i + 1].T) @ lora.up[2 * i + 1].T
        return h

    fns = ModelFns(predict=predict, sigma_of_u=lambda u: u.float().to(device),
                   noise_latent=lambda s, n, x0: (1 - s.view(-1, 1, 1)) * x0 + s.view(-1, 1, 1) * n,
                   target=lambda s, n, x0: n - x0, collate=lambda c: torch.stack(c).to(device), device=device)
    data = [Sample(latent=torch.randn(args.tokens, w, generator=g), cond=torch.tensor(float(i))) for i in range(args.batch)]
    stamps: list[float] = []

    def on_step(report):
        if device.type == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    settings = TrainSettings(learning_rate=1e-3, batch_size=args.batch, timestep_sampling="uniform")
    start = time.perf_counter()
    train(lora, data, fns, settings, steps=args.warmup + args.steps, seed=0, hooks=Hooks(on_step=on_step),
          parallel=timed)
    steps = [b - a for a, b in zip([start, *stamps[:-1]], stamps)][args.warmup:]
    reduces = times[args.warmup:]
    if par.is_main:
        n_params = sum(p.numel() for p in lora.parameters())
        print("RESULT " + json.dumps({"procs": par.world, "device": str(device), "step_s": statistics.median(steps),
                                      "reduce_s": statistics.median(reduces), "lora_params": n_params,
                                      "threads": torch.get_num_threads()}), flush=True)
    distributed.deactivate()


# ---- the driver ----

def _launch(args: argparse.Namespace, procs: int, threads: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forwarded = [f"--{k}={getattr(args, k)}" for k in ("width", "depth", "tokens", "rank", "batch", "steps", "warmup")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_addr",
           "127.0.0.1", "--master_port", str(port), os.path.abspath(__file__), "--worker", *forwarded]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench/distributed.py: {procs} process(es) failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])


def main(argv: list[str]) -> None:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return
    import torch

    cores = len(os.sched_getaffinity(0))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    counts = [int(p) for p in args.procs.split(",")]
    where = (f"{gpus} CUDA GPU(s), NCCL" if gpus >= max(counts) else
             f"CPU, gloo, {cores} cores visible to this process (shared with whatever else runs here)")
    print(f"data-parallel step time: {where}; model width {args.width}, depth {args.depth}, {args.tokens} tokens, "
          f"LoRA rank {args.rank}; global batch {args.batch}; median of {args.steps} steps after {args.warmup}")
    rows = []
    for procs in counts:
        configs = [max(1, cores // procs)] if gpus >= max(counts) else sorted({1, max(1, cores // procs)})
        for threads in configs:
            res = _launch(args, procs, threads)
            rows.append((procs, threads, res))
    ref = min((r for p, _, r in rows if p == 1), key=lambda r: r["step_s"])  # the faster one-process setting
    print(f"{'processes':>9} {'threads/proc':>12} {'device':>8} {'step ms':>9} {'vs 1 proc':>9} {'all-reduce ms':>13} {'share':>6}")
    for procs, threads, r in rows:
        share = f"{r['reduce_s'] / r['step_s']:.1%}" if procs > 1 else "-"
        print(f"{procs:>9} {threads:>12} {r['device']:>8} {r['step_s'] * 1e3:>9.1f} {ref['step_s'] / r['step_s']:>8.2f}x "
              f"{r['reduce_s'] * 1e3:>13.2f} {share:>6}")
    print(f"(LoRA parameters all-reduced per step: {rows[0][2]['lora_params']:,}; 'vs 1 proc': speed-up over the "
          "faster one-process row; one process runs in a 1-rank group, whose all-reduce is a copy, so its "
          "share is not shown)")


if __name__ == "__main__":
    main(sys.argv[1:])
