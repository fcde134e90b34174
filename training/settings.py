"""Training settings: one frozen dataclass, validated once, when it is built.

``TrainSettings`` is what ``PrecisionTrainSettings`` builds and ``PrecisionTrainLoRA`` consumes. Every
option list (optimizers, schedules, samplers, weightings, targets, NaN policies) comes from the registry
that implements it, so a name accepted here is a name the loop can run. The registries take only the
few values they read (``schedule``, ``sampler``, ``hyperparams``), never the whole settings object.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .checks import number_problem
from .learning import LEARNING_GUARDS
from .memory_plan import parse_budget
from .regional_compile import COMPILE_MODES
from .optim import OPTIMIZERS, SCHEDULES, Hyperparams, Schedule, group_lr, schedule_free
from .sampling import LOSS_WEIGHTINGS, TARGETS, TIMESTEP_SAMPLERS, Sampler
from .views import EMA_SAVE

NAN_POLICIES: dict[str, str] = {
    "rollback": "skip a non-finite step; after `nan_patience` bad steps in a row restore the last good LoRA + optimizer",
    "stop": "skip a non-finite step; after `nan_patience` bad steps in a row stop the run (last good state kept)",
}


def _err(field: str, value: object, fix: str) -> ValueError:
    return ValueError(f"TrainSettings.{field}={value!r}: {fix}")


@dataclass(frozen=True)
class TrainSettings:
    """Optimizer, schedule, sampling, loss and safety options of a training run (no model, no data).

    Construction validates (ValueError naming the field, the bad value and the fix), so every instance
    in circulation is valid and nothing downstream checks it again."""

    optimizer: str = "adamw"
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    schedule_steps: int = 1000      # horizon of decaying schedules, independent of how runs are chained
    restarts: int = 1               # cosine_with_restarts cycles
    loraplus_ratio: float = 1.0     # lr of lora_up = lr * ratio (1 = plain LoRA)
    batch_size: int = 1
    grad_accum: int = 1
    max_grad_norm: float = 1.0      # 0 = no clipping
    timestep_sampling: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    sigmoid_scale: float = 1.0
    shift: float = 3.0
    loss_weighting: str = "none"
    target: str = "auto"
    dop_multiplier: float = 0.0     # 0 = DOP off
    dop_every_n: int = 1
    checkpoint_every: int = 0       # 0 = no periodic checkpoints
    nan_policy: str = "rollback"
    nan_patience: int = 3
    gradient_checkpointing: bool = False
    caption_dropout: float = 0.0    # probability of training a sample on the empty caption (0 = off)
    ema_decay: float = 0.0          # EMA of the LoRA weights (0 = off; 0.99 .. 0.9999 typical)
    ema_warmup: int = 0             # steps over which the EMA decay ramps up from 0 (0 = none)
    ema_on_cpu: bool = False        # keep the fp32 EMA shadow in host memory instead of on the device
    ema_save: str = "beside"        # EMA_SAVE: "beside" (extra file) or "as_lora" (the LoRA is the EMA)
    ema_preview: bool = False       # previews sample with the EMA weights
    swap_blocks: int = 0            # frozen blocks streamed from host memory (training.swap); 0 = off
    offload_block_inputs: bool = False  # checkpointed blocks' inputs wait for backward in host memory
    compile: str = "off"            # COMPILE_MODES: "blocks" compiles each transformer block (training.regional_compile)
    vram_budget_gb: str = "0"       # "0"/"off", "auto" or GiB: the memory planner picks checkpointing + swap_blocks
    ram_budget_gb: str = "auto"     # with a VRAM plan: host memory it may keep ("auto": available now; "0"/"off": unchecked)
    learning_guard: str = "warn"    # LEARNING_GUARDS: name factors that do not learn (warn), also end the run (stop), off
    learning_guard_steps: int = 20  # the learning guard's window: the first N optimizer steps of each call
    validate_every_n_steps: int = 0  # the held-out validation loss after every N-th step (0 = off)
    validation_fraction: float = 0.0  # without a validation set: this share of the samples held out (by seed)
    keep_best_validation: bool = False  # the LoRA output is the one at the lowest validation loss (training.views)
    unmasked_weight: float = 0.0    # masked loss: the weight of latent cells outside a sample's mask (0..1)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def schedule(self) -> Schedule:
        return Schedule(self.lr_schedule, self.warmup_steps, self.schedule_steps, self.restarts)

    @property
    def sampler(self) -> Sampler:
        return Sampler(self.timestep_sampling, self.logit_mean, self.logit_std, self.sigmoid_scale, self.shift)

    @property
    def hyperparams(self) -> Hyperparams:
        return Hyperparams((self.beta1, self.beta2), self.eps, self.weight_decay)

    def validate(self) -> None:
        """Raise ValueError naming the field, the bad value and the fix."""
        self._validate_names()
        self._validate_floats()
        if not self.learning_rate > 0:
            raise _err("learning_rate", self.learning_rate, "must be > 0 (typical LoRA values: 1e-5 .. 1e-3)")
        if self.weight_decay < 0:
            raise _err("weight_decay", self.weight_decay, "must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise _err(name, getattr(self, name), "must be in [0, 1)")
        if not self.eps > 0:
            raise _err("eps", self.eps, "must be > 0")
        self._validate_counts()
        if self.lr_schedule == "constant" and self.warmup_steps > 0:
            raise _err("warmup_steps", self.warmup_steps, "has no effect with lr_schedule 'constant'; "
                       "choose 'constant_with_warmup' or set warmup_steps to 0")
        if self.warmup_steps > self.schedule_steps and self.lr_schedule not in ("constant", "constant_with_warmup"):
            raise _err("warmup_steps", self.warmup_steps, f"must be <= schedule_steps ({self.schedule_steps})")
        if not self.loraplus_ratio > 0:
            raise _err("loraplus_ratio", self.loraplus_ratio, "must be > 0 (1 = plain LoRA, LoRA+ uses ~16)")
        if self.loraplus_ratio != 1.0 and self.optimizer in OPTIMIZERS and not group_lr(self.optimizer):
            raise _err("loraplus_ratio", self.loraplus_ratio, f"optimizer {self.optimizer!r} steps every parameter "
                       "group with one step size (its own estimate times the first group's learning_rate), so "
                       "lora_up's larger learning rate would be ignored; set loraplus_ratio to 1, or choose an "
                       "optimizer such as adamw for LoRA+")
        if self.max_grad_norm < 0:
            raise _err("max_grad_norm", self.max_grad_norm, "must be >= 0 (0 disables clipping)")
        if not self.logit_std > 0:
            raise _err("logit_std", self.logit_std, "must be > 0")
        if not self.sigmoid_scale > 0:
            raise _err("sigmoid_scale", self.sigmoid_scale, "must be > 0")
        if not self.shift > 0:
            raise _err("shift", self.shift, "must be > 0 (1 = no shift, > 1 favours high noise)")
        if self.dop_multiplier < 0:
            raise _err("dop_multiplier", self.dop_multiplier, "must be >= 0 (0 disables DOP)")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise _err("validation_fraction", self.validation_fraction, "must be in [0, 1) (0 = no samples held out, "
                       "0.1 typical)")
        if not 0.0 <= self.unmasked_weight <= 1.0:
            raise _err("unmasked_weight", self.unmasked_weight, "must be in [0, 1] (0 = only the masked region "
                       "trains, 1 = the mask changes nothing)")
        if self.keep_best_validation and self.validate_every_n_steps == 0:
            raise _err("keep_best_validation", True, "keeps the LoRA at the lowest validation loss, but "
                       "validate_every_n_steps is 0, so none is measured; set validate_every_n_steps or turn it off")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise _err("caption_dropout", self.caption_dropout, "must be in [0, 1] (0 = off, ~0.05 .. 0.1 typical)")
        self._validate_ema()
        for name in ("vram_budget_gb", "ram_budget_gb"):
            try:
                parse_budget(getattr(self, name))
            except ValueError as exc:
                raise _err(name, getattr(self, name), str(exc).replace("the training device's free memory",
                           "the training device's free memory" if name == "vram_budget_gb" else
                           "the memory available on this machine")) from None

    @property
    def budget(self) -> float | str | None:
        """``vram_budget_gb`` parsed: None (off), "auto" or GiB (``training.memory_plan.parse_budget``)."""
        return parse_budget(self.vram_budget_gb)

    @property
    def ram_budget(self) -> float | str | None:
        """``ram_budget_gb`` parsed: None (unchecked), "auto" or GiB."""
        return parse_budget(self.ram_budget_gb)

    def _validate_ema(self) -> None:
        if not 0.0 <= self.ema_decay < 1.0:
            raise _err("ema_decay", self.ema_decay, "must be in [0, 1) (0 = no EMA, 0.99 .. 0.9999 typical)")
        for name in ("ema_on_cpu", "ema_preview", "keep_best_validation"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, getattr(self, name), "must be true or false")
        if self.ema_decay > 0 and schedule_free(self.optimizer):
            raise _err("ema_decay", self.ema_decay, f"an EMA on top of the schedule-free optimizer "
                       f"{self.optimizer!r} is not offered: schedule-free already averages its iterates (its "
                       "averaged weights are what is saved and previewed); set ema_decay to 0 or choose another optimizer")
        if self.keep_best_validation and (schedule_free(self.optimizer) or self.ema_decay > 0 and
                                          self.ema_save == "as_lora"):
            what = (f"the schedule-free optimizer {self.optimizer!r} saves its averaged weights"
                    if schedule_free(self.optimizer) else "ema_save 'as_lora' saves the EMA")
            raise _err("keep_best_validation", True, f"keeps the trained weights at the lowest validation loss, but "
                       f"{what} as the LoRA; use one: turn keep_best_validation off, or choose another optimizer / "
                       "ema_save 'beside'")
        if not isinstance(self.offload_block_inputs, bool):
            raise _err("offload_block_inputs", self.offload_block_inputs, "must be true or false")
        if self.offload_block_inputs and not self.gradient_checkpointing:
            raise _err("offload_block_inputs", self.offload_block_inputs, "needs gradient_checkpointing on (only a "
                       "checkpointed block's inputs wait for backward); turn gradient_checkpointing on or set "
                       "offload_block_inputs to false")
        if self.swap_blocks > 0 and not self.gradient_checkpointing:
            raise _err("swap_blocks", self.swap_blocks, "needs gradient_checkpointing on (the backward recomputes a "
                       "swapped block to read its streamed weights again); turn gradient_checkpointing on or set "
                       "swap_blocks to 0")

    def _validate_names(self) -> None:
        registries: dict[str, Mapping[str, Any]] = {
            "optimizer": OPTIMIZERS, "lr_schedule": SCHEDULES, "timestep_sampling": TIMESTEP_SAMPLERS,
            "loss_weighting": LOSS_WEIGHTINGS, "target": TARGETS, "nan_policy": NAN_POLICIES, "ema_save": EMA_SAVE,
            "learning_guard": LEARNING_GUARDS, "compile": COMPILE_MODES,
        }
        for field, registry in registries.items():
            value = getattr(self, field)
            if value not in registry:
                raise _err(field, value, f"unknown; choose one of {sorted(registry)}")

    def _validate_floats(self) -> None:
        """Every float field is a finite number: NaN passes every ``<``/``>`` bound test below (a NaN
        max_grad_norm would silently turn clipping off, a NaN dop_multiplier DOP)."""
        for f in dataclasses.fields(self):
            if f.type == "float":
                problem = number_problem(getattr(self, f.name))
                if problem is not None:
                    raise _err(f.name, getattr(self, f.name), problem)

    def _validate_counts(self) -> None:
        minimums = {"warmup_steps": 0, "schedule_steps": 1, "restarts": 1, "batch_size": 1, "grad_accum": 1,
                    "dop_every_n": 1, "checkpoint_every": 0, "nan_patience": 1, "swap_blocks": 0,
                    "learning_guard_steps": 2, "validate_every_n_steps": 0}
        for field, low in minimums.items():
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise _err(field, value, f"must be an integer >= {low}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSettings:
        """Inverse of ``to_dict``; unknown keys (from a newer version) are ignored, missing ones default."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
