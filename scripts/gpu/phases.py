"""The phases of scripts/gpu_check.sh, in priority order: what only a GPU can show first (docs/gpu.md).

Each phase is one shell command run from the repository root under ``timeout`` (its time box), so a run cut
off by the device tool's 10-minute limit or by ``--minutes`` still reports every phase that finished.
``{py033}``, ``{py0375}``, ``{comfy033}``, ``{comfy0375}``, ``{work}``, ``{bundle}`` are filled in by check.py.
"""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    what: str
    command: str
    box_s: int  # time box in seconds (cut to what is left of --minutes)
    groups: tuple[str, ...] = ()  # bundle groups it needs
    needs_file: str = ""  # a file of the tree it needs; missing -> "skipped" with the reason
    needs_phase: str = ""  # a phase that must have passed first (the host's install)
    needs_text: str = ""  # text that needs_file must contain (a flag the command uses)


KEYS = {"0.33.0": "033", "0.3.75": "0375"}  # placeholder suffixes: {py033}, {comfy0375}, ...
PYTEST = "-m pytest -q -p no:cacheprovider --timeout 600"


# The tests and benches compare fp32 results to 1e-4..1e-5: IEEE fp32 GEMMs, whatever the image's environment
# forces (arrival.py records what it found; docs/gpu.md).
IEEE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 NVIDIA_TF32_OVERRIDE=0"


def _host_env(host: str) -> str:
    return f"{IEEE} PRECISION_LORA_COMFYUI={{comfy{KEYS[host]}}}"


def _install(host: str, groups: tuple[str, ...]) -> Phase:
    return Phase(f"install-{host}", f"unpack the bundle, a throwaway venv for ComfyUI {host} on the image's torch",
                 f"bash scripts/gpu/install_host.sh {host} {{bundle}} {{work}}", 300 if host == "0.33.0" else 180,
                 groups, needs_phase="arrival")


def _tests(host: str) -> list[Phase]:
    key = KEYS[host]
    env = _host_env(host)
    return [
        Phase(f"gpu-tests-{host}", f"every gpu-marked test on ComfyUI {host}",
              f"{env} {{py{key}}} {PYTEST} -m gpu tests/unit tests/comfy", 240, needs_phase=f"install-{host}"),
        Phase(f"inprocess-{host}", f"the in-process tier (tests/comfy) on CUDA, ComfyUI {host}, dynamic VRAM default",
              f"{env} {{py{key}}} {PYTEST} -m 'not gpu' tests/comfy", 420, needs_phase=f"install-{host}"),
    ]


def _bench(name: str, what: str, args: str, box_s: int, needs_text: str = "") -> Phase:
    return Phase(name, what, f"{_host_env('0.33.0')} {{py033}} {args}", box_s,
                 needs_file=args.split()[0], needs_phase="install-0.33.0", needs_text=needs_text)


PHASES: tuple[Phase, ...] = (
    Phase("arrival", "the machine: GPU, driver, Python/torch/CUDA/triton against scripts/gpu/assumed.env",
          "python3 scripts/gpu/arrival.py", 60),
    _install("0.33.0", ("core",)),
    *_tests("0.33.0"),
    _install("0.3.75", ("core", "host0375")),
    *_tests("0.3.75"),
    Phase("e2e-0.33.0", "the e2e tier once: a real ComfyUI server on the GPU, /prompt with validation",
          f"{_host_env('0.33.0')} {{py033}} {PYTEST} tests/e2e", 360, needs_phase="install-0.33.0"),
    _bench("bench-attention", "attention: stock vs override, fused stable kernel vs SDPA flash, flash/sage/xformers",
           "bench/attention.py", 300),
    _bench("bench-lora", "fp32-accumulating vs bf16 LoRA layer on the GPU GEMMs", "bench/lora.py --device cuda", 180),
    _bench("bench-precision", "LoRA delta survival with the GPU GEMM path", "bench/precision.py --device cuda", 180),
    _bench("bench-outcome", "training outcome with real bf16 GPU kernels", "bench/outcome.py --device cuda", 480),
    _bench("bench-train-flux", "training step at Flux.1's width (3072 = 24 heads x 128), 1024 px, bf16, "
           "with and without checkpointing, ours vs built-in",
           "bench/train.py --dtype bf16 --widths 3072 --blocks 2 --size 1024 --steps 4 --warm-steps 1 --repeats 2",
           420),
    _bench("bench-memory", "memory estimator (docs/memory.md) vs torch.cuda.max_memory_allocated of the same step",
           "bench/memory.py --model cosmos-predict2-2b --size 512 --rank 8 --base bf16 --checkpointing --device cuda "
           "--json", 300, needs_text="--device"),
    _bench("bench-block-swap", "block swap (docs/memory.md): step time and peak memory at Flux width, 4 blocks, 2 swapped",
           "bench/train.py --dtype bf16 --widths 3072 --blocks 4 --size 1024 --steps 4 --warm-steps 1 --repeats 1 "
           "--swap-blocks 2", 240, needs_text="--swap-blocks"),
    _bench("bench-compile", "regional compile (compile 'blocks', triton): compiled vs eager step time, peak memory and "
           "compile time at Flux.1's width, 2 + 2 blocks, 1024 px, bf16, with and without checkpointing",
           "bench/train.py --compile --family flux1_dev --dtype bf16 --widths 3072 --blocks 2 --size 1024 --steps 4 "
           "--warm-steps 1 --repeats 1", 360, needs_text="--compile"),
)


def by_name() -> dict[str, Phase]:
    return {p.name: p for p in PHASES}


def fill(phase: Phase, work: str, bundle: str) -> str:
    """The phase's command with the throwaway environment's paths."""
    paths = {"work": work, "bundle": bundle}
    for host, key in KEYS.items():
        paths[f"py{key}"] = os.path.join(work, host, "venv", "bin", "python")
        paths[f"comfy{key}"] = os.path.join(work, host, "comfyui")
    return phase.command.format(**paths)
