"""Memory and FLOPs of one training step of the pack at real size, on the CPU (no GPU, no weights needed).

The real ComfyUI model class at the released file's config (``bench/memory_models.py``) is built under
``FakeTensorMode`` on device cpu (shapes and dtypes only), the pack's own LoRA is attached as
``PrecisionAttachLoRA`` does (object patches on each target Linear), and two steps of the pack's training
step run (``training/memory_step.py`` through ``nodes/train/memory_estimate.py``, which the training node's
VRAM planner shares: loss, backward, the pack's optimizer with its fp32 masters, gradient
checkpointing as ``training_session`` applies it) under torch's ``MemTracker``; the peak is taken over
both steps, so the optimizer state made by the first counts. Attention runs through PyTorch SDPA (what
ComfyUI uses on NVIDIA); on the CPU that is the flash kernel, which keeps the output and log-sum-exp, the
memory shape of flash/cuDNN attention on a GPU.

What the tracker cannot see is added on its own lines (``overhead_gib``): the CUDA context, cuBLAS and
attention workspaces, and a fragmentation margin; attention FLOPs (the CPU flash op has no FLOP formula)
are counted from the calls (forward and recomputation as called, backward 2.5x the forward). Block swap
(``--swap-blocks N``) is modelled, not run: the resident weights minus N swapped blocks plus min(2, N) ring
slots of the largest swapped block, as ``training.swap`` streams them (at most every block but the last,
which is not checkpointed).
``--base q4_k`` (q8_0, q6_k, q5_k, q5_0, q4_0): a GGUF file of that GGML type as ComfyUI-GGUF's loader holds it
(its layers, from ../shared/custom_nodes): each weight at its raw blocks' bytes (``training/memory_gguf.py``),
dequantized per call by those layers inside the tracked step.
``--offload-inputs`` (with ``--checkpointing``): the checkpointed blocks' inputs wait for backward in host
memory (Train Settings' ``offload_block_inputs``).
``--budget GIB`` picks the cheapest plan that fits (``training.memory_plan``: no checkpointing, then
checkpointing, then checkpointing with the block inputs in host memory, then swapping more blocks; with
``--offload-inputs`` only plans with the inputs in host memory), as the training node's ``vram_budget_gb`` does. ``--device cuda`` (on a GPU machine) also runs the step for real
with random weights at the real size and sets ``torch.cuda.max_memory_allocated`` beside the estimate.

Usage::

    .venv/bin/python bench/memory.py --model flux1-dev --size 1024 --rank 16 --base fp8 --checkpointing
    .venv/bin/python bench/memory.py --model qwen-image --size 1024 --base fp8 --budget 16 --json
    .venv/bin/python bench/memory.py --model flux1-dev --size 1024 --base q4_k --checkpointing

See docs/memory.md for the figures, the validation and what the estimate leaves out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def _pack(name: str) -> Any:
    import comfy_harness

    return comfy_harness.pack_module(name)


def _setup_paths() -> None:
    for path in (os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts"), os.path.join(ROOT, "bench")):
        if path not in sys.path:
            sys.path.insert(0, path)


def _estimate() -> Any:
    """The pack's estimator (``nodes/train/memory_estimate.py``: the training node plans VRAM budgets with it)."""
    return _pack("nodes.train.memory_estimate")


def sdpa_override(counter: dict) -> Any:
    return _estimate().sdpa_override(counter)


def _patched_forwards(model: Any) -> list[tuple[Any, str, bool]]:
    return _estimate().patched_forwards(model)


def _inputs(model: Any, size: int, tokens: int, device: Any = None) -> tuple[Any, Any]:
    """(x0 latent (1, ...), the model's processed conds) as the training node builds them."""
    import torch

    nodes, data = _pack("demo.nodes"), _pack("nodes.train.data")
    latent = {"samples": torch.randn(nodes.latent_shape(model, size, size, 1))}
    cond = _conditioning(model, nodes, tokens)
    if hasattr(model.model.diffusion_model, "llm_adapter"):  # Anima: T5 ids beside the Qwen3 context
        cond[0][1].update(t5xxl_ids=torch.zeros(tokens, dtype=torch.int32), t5xxl_weights=torch.ones(tokens))
    sample = data.build_samples(model, [latent], [cond], None, device or torch.device("cpu"))[0]
    return sample.latent.unsqueeze(0), sample.cond


# Text-context widths the demo conditioning does not know: Qwen-Image (Qwen2.5-VL 7B hidden states; the
# model's joint_attention_dim) and Z-Image (Qwen3-4B; detection's cap_feat_dim).
CONTEXT_WIDTHS = {"qwen_image": 3584}
SDXL_POOLED = {2816: 1280}  # SDXL's label input (adm_in_channels) -> the pooled CLIP-G width it is built from


def _conditioning(model: Any, nodes: Any, tokens: int) -> list:
    import torch

    config = model.model.model_config.unet_config
    if config.get("adm_in_channels") in SDXL_POOLED:  # CLIP-G pooled + six 256-wide size embeddings = 2816
        pooled = SDXL_POOLED[config["adm_in_channels"]]
        return [[torch.randn(1, tokens, int(config["context_dim"])), {"pooled_output": torch.randn(1, pooled)}]]
    width = CONTEXT_WIDTHS.get(config.get("image_model")) or config.get("cap_feat_dim")
    if width is None:
        return nodes.make_conditioning(model, "estimate", 0, tokens)
    return [[torch.randn(1, tokens, int(width)), {"pooled_output": None}]]


def run_step(model: Any, *, size: int, rank: int, checkpointing: bool, targets: str = "attention",
             tokens: int = 512, steps: int = 2, fp32_accumulation: bool = True, cuda_kernels: bool = False,
             device: Any = None, on_second_step: Callable[[], None] | None = None, offload: bool = False,
             swap_blocks: int = 0, keep: dict | None = None) -> dict:
    """Track ``steps`` training steps of ``model`` (fake or real tensors: whatever the model holds) at a
    square ``size`` with ``tokens`` text tokens; the step is the pack's (``memory_estimate.run_step``).
    ``cuda_kernels`` (fake tensors only): the fp32-output base GEMM as on CUDA (``mm`` with ``out_dtype``, no
    fp32 copies of the operands; the CPU path upcasts them, a temporary a GPU never makes). ``device``:
    where the inputs go (the model's device; default cpu); ``on_second_step``: called before the tracked steps;
    ``offload``: the checkpointed blocks' inputs wait for backward in host memory (``offload_block_inputs``);
    ``swap_blocks`` (real tensors, with ``checkpointing``): that many blocks stream through ``training.swap``;
    ``keep``: receives the trained copy (``memory_estimate.run_step``)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    settings = _pack("training.settings").TrainSettings(gradient_checkpointing=checkpointing,
                                                        offload_block_inputs=offload and checkpointing,
                                                        swap_blocks=swap_blocks)
    cfg = _pack("lora.config").LoRAConfig(rank=rank, alpha=float(rank), targets=targets,
                                          fp32_accumulation=fp32_accumulation)
    with torch.inference_mode(False), unset_fake_temporarily():  # real (small) inputs: the data checks read values
        x0, cond = _inputs(model, size, tokens, device)
    return _estimate().run_step(model, x0, [cond], cfg, settings, steps=steps, cuda_kernels=cuda_kernels, device=device,
                                on_second_step=on_second_step, keep=keep)


BASES = {"bf16": ("bfloat16", None), "fp8": ("float8_e4m3fn", "bfloat16")}
# GGUF files in one GGML type (training/memory_gguf.py's rules), loaded by ComfyUI-GGUF, computed in bf16
GGUF_BASES = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q5_k": "Q5_K", "q5_0": "Q5_0", "q4_k": "Q4_K", "q4_0": "Q4_0"}


def fake_model(name: str, base: str) -> tuple[Any, Any]:
    """(FakeTensorMode, the model ``name`` built under it with ``base`` weights, computed in bf16)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memory_models

    if base in GGUF_BASES:
        return fake_gguf_model(name, GGUF_BASES[base])
    config = memory_models.unet_config(name)
    weight, compute = (getattr(torch, d) if d else None for d in BASES[base])
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = memory_models.build(config, weight, compute, _pack("nodes.host.comfy_compat").fit_flux_config)
    model.load_device = None  # the LoRA set stays where it is made (Module.to cannot swap fake parameters)
    return mode, model


def fake_gguf_model(name: str, qtype: str) -> tuple[Any, Any]:
    """(FakeTensorMode, the model ``name`` as ComfyUI-GGUF's Unet Loader (GGUF) holds a file of GGML type ``qtype``:
    its layers (the real pack, from ../shared/custom_nodes through tests/other_packs.py), each weight as raw blocks at
    their real bytes (``gguf_layout``), dequantized per call by those layers in the step; computed in bf16)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memory_models
    import other_packs

    gg = other_packs.load_in_process(other_packs.GGUF)
    config, fit = memory_models.unet_config(name), _pack("nodes.host.comfy_compat").fit_flux_config
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        plain = memory_models.build(config, torch.bfloat16, None, fit)  # the file's tensors: their shapes
        model = memory_models.build(config, torch.bfloat16, None, fit, operations=gg.ops.GGMLOps())
        dm = model.model.diffusion_model
        _pack("nodes.host.gguf").fill_fake(dm, gguf_layout(plain.model.diffusion_model, dm, qtype, gg))
    model.load_device = None
    return mode, model


def gguf_layout(plain: Any, ggml: Any, qtype: str, gg: Any) -> dict:
    """Parameter name -> ``nodes.host.gguf.RawTensor``: what ComfyUI-GGUF's loader (``gg``: its module) holds in
    ``ggml`` (a model built with its ops) for each parameter of ``plain`` (the same model with ordinary layers)
    stored in a file of GGML type ``qtype``. Each tensor gets the type of the conversion rules
    (``training.memory_gguf.stored_type``); the loader keeps every Linear parameter, and every block-quantized one,
    as raw GGUF and copies the other F32 / F16 tensors into the model's own parameters (left as built)."""
    import gguf

    rules, raw_tensor = _pack("training.memory_gguf"), _pack("nodes.host.gguf").RawTensor
    modules = dict(ggml.named_modules())
    layout = {}
    for name, p in plain.named_parameters():
        owner = modules.get(name.rpartition(".")[0])
        kind = rules.stored_type(tuple(p.shape), qtype)
        raw = isinstance(owner, gg.ops.GGMLOps.Linear) or (isinstance(owner, gg.ops.GGMLLayer)
                                                            and kind not in rules.FLOAT_TYPES)
        if raw:
            size, dtype = rules.raw_size(tuple(p.shape), kind)
            layout[name] = raw_tensor(size, dtype, gguf.GGMLQuantizationType[kind], tuple(p.shape))
    return layout


def lora_param_bytes(name: str, base: str, rank: int, targets: str) -> int:
    """Bytes of the fp32 LoRA ``attach_lora`` makes on the released model ``name`` (no step run): what the attached
    set Train LoRA trains a copy of keeps on the device (``StepCost.upstream``). ``bench/memory_table.py --replan``
    uses it for rows stored before the estimate counted that set."""
    mode, model = fake_model(name, base)
    cfg = _pack("lora.config").LoRAConfig(rank=rank, alpha=float(rank), targets=targets)
    with mode:
        chosen = _pack("nodes.lora.glue").plan_targets(model, cfg)
    return sum(4 * rank * (i + o) for i, o in chosen.values())


def tracked(name: str, size: int, rank: int, base: str, checkpointing: bool, targets: str,
            offload: bool = False, cuda_kernels: bool = True) -> dict:
    """``run_step`` of the released model ``name`` at real size, on fake tensors (``cuda_kernels``: the base GEMM as on
    CUDA, what a GPU run plans with; False: as the CPU runs it)."""
    import memory_models

    mode, model = fake_model(name, base)
    with mode:
        return run_step(model, size=size, rank=rank, checkpointing=checkpointing, targets=targets,
                        tokens=memory_models.MODELS[name].text_tokens, cuda_kernels=cuda_kernels, offload=offload)


def step_cost(run: dict):
    """``training.memory_plan.StepCost`` of a tracked run."""
    return _estimate().step_cost(run)


def plan_figures(run: dict, checkpointing: bool, swap: int, offload: bool = False) -> dict:
    """The figures of one plan from a tracked run (``training.memory_plan``: the swap model and the
    allowances on their own lines) with the run's own lines (LoRA, optimizer, activations, FLOPs)."""
    cost = step_cost(run)
    p = _pack("training.memory_plan").plan(cost, checkpointing, swap, offload)
    return {**_plan_dict(p), "lora_gib": _gib(cost.lora), "optimizer_gib": _gib(cost.optimizer),
            "activations_gib": _gib(cost.activations), "flops": run["matmul_flops"] + run["attention_flops"],
            "attention_flops": run["attention_flops"], "largest_saved": run["largest_saved"]}


def _plan_dict(p: Any) -> dict:
    return {"plan": p.describe(), "checkpointing": p.checkpointing, "offload_inputs": p.offload_inputs,
            "swap_blocks": p.swap_blocks,
            "peak_gib": p.peak_gib, "tracked_gib": p.tracked_gib, "weights_gib": p.weights_gib,
            "overhead_gib": p.overhead_gib, "swapped_gib": p.swapped_gib, "ring_gib": p.ring_gib,
            "upstream_gib": p.upstream_gib, "margin_gib": p.margin_gib}


def _gib(n: float) -> float:
    return round(n / GIB, 2)


def budget_plan(runs: Callable[[bool, bool], dict], budget_gib: float, checkpointing_only: bool,
                offload_only: bool = False, swap: bool = True) -> dict:
    """The cheapest plan within ``budget_gib`` (``training.memory_plan.choose``, block inputs in host memory
    offered as the node offers them; ``offload_only``: only plans with them) with its figures, or
    ``{"plan": None, "smallest_gib": ...}``. ``runs(checkpointing, offload)``: the tracked run (cached by the
    caller). ``swap`` False (a GGUF base: block swap cannot stream its weights): no plan that swaps blocks, as the
    training node's planner (``nodes/train/budget.py``)."""
    plan, tried = _pack("training.memory_plan").choose(
        lambda c: step_cost(runs(c, False)), budget_gib, checkpointing_only or offload_only,
        offload_cost=lambda: step_cost(runs(True, True)), offload_only=offload_only)
    if plan is not None and plan.swap_blocks and not swap:
        plan, tried = None, [t for t in tried if not t.swap_blocks]
    if plan is None:
        return {"plan": None, "smallest_gib": min(t.peak_gib for t in tried)}
    return plan_figures(runs(plan.checkpointing, plan.offload_inputs), plan.checkpointing, plan.swap_blocks,
                        plan.offload_inputs)


def _parser() -> argparse.ArgumentParser:
    import memory_models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, choices=list(memory_models.MODELS))
    p.add_argument("--size", type=int, default=1024, help="square image size in pixels")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--base", default="bf16", choices=[*BASES, *GGUF_BASES],
                   help="base weights: bf16, fp8 e4m3fn computed in bf16, or a GGUF file of one GGML type (q8_0, q4_k, "
                   "...: ComfyUI-GGUF's layers, computed in bf16)")
    p.add_argument("--targets", default="attention", help="LoRA targets preset (lora/targets.py)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of the blocks")
    p.add_argument("--offload-inputs", action="store_true", help="with --checkpointing: the checkpointed blocks' "
                   "inputs wait for backward in host memory (Train Settings' offload_block_inputs)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--swap-blocks", type=int, default=0, help="blocks kept in host memory (a model of the plan)")
    group.add_argument("--budget", type=float, default=0.0, help="GiB the step must fit: the cheapest plan that fits")
    group.add_argument("--budgets", default="", help="comma-separated GiB, e.g. 8,12,16,24,48,80: the cheapest plan "
                       "for each (docs/memory.md's table); with --checkpointing only checkpointed plans are tried")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: the estimate (fake tensors, no GPU); cuda: also run the step for real on the GPU "
                   "(random weights at the real size) and compare with torch.cuda.max_memory_allocated")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--lora-bytes", action="store_true", help="only print the attached LoRA's bytes as JSON "
                   "({\"lora_param_bytes\": N}; no step run): bench/memory_table.py --replan")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, refused with a clear message (exit 2) where it asks for something impossible."""
    p = _parser()
    args = p.parse_args(argv)
    if args.offload_inputs and not args.checkpointing:
        p.error("--offload-inputs needs --checkpointing: only a checkpointed block's inputs wait for backward")
    if args.swap_blocks and not args.checkpointing:
        p.error(f"--swap-blocks {args.swap_blocks} needs --checkpointing: without it the backward needs every "
                "block's weights resident")
    if args.device == "cuda" and args.base in GGUF_BASES:
        p.error(f"--device cuda --base {args.base}: the measured run builds bf16 and fp8 bases only; a GGUF base is "
                "an estimate here (leave --device cuda out)")
    if args.device == "cuda" and (args.budget or args.budgets or args.swap_blocks):
        p.error("--device cuda measures one plan as given (--checkpointing or not): --budget, --budgets and "
                "--swap-blocks are estimates only; run them without --device cuda")
    try:
        args.budget_list = [float(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        p.error(f"--budgets {args.budgets!r}: give GiB as numbers separated by commas, e.g. 8,12,16,24")
    if any(b <= 0 for b in args.budget_list + ([args.budget] if args.budget else [])) or args.budget < 0:
        p.error("--budget/--budgets: give a positive number of GiB")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    _setup_paths()
    import comfy_harness

    comfy_harness.pack()
    if args.lora_bytes:
        result = {"lora_param_bytes": lora_param_bytes(args.model, args.base, args.rank, args.targets)}
        print(json.dumps(result), flush=True)
        return result
    cache: dict[tuple[bool, bool], dict] = {}

    def runs(ckpt: bool, offload: bool) -> dict:
        if (ckpt, offload) not in cache:
            cache[ckpt, offload] = tracked(args.model, args.size, args.rank, args.base, ckpt, args.targets, offload)
        return cache[ckpt, offload]

    off = args.offload_inputs
    if args.budget_list:
        swap = args.base not in GGUF_BASES
        plans = {str(b): budget_plan(runs, b, args.checkpointing, off, swap) for b in args.budget_list}
        result = {**plan_figures(runs(True, off), True, 0, off),  # the headline: checkpointing, no swap
                  "offload_peak_gib": plan_figures(runs(True, True), True, 0, True)["peak_gib"],
                  "plans": {b: {"plan": p["plan"], "peak_gib": p.get("peak_gib", p.get("smallest_gib"))}
                            for b, p in plans.items()}}
    elif args.budget:
        result = budget_plan(runs, args.budget, args.checkpointing, off, args.base not in GGUF_BASES)
    else:
        result = plan_figures(runs(args.checkpointing, off), args.checkpointing, args.swap_blocks, off)
    result = {"model": args.model, "size": args.size, "rank": args.rank, "base": args.base,
              "targets": args.targets, "budget_gib": args.budget or None, "offload_block_inputs": args.offload_inputs,
              **result}
    # each estimated step's costs (training.memory_plan.StepCost), to plan other budgets without a new run
    result["step_costs"] = {("checkpointing" if c else "plain") + (" + inputs in host memory" if o else ""):
                            vars(step_cost(r)) for (c, o), r in cache.items()}
    if args.device == "cuda":
        result["cuda"] = measured_on_cuda(args, result)
    _print(result)
    if args.json:
        print(json.dumps(result), flush=True)
    return result


def _print(r: dict) -> None:
    mp = _pack("training.memory_plan")
    print(f"[Precision LoRA] bench/memory.py {r['model']} {r['size']} px rank {r['rank']} {r['base']} base, "
          f"targets {r['targets']}")
    if r["plan"] is None:
        smallest = ("without block swap (it cannot stream GGUF weights); use a smaller GGUF type"
                    if r["base"] in GGUF_BASES else "with every block swapped; use "
                    + ("a smaller rank" if r["base"].startswith("fp8") else "--base fp8"))
        print(f"no plan fits {r['budget_gib']} GiB: the smallest, {r['smallest_gib']} GiB, is {smallest}, a smaller "
              "size or a larger budget")
        return
    print(f"plan: {r['plan']}" + (f" (fits {r['budget_gib']} GiB)" if r["budget_gib"] else ""))
    for key in ("weights_gib", "lora_gib", "upstream_gib", "optimizer_gib", "activations_gib", "tracked_gib",
                "overhead_gib", "peak_gib", "margin_gib"):
        print(f"  {key[:-4]:<12}{r[key]:>9.2f} GiB")
    print("  (upstream: the attached LoRA set Train LoRA trains a copy of, kept on the device; in tracked)")
    print(f"  (overhead: CUDA context {mp.CUDA_CONTEXT_GIB} + workspaces {mp.WORKSPACE_GIB} GiB + "
          f"{mp.FRAGMENTATION:.0%} fragmentation margin of the tracked peak; not seen by the tracker)")
    print(f"  (margin: {mp.SAFETY_MARGIN:.0%} of the tracked figure, kept free beyond peak: a plan fits a budget "
          "when peak + margin is within it)")
    print(f"  FLOPs per step: {r['flops'] / 1e12:.1f} TFLOP (attention {r['attention_flops'] / 1e12:.1f}, by formula)")
    for t in r["largest_saved"]:
        print(f"  saved {t['bytes'] / 2**20:9.1f} MiB {t['dtype']:<9} {t['shape']}")
    for budget, plan in r.get("plans", {}).items():
        print(f"  budget {budget:>5} GiB: " + (f"{plan['plan']}, est. {plan['peak_gib']} GiB" if plan["plan"]
                                              else f"no plan fits (smallest {plan['peak_gib']} GiB)"))
    if "cuda" in r:
        c = r["cuda"]
        print(f"  on {c['device']}: max_memory_allocated {c['max_allocated_gib']} GiB vs tracked estimate "
              f"{r['tracked_gib']} GiB ({c['allocated_vs_estimate']:+.1%}); max_memory_reserved "
              f"{c['max_reserved_gib']} GiB vs estimate with allowances {r['peak_gib']} GiB")


def measured_on_cuda(args: argparse.Namespace, estimate: dict) -> dict:
    """The estimated step run for real on the GPU: the same model class and config with random weights
    (``torch.empty`` at the real size; values do not change the memory), the same LoRA, step and tracker
    inputs; ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the second step."""
    import torch

    import memory_models

    if not torch.cuda.is_available():
        raise SystemExit("bench/memory.py --device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                         "run it on a machine with an NVIDIA GPU, or leave --device out for the estimate")
    device = torch.device("cuda")
    weight, compute = (getattr(torch, d) if d else None for d in BASES[args.base])
    with torch.device(device):
        model = memory_models.build(memory_models.unet_config(args.model), weight, compute,
                                    _pack("nodes.host.comfy_compat").fit_flux_config)
    model.load_device = None
    run = run_step(model, size=args.size, rank=args.rank, checkpointing=args.checkpointing, targets=args.targets,
                   tokens=memory_models.MODELS[args.model].text_tokens, device=device,
                   on_second_step=torch.cuda.reset_peak_memory_stats, offload=args.offload_inputs)
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {"device": torch.cuda.get_device_name(), "max_allocated_gib": _gib(allocated),
            "max_reserved_gib": _gib(reserved), "tracked_on_cuda_gib": _gib(run["peak"]),
            "allocated_vs_estimate": allocated / (estimate["tracked_gib"] * GIB) - 1}


if __name__ == "__main__":
    main()
