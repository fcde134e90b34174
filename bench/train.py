"""Training step time and peak memory: PrecisionTrainLoRA vs ComfyUI's built-in TrainLoraNode.

One run measures both trainers on the same real ComfyUI model, data (two latents, one conditioning), rank,
steps and dtype, with and without gradient checkpointing, each configuration in its own subprocess (so
peak memory is not shared), and prints the ratios side by side, for each model of the run:

- ``tiny``: the family's tiny test model (Cosmos: 192 channels, 10 blocks);
- ``<width>`` (Cosmos only, ``--widths 512,2048``): a Cosmos-Predict2 of that width in heads of 128 with
  ``--blocks`` blocks: the layer shapes of real models (the released 2B model is 2048 wide, 28 blocks deep)
  at a depth a CPU can train. The tiny model is so narrow that per-op overhead and attention dominate and
  the two trainers do nearly the same work; at real widths the linear layers dominate, and there the
  built-in trainer's merged-weight LoRA (W + BA built every forward, a full weight gradient every backward,
  the merged weight kept for backward) costs what ours (the low-rank path beside the frozen base) does not.

Measured:
- step time: steady state, between the first and the last optimizer step of one node call of N steps
  (timestamps from ComfyUI's progress-bar hook, which both nodes advance once per optimizer step), after a
  warm-up call in the same process; the rest of the call (LoRA creation, model load, final state) is
  printed as "set-up s". Configurations are repeated interleaved (``--repeats``) and the fastest kept, so
  load from other processes on a shared machine does not decide the ratio;
- peak memory: CUDA ``max_memory_allocated`` on a GPU, else the peak of torch's ``MemTracker`` over the
  measured call minus the model's weights (``PeakMemory``); both above what the model itself holds.

``--compile``: ours eager vs ours with ``compile`` 'blocks' (Train Settings; training/regional_compile.py), each in its
own subprocess, interleaved repeats, with and without checkpointing: step time, peak memory and the first call's
time (the compile time is the compiled first call minus the eager one), with the ratios. On the CPU inductor
builds C++ kernels, and the peak is the resident memory's (``VmHWM`` over the measured call, glibc's mmap
threshold fixed so freed tensors go back; bench/realsize.py), because compiled kernels allocate their buffers
where torch's ``MemTracker`` does not see them. ``--widths`` for Flux.1 (``--family flux1_dev``) and SDXL
(``--family sdxl``): blocks of that width (Flux.1: heads of 128, ``--blocks`` double and single blocks; SDXL:
``model_channels``, heads of 64) beside the tiny model.

Both trainers adapt every Linear of the model, embedders and final layer included (ours: targets "all"
plus include ".+"; the built-in also trains bias/norm diffs, which are tiny). Usage (tcmalloc makes CPU training several times faster)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 .venv/bin/python bench/train.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = ("ours", "builtin")


class PeakMemory:
    """Peak bytes of one run: CUDA ``max_memory_allocated`` above the level at ``__enter__`` on a GPU; on the
    CPU the peak of torch's ``MemTracker`` (every tensor storage made or used in the call, once each;
    bench/memory_step.py) minus the model's own weights, which both trainers hold before they start; with
    ``rss`` (``--compile``) the peak resident memory above the resident memory at ``__enter__``.

    (Resident-set growth, used before, was meaningless: the allocator reuses the warm-up call's memory.)"""

    def __init__(self, cuda: bool, model=None, rss: bool = False) -> None:
        self.cuda, self.model, self.peak, self.rss = cuda, model, 0, rss and not cuda

    def __enter__(self) -> PeakMemory:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        elif self.rss:
            sys.path.insert(0, os.path.join(ROOT, "bench"))
            import realsize

            realsize.reset_peak_rss()
            self.base = realsize.rss_bytes()
        else:
            sys.path.insert(0, os.path.join(ROOT, "bench"))
            import memory_step

            self.tracker = memory_step.FrozenSafeTracker()
            if self.model is not None:
                self.tracker.track_external(self.model)
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            return
        if self.rss:
            import realsize

            self.peak = max(0, realsize.peak_rss_bytes() - self.base)
            return
        import memory_step

        self.tracker.__exit__(*exc)
        kinds = memory_step._category_bytes(self.tracker.get_tracker_snapshot("peak"))
        weights = 0 if self.model is None else sum(
            memory_step.storage_bytes(t) for t in (*self.model.parameters(), *self.model.buffers()))
        self.peak = max(0, kinds.get("Total", 0) - weights)


def _setup(args: argparse.Namespace):
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]
    import torch

    torch.set_num_threads(args.threads)
    import comfy_harness
    from models import make_conditioning, make_latent

    tiny = comfy_harness.pack_module("demo.tiny_models")
    config = width_config(tiny, args.family, args.width, args.blocks) if args.width else None
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = tiny.build_tiny_model(args.family, seed=0, dtype=dtype, unet_config=config)
    latents = [make_latent(model, 1, width=args.size, height=args.size, seed=s) for s in (1, 2)]
    return comfy_harness, model, latents, make_conditioning(model, 1)


def width_config(tiny, family: str, width: int, blocks: int) -> dict:
    """The family's model with blocks ``width`` wide (``--widths``): Cosmos-Predict2 (heads of 128), Flux.1 (heads of
    128, ``blocks`` double and single blocks), SDXL (``model_channels``, heads of 64)."""
    if family == "cosmos":
        return tiny.cosmos_width_config(width, blocks)
    if family == "flux1_dev":
        return tiny.fit_flux_config({**tiny.TINY_UNET_CONFIGS["flux1_dev"], "hidden_size": width,
                                     "num_heads": width // 128, "axes_dim": [16, 56, 56], "depth": blocks,
                                     "depth_single_blocks": blocks})
    if family == "sdxl":
        return {**tiny.TINY_UNET_CONFIGS["sdxl"], "model_channels": width, "num_head_channels": 64}
    raise ValueError(f"--widths {width}: no wider model of family {family!r} (cosmos, flux1_dev, sdxl)")


def _ours(h, model, latents, cond, args, steps: int) -> int:
    import torch

    glue, train = h.pack_module("nodes.lora.glue"), h.pack_module("nodes.train.node")
    h.pack_module("training.regional_compile").BACKEND = args.backend
    lora, settings = h.pack_module("lora.config"), h.pack_module("training.settings")
    cfg = settings.TrainSettings(learning_rate=1e-4, gradient_checkpointing=args.checkpointing, max_grad_norm=0.0,
                                 weight_decay=0.01, swap_blocks=args.swap,
                                 compile="blocks" if args.compiled else "off")
    with torch.inference_mode():
        every = args.targets == "all"  # the comparison with the built-in: every Linear, embedders included
        attached = glue.attach_lora(model, lora.LoRAConfig(rank=args.rank, alpha=args.rank, targets=args.targets,
                                                           include=".+" if every else ""))
        train.PrecisionTrainLoRA.execute([attached], latents, [cond], [steps], [0], ["bench"], settings=[cfg])
    return attached.get_attachment(glue.ATTACHMENT_KEY).num_parameters()


def builtin_inputs(model, latents, cond, args, steps: int) -> dict:
    """TrainLoraNode's inputs for this host, by name from its own schema (0.33 added quantized_backward,
    checkpoint_depth, offloading, bucket_mode, bypass_mode): defaults, then the bench's settings, then the
    variant's options (``--builtin-variants``). Every value is a list (the node is ``is_input_list``)."""
    from comfy_extras.nodes_train import TrainLoraNode

    schema = TrainLoraNode.define_schema()
    values = {i.id: getattr(i, "default", None) for i in schema.inputs}
    dtype = "fp32" if args.dtype == "fp32" else "bf16"  # its compute dtype = the model's; LoRA in fp32 like ours
    values.update(model=model, batch_size=1, steps=steps,
                  grad_accumulation_steps=1, learning_rate=1e-4, rank=args.rank, optimizer="AdamW",
                  loss_function="MSE", seed=0, training_dtype=dtype, lora_dtype="fp32", algorithm="LoRA",
                  gradient_checkpointing=args.checkpointing, existing_lora="[None]")
    for key, value in parse_variant(args.variant).items():
        if key not in values:
            raise SystemExit(f"bench/train.py: TrainLoraNode of this ComfyUI has no input {key!r} "
                             f"(inputs: {', '.join(values)})")
        values[key] = value
    lists = {"latents": latents, "positive": [cond]}
    if values.get("bucket_mode"):  # ResolutionBucket's format: a LATENT per bucket, a conditioning per image
        import torch

        samples = torch.cat([latent["samples"] for latent in latents])
        lists = {"latents": [{"samples": samples}], "positive": [cond] * samples.shape[0]}
    return {k: lists.get(k, [v]) for k, v in values.items()}


def parse_variant(spec: str) -> dict:
    """"bypass_mode" -> {"bypass_mode": True}; "checkpoint_depth=2" -> {"checkpoint_depth": 2}; "" -> {}."""
    out: dict = {}
    for item in (x for x in spec.split("+") if x):
        key, _, raw = item.partition("=")
        out[key] = True if not raw else (int(raw) if raw.isdigit() else raw in ("true", "True") or raw)
    return out


def _builtin(h, model, latents, cond, args, steps: int) -> int:
    import torch
    from comfy_extras.nodes_train import TrainLoraNode

    h.pack()
    with torch.inference_mode():
        TrainLoraNode.execute(**builtin_inputs(model, latents, cond, args, steps))
    return 0


class StepClock:
    """Timestamps of optimizer steps, from ComfyUI's progress-bar hook: both trainers advance their
    ``comfy.utils.ProgressBar`` once per optimizer step, so steady-state step time is measured the same way
    for both, without either node's per-call set-up (LoRA creation, model load). ComfyUI 0.33 throttles the
    hook (updates closer than 100 ms may be dropped; the first and last always arrive), so the time is taken
    between the first and the last update over the steps between them."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []

    def __call__(self, value, total, preview, node_id=None) -> None:
        self.points.append((int(value), time.perf_counter()))

    def step_s(self, steps: int) -> float:
        if steps < 2 or len(self.points) < 2 or self.points[-1][0] - self.points[0][0] < 1:
            raise RuntimeError(f"expected progress updates over {steps} (>= 2) steps, got {self.points}")
        (v0, t0), (v1, t1) = self.points[0], self.points[-1]
        return (t1 - t0) / (v1 - v0)


def child(args: argparse.Namespace) -> dict:
    """One trainer x one checkpointing setting; prints a JSON line."""
    import torch

    h, model, latents, cond = _setup(args)
    import comfy.utils

    args.variant = args.trainer.partition(":")[2]
    run = _ours if args.trainer == "ours" else _builtin
    cuda = torch.cuda.is_available()
    if args.compile and not cuda:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import realsize

        realsize.fixed_mmap_threshold()
    t0 = time.perf_counter()
    run(h, model, latents, cond, args, args.warm_steps)  # first-use allocations, thread pools (and compilation)
    first = time.perf_counter() - t0
    with PeakMemory(cuda, model.model.diffusion_model, rss=args.compile) as mem:
        clock = StepClock()
        comfy.utils.set_progress_bar_global_hook(clock)
        t0 = time.perf_counter()
        lora_params = run(h, model, latents, cond, args, args.steps)
        call = time.perf_counter() - t0
        comfy.utils.set_progress_bar_global_hook(None)
    step = clock.step_s(args.steps)
    dm = model.model.diffusion_model
    return {"trainer": args.trainer, "checkpointing": args.checkpointing, "swap": args.swap, "step_s": step,
            "compiled": args.compiled, "first_s": first,
            "setup_s": max(0.0, call - args.steps * step), "peak_bytes": mem.peak,
            "model": _model_label(args), "model_params": sum(p.numel() for p in dm.parameters()),
            "device": "cuda" if cuda else "cpu",
            "lora_params": lora_params}


def _model_label(args: argparse.Namespace) -> str:
    return f"{args.width}x{args.blocks}" if args.width else "tiny"


def _spawn(args: argparse.Namespace, width: int, trainer: str, checkpointing: bool, swap: int = 0,
           compiled: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--trainer", trainer, "--family", args.family,
           "--rank", str(args.rank), "--size", str(args.size), "--steps", str(args.steps), "--warm-steps",
           str(args.warm_steps), "--dtype", args.dtype, "--threads", str(args.threads), "--width", str(width),
           "--blocks", str(args.blocks), "--swap", str(swap), "--targets", args.targets, "--backend", args.backend]
    if checkpointing:
        cmd.append("--checkpointing")
    if args.compile:
        cmd.append("--compile")
    if compiled:
        cmd.append("--compiled")
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    label = _model_label(argparse.Namespace(width=width, blocks=args.blocks))
    if out.returncode != 0 or not lines:
        return {"trainer": trainer, "checkpointing": checkpointing, "swap": swap, "model": label,
                "compiled": compiled, "error": _error_line(out.stderr)}
    return json.loads(lines[-1])


def _error_line(stderr: str) -> list[str]:
    """The exception line of a child's traceback (the last stderr line can be a hint printed after it)."""
    lines = stderr.strip().splitlines()
    errors = [ln for ln in lines if ln[:1].isalpha() and ("Error:" in ln or "Exception:" in ln)]
    return (errors or lines)[-1:]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="cosmos", choices=["cosmos", "flux1_dev", "flux2", "sdxl"])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--widths", default="tiny,512,2048",
                   help="models, comma-separated: 'tiny' (the family's tiny test model) and/or Cosmos widths "
                        "(multiples of 128, heads of 128, --blocks blocks); with --compile also Flux.1 (multiples "
                        "of 128) and SDXL (multiples of 64) widths")
    p.add_argument("--blocks", type=int, default=2, help="blocks of the --widths models")
    p.add_argument("--size", type=int, default=256, help="latent image size in pixels")
    p.add_argument("--steps", type=int, default=6, help="steps of the measured node call (>= 2; the warm-up call comes first)")
    p.add_argument("--warm-steps", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the model's weights and compute dtype, for both trainers (LoRA parameters are fp32 in both)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per configuration (minimum kept)")
    p.add_argument("--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    p.add_argument("--quick", action="store_true", help="tiny run for tests: flux1_dev, 32 px, 3 steps")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--builtin-variants", default="",
                   help="extra built-in configurations, comma-separated, each options joined by '+', e.g. "
                        "'bypass_mode,checkpoint_depth=2,offloading' (ComfyUI 0.33's TrainLoraNode options)")
    p.add_argument("--swap-blocks", type=int, default=0,
                   help="block swap instead of the trainer comparison: ours with checkpointing, N blocks swapped "
                        "vs none, side by side (N <= blocks - 1: the last block is not checkpointed)")
    p.add_argument("--compile", action="store_true",
                   help="ours eager vs ours with compile 'blocks' (Train Settings), with and without checkpointing")
    p.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"],
                   help="with --compile: torch.compile's backend (aot_eager: dynamo without code generation, for "
                        "quick checks of the bench itself; its times are not a compiled step's)")
    p.add_argument("--targets", default="all", choices=["all", "attention", "attention_mlp"],
                   help="ours' LoRA preset with --compile (default all: every Linear, as against the built-in)")
    p.add_argument("--swap", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--trainer", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.targets != "all" and not args.compile:
        p.error(f"--targets {args.targets}: only with --compile (the built-in trains every Linear)")
    if args.quick:
        args.family, args.size, args.steps, args.warm_steps, args.repeats = "flux1_dev", 32, 3, 1, 1
        args.widths = "tiny"
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return []
    if args.steps < 2:
        p.error(f"--steps {args.steps}: use >= 2 (step time is measured between the first and the last step)")
    if args.swap_blocks < 0:
        p.error(f"--swap-blocks {args.swap_blocks}: use 0 (off) or a count of blocks to swap")
    widths = _widths(p, args)
    _header(args)
    rows: list[dict] = []
    for width in widths:
        if args.swap_blocks:
            rows += _swap_rows(args, width)
            continue
        if args.compile:
            rows += _compile_rows(args, width)
            continue
        trainers = trainer_names(args)
        runs = [_spawn(args, width, t, c) for _ in range(args.repeats) for c in (False, True) for t in trainers]
        best = _best(runs, trainers)
        rows += best
        _report(best, trainers)
    return rows


def _swap_rows(args: argparse.Namespace, width: int) -> list[dict]:
    """Ours with checkpointing, no swap vs ``--swap-blocks`` swapped (interleaved repeats, fastest kept), printed
    side by side with the ratio. Peak memory is what the device holds above the model's start: on a GPU the
    swapped blocks' weights are not in it; on a CPU the device is the host, so only the time is comparable."""
    runs = [_spawn(args, width, "ours", True, swap) for _ in range(args.repeats) for swap in (0, args.swap_blocks)]
    rows = []
    for swap in (0, args.swap_blocks):
        rows.append(_fastest([r for r in runs if r["swap"] == swap], ("step_s", "peak_bytes")))
    print(f"\nmodel {rows[0]['model']}: block swap, ours with checkpointing")
    print(f"{'swapped':<10}{'s/step':>10}{'peak MiB':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['swap']:<10}  failed: {r['error']}")
        else:
            print(f"{r['swap']:<10}{r['step_s']:>10.4f}{r['peak_bytes'] / 2**20:>10.1f}")
    if not any("error" in r for r in rows):
        none, swapped = rows
        print(f"ratio swap {args.swap_blocks}/none, model={none['model']}: time {swapped['step_s'] / none['step_s']:.2f}x, "
              f"peak memory {swapped['peak_bytes'] / max(1, none['peak_bytes']):.2f}x"
              f"{'' if 'cuda' in none.get('device', '') else ' (CPU: the device is the host; compare times only)'}",
              flush=True)
    return rows


def _fastest(mine: list[dict], keys: tuple[str, ...]) -> dict:
    """One configuration's repeats as one row: the smallest of each of ``keys`` over the runs that worked (the
    machine is shared; the minimum keeps other load out), or the first run's error when none did."""
    good = [r for r in mine if "error" not in r]
    return mine[0] if not good else {**good[0], **{k: min(r[k] for r in good) for k in keys}}


def _compile_rows(args: argparse.Namespace, width: int) -> list[dict]:
    """Ours eager vs compiled, without and with checkpointing (interleaved repeats, fastest kept), side by side
    with the ratios and the compile time (the compiled first call minus the eager one)."""
    runs = [_spawn(args, width, "ours", ckpt, compiled=c) for _ in range(args.repeats) for ckpt in (False, True)
            for c in (False, True)]
    rows = []
    for ckpt in (False, True):
        for c in (False, True):
            rows.append(_fastest([r for r in runs if r["checkpointing"] == ckpt and r["compiled"] == c],
                                 ("step_s", "peak_bytes", "first_s")))
    what = "peak MiB" if rows[0].get("device") == "cuda" else "peak RSS MiB"
    print(f"\nmodel {rows[0]['model']}: regional compile (compile 'blocks'), ours")
    print(f"{'checkpointing':<14}{'compiled':<10}{'s/step':>10}{what:>14}{'first call s':>14}")
    for r in rows:
        if "error" in r:
            print(f"{str(r['checkpointing']):<14}{str(r['compiled']):<10}  failed: {r['error']}")
        else:
            print(f"{str(r['checkpointing']):<14}{str(r['compiled']):<10}{r['step_s']:>10.4f}"
                  f"{r['peak_bytes'] / 2**20:>14.1f}{r['first_s']:>14.2f}")
    for eager, compiled in (rows[0:2], rows[2:4]):
        if "error" in eager or "error" in compiled:
            continue
        print(f"ratio compiled/eager, model={eager['model']} checkpointing={eager['checkpointing']}: time "
              f"{compiled['step_s'] / eager['step_s']:.2f}x, peak memory "
              f"{compiled['peak_bytes'] / max(1, eager['peak_bytes']):.2f}x; compile time "
              f"{compiled['first_s'] - eager['first_s']:.1f} s", flush=True)
    return rows


def _widths(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """--widths as ints (0 = tiny); argparse error naming the bad entry."""
    out = []
    for item in (x.strip() for x in args.widths.split(",") if x.strip()):
        if item == "tiny":
            out.append(0)
        elif not item.isdigit() or int(item) < 128 or int(item) % (64 if args.family == "sdxl" else 128):
            p.error(f"--widths: {item!r} is neither 'tiny' nor a multiple of "
                    f"{64 if args.family == 'sdxl' else 128} (>= 128)")
        elif args.family not in ("cosmos", "flux1_dev", "sdxl"):
            p.error(f"--widths {item}: wider models are Cosmos, Flux.1 (flux1_dev) and SDXL; use one of those "
                    "families or --widths tiny")
        elif args.family != "cosmos" and not args.compile:
            p.error(f"--widths {item}: Flux.1 and SDXL widths are for --compile; the trainer comparison takes Cosmos "
                    "widths")
        else:
            out.append(int(item))
    if not out:
        p.error("--widths is empty: give 'tiny' and/or Cosmos widths such as 512,2048")
    return out


def trainer_names(args: argparse.Namespace) -> list[str]:
    """"ours", "builtin" and one "builtin:<options>" per --builtin-variants entry."""
    return [*TRAINERS, *(f"builtin:{v.strip()}" for v in args.builtin_variants.split(",") if v.strip())]


def _best(runs: list[dict], trainers: list[str]) -> list[dict]:
    """Per (trainer, checkpointing): the fastest step time and the smallest peak over the repeats (the
    machine is shared; interleaved repeats and the minimum keep other load out of the ratio)."""
    out = []
    for ckpt in (False, True):
        for trainer in trainers:
            mine = [r for r in runs if r["trainer"] == trainer and r["checkpointing"] == ckpt]
            good = [r for r in mine if "error" not in r]
            if not good:
                out.append(mine[0])
                continue
            out.append({**good[0], "step_s": min(r["step_s"] for r in good),
                        "setup_s": min(r["setup_s"] for r in good),
                        "peak_bytes": min(r["peak_bytes"] for r in good), "repeats": len(good)})
    return out


def _header(args: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import comfy_bootstrap

    with open(os.path.join(comfy_bootstrap.COMFY_DIR, "comfyui_version.py")) as f:
        version = f.read().split('"')[-2]
    print(f"[Precision LoRA] bench/train.py ComfyUI {version} family={args.family} size={args.size}px "
          f"rank={args.rank} dtype={args.dtype} steps={args.steps} repeats={args.repeats} threads={args.threads}"
          f"{' targets=' + args.targets + ' backend=' + args.backend if args.compile else ''}", flush=True)


def _report(rows: list[dict], trainers: list[str]) -> None:
    """One model's rows (trainer x checkpointing) and a ratio line per built-in configuration; a built-in
    that failed is said so, with its error (e.g. ComfyUI 0.33's built-in cannot backward through Cosmos)."""
    sizes = next((r for r in rows if r["trainer"] == "ours" and "error" not in r), None)
    about = "" if sizes is None else (f": {sizes['model_params']:,} parameters, LoRA {sizes['lora_params']:,} "
                                      "(every Linear)")
    width = max(9, *(len(t) + 2 for t in trainers))
    print(f"\nmodel {rows[0]['model']}{about}")
    print(f"{'checkpointing':<14}{'trainer':<{width}}{'s/step':>10}{'peak MiB':>10}{'set-up s':>10}")
    for r in rows:
        if "error" in r:
            print(f"{str(r['checkpointing']):<14}{r['trainer']:<{width}}  failed: {r['error']}")
            continue
        print(f"{str(r['checkpointing']):<14}{r['trainer']:<{width}}{r['step_s']:>10.4f}"
              f"{r['peak_bytes'] / 2**20:>10.1f}{r['setup_s']:>10.3f}")
    for ckpt in (False, True):
        pair = {r["trainer"]: r for r in rows if r["checkpointing"] == ckpt}
        ours = pair.get("ours")
        for name in trainers[1:]:
            other = pair.get(name)
            if ours is None or other is None or "error" in ours:
                continue
            if "error" in other:
                print(f"no ratio ours/{name}, model={rows[0]['model']} checkpointing={ckpt}: the built-in trainer "
                      f"could not train this model here ({' '.join(other['error'])[:200]})", flush=True)
                continue
            t = ours["step_s"] / other["step_s"]
            m = ours["peak_bytes"] / max(1, other["peak_bytes"])
            print(f"ratio ours/{name}, model={rows[0]['model']} checkpointing={ckpt}: time {t:.2f}x, "
                  f"peak memory {m:.2f}x", flush=True)


if __name__ == "__main__":
    main()
