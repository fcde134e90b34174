"""Attention settings: one frozen config, scale resolution, and the LoRA-file metadata round trip.

The softmax scale is a temperature change, not a precision fix: whatever scale a LoRA was trained with
must be used again at inference, so it is recorded in the file's metadata.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping

from .backends import BACKENDS, available

AUTO_BACKEND = "auto"
SCALE_MODES = ("default", "absolute", "multiplier")
STABLE_BETA_RANGE = (1.5, 8.0)
# Backends that see the logits and can therefore apply a softclamp.
SOFTCLAMP_BACKENDS = ("math", "stable")
# A softclamp c below this many times the largest logit changes the pretrained model's output noticeably.
SOFTCLAMP_SAFETY = 10.0
# Backends whose kernels take only bf16/fp16 inputs (they already keep softmax statistics in fp32).
NO_FP32_INPUT_BACKENDS = ("flash", "sage")

META_SCALE = "ss_attn_softmax_scale"
META_MODE = "ss_attn_mode"
META_SCALE_MODE = "ss_attn_scale_mode"
META_SCALE_VALUE = "ss_attn_scale_value"
META_BETA = "ss_attn_stable_beta"
META_SOFTCLAMP = "ss_attn_softclamp"
META_FP32 = "ss_attn_fp32_softmax"
METADATA_KEYS = (META_SCALE, META_MODE, META_SCALE_MODE, META_SCALE_VALUE, META_BETA, META_SOFTCLAMP, META_FP32)


def default_scale(head_dim: int) -> float:
    """The standard softmax scale 1/sqrt(head_dim): the one place it is computed."""
    return 1.0 / math.sqrt(head_dim)


def usable_backends() -> list[str]:
    """``"auto"`` and every registered backend installed here."""
    return [AUTO_BACKEND] + [name for name, reason in available().items() if reason is None]


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class AttentionConfig:
    """What PrecisionPatchAttention applies to every attention call of a model.

    backend: a name from ``attention.backends.BACKENDS`` or ``"auto"`` (the ComfyUI backend the model
    would use anyway, with the scale applied by multiplying q in fp32).
    scale_mode: ``"default"`` (1/sqrt(head_dim)), ``"absolute"`` (scale_value itself) or
    ``"multiplier"`` (scale_value / sqrt(head_dim)).
    stable_beta: the stable backend's shift factor β in [1.5, 8].
    softclamp: 0 = off; else logits become c*tanh(s/c) (math and stable backends only).
    fp32_softmax: run the backend on fp32 copies of q/k/v (output cast back to the input dtype).
    collect_stats: record per-call statistics (off by default; costs an extra pass over the logits).

    Validated when built (``__post_init__``): an AttentionConfig that exists is a valid one, so nothing
    downstream validates it again.
    """

    backend: str = AUTO_BACKEND
    scale_mode: str = "default"
    scale_value: float = 1.0
    stable_beta: float = 2.0
    softclamp: float = 0.0
    fp32_softmax: bool = False
    collect_stats: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, the bad value and the fix."""
        known = (AUTO_BACKEND, *BACKENDS)
        if self.backend not in known:
            raise ValueError(
                f"backend={self.backend!r} is unknown; choose one of {', '.join(known)} "
                f"(usable here: {', '.join(usable_backends())})"
            )
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode={self.scale_mode!r} is unknown; choose one of {', '.join(SCALE_MODES)}")
        if self.scale_mode != "default" and not (_finite(self.scale_value) and self.scale_value > 0):
            raise ValueError(
                f"scale_value={self.scale_value!r} is invalid for scale_mode={self.scale_mode!r}: "
                "it must be a finite number > 0 (e.g. 1.0 for the multiplier, 0.088 for head_dim 128)"
            )
        lo, hi = STABLE_BETA_RANGE
        if not (_finite(self.stable_beta) and lo <= self.stable_beta <= hi):
            raise ValueError(f"stable_beta={self.stable_beta!r} is out of range; use a value in [{lo}, {hi}] (2.0 is the default)")
        if not (_finite(self.softclamp) and self.softclamp >= 0):
            raise ValueError(f"softclamp={self.softclamp!r} is invalid; use 0 (off) or a finite value > 0 such as 50")
        if self.softclamp > 0 and self.backend not in SOFTCLAMP_BACKENDS:
            raise ValueError(
                f"softclamp={self.softclamp} needs the logits, which backend={self.backend!r} never exposes; "
                f"choose backend {' or '.join(SOFTCLAMP_BACKENDS)}, or set softclamp to 0"
            )
        if self.fp32_softmax and self.backend in NO_FP32_INPUT_BACKENDS:
            raise ValueError(
                f"fp32_softmax=True is not possible with backend={self.backend!r} (it takes only fp16/bf16 inputs and "
                "already keeps softmax statistics in fp32); turn fp32_softmax off or choose sdpa/math/stable"
            )

    def resolve_scale(self, head_dim: int, base: float | None = None) -> float:
        """The absolute softmax scale of a call with head dimension ``head_dim``.

        ``base``: the scale the model asks for itself (None: ``default_scale(head_dim)``). The default and
        multiplier modes are relative to it; an absolute scale replaces it.
        """
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
            raise ValueError(f"head_dim={head_dim!r} is invalid; it must be a positive integer")
        base = default_scale(head_dim) if base is None else float(base)
        if self.scale_mode == "default":
            return base
        if self.scale_mode == "absolute":
            return float(self.scale_value)
        if self.scale_mode == "multiplier":
            return float(self.scale_value) * base
        raise ValueError(f"scale_mode={self.scale_mode!r} is unknown; choose one of {', '.join(SCALE_MODES)}")

    def scale_is_default(self) -> bool:
        """True when the resolved scale is 1/sqrt(head_dim) for every head_dim."""
        return self.scale_mode == "default" or (self.scale_mode == "multiplier" and self.scale_value == 1.0)

    def is_default(self) -> bool:
        """Stock behaviour: auto backend, default scale, no options."""
        return (
            self.backend == AUTO_BACKEND
            and self.scale_is_default()
            and self.softclamp == 0
            and not self.fp32_softmax
            and not self.collect_stats
        )

    def to_metadata(self, head_dim: int) -> dict[str, str]:
        """Safetensors metadata (all values strings) recording these settings for ``head_dim``."""
        return {
            META_SCALE: repr(self.resolve_scale(head_dim)),
            META_MODE: self.backend,
            META_SCALE_MODE: self.scale_mode,
            META_SCALE_VALUE: repr(float(self.scale_value)),
            META_BETA: repr(float(self.stable_beta)),
            META_SOFTCLAMP: repr(float(self.softclamp)),
            META_FP32: "true" if self.fp32_softmax else "false",
        }

    @classmethod
    def from_metadata(cls, md: Mapping[str, str]) -> AttentionConfig | None:
        """Rebuild the config recorded by ``to_metadata``; None when the file has no attention keys.

        A file with only ``ss_attn_softmax_scale`` (written by other tools) gives an absolute scale.
        Raises ValueError naming the key when a value does not parse or is out of range.
        """
        if not any(key in md for key in METADATA_KEYS):
            return None
        defaults = cls()
        kwargs: dict[str, object] = {
            "backend": md.get(META_MODE, defaults.backend),
            "scale_mode": md.get(META_SCALE_MODE),
            "stable_beta": _parse_float(md, META_BETA, defaults.stable_beta),
            "softclamp": _parse_float(md, META_SOFTCLAMP, defaults.softclamp),
            "fp32_softmax": _parse_bool(md, META_FP32, defaults.fp32_softmax),
        }
        if kwargs["scale_mode"] is None:
            if META_SCALE in md:
                kwargs["scale_mode"] = "absolute"
                kwargs["scale_value"] = _parse_float(md, META_SCALE, 1.0)
            else:
                kwargs["scale_mode"] = "default"
        else:
            kwargs["scale_value"] = _parse_float(md, META_SCALE_VALUE, defaults.scale_value)
        try:
            return cls(**kwargs)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"LoRA metadata holds invalid attention settings: {exc}") from exc

    def replace(self, **changes: object) -> AttentionConfig:
        """A copy with ``changes`` applied (validated, as every new config is)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _parse_float(md: Mapping[str, str], key: str, default: float) -> float:
    if key not in md:
        return default
    try:
        return float(md[key])
    except (TypeError, ValueError):
        raise ValueError(f"LoRA metadata key {key}={md[key]!r} is not a number") from None


def _parse_bool(md: Mapping[str, str], key: str, default: bool) -> bool:
    if key not in md:
        return default
    text = str(md[key]).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"LoRA metadata key {key}={md[key]!r} is not a boolean (true/false)")
