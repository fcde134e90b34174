"""Regional compile on every family row: compiled vs eager LoRA gradients of the same step, per family.

For each tiny family of ``tests/families.py`` (ComfyUI's own classes, the rows of docs/families.md): the pack's
attention override patched (softmax scale 1.25x, as the family test trains), the default LoRA (attention preset,
rank 4, up factors seeded non-zero), one loss + backward of the pack's predict through the training node's session
(``compiled_training`` before ``training_session``), eager and with ``compile`` 'blocks'; the largest difference of
any LoRA gradient tensor relative to that tensor's largest eager value, against the tolerance of the model's dtype
(``training.regional_compile.GRADIENT_TOLERANCE``: the run's own check before it trains, and the tests' bound).
Printed per family: blocks, graphs, graph breaks, the block kinds with parts that run eager (with the reason),
the difference, the time of the two passes; and a last line with the count of rows within tolerance (a row beyond
it is one the run's check would turn eager).

``--backend``: ``inductor`` (the run's own: C++ on the CPU, slow to build) or ``aot_eager`` (dynamo and AOT
autograd without code generation: checks tracing, the graph breaks, the fallbacks and the hooks of the saved
tensors on every row in minutes; the kernels' numerics only with inductor). Usage::

    .hosts/0.33.0/venv/bin/python bench/compile_families.py [--backend aot_eager] [--families Flux,SDXL] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lora_gradients(pack_module, model, x0, cond, compile: str, steps: int = 1, **settings_kw):
    """LoRA gradients of a loss + backward of the pack's predict in the training node's session
    (``nodes.train.glue.sample_gradients``), after ``steps`` identical steps; the compile report (None with compile
    'off') and the compiling calls of the last step. The run's own check (``check_compiled_gradients``) is not
    applied: this compares what compiled blocks give."""
    import torch

    glue, tglue = pack_module("nodes.lora.glue"), pack_module("nodes.train.glue")
    settings = pack_module("training.settings").TrainSettings(compile=compile, **settings_kw)
    lora_set = glue.get_lora_set(model)
    compiles = []
    with torch.inference_mode(), tglue.compiled_training(model, settings) as report, \
            tglue.training_session(model, lora_set, settings) as device:
        fns = tglue.model_fns(model, lora_set, settings, device)
        collated = fns.collate([cond])
        for _ in range(steps):
            grads = tglue.sample_gradients(fns, lora_set, x0.to(device), collated)
            compiles.append(report.compiles if report is not None else 0)
    return grads, report, compiles[-1] - (compiles[-2] if len(compiles) > 1 else 0)


def _row(pack_module, families, name: str, backend: str) -> dict:
    import torch

    glue, tglue, aglue = (pack_module(m) for m in ("nodes.lora.glue", "nodes.train.glue", "nodes.attention.glue"))
    data, lora = pack_module("nodes.train.data"), pack_module("lora.config")
    config = pack_module("attention.config").AttentionConfig
    pack_module("training.regional_compile").BACKEND = backend
    grads = {}
    for compile in ("off", "blocks"):
        model = families.build(name)
        latent = {"samples": families.latent(model, frames=families.FRAMES.get(name, 1),
                                             size=families.PIXELS.get(name, 32))}
        with torch.inference_mode():
            model = aglue.patch_attention(model, config(scale_mode="multiplier", scale_value=1.25))
            attached = glue.attach_lora(model, lora.LoRAConfig(rank=4, alpha=4))
            out, lora_set = tglue.fork_lora(attached)
        with torch.inference_mode(False), torch.no_grad():
            g = torch.Generator().manual_seed(3)
            for a in lora_set.adapters().values():
                a.up.copy_(torch.randn(a.up.shape, generator=g) * 0.2)
                a.mark_modified()
        sample = data.build_samples(out, [latent], [families.conditioning(name, training=True)], None,
                                    torch.device("cpu"))[0]
        began = time.perf_counter()
        grads[compile], report, _ = lora_gradients(pack_module, out, sample.latent.unsqueeze(0), sample.cond, compile)
        took = time.perf_counter() - began
    rc = pack_module("training.regional_compile")
    dtype = next(out.model.diffusion_model.parameters()).dtype
    worst = rc.worst_difference(grads["off"], grads["blocks"])
    tol = rc.GRADIENT_TOLERANCE.get(dtype, rc.GRADIENT_TOLERANCE[torch.bfloat16])
    # a gradient one run has and the other has not (None): equal only if it is all zeros (the compiled graph
    # returns a zero gradient for an input it does not use, e.g. the last block's text-stream output)
    only = sorted(set(grads["off"]) ^ set(grads["blocks"]))
    nonzero = [n for n in only if float((grads["off"].get(n, grads["blocks"].get(n))).abs().max()) > 0]
    return {"family": name, "dtype": str(dtype).replace("torch.", ""), "blocks": report.blocks, "kinds": report.kinds, "graphs": report.graphs,
            "only_one_side": only,
            "breaks": sum(report.breaks.values()), "fallbacks": report.fallbacks, "worst": worst, "tolerance": tol,
            "ok": worst <= tol, "seconds": took, "nonzero_one_side": nonzero,
            "tensors": len(grads["off"])}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--families", default="", help="comma-separated family names (default: every available row)")
    p.add_argument("--json", action="store_true", help="also print each row as a JSON line")
    args = p.parse_args(argv)  # before the harness: ComfyUI's argument parsing clears sys.argv
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]
    import comfy_harness
    import torch

    comfy_harness.pack()
    torch.set_num_threads(1)
    import families

    names = [n.strip() for n in args.families.split(",") if n.strip()] or sorted(families.TINY)
    unknown = [n for n in names if n not in families.TINY]
    if unknown:
        p.error(f"--families: unknown {', '.join(unknown)} (known: {', '.join(sorted(families.TINY))})")
    print(f"[Precision LoRA] bench/compile_families.py backend={args.backend} torch {torch.__version__}", flush=True)
    print(f"{'family':<30}{'dtype':<10}{'blocks':>7}{'graphs':>8}{'breaks':>8}{'worst rel diff':>16}{'tol':>8}"
          f"{'s':>8}  eager fallbacks")
    rows = []
    for name in names:
        reason = families.available(name)
        if reason is not None:
            print(f"{name:<30}not available here: {reason}")
            continue
        try:
            row = _row(comfy_harness.pack_module, families, name, args.backend)
        except Exception as exc:  # a row that fails is a finding, printed; the sweep goes on
            row = {"family": name, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}", "ok": False}
            print(f"{name:<30}failed: {row['error']}", flush=True)
            rows.append(row)
            continue
        rows.append(row)
        falls = "; ".join(f"{k}: {v[:80]}" for k, v in row["fallbacks"].items()) or "none"
        print(f"{name:<30}{row['dtype']:<10}{row['blocks']:>7}{row['graphs']:>8}{row['breaks']:>8}"
              f"{row['worst']:>16.2e}{row['tolerance']:>8.0e}{row['seconds']:>8.1f}  {falls}"
              f"{'' if row['ok'] else '  OVER TOLERANCE'}"
              f"{'  a gradient on one side only (zero on the other): ' + ', '.join(row['only_one_side'][:2]) if row['only_one_side'] else ''}"
              f"{' (NOT ZERO)' if row['nonzero_one_side'] else ''}",
              flush=True)
        if args.json:
            print(json.dumps({k: v for k, v in row.items()}), flush=True)
    good = sum(1 for r in rows if r["ok"])
    fell = sum(1 for r in rows if r.get("fallbacks"))
    print(f"rows within tolerance: {good} of {len(rows)}; rows with a block kind run eager: {fell}", flush=True)
    return rows


if __name__ == "__main__":
    main()
