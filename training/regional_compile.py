"""Regional compilation: each transformer block compiled once (Train Settings' ``compile``: off / blocks).

``compiled_blocks(blocks)`` replaces each block's ``forward`` (an instance attribute, removed on exit, as
``training.grad.checkpoint_blocks`` and ``training.swap.swap_blocks`` do) with ``torch.compile`` of the block's own
forward. Enter it *before* block swap and checkpointing: the compiled region is then the block's own math, and
checkpointing's recomputation and the swap's streaming wrap it from outside. Blocks of one class share their
compiled code (torch takes the parameters as inputs), so a model compiles once per block kind, grad mode (the
checkpointed forward runs without gradients, its recomputation with them) and input shape; a second latent size
compiles again with the varying dimensions dynamic (``torch.compile``'s default).

What stays out of the graphs: whatever the caller marks with ``torch.compiler.disable`` (the pack's LoRA layers:
``nodes.lora.glue.outside_compiled_graphs``; their fp32 low-rank path runs as in eager mode), and what dynamo
cannot trace (each a graph break, counted by reason in the report).

While open, ``training.grad``'s saved-tensor copies keep their strides (``grad.strided_copies``): a compiled
backward reads its saved tensors with the strides it was traced with. The backward is compiled with the forward
(``force_non_lazy_backward_lowering``), so a failure to compile either happens while the frame compiles.

A compile that fails never fails the run, and never runs anything twice. Dynamo compiles a block in frames (the
block's forward, and after each graph break the rest of it); a frame that fails to compile runs eager from its
start, the frames before it compiled as they were (``suppress_errors``: dynamo's own per-frame fallback; a frame
that has begun is never run again, so nothing is applied twice). The failures are read from dynamo's log while the
blocks run and reported by block kind with the reason; so are frames that hit dynamo's recompile limit (they run
eager from then on). An error raised while a compiled block runs (out of memory, a shape error) is raised as
eager mode raises it.

A compiled block gets its tensor inputs contiguous: with a transposed input that needs no gradient (tiny Mochi's
block 0), the graph breaks around the eager LoRA layers gave gradients 2.7x off with no error (inductor; also
aot_eager in a stand-alone setting); reproduced with ComfyUI's Mochi blocks and a plain ``torch.compiler.disable``'d
low-rank layer, and gone with contiguous inputs.

Compiled gradients are checked before the run trains (``check_gradients``): one loss + backward of the first sample
eager and compiled, every LoRA gradient tensor compared against ``GRADIENT_TOLERANCE`` of the model's dtype; beyond
it the run is eager, with the difference in the report. Pure torch, no ComfyUI.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from . import grad

log = logging.getLogger(__name__)

COMPILE_MODES = {
    "off": "eager PyTorch",
    "blocks": "each transformer block compiled once with torch.compile (inductor), the LoRA layers run eager inside "
              "it; a part that fails to compile runs eager with the reason in the report",
}
BACKEND: Any = "inductor"  # what torch.compile builds with (a test swaps in a failing backend)
# compiled vs eager LoRA gradients: max |difference| of each tensor over its largest |eager| value. fp32: fused
# kernels reorder sums (measured ~1e-6 on every family row); bf16 / fp16: inductor keeps fused pointwise work in
# fp32 where eager rounds each op's output. Other dtypes (fp8 storage) use the low-precision bound.
GRADIENT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


@dataclass
class CompileReport:
    """What compilation did in one session: blocks and block kinds compiled, graphs built, compiling calls (the
    first per block kind and grad mode; the rest are recompiles: a new input shape, dtype or requires_grad), the
    input shapes seen, graph breaks by reason, seconds spent in compiling calls, the parts of each kind that run
    eager (frames that failed to compile, with the first reason) and the frames that hit the recompile limit."""

    blocks: int = 0
    kinds: list[str] = field(default_factory=list)
    graphs: int = 0
    compiles: int = 0
    recompiles: int = 0
    shapes: dict[str, set] = field(default_factory=dict)
    breaks: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    fallbacks: dict[str, str] = field(default_factory=dict)  # block kind -> why a part of it runs eager
    eager_parts: Counter = field(default_factory=Counter)  # block kind -> frames that failed to compile
    limit_hits: int = 0
    checked: tuple[float, float] | None = None  # (worst gradient difference vs eager, tolerance)
    eager_only: str | None = None  # why compiled blocks are not used in this run
    probing_eager: bool = False  # the gradient check's eager pass
    _first: set = field(default_factory=set)

    def line(self) -> str:
        if not self.blocks:
            return ("compile: nothing compiled, the run is eager: this model has no block list the trainer finds "
                    "(the lists it checkpoints); set compile to off")
        kinds = len(self.kinds)
        shapes = max((len(s) for s in self.shapes.values()), default=0)
        head = (f"compile: {self.blocks} blocks of {kinds} kind{'s' if kinds != 1 else ''} ({', '.join(self.kinds)}) "
                f"compiled with torch.compile: {self.graphs} graph{'s' if self.graphs != 1 else ''} built in "
                f"{self.compiles} compiling call{'s' if self.compiles != 1 else ''} ({self.seconds:.1f} s), "
                f"{self.recompiles} recompile{'s' if self.recompiles != 1 else ''} "
                f"({shapes} input shape{'s' if shapes != 1 else ''} per block kind"
                f"{'; after the second, the varying dimensions are dynamic' if shapes > 1 else ''})")
        if self.breaks:
            head += "; graph breaks: " + ", ".join(f"{n} x {why}" for why, n in self.breaks.most_common(4))
        if self.limit_hits:
            head += (f"; {self.limit_hits} frame{'s' if self.limit_hits != 1 else ''} hit dynamo's recompile limit "
                     "(run eager from then on)")
        if self.checked is not None:
            head += (f"; gradients vs eager on the first sample: max difference {self.checked[0]:.1e} of the largest "
                     f"(tolerance {self.checked[1]:.0e})")
        if self.eager_only is not None:
            head += f"; NOT USED, the run is eager: {self.eager_only}"
        falls = "; ".join(f"{kind}: {self.eager_parts[kind]} part{'s' if self.eager_parts[kind] != 1 else ''} "
                          f"run{'s' if self.eager_parts[kind] == 1 else ''} eager ({why})"
                          for kind, why in self.fallbacks.items())
        return f"{head}; {falls}" if falls else head


class _DynamoLog(logging.Handler):
    """Reads dynamo's warnings while compiled blocks run: a frame whose compilation failed and was suppressed (it
    runs eager; the exception is the record's ``exc_info``), and a frame that hit the recompile limit."""

    def __init__(self, report: CompileReport) -> None:
        super().__init__(logging.WARNING)
        self.report, self.kind = report, "block"

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.report.limit_hits += 1
        elif record.exc_info and record.exc_info[1] is not None:
            self.report.eager_parts[self.kind] += 1
            self.report.fallbacks.setdefault(self.kind, _short(record.exc_info[1]))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _break_reasons() -> Counter:
    from torch._dynamo.utils import counters

    return Counter(dict(counters["graph_break"]))


def _reason(key: str) -> str:
    """A graph break's reason, short: its first line (the pack's LoRA layers are named as such)."""
    first = key.strip().splitlines()[0] if key.strip() else key
    if "torch.compiler.disable" in first or "LoRAForward" in key:
        return "the LoRA layers (run eager)"
    if "builtin operator" in first and "open" in key:
        return "builtin open (a memory query, e.g. ComfyUI's sub-quadratic attention on the CPU)"
    return " ".join(first.split())[:120]


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _shape(args: tuple, kwargs: dict) -> tuple:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
    return ()


class _Compiled:
    """A block's forward, compiled; counts what each call compiled (graphs, breaks, parts that failed)."""

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any], kind: str, report: CompileReport,
                 dynamo_log: _DynamoLog, on_change: Callable[[], None]) -> None:
        self.eager, self.compiled, self.kind, self.report = eager, compiled, kind, report
        self.log, self.on_change = dynamo_log, on_change

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        report = self.report
        if report.probing_eager or report.eager_only is not None:
            return self.eager(*args, **kwargs)
        graphs, breaks, parts, began = _graphs(), _break_reasons(), sum(report.eager_parts.values()), time.perf_counter()
        self.log.kind = self.kind
        # contiguous tensor inputs (a copy only where one is not): with a transposed block input that needs no
        # gradient, the graph breaks around the eager LoRA layers gave wrong gradients with no error (tiny Mochi's
        # patch embedding hands block 0 such a tensor: 2.7x off; reproduced with a plain low-rank layer)
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        out = self.compiled(*args, **kwargs)
        new = _graphs() - graphs
        failed = sum(report.eager_parts.values()) - parts
        if new or failed:
            report.graphs += new
            report.compiles += 1
            first = (self.kind, torch.is_grad_enabled())
            if first in report._first:
                report.recompiles += 1
            report._first.add(first)
            report.shapes.setdefault(self.kind, set()).add(_shape(args, kwargs))
            for key, n in (_break_reasons() - breaks).items():
                report.breaks[_reason(key)] += n
            report.seconds += time.perf_counter() - began
            if failed:
                log.warning("compile: %s: %d part(s) run eager: %s", self.kind, failed, report.fallbacks[self.kind])
            self.on_change()
        return out


@contextlib.contextmanager
def compiled_blocks(blocks: Sequence[nn.Module], on_change: Callable[[CompileReport], None] = lambda r: None,
                    dynamic: bool | None = None) -> Iterator[CompileReport]:
    """Each of ``blocks`` runs ``torch.compile`` of its own forward for the body (module docstring); yields the
    report, which ``on_change`` receives whenever a call compiled or fell back. No blocks: nothing changes, and
    the report (and a warning) says so."""
    report = CompileReport(blocks=len(blocks))
    if not blocks:
        log.warning("%s", report.line())
    patched: list[tuple[nn.Module, Any]] = []
    dynamo_log, dynamo_logger = _DynamoLog(report), logging.getLogger("torch._dynamo")
    with contextlib.ExitStack() as stack:
        if blocks:
            stack.enter_context(grad.strided_copies())
            stack.enter_context(torch._functorch.config.patch(force_non_lazy_backward_lowering=True))
            stack.enter_context(torch._dynamo.config.patch(suppress_errors=True))
            dynamo_logger.addHandler(dynamo_log)
            stack.callback(dynamo_logger.removeHandler, dynamo_log)
        try:
            for block in blocks:
                kind = type(block).__name__
                if kind not in report.kinds:
                    report.kinds.append(kind)
                previous = block.__dict__.get("forward")
                eager = block.forward
                compiled = torch.compile(eager, backend=BACKEND, dynamic=dynamic)
                block.forward = _Compiled(eager, compiled, kind, report, dynamo_log,  # type: ignore[method-assign]
                                          lambda: on_change(report))
                patched.append((block, previous))
            yield report
        finally:
            if report.fallbacks:  # dynamo skips a frame that failed for good: the next session tries (and reports) again
                torch._dynamo.reset()
            for block, previous in reversed(patched):
                if previous is None:
                    del block.forward
                else:
                    block.forward = previous  # type: ignore[method-assign]


def worst_difference(eager: dict, compiled: dict) -> float:
    """The largest |compiled - eager| of any gradient tensor over that tensor's largest |eager| value; a gradient
    only one side has counts as compared with zeros (a compiled graph returns a zero gradient for an input it
    does not use where eager autograd leaves None)."""
    worst = 0.0
    for name in eager.keys() | compiled.keys():
        e, c = eager.get(name), compiled.get(name)
        e = torch.zeros_like(c) if e is None else e
        c = torch.zeros_like(e) if c is None else c
        scale = float(e.abs().max())
        diff = float((c - e).abs().max())
        if scale > 0:
            worst = max(worst, diff / scale)
        elif diff > 0:
            worst = float("inf")
    return worst


def check_gradients(report: CompileReport, gradients: Callable[[], dict], dtype: torch.dtype) -> None:
    """``gradients()`` (one loss + backward, the LoRA gradients by name) once eager and once compiled; the largest
    difference against ``GRADIENT_TOLERANCE[dtype]`` goes to the report, and beyond it the run is eager
    (``report.eager_only``, dynamo's caches reset so nothing compiled is kept)."""
    if not report.blocks:
        return
    report.probing_eager = True
    try:
        eager = gradients()
    finally:
        report.probing_eager = False
    compiled = gradients()
    tolerance = GRADIENT_TOLERANCE.get(dtype, GRADIENT_TOLERANCE[torch.bfloat16])
    worst = worst_difference(eager, compiled)
    report.checked = (worst, tolerance)
    if not worst <= tolerance:
        report.eager_only = (f"compiled LoRA gradients differ from eager by {worst:.2g} of the largest (tolerance "
                             f"{tolerance:.0e}) on the first sample; set compile to off")
        log.warning("compile: %s", report.eager_only)
        torch._dynamo.reset()

