"""``LoRAConfig``: everything that defines a LoRA set, validated once, when it is built.

Defaults are the node defaults (one source of truth). ``lora_scale`` is the one place the LoRA scale is
defined.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from . import targets as _targets

PARAM_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_RANK = 1024
# Adapter kinds; the classes are in lora.adapters (ADAPTERS), named here so config.py needs no layer module
ADAPTER_KINDS = ("lora", "lokr", "loha", "dora", "locon")  # locon: lora.locon on the Conv2d layers too
MAX_LOKR_FACTOR = 256


@dataclass(frozen=True)
class LoRAConfig:
    """Everything that defines a LoRA set. Construction validates (ValueError naming the field, the bad
    value and the fix), so every instance in circulation is valid and nothing downstream checks it again."""

    rank: int = 16
    alpha: float = 16.0
    rslora: bool = False
    dropout: float = 0.0
    rank_dropout: float = 0.0
    module_dropout: float = 0.0
    fp32_accumulation: bool = True
    targets: str = "attention"
    include: str = ""
    exclude: str = ""
    blocks: str = ""
    seed: int = 0
    param_dtype: str = "fp32"
    adapter: str = "lora"
    lokr_factor: int = -1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, the bad value and the fix."""
        if not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"LoRAConfig.rank={self.rank!r} is invalid: use an integer in [1, {MAX_RANK}]")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRAConfig.alpha={self.alpha!r} is invalid: use a positive number (often alpha = rank)")
        for name in ("dropout", "rank_dropout", "module_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"LoRAConfig.{name}={value!r} is invalid: use a probability in [0, 1)")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(
                f"LoRAConfig.param_dtype={self.param_dtype!r} is unknown: use one of {sorted(PARAM_DTYPES)}"
            )
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"LoRAConfig.seed={self.seed!r} is invalid: use an integer in [0, 2**63)")
        self._validate_adapter()
        _targets.validate_target_options(self.targets, self.include, self.exclude, self.blocks)

    def _validate_adapter(self) -> None:
        if self.adapter not in ADAPTER_KINDS:
            raise ValueError(f"LoRAConfig.adapter={self.adapter!r} is unknown: use one of {list(ADAPTER_KINDS)}")
        if not isinstance(self.lokr_factor, int) or not (self.lokr_factor == -1 or 1 <= self.lokr_factor <= MAX_LOKR_FACTOR):
            raise ValueError(f"LoRAConfig.lokr_factor={self.lokr_factor!r} is invalid: use -1 (as square "
                             f"as possible) or an integer in [1, {MAX_LOKR_FACTOR}]")
        if self.adapter != "lora" and (self.dropout > 0 or self.rank_dropout > 0):
            raise ValueError(f"LoRAConfig: dropout={self.dropout!r} / rank_dropout={self.rank_dropout!r} "
                             f"act on the low-rank path of adapter 'lora' only; adapter={self.adapter!r} has none: set "
                             "both to 0 (module_dropout works with every adapter)")

    @property
    def scale(self) -> float:
        return lora_scale(self.alpha, self.rank, self.rslora)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """The one place the LoRA scale is defined: alpha/rank, or alpha/sqrt(rank) for rsLoRA."""
    return float(alpha) / (math.sqrt(rank) if rslora else float(rank))
