"""Memory and FLOPs of one training step of the pack at real size, on the CPU (no GPU, no weights needed).

The real ComfyUI model class at the released file's config (``bench/memory_models.py``) is built under
``FakeTensorMode`` on device cpu (shapes and dtypes only), the pack's own LoRA is attached as
``PrecisionAttachLoRA`` does (object patches on each target Linear), and two steps of the pack's training
step run (``bench/memory_step.py``: loss, backward, the pack's optimizer with its fp32 masters, gradient
checkpointing as ``training_session`` applies it) under torch's ``MemTracker``; the peak is taken over
both steps, so the optimizer state made by the first counts. Attention runs through PyTorch SDPA (what
ComfyUI uses on NVIDIA); on the CPU that is the flash kernel, which keeps the output and log-sum-exp, the
memory shape of flash/cuDNN attention on a GPU.

What the tracker cannot see is added on its own lines (``overhead_gib``): the CUDA context, cuBLAS and
attention workspaces, and a fragmentation margin; attention FLOPs (the CPU flash op has no FLOP formula)
are counted from the calls. Block swap (``--swap-blocks N``) is modelled, not run: the resident weights
minus N swapped blocks plus two ring slots of the largest block (the executor is future work, #29 item 3).
``--budget GIB`` picks the cheapest plan that fits: as given, then checkpointing, then swapping more blocks.

Usage::

    .venv/bin/python bench/memory.py --model flux1-dev --size 1024 --rank 16 --base fp8 --checkpointing
    .venv/bin/python bench/memory.py --model qwen-image --size 1024 --base fp8 --budget 16 --json

See docs/memory.md for the figures, the validation and what the estimate leaves out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30
# Allowances for what no tensor tracker sees (docs/memory.md says where each figure comes from).
CUDA_CONTEXT_GIB = 0.6
WORKSPACE_GIB = 0.25  # cuBLAS (cublasLt) + attention workspaces, about 2 streams' worth
FRAGMENTATION = 0.05  # of the tracked peak: reserved minus allocated in the caching allocator
RING_SLOTS = 2


def _pack(name: str) -> Any:
    import comfy_harness

    return comfy_harness.pack_module(name)


def _setup_paths() -> None:
    for path in (os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts"), os.path.join(ROOT, "bench")):
        if path not in sys.path:
            sys.path.insert(0, path)


def sdpa_override(counter: dict) -> Any:
    """An ``optimized_attention_override`` that runs ComfyUI's PyTorch-SDPA attention and counts the
    attention FLOPs of each call (4·B·H·Lq·Lk·D, forward) into ``counter``."""
    import comfy.ldm.modules.attention as attention

    def override(func: Any, q: Any, k: Any, v: Any, heads: int, *args: Any, **kwargs: Any) -> Any:
        b, lq, lk = q.shape[0], q.shape[-2], k.shape[-2]
        if not kwargs.get("skip_reshape", False):
            lq, lk = q.shape[1], k.shape[1]
        d = q.shape[-1] if kwargs.get("skip_reshape", False) else q.shape[-1] // heads
        counter["flops"] = counter.get("flops", 0) + 4 * b * heads * lq * lk * d
        counter["calls"] = counter.get("calls", 0) + 1
        kwargs.pop("transformer_options", None)
        return attention.attention_pytorch(q, k, v, heads, *args, **kwargs)

    return override


def _inputs(model: Any, size: int, tokens: int) -> tuple[Any, Any]:
    """(x0 latent (1, ...), the model's processed conds) as the training node builds them."""
    import torch

    nodes, data = _pack("demo.nodes"), _pack("nodes.train.data")
    latent = {"samples": torch.randn(nodes.latent_shape(model, size, size, 1))}
    cond = _conditioning(model, nodes, tokens)
    if hasattr(model.model.diffusion_model, "llm_adapter"):  # Anima: T5 ids beside the Qwen3 context
        cond[0][1].update(t5xxl_ids=torch.zeros(tokens, dtype=torch.int32), t5xxl_weights=torch.ones(tokens))
    sample = data.build_samples(model, [latent], [cond], None, torch.device("cpu"))[0]
    return sample.latent.unsqueeze(0), sample.cond


# Text-context widths the demo conditioning does not know: Qwen-Image (Qwen2.5-VL 7B hidden states; the
# model's joint_attention_dim) and Z-Image (Qwen3-4B; detection's cap_feat_dim).
CONTEXT_WIDTHS = {"qwen_image": 3584}


def _conditioning(model: Any, nodes: Any, tokens: int) -> list:
    import torch

    config = model.model.model_config.unet_config
    width = CONTEXT_WIDTHS.get(config.get("image_model")) or config.get("cap_feat_dim")
    if width is None:
        return nodes.make_conditioning(model, "estimate", 0, tokens)
    return [[torch.randn(1, tokens, int(width)), {"pooled_output": None}]]


def _patched_forwards(model: Any) -> list[tuple[Any, str, bool]]:
    """Install the clone's object patches (the LoRA forwards) on the modules, as ``patch_model`` does;
    returns what to undo."""
    import comfy.utils

    undo = []
    for key, patch in model.object_patches.items():
        owner_path, attr = key.rsplit(".", 1)
        owner = comfy.utils.get_attr(model.model, owner_path)
        undo.append((owner, attr, attr in owner.__dict__))
        setattr(owner, attr, patch)
    return undo


def run_step(model: Any, *, size: int, rank: int, checkpointing: bool, targets: str = "attention",
             tokens: int = 512, steps: int = 2, fp32_accumulation: bool = True, cuda_gemm: bool = False) -> dict:
    """Track ``steps`` training steps of ``model`` (fake or real tensors: whatever the model holds);
    returns bytes by category, the peak, the five largest saved tensors and FLOPs. ``cuda_gemm`` (fake
    tensors only): the fp32-output base GEMM as on CUDA (``mm`` with ``out_dtype``, no fp32 copies of
    the operands; the CPU path upcasts them, a temporary a GPU never makes)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import memory_step

    glue, tglue, grad = _pack("nodes.lora.glue"), _pack("nodes.train.glue"), _pack("training.grad")
    compat, optim, masters_mod = _pack("nodes.host.comfy_compat"), _pack("training.optim"), _pack("training.masters")
    settings = _pack("training.settings").TrainSettings(gradient_checkpointing=checkpointing)
    cfg = _pack("lora.config").LoRAConfig(rank=rank, alpha=float(rank), targets=targets,
                                                 fp32_accumulation=fp32_accumulation)
    with torch.inference_mode(False):
        attached = glue.attach_lora(model, cfg)
        lora_set = glue.get_lora_set(attached)
        counter: dict = {}
        topts = attached.model_options.setdefault("transformer_options", {})
        topts["optimized_attention_override"] = sdpa_override(counter)
        dm = attached.model.diffusion_model
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # real (small) inputs: the data checks read values
            x0, cond = _inputs(attached, size, tokens)
        fns = tglue.model_fns(attached, lora_set, settings, torch.device("cpu"))
        cond = fns.collate([cond])
        groups = lora_set.param_groups(settings.learning_rate, settings.loraplus_ratio)
        masters = masters_mod.MasterWeights(groups, torch.Generator().manual_seed(0))
        optimizer = optim.build_optimizer(groups, settings.optimizer, settings.hyperparams)
        undo = _patched_forwards(attached)
        linear = _pack("lora.linear")
        cpu_gemm = linear._gemm_fp32_out
        if cuda_gemm:
            linear._gemm_fp32_out = lambda a, b_t: torch.mm(a, b_t, out_dtype=torch.float32)
        frozen = [(p, p.requires_grad) for p in dm.parameters()]
        try:
            with grad.autograd_enabled(), compat.model_gradients():
                for p, _ in frozen:
                    p.requires_grad_(False)
                lora_set.train(True)
                blocks = grad.find_block_lists(dm, tglue.BLOCK_LISTS)[:-1] if checkpointing else []
                with grad.checkpoint_blocks(blocks, in_place_adds=tglue.needs_in_place_fix(attached), rng=lora_set.rng):
                    def predict(*args: Any) -> Any:  # notes the forward's attention FLOPs (no recomputation)
                        out = fns.predict(*args)
                        counter.setdefault("forward", counter.get("flops", 0))
                        return out

                    step = memory_step.make_step(predict, x0, cond, fns, settings, optimizer, masters,
                                                 _pack("training.sampling"))
                    flops = FlopCounterMode(display=False)
                    with flops:  # a first step outside the tracker: FLOPs, attention calls, optimizer state
                        step()
                    # forward + recomputation (counted as called) + backward (twice the forward's)
                    attention = counter.get("flops", 0) + 2 * counter.get("forward", 0)
                    tracker, census = memory_step.tracked_steps(step, [dm, lora_set], optimizer, steps - 1, grad)
        finally:
            linear._gemm_fp32_out = cpu_gemm
            for p, flag in frozen:
                p.requires_grad_(flag)
            for owner, attr, had in undo:
                if not had:
                    owner.__dict__.pop(attr, None)
    mem = memory_step.summarize(tracker, census)
    return {"peak": mem.peak, "by_kind": mem.by_kind, "largest_saved": mem.largest_saved,
            "matmul_flops": int(flops.get_total_flops()), "attention_flops": int(attention),
            "lora_bytes": sum(p.numel() * p.element_size() for p in lora_set.parameters()),
            "blocks": _block_bytes(dm, grad, tglue)}


def _block_bytes(dm: Any, grad: Any, tglue: Any) -> list[int]:
    """Weight bytes of each block the pack would checkpoint/swap, in execution order."""
    return [sum(p.numel() * p.element_size() for p in b.parameters()) for b in grad.find_block_lists(dm, tglue.BLOCK_LISTS)]


BASES = {"bf16": ("bfloat16", None), "fp8": ("float8_e4m3fn", "bfloat16")}


def fake_model(name: str, base: str) -> tuple[Any, Any]:
    """(FakeTensorMode, the model ``name`` built under it with ``base`` weights, computed in bf16)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memory_models

    config = memory_models.unet_config(name)
    weight, compute = (getattr(torch, d) if d else None for d in BASES[base])
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = memory_models.build(config, weight, compute, _pack("nodes.host.comfy_compat").fit_flux_config)
    model.load_device = None  # the LoRA set stays where it is made (Module.to cannot swap fake parameters)
    return mode, model


def tracked(name: str, size: int, rank: int, base: str, checkpointing: bool, targets: str) -> dict:
    """``run_step`` of the released model ``name`` at real size, on fake tensors."""
    import memory_models

    mode, model = fake_model(name, base)
    with mode:
        return run_step(model, size=size, rank=rank, checkpointing=checkpointing, targets=targets,
                        tokens=memory_models.MODELS[name].text_tokens, cuda_gemm=True)


def _gib(n: float) -> float:
    return round(n / GIB, 2)


def plan_figures(run: dict, swap: int) -> dict:
    """The figures of one plan from a tracked run: the swap model and the allowances on their own lines."""
    kinds, blocks = run["by_kind"], run["blocks"]
    if swap > len(blocks):
        raise ValueError(f"bench/memory.py: --swap-blocks {swap}: the model has {len(blocks)} blocks")
    swapped = sum(blocks[:swap])
    ring = RING_SLOTS * max(blocks) if swap else 0
    tracked = run["peak"] - swapped + ring
    overhead = CUDA_CONTEXT_GIB * GIB + WORKSPACE_GIB * GIB + FRAGMENTATION * tracked
    weights = kinds.get("Parameter", 0) + kinds.get("Buffer", 0) - run["lora_bytes"] - swapped + ring
    return {"peak_gib": _gib(tracked + overhead), "tracked_gib": _gib(tracked), "weights_gib": _gib(weights),
            "lora_gib": _gib(run["lora_bytes"] + kinds.get("Gradient", 0)),
            "optimizer_gib": _gib(kinds.get("Optstate", 0)),
            "activations_gib": _gib(kinds.get("Activation", 0) + kinds.get("Temp", 0)),
            "overhead_gib": _gib(overhead), "swapped_gib": _gib(swapped), "ring_gib": _gib(ring),
            "flops": run["matmul_flops"] + run["attention_flops"], "attention_flops": run["attention_flops"],
            "largest_saved": run["largest_saved"]}


def choose(runs: dict[bool, dict], budget_gib: float, checkpointing: bool) -> tuple[dict | None, list[dict]]:
    """Cheapest plan within ``budget_gib``: the given checkpointing setting without swap, then checkpointing,
    then 1, 2, ... swapped blocks (swap needs checkpointing: the recomputation re-reads streamed blocks).
    Returns (the plan or None, every plan tried)."""
    tried = []
    order = [(checkpointing, 0)] + ([] if checkpointing else [(True, 0)])
    order += [(True, n) for n in range(1, len(runs[True]["blocks"]) + 1)] if True in runs else []
    for ckpt, swap in order:
        if ckpt not in runs:
            continue
        figures = {**plan_figures(runs[ckpt], swap), "plan": describe(ckpt, swap, len(runs[ckpt]["blocks"]))}
        tried.append(figures)
        if figures["peak_gib"] <= budget_gib:
            return figures, tried
    return None, tried


def describe(checkpointing: bool, swap: int, blocks: int) -> str:
    return (("checkpointing" if checkpointing else "no checkpointing")
            + (f", {swap} of {blocks} blocks swapped" if swap else ""))


def main(argv: list[str] | None = None) -> dict:
    import memory_models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, choices=list(memory_models.MODELS))
    p.add_argument("--size", type=int, default=1024, help="square image size in pixels")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--base", default="bf16", choices=list(BASES), help="base weights: bf16, or fp8 e4m3fn computed in bf16")
    p.add_argument("--targets", default="attention", help="LoRA targets preset (lora/targets.py)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of the blocks")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--swap-blocks", type=int, default=0, help="blocks kept in host memory (a model of the plan)")
    group.add_argument("--budget", type=float, default=0.0, help="GiB the step must fit: the cheapest plan that fits")
    group.add_argument("--budgets", default="", help="comma-separated GiB, e.g. 8,12,16,24,48,80: the cheapest plan "
                       "for each (docs/memory.md's table); with --checkpointing only checkpointed plans are tried")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    if args.swap_blocks and not args.checkpointing:
        p.error(f"--swap-blocks {args.swap_blocks} needs --checkpointing: without it the backward needs every "
                "block's weights resident")
    _setup_paths()
    import comfy_harness

    comfy_harness.pack()
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    planning = bool(args.budget or budgets)
    settings = [args.checkpointing] if not planning or args.checkpointing else [False, True]
    runs = {ckpt: tracked(args.model, args.size, args.rank, args.base, ckpt, args.targets) for ckpt in settings}
    if budgets:
        result = {**plan_figures(runs[settings[-1]], 0), "plan": describe(settings[-1], 0, len(runs[settings[-1]]["blocks"])),
                  "plans": {str(b): _brief(*choose(runs, b, args.checkpointing)) for b in budgets}}
    elif args.budget:
        plan, tried = choose(runs, args.budget, args.checkpointing)
        result = plan or {**tried[-1], "plan": None, "smallest_gib": min(t["peak_gib"] for t in tried)}
    else:
        result = {**plan_figures(runs[args.checkpointing], args.swap_blocks),
                  "plan": describe(args.checkpointing, args.swap_blocks, len(runs[args.checkpointing]["blocks"]))}
    result = {"model": args.model, "size": args.size, "rank": args.rank, "base": args.base,
              "targets": args.targets, "budget_gib": args.budget or None, **result}
    _print(result)
    if args.json:
        print(json.dumps(result), flush=True)
    return result


def _brief(plan: dict | None, tried: list[dict]) -> dict:
    if plan is None:
        return {"plan": None, "peak_gib": min(t["peak_gib"] for t in tried)}
    return {"plan": plan["plan"], "peak_gib": plan["peak_gib"]}


def _print(r: dict) -> None:
    print(f"[Precision LoRA] bench/memory.py {r['model']} {r['size']} px rank {r['rank']} {r['base']} base, "
          f"targets {r['targets']}")
    if r["plan"] is None:
        print(f"no plan fits {r['budget_gib']} GiB: the smallest, {r['smallest_gib']} GiB, is with every block "
              "swapped; use --base fp8, a smaller size or a larger budget")
        return
    print(f"plan: {r['plan']}" + (f" (fits {r['budget_gib']} GiB)" if r["budget_gib"] else ""))
    for key in ("weights_gib", "lora_gib", "optimizer_gib", "activations_gib", "tracked_gib", "overhead_gib", "peak_gib"):
        print(f"  {key[:-4]:<12}{r[key]:>9.2f} GiB")
    print(f"  (overhead: CUDA context {CUDA_CONTEXT_GIB} + workspaces {WORKSPACE_GIB} GiB + {FRAGMENTATION:.0%} "
          "fragmentation margin of the tracked peak; not seen by the tracker)")
    print(f"  FLOPs per step: {r['flops'] / 1e12:.1f} TFLOP (attention {r['attention_flops'] / 1e12:.1f}, by formula)")
    for t in r["largest_saved"]:
        print(f"  saved {t['bytes'] / 2**20:9.1f} MiB {t['dtype']:<9} {t['shape']}")
    for budget, plan in r.get("plans", {}).items():
        print(f"  budget {budget:>5} GiB: " + (f"{plan['plan']}, est. {plan['peak_gib']} GiB" if plan["plan"]
                                              else f"no plan fits (smallest {plan['peak_gib']} GiB)"))


if __name__ == "__main__":
    main()
