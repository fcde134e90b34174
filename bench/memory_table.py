"""docs/memory.md's "Will it fit my GPU?" table, from ``bench/memory.py`` runs.

Each row is one ``bench/memory.py --model M --size PX --base B --checkpointing --budgets ... --json`` run in
its own process (a real-size fake-tensor step: 1-5 minutes of one CPU core each); its JSON line is appended
to ``--results`` (rows already there are not run again unless ``--rerun``), and the table is written from
the results between the ``memory-table`` markers of ``--doc``. Usage::

    .venv/bin/python bench/memory_table.py                       # every model, 512 and 1024 px
    .venv/bin/python bench/memory_table.py --models sdxl,anima --sizes 1024
    .venv/bin/python bench/memory_table.py --models flux1-dev --base bf16   # extra rows in another base
    .venv/bin/python bench/memory_table.py --table-only          # rewrite the doc's table from the results
    .venv/bin/python bench/memory_table.py --replan              # plans again from each row's stored step costs

``--replan`` runs nothing: it plans each row again from the step costs its run stored (``step_costs``) with the
planner as it is now (``training/memory_plan.py``) and appends the re-planned rows, marked ``replanned``. A row
stored before the costs counted the LoRA set Train LoRA forks from (``upstream``) gets it as ``bench/memory.py
--lora-bytes`` counts it on the row's model, rank and targets (its own process; no step run): the attached set
is what the trained one is a copy of (``glue.fork_lora``), fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import memory_models  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import pure_packages  # noqa: E402

pure_packages.install()
from training import memory_plan  # noqa: E402

BUDGETS = (8, 12, 16, 24, 48, 80)
# the base users train each model on: fp8 for the large ones (what the published figures use), bf16 else
BASE = {"cosmos-predict2-2b": "bf16", "anima": "bf16", "sdxl": "bf16", "flux2-klein-4b": "fp8"}
# published figures (docs/memory.md names their sources)
PUBLISHED = {
    "flux1-dev": "sd-scripts, fp8: 24 GB (batch 2); 16 with swap; 12 with 16 swapped; 8 with 28",
    "flux2-klein-4b": "~8 GB 8-bit (seed doc, SimpleTuner)",
    "flux2-klein-9b": "~18 GB (seed doc); ~14 GB int8 (SimpleTuner)",
    "flux2-dev": "50-70 GB (seed doc); ~22 GB int8 + int4 TE (SimpleTuner)",
    "qwen-image": "musubi, fp8: 30 GB; 24 with 16 swapped; 12 with 45",
    "z-image": "9.7 GiB int8, rank 64 (SimpleTuner)",
    "sdxl": "~4 GB full offload + bypass (ComfyUI PR #12189)",
}
START, END = "<!-- memory-table:start -->", "<!-- memory-table:end -->"


def run_row(model: str, size: int, base: str, budgets: tuple[float, ...]) -> dict:
    """One bench/memory.py run (checkpointed plans only) in its own process; its JSON result."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "memory.py"), "--model", model, "--size", str(size),
           "--rank", "16", "--base", base, "--checkpointing", "--budgets", ",".join(f"{b:g}" for b in budgets), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"bench/memory_table.py: {' '.join(cmd[1:])} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cell(plan: dict) -> str:
    if plan["plan"] is None:
        return f"none (min {plan['peak_gib']})"
    text = plan["plan"].replace("checkpointing", "ckpt").replace(" blocks swapped", " swapped")
    text = text.replace("block inputs in host memory", "inputs on host")
    return f"{text}: {plan['peak_gib']}"


def table(rows: list[dict]) -> str:
    """The markdown table: one line per (model, base, size) in MODELS order."""
    order = {m: i for i, m in enumerate(memory_models.MODELS)}
    head = ["model", "base", "px", "ckpt, no swap", "ckpt, inputs on host"] + [f"{b:g} GB" for b in BUDGETS] + [
        "published"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (order.get(r["model"], 99), r["base"], -r["size"])):
        cells = [_cell(r["plans"].get(str(float(b)), {"plan": None, "peak_gib": "?"})) for b in BUDGETS]
        lines.append("| " + " | ".join([r["model"], r["base"], str(r["size"]), str(r["peak_gib"]),
                                         str(r.get("offload_peak_gib", "?")), *cells,
                                         PUBLISHED.get(r["model"], "")]) + " |")
    return "\n".join(lines)


def lora_bytes(row: dict) -> int:
    """``bench/memory.py --lora-bytes`` for the row's model, base, rank and targets."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "memory.py"), "--model", row["model"], "--base", row["base"],
           "--rank", str(row["rank"]), "--targets", row["targets"], "--lora-bytes"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"bench/memory_table.py: {' '.join(cmd[1:])} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["lora_param_bytes"]


def replan(row: dict) -> dict:
    """``row`` planned again from its stored step costs (module docstring)."""
    costs = {}
    upstream = None
    for name, c in row["step_costs"].items():
        fields = {**c, "blocks": tuple(c["blocks"])}
        if "upstream" not in fields:
            upstream = lora_bytes(row) if upstream is None else upstream
            fields["upstream"] = upstream
        costs[name] = memory_plan.StepCost(**fields)
    ckpt, offload = costs["checkpointing"], costs["checkpointing + inputs in host memory"]
    head = memory_plan.plan(ckpt, True, 0)
    plans = {}
    for budget in BUDGETS:
        chosen, tried = memory_plan.choose(lambda c: ckpt, budget, checkpointing_only=True,
                                           offload_cost=lambda: offload)
        plans[str(float(budget))] = ({"plan": chosen.describe(), "peak_gib": chosen.peak_gib} if chosen else
                                     {"plan": None, "peak_gib": min(t.peak_gib for t in tried)})
    return {**row, "peak_gib": head.peak_gib, "tracked_gib": head.tracked_gib, "weights_gib": head.weights_gib,
            "overhead_gib": head.overhead_gib, "upstream_gib": head.upstream_gib, "margin_gib": head.margin_gib,
            "offload_peak_gib": memory_plan.plan(offload, True, 0, True).peak_gib, "plans": plans,
            "step_costs": {name: vars(c) | {"blocks": list(c.blocks)} for name, c in costs.items()},
            "replanned": "from the stored step costs by bench/memory_table.py --replan"}


def write_doc(path: str, text: str) -> None:
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    if START not in doc or END not in doc:
        raise ValueError(f"bench/memory_table.py: {path} has no {START} ... {END} section to write the table into")
    head, rest = doc.split(START, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + START + "\n" + text + "\n" + END + rest.split(END, 1)[1])


def _load(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    last = {(r["model"], r["size"], r["base"]): r for r in rows}  # a row run again replaces the earlier one
    return list(last.values())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(memory_models.MODELS))
    p.add_argument("--sizes", default="1024,512")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "memory_table.jsonl"))
    p.add_argument("--doc", default=os.path.join(ROOT, "docs", "memory.md"))
    p.add_argument("--base", choices=["bf16", "fp8"], help="every row in this base (default: each model's, BASE)")
    p.add_argument("--rerun", action="store_true", help="run rows again even when the results have them")
    p.add_argument("--table-only", action="store_true", help="only write the doc's table from the results")
    p.add_argument("--replan", action="store_true",
                   help="plan every row again from its stored step costs (no run), append them, write the table")
    args = p.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in memory_models.MODELS]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(memory_models.MODELS)}")
    rows = _load(args.results)
    if args.replan:
        rows = [replan(r) for r in rows]
        with open(args.results, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif not args.table_only:
        os.makedirs(os.path.dirname(args.results), exist_ok=True)
        for model in args.models.split(","):
            for size in (int(s) for s in args.sizes.split(",")):
                base = args.base or BASE.get(model, "fp8")
                key = (model, size, base)
                if not args.rerun and any((r["model"], r["size"], r["base"]) == key for r in rows):
                    continue
                row = run_row(model, size, base, BUDGETS)
                rows = [r for r in rows if (r["model"], r["size"], r["base"]) != key] + [row]
                with open(args.results, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{model} {size} px {base}: ckpt {row['peak_gib']} GiB", flush=True)
    write_doc(args.doc, table(rows))


if __name__ == "__main__":
    main()
