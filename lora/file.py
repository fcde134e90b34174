"""LoRA file format: kohya / diffusion_model keys, explicit ``.alpha``, string metadata, atomic save, checked read.

Keys per adapted module (path relative to the diffusion model, e.g. ``double_blocks.0.img_attn.qkv``):
``<prefix>.lora_down.weight`` (rank, in), ``<prefix>.lora_up.weight`` (out, rank), ``<prefix>.alpha`` (0-d).
``prefix`` is ``lora_unet_<path with _>`` (kohya, Flux family) or ``diffusion_model.<path>``. ComfyUI
scales by ``alpha / rank`` and uses 1.0 when ``.alpha`` is missing, so ``.alpha`` is always written (for
rsLoRA it is ``scale * rank``, which makes ComfyUI reproduce the trained scale).
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..training.files import atomic_write
from ..training.guard import assert_finite
from .config import LoRAConfig
from .layer import LoRASet

log = logging.getLogger(__name__)


def read_pack_version(pyproject: str) -> str:
    """``version`` of the ``[project]`` table in the file ``pyproject``, or "unknown" when it has none.

    The version is written once, in the pack's ``pyproject.toml``. The pack runs from a folder in
    ``custom_nodes/`` (not pip-installed), so there is no package metadata to ask, and Python 3.10 has no
    ``tomllib``: this reads the one key it needs, a quoted ``version = "X.Y.Z"`` line in ``[project]``.
    """
    try:
        with open(pyproject, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown"
    table = None
    for line in lines:
        header = re.match(r"\s*\[\[?([^\[\]]+)\]\]?\s*(#.*)?$", line)  # [table] or [[array of tables]]
        if header:
            table = header.group(1).strip()
            continue
        value = re.match(r"""\s*version\s*=\s*(["'])([^"']+)\1\s*(#.*)?$""", line)
        if table == "project" and value:
            return value.group(2)
    return "unknown"


PACK_VERSION = read_pack_version(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                              "pyproject.toml"))
SAVE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KEY_STYLES: dict[str, str] = {"kohya": "lora_unet_", "diffusion_model": "diffusion_model."}
_KOHYA_FAMILIES = ("flux", "flux1", "flux2", "chroma", "kontext")
_DOWN = (".lora_down.weight", ".lora_A.weight")
_UP = (".lora_up.weight", ".lora_B.weight")


def default_key_style(family: str) -> str:
    """kohya keys for the Flux family (what sd-scripts writes), ``diffusion_model.`` keys for the rest."""
    return "kohya" if family.lower().replace(".", "") in _KOHYA_FAMILIES else "diffusion_model"


def key_prefix(path: str, key_style: str) -> str:
    if key_style == "kohya":
        return KEY_STYLES["kohya"] + path.replace(".", "_")
    if key_style == "diffusion_model":
        return KEY_STYLES["diffusion_model"] + path
    raise ValueError(f"key_style={key_style!r} is unknown: use one of {sorted(KEY_STYLES)}")


def _save_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in SAVE_DTYPES.values():
            raise ValueError(f"save dtype {dtype} is unsupported: use one of {sorted(SAVE_DTYPES)}")
        return dtype
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype {dtype!r} is unknown: use one of {sorted(SAVE_DTYPES)}")
    return SAVE_DTYPES[dtype]


def lora_state_dict(lora_set: LoRASet, key_style: str, dtype: str | torch.dtype = "fp32") -> dict[str, torch.Tensor]:
    """Tensors to save: each adapter's factors under the keys stock ComfyUI reads for its kind (LoRA
    down/up, LoKr ``lokr_w*``, LoHa ``hada_w*``, DoRA down/up + ``dora_scale``) in ``dtype`` (multiplier
    not applied), ``.alpha`` fp32 0-d (scale * rank; none for a full-matrix LoKr, whose scale is 1). CPU, contiguous."""
    dt = _save_dtype(dtype)
    out: dict[str, torch.Tensor] = {}
    for path, a in lora_set.adapters().items():
        prefix = key_prefix(path, key_style)
        for suffix, t in a.file_tensors().items():
            out[prefix + suffix] = _cast(t, dt, prefix + suffix)
        alpha = a.file_alpha()
        if alpha is not None:
            out[prefix + ".alpha"] = torch.tensor(alpha, dtype=torch.float32)
    return out


def _cast(t: torch.Tensor, dt: torch.dtype, key: str) -> torch.Tensor:
    """``t`` in ``dt`` on the CPU; ValueError when a finite value does not fit (fp16 tops out at 65504, and
    an overflow would be written as inf)."""
    out = t.detach().float().to(dt).cpu().contiguous()
    if dt != torch.float32 and not bool(torch.isfinite(out).all()) and bool(torch.isfinite(t.detach()).all()):
        name = next(n for n, d in SAVE_DTYPES.items() if d == dt)
        peak = float(t.detach().abs().max())
        raise ValueError(f"save dtype {name} cannot hold '{key}': its largest value {peak:.4g} is "
                         f"above {name}'s maximum {torch.finfo(dt).max:.6g} and would be written as inf; "
                         "save as fp32 (or bf16)")
    return out


def lora_metadata(config: LoRAConfig, *, family: str, key_style: str, mixed_precision: str,
                  extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """kohya-style ``ss_*`` metadata (strings) for a LoRA trained with ``config``; ``extra`` keys are copied verbatim."""
    args = {k: getattr(config, k) for k in ("targets", "include", "exclude", "blocks", "dropout", "rank_dropout",
                                              "module_dropout", "rslora", "fp32_accumulation", "param_dtype", "adapter")}
    if config.adapter != "lora":  # LyCORIS's spelling, which other tools read: DoRA is algo lora with dora_wd
        args.update(algo="lora" if config.adapter == "dora" else config.adapter, dora_wd=config.adapter == "dora")
    if config.adapter == "lokr":
        args["factor"] = config.lokr_factor
    module = "networks.lora_flux" if key_style == "kohya" else "networks.lora"
    md: dict[str, object] = {
        "ss_network_module": module if config.adapter == "lora" else "lycoris.kohya",
        "ss_network_dim": config.rank,
        "ss_network_alpha": config.scale * config.rank,
        "ss_network_args": json.dumps(args, sort_keys=True),
        "ss_base_model_version": family,
        "modelspec.architecture": f"{family}/lora",
        "ss_seed": config.seed,
        "ss_mixed_precision": mixed_precision,
        "ss_lora_fp32_accumulation": config.fp32_accumulation,
        "ss_key_style": key_style,
        "precision_lora_version": PACK_VERSION,
    }
    md.update(extra or {})
    return {str(k): _md_str(v) for k, v in md.items()}


def _md_str(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def save_lora_file(path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
                   overwrite: bool = False) -> str:
    """Write ``tensors`` + ``metadata`` as safetensors atomically (temp file in the same folder + os.replace).

    Refuses an existing ``path`` unless ``overwrite``; non-string metadata is an error. Returns the absolute path.
    """
    from safetensors.torch import save_file

    path = os.path.abspath(path)
    bad = {k: type(v).__name__ for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise ValueError(f"metadata values must be strings; got {bad}: convert them with str()")
    if not tensors:
        raise ValueError(f"refusing to write an empty LoRA to '{path}'")
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"'{path}' exists: choose another name or enable overwrite")
    contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    assert_finite(contiguous, f"LoRA file {os.path.basename(path)}")
    atomic_write(path, lambda tmp: save_file(contiguous, tmp, metadata=dict(metadata)))
    log.info("saved %d tensors to %s", len(tensors), path)
    return path


def read_lora_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load tensors (CPU) and metadata ({} when none). Clear ValueError / FileNotFoundError on bad files."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise FileNotFoundError(f"LoRA file '{path}' does not exist: check the name and the loras folder")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for bad headers and short files
        raise ValueError(
            f"cannot read LoRA file '{path}' ({type(e).__name__}: {e}): the file is corrupt or "
            "truncated (or not safetensors); re-save or re-download it"
        ) from None
    if not tensors:
        raise ValueError(f"LoRA file '{path}' holds no tensors: re-save it")
    bad = next((k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad is not None:
        raise ValueError(f"LoRA file '{path}' holds NaN/inf in '{bad}' (e.g. a LoRA with values "
                         "above 65504 saved as fp16): applying it would turn every output into NaN; retrain it or "
                         "save it again as fp32")
    return tensors, metadata


@dataclass(frozen=True)
class LoRAFactors:
    """One module's factors from a file: down (rank, in), up (out, rank), and the scale ComfyUI would use."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


def _prefix_map(linears: Mapping[str, tuple[int, int]]) -> dict[str, str]:
    return {key_prefix(p, style): p for p in linears for style in KEY_STYLES}


def _split_key(key: str) -> tuple[str, str] | None:
    for suffix in _DOWN + _UP + (".alpha",):
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    return None


def parse_lora_tensors(tensors: Mapping[str, torch.Tensor], linears: Mapping[str, tuple[int, int]],
                       name: str = "LoRA file") -> dict[str, LoRAFactors]:
    """Match file keys to the model's linear layers (path → (in, out)); check ranks and shapes.

    Accepts kohya / diffusion_model prefixes with lora_down/lora_up or lora_A/lora_B. ValueError when no
    key matches (a LoRA for another model), when some keys do not match, or on rank / shape mismatch.
    """
    prefixes = _prefix_map(linears)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, t in tensors.items():
        split = _split_key(key)
        if split is None or split[0] not in prefixes:
            unknown.append(key)
            continue
        groups.setdefault(prefixes[split[0]], {})[split[1]] = t
    if not groups:
        raise ValueError(
            f"{name}: none of its {len(tensors)} keys (e.g. {sorted(tensors)[:3]}) matches a linear "
            "layer of this model: it is a LoRA for another model family or architecture; pick a LoRA trained for this model"
        )
    if unknown:
        raise ValueError(
            f"{name}: {len(unknown)} keys do not match this model (e.g. {sorted(unknown)[:3]}): "
            "the LoRA was trained for a different architecture or variant"
        )
    return {path: _factors(path, parts, linears[path], name) for path, parts in sorted(groups.items())}


def _factors(path: str, parts: Mapping[str, torch.Tensor], shape: tuple[int, int], name: str) -> LoRAFactors:
    down = next((parts[s] for s in _DOWN if s in parts), None)
    up = next((parts[s] for s in _UP if s in parts), None)
    if down is None or up is None:
        raise ValueError(f"{name}: module '{path}' lacks its {'down' if down is None else 'up'} factor: the file is incomplete")
    n_in, n_out = shape
    if down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
        raise ValueError(
            f"{name}: rank mismatch at '{path}': down {tuple(down.shape)} vs up {tuple(up.shape)}: the file is inconsistent"
        )
    if down.shape[1] != n_in or up.shape[0] != n_out:
        raise ValueError(
            f"{name}: '{path}' is {n_out}x{n_in} in this model but the LoRA has up {tuple(up.shape)}, "
            f"down {tuple(down.shape)}: the LoRA was trained for a different model size"
        )
    rank = int(down.shape[0])
    alpha = parts.get(".alpha")
    scale = 1.0 if alpha is None else float(alpha.float().item()) / rank  # ComfyUI's rule
    return LoRAFactors(down, up, scale)


def file_rank(factors: Mapping[str, LoRAFactors]) -> int:
    """The single rank of a parsed file (ValueError if modules disagree)."""
    ranks = sorted({f.rank for f in factors.values()})
    if len(ranks) != 1:
        raise ValueError(f"the LoRA file mixes ranks {ranks}: it cannot initialise one LoRA set")
    return ranks[0]
