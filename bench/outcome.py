"""Training outcome: does fp32 LoRA accumulation (or the stable attention backend) change what training learns?

A small pure-torch model (pre-norm blocks of multi-head attention + MLP, every Linear adapted by the pack's
``lora.layer`` layers, attention through the pack's backends) learns a teacher: the same base weights plus
small low-rank deltas (rms(ΔW*)/rms(W) = ``rho``, the regime where bf16 rounding matters). Every run starts
from the same base weights (bf16-representable), the same LoRA init and sees the same batches:

- (a) bf16 LoRA: bf16 base, LoRA parameters stored in bf16, plain bf16 path (delta rounded, added in bf16)
- (a') fp32 parameters but the plain bf16 path (separates parameter storage from the forward path)
- (b) fp32-accumulating LoRA: bf16 base, fp32 parameters, delta added before the output is rounded
- (c) fp32 reference: the same model in fp32

Reported against (c): ‖ΔW − ΔW_c‖ / ‖ΔW_c‖ over all layers, and rms(out − out_c) / rms(out_c − base_c) on held-out
inputs (output distance relative to the LoRA's own effect), once in each run's own precision and once with
the learned ΔW evaluated in an fp64 copy of the model; also the distance of ΔW to the teacher's ΔW*, the
part of the teacher's effect not learned (rms(out_fp64 − y*) / rms(y* − base)), the fraction of
``lora_down`` elements that ever moved, and the last training loss. The same for attention backends
(fp32-accumulating LoRA everywhere): sdpa, stable, and an emulated low-precision kernel (bf16 P̄ and bf16
tile products, ``emulate="paper"``) with the standard vs the stable shift.

The ``stable`` backend with bf16 inputs rounds P̄ to bf16 for the P̄V product, as a flash kernel does, with
the shift on.

Run: ``.venv/bin/python bench/outcome.py`` (full) or ``--quick`` (seconds, used by the tests);
``--group lora`` / ``--group attention`` runs one table; ``--device cuda`` trains on a GPU.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import pure_packages  # noqa: E402  (the pure packages by their short names)

pure_packages.install()
from attention.backends import get_backend  # noqa: E402
from attention.config import default_scale  # noqa: E402
from attention.stable import StableOptions, stable_attention  # noqa: E402
from attention.stats import measure_call  # noqa: E402
from lora.config import LoRAConfig  # noqa: E402
from lora.layer import LoRASet  # noqa: E402
from lora.lowrank import lora_linear  # noqa: E402

FULL = {"dim": 64, "heads": 4, "blocks": 2, "tokens": 16, "batch": 8, "train": 128, "test": 32, "steps": 200,
        "rank": 4, "rho": 2e-3, "lrs": (1e-4, 1e-3)}
QUICK = {"dim": 32, "heads": 2, "blocks": 1, "tokens": 16, "batch": 8, "train": 16, "test": 8, "steps": 4,
         "rank": 2, "rho": 2e-3, "lrs": (1e-3,)}


@dataclass(frozen=True)
class RunSpec:
    """One training run: compute dtype of base and activations, LoRA storage/path, attention backend."""

    label: str
    dtype: torch.dtype
    param_dtype: str = "fp32"
    fp32_accumulation: bool = True
    attention: str = "sdpa"


LORA_RUNS = (
    RunSpec("(a) bf16 LoRA: bf16 params, bf16 add", torch.bfloat16, "bf16", False),
    RunSpec("(a') fp32 params, bf16 add", torch.bfloat16, "fp32", False),
    RunSpec("(b) fp32-accumulating LoRA (ours)", torch.bfloat16, "fp32", True),
    RunSpec("(c) fp32 reference", torch.float32),
)
ATTENTION_RUNS = (
    RunSpec("bf16, sdpa", torch.bfloat16, attention="sdpa"),
    RunSpec("bf16, stable", torch.bfloat16, attention="stable"),
    RunSpec("bf16, emulated kernel, standard shift", torch.bfloat16, attention="paper_standard"),
    RunSpec("bf16, emulated kernel, stable shift", torch.bfloat16, attention="paper_stable"),
    RunSpec("(c) fp32 reference, sdpa", torch.float32, attention="sdpa"),
)


def layer_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """Module path → (in, out) for every Linear of the model."""
    d = cfg["dim"]
    shapes = {}
    for i in range(cfg["blocks"]):
        shapes.update({f"blocks.{i}.qkv": (d, 3 * d), f"blocks.{i}.proj": (d, d),
                       f"blocks.{i}.fc1": (d, 4 * d), f"blocks.{i}.fc2": (4 * d, d)})
    return shapes


def make_base(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Fan-in scaled weights, rounded to bf16 once so every run starts from exactly the same numbers (fp32)."""
    return {p: (torch.randn(o, i, generator=gen) / math.sqrt(i)).bfloat16().float() for p, (i, o) in layer_shapes(cfg).items()}


def make_teacher(base: dict[str, torch.Tensor], cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Low-rank ΔW* per layer (fp64) with rms(ΔW*)/rms(W) = cfg['rho']."""
    out = {}
    for p, w in base.items():
        dw = torch.randn(w.shape[0], cfg["rank"], generator=gen).double() @ torch.randn(cfg["rank"], w.shape[1], generator=gen).double()
        out[p] = dw * (cfg["rho"] * w.double().pow(2).mean().sqrt() / dw.pow(2).mean().sqrt())
    return out


def attend(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q/k/v (B, H, L, D) → (B, H, L, D) through the pack's attention code."""
    if kind in ("sdpa", "stable"):
        return get_backend(kind)(q, k, v, scale=scale, layout="bhld")
    opts = StableOptions(shift=kind == "paper_stable", emulate="paper")
    return stable_attention(q, k, v, scale=scale, options=opts)


class TinyModel(nn.Module):
    """Pre-norm attention + MLP blocks; weights frozen in ``dtype``; LoRA on every Linear (or ``deltas`` merged
    in fp64 for the teacher). x (B, L, dim) → (B, L, dim) in ``dtype``."""

    def __init__(self, base: dict[str, torch.Tensor], cfg: dict, spec: RunSpec, lora: LoRASet | None = None,
                 deltas: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.cfg, self.spec, self.lora = cfg, spec, lora
        dtype = spec.dtype
        self.weights = {p: (w.double() + deltas[p] if deltas else w).to(dtype) for p, w in base.items()}
        self.adapters = lora.adapters() if lora is not None else {}

    def linear(self, path: str, x: torch.Tensor) -> torch.Tensor:
        adapter = self.adapters.get(path)
        if adapter is None:
            return F.linear(x, self.weights[path])
        return lora_linear(x, self.weights[path], None, (adapter,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.spec.dtype)
        b, n, d = x.shape
        h = self.cfg["heads"]
        for i in range(self.cfg["blocks"]):
            y = F.layer_norm(x, (d,))
            q, k, v = self.linear(f"blocks.{i}.qkv", y).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
            a = attend(self.spec.attention, q, k, v, default_scale(d // h)).transpose(1, 2).reshape(b, n, d)
            x = x + self.linear(f"blocks.{i}.proj", a)
            y = F.layer_norm(x, (d,))
            x = x + self.linear(f"blocks.{i}.fc2", F.gelu(self.linear(f"blocks.{i}.fc1", y)))
        return x


@dataclass
class Outcome:
    """What a run learned: ΔW per layer (fp64), held-out outputs in the run's own precision and of the fp32
    model carrying the learned LoRA (fp64), down-moved fraction, last loss."""

    dw: dict[str, torch.Tensor]
    out: torch.Tensor
    out_fp32: torch.Tensor
    down_moved: float
    loss: float


def make_data(cfg: dict, base: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Train/test inputs and the teacher's fp64 targets; ``base_out``: the fp32 model without LoRA on test;
    ``dw.<path>``: the teacher's ΔW* per layer."""
    x = torch.randn(cfg["train"] + cfg["test"], cfg["tokens"], cfg["dim"], generator=gen)
    deltas = make_teacher(base, cfg, gen)
    teacher = TinyModel(base, cfg, RunSpec("teacher", torch.float64), deltas=deltas)
    with torch.no_grad():
        y = teacher(x.double())
        base_out = TinyModel(base, cfg, RunSpec("base", torch.float32))(x[cfg["train"]:]).double()
    n = cfg["train"]
    return {"x": x[:n], "y": y[:n], "x_test": x[n:], "y_test": y[n:], "base_out": base_out,
            **{f"dw.{p}": d for p, d in deltas.items()}}


def train(spec: RunSpec, cfg: dict, base: dict[str, torch.Tensor], data: dict[str, torch.Tensor], lr: float) -> Outcome:
    """AdamW on the LoRA for cfg['steps'] steps over fixed batches (the same for every run)."""
    lora_cfg = LoRAConfig(rank=cfg["rank"], alpha=float(cfg["rank"]), fp32_accumulation=spec.fp32_accumulation,
                          param_dtype=spec.param_dtype, seed=0)
    device = next(iter(base.values())).device
    lora = LoRASet(lora_cfg, layer_shapes(cfg)).to(device).train()
    model = TinyModel(base, cfg, spec, lora)
    downs0 = {p: a.down.detach().clone() for p, a in lora.adapters().items()}
    moved = {p: torch.zeros_like(d, dtype=torch.bool) for p, d in downs0.items()}
    opt = torch.optim.AdamW(lora.param_groups(lr), lr=lr, weight_decay=0.0)
    loss = torch.zeros(())
    for step in range(cfg["steps"]):
        start = (step * cfg["batch"]) % cfg["train"]
        xb, yb = data["x"][start:start + cfg["batch"]], data["y"][start:start + cfg["batch"]]
        loss = F.mse_loss(model(xb).float(), yb.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for p, a in lora.adapters().items():
            moved[p] |= a.down.detach() != downs0[p]
    lora.eval()
    with torch.no_grad():
        out = model(data["x_test"]).double()
        dw = {p: (a.up.double() @ a.down.double()) * a.scale for p, a in lora.adapters().items()}
        out_fp32 = TinyModel(base, cfg, RunSpec("eval", torch.float64), deltas=dw)(data["x_test"].double())
    frac = sum(float(m.sum()) for m in moved.values()) / sum(m.numel() for m in moved.values())
    return Outcome(dw=dw, out=out, out_fp32=out_fp32, down_moved=frac, loss=float(loss.detach()))


def rel_dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over all layers together."""
    num = sum(float((a[p] - b[p]).pow(2).sum()) for p in b)
    den = sum(float(b[p].pow(2).sum()) for p in b)
    return math.sqrt(num / den) if den > 0 else float("inf")


def compare(runs: dict[str, Outcome], ref: Outcome, data: dict[str, torch.Tensor]) -> list[dict]:
    effect = float((ref.out - data["base_out"]).pow(2).mean().sqrt())
    teacher_effect = float((data["y_test"] - data["base_out"]).pow(2).mean().sqrt())
    teacher_dw = {k[3:]: v for k, v in data.items() if k.startswith("dw.")}
    rows = []
    for label, o in runs.items():
        rows.append({"run": label, "dw_dist": rel_dist(o.dw, ref.dw),
                     "out_dist": float((o.out - ref.out).pow(2).mean().sqrt()) / effect,
                     "out_fp32_dist": float((o.out_fp32 - ref.out_fp32).pow(2).mean().sqrt()) / effect,
                     "teacher_dist": rel_dist(o.dw, teacher_dw),
                     "teacher_fit": float((o.out_fp32 - data["y_test"]).pow(2).mean().sqrt()) / teacher_effect,
                     "down_moved": o.down_moved, "loss": o.loss})
    return rows


def tie_fraction(cfg: dict, base: dict[str, torch.Tensor], data: dict[str, torch.Tensor]) -> float:
    """Fraction of attention rows of the first block with two bf16(P̄) == 1 at the start of training."""
    d, h = cfg["dim"], cfg["heads"]
    x = data["x_test"].bfloat16()
    q, k, _v = F.linear(F.layer_norm(x, (d,)), base["blocks.0.qkv"].bfloat16()).view(*x.shape[:2], 3, h, d // h).permute(2, 0, 3, 1, 4)
    return measure_call(q, k, scale=default_scale(d // h)).bf16_one_fraction


def run_group(specs: tuple[RunSpec, ...], cfg: dict, lr: float, seed: int = 0, device: str = "cpu") -> list[dict]:
    """Train every spec of a group (the last one is the reference) and compare them with it."""
    gen = torch.Generator().manual_seed(seed)
    base = make_base(cfg, gen)
    teacher_gen = torch.Generator().manual_seed(seed + 1)
    data = {k: t.to(device) for k, t in make_data(cfg, base, teacher_gen).items()}
    base = {k: t.to(device) for k, t in base.items()}
    outcomes = {s.label: train(s, cfg, base, data, lr) for s in specs}
    return compare(outcomes, outcomes[specs[-1].label], data)


def format_rows(rows: list[dict]) -> str:
    out = ["| run | ‖ΔW − ΔW_c‖/‖ΔW_c‖ | output distance, own precision | output distance, learned LoRA in fp64 "
           "model | ‖ΔW − ΔW*‖/‖ΔW*‖ (teacher) | teacher effect not learned | lora_down elements moved | last loss |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['run']} | {r['dw_dist']:.4f} | {r['out_dist']:.3f} | {r['out_fp32_dist']:.4f} | "
                   f"{r['teacher_dist']:.4f} | {r['teacher_fit']:.4f} | "
                   f"{r['down_moved']:.1%} | {r['loss']:.3e} |")
    return "\n".join(out)


def run_and_print(cfg: dict, label: str, device: str = "cpu", groups: tuple[str, ...] = ("lora", "attention")) -> dict:
    """Train every group, print the tables; returns {"lora": {lr: rows}, "attention": rows, "ties": fraction}."""
    t0 = time.perf_counter()
    print(f"model: {cfg['blocks']} blocks, dim {cfg['dim']}, {cfg['heads']} heads, {cfg['tokens']} tokens, "
          f"LoRA rank {cfg['rank']} on every Linear, teacher rho {cfg['rho']:g}, {cfg['steps']} AdamW steps, "
          f"batch {cfg['batch']}")
    results: dict = {"lora": {}}
    for lr in cfg["lrs"] if "lora" in groups else ():
        results["lora"][lr] = run_group(LORA_RUNS, cfg, lr, device=device)
        print(f"\n### LoRA precision, lr {lr:g}\n")
        print(format_rows(results["lora"][lr]))
    lr = cfg["lrs"][-1]
    if "attention" not in groups:
        return results
    base = make_base(cfg, torch.Generator().manual_seed(0))
    results["ties"] = tie_fraction(cfg, base, make_data(cfg, base, torch.Generator().manual_seed(1)))
    results["attention"] = run_group(ATTENTION_RUNS, cfg, lr, device=device)
    print(f"\n### Attention backend, lr {lr:g} (rows with two bf16(P̄) == 1 at the start: {results['ties']:.2%})\n")
    print(format_rows(results["attention"]))
    print(f"\n({label} mode, {device}, {time.perf_counter() - t0:.1f} s, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few steps (seconds) for the test suite")
    ap.add_argument("--device", default="cpu", help="where to train (cuda: real bf16 GPU kernels)")
    ap.add_argument("--group", choices=("lora", "attention"), action="append", help="run only these groups")
    args = ap.parse_args(argv)
    groups = tuple(args.group or ("lora", "attention"))
    run_and_print(QUICK if args.quick else FULL, "quick" if args.quick else "full", args.device, groups)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
