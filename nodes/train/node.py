"""PrecisionTrainSettings and PrecisionTrainLoRA: thin V3 nodes over ``training.loop``.

Defaults come from ``TrainSettings``; every option list from the registry that implements it.
"""
from __future__ import annotations

import json
import logging
import math
import time
from typing import Any, Callable, Mapping

import comfy.model_management as mm
import comfy.utils

from ...training import optim, sampling
from ...training.checkpoint import TrainingState
from ...training.loop import Hooks, StepReport, train
from ...training.learning import LEARNING_GUARDS
from ...training.settings import NAN_POLICIES, TrainSettings
from ...training.regional_compile import COMPILE_MODES
from ...training.views import EMA_SAVE
from ..checks.gate import PrecisionNode
from ..host import page
from ..host.errors import plain
from ..host.comfy_io import io
from .captions import with_empty_caption
from .data import build_dataset
from .checkpoint_files import verify_resume
from .ema_files import ema_writer
from ..checks.graph import refusal
from .budget import plan_step
from .glue import (check_compiled_gradients, checkpoint_writer, compiled_training, fork_lora, model_fns,
                   training_session)
from ..attention.run_report import attention_account
from ..lora.trained_over import trained_over_metadata
from .jobs import finish_job, start_job, stopped_runs
from .preview import PreviewStepHook, make_previewer, node_outputs
from .states import continued_state, exploded_note, set_aside_exploded, training_metadata
from ..host.types import LossMapType, PreviewSettingsType, TrainingStateType, TrainSettingsType

log = logging.getLogger(__name__)
DEFAULTS = TrainSettings()
CATEGORY = "precision_lora/train"


def _node_error(node: str, exc: Exception) -> ValueError:
    msg = plain(str(exc))
    return ValueError(f"{node}: {msg}")


def _float(name: str, lo: float, hi: float, step: float, tip: str) -> io.Float.Input:
    return io.Float.Input(name, default=getattr(DEFAULTS, name), min=lo, max=hi, step=step, tooltip=tip)


def _int(name: str, lo: int, hi: int, tip: str) -> io.Int.Input:
    return io.Int.Input(name, default=getattr(DEFAULTS, name), min=lo, max=hi, step=1, tooltip=tip)


def _combo(name: str, options: list[str], tip: str) -> io.Combo.Input:
    return io.Combo.Input(name, options=options, default=getattr(DEFAULTS, name), tooltip=tip)


def _optimizer_tip() -> str:
    """From the registry: what each optimizer is for, its LoRA learning rate, and whether it is installed."""
    return "Optimizer (docs/optimizers.md). " + "; ".join(optim.describe())


def _settings_inputs() -> list:
    return [
        _combo("optimizer", list(optim.OPTIMIZERS), _optimizer_tip()),
        _float("learning_rate", 0.0, 10.0, 1e-6, "Base learning rate (> 0). Each optimizer's LoRA range is in the optimizer tooltip "
               "(AdamW 1e-4 .. 5e-4, Lion 1e-5 .. 5e-5, Prodigy 1.0)."),
        _float("weight_decay", 0.0, 1.0, 1e-4, "Decoupled weight decay (AdamW) / L2 (SGD, Adafactor)."),
        _float("beta1", 0.0, 0.9999, 1e-4, "Adam beta1 / SGD and Muon momentum."),
        _float("beta2", 0.0, 0.99999, 1e-5, "Adam beta2."),
        _float("eps", 1e-12, 1e-3, 1e-9, "Adam epsilon."),
        _combo("lr_schedule", list(optim.SCHEDULES), "Learning-rate schedule; decaying ones reach 0 at schedule_steps."),
        _int("warmup_steps", 0, 100000, "Linear warmup steps (not with 'constant')."),
        _int("schedule_steps", 1, 1000000, "Horizon of linear/cosine schedules in optimizer steps (whole run, all chained nodes)."),
        _int("restarts", 1, 100, "Cycles of cosine_with_restarts."),
        _float("loraplus_ratio", 0.01, 100.0, 0.01, "LoRA+: lr of lora_up = lr x ratio (1 = plain LoRA, ~16 typical; not with prodigy: one step size for all)."),
        _int("batch_size", 1, 256, "Samples per micro-batch (capped at the dataset size)."),
        _int("grad_accum", 1, 1024, "Micro-batches per optimizer step (the loss is averaged)."),
        _float("max_grad_norm", 0.0, 1000.0, 0.01, "Clip the gradient norm to this (0 = no clipping)."),
        _combo("timestep_sampling", list(sampling.TIMESTEP_SAMPLERS),
               "Where on the noise schedule to train: " + "; ".join(f"{k}: {v}" for k, v in sampling.TIMESTEP_SAMPLERS.items())),
        _float("logit_mean", -5.0, 5.0, 0.01, "logit_normal: mean of the logit of u (u = noise fraction)."),
        _float("logit_std", 0.01, 5.0, 0.01, "logit_normal: std of the logit of u."),
        _float("sigmoid_scale", 0.01, 10.0, 0.01, "sigmoid: u = sigmoid(scale * z)."),
        _float("shift", 0.01, 20.0, 0.01, "shift: u = s r / (1 + (s-1) r); > 1 favours high noise."),
        _combo("loss_weighting", list(sampling.LOSS_WEIGHTINGS),
               "Per-sample loss weight: " + "; ".join(f"{k}: {v}" for k, v in sampling.LOSS_WEIGHTINGS.items())),
        _combo("target", list(sampling.TARGETS), "Regression target: " + "; ".join(f"{k}: {v}" for k, v in sampling.TARGETS.items())),
        _float("dop_multiplier", 0.0, 100.0, 0.01, "DOP: weight of mse(pred with LoRA, pred without LoRA) on the class conditioning (0 = off)."),
        _int("dop_every_n", 1, 1000, "DOP every n optimizer steps (amortises its two extra forwards)."),
        _int("checkpoint_every", 0, 1000000, "Write a checkpoint every N optimizer steps into models/loras/<name>/ (0 = only on stop/cancel)."),
        _combo("nan_policy", list(NAN_POLICIES), "; ".join(f"{k}: {v}" for k, v in NAN_POLICIES.items())),
        _int("nan_patience", 1, 100, "Non-finite steps in a row before rollback / stop."),
        io.Boolean.Input("gradient_checkpointing", default=DEFAULTS.gradient_checkpointing,
                         tooltip="Recompute every transformer block but the last in backward: far less activation "
                                 "memory for more time per step (bench/train.py measures both)."),
        # Optional: API workflows saved before this input existed still validate (and get the default, off).
        io.Float.Input("caption_dropout", default=DEFAULTS.caption_dropout, min=0.0, max=1.0, step=0.01, optional=True,
                       tooltip="Probability of training a sample on the empty caption at each step (seeded; 0 = "
                               "off, 0.05 .. 0.1 typical). Needs empty_conditioning on Train LoRA."),
        io.Int.Input("swap_blocks", default=DEFAULTS.swap_blocks, min=0, max=200, step=1, optional=True,
                     tooltip="Block swap: keep this many transformer blocks in host memory and stream each to the "
                             "GPU just before it runs (forward and backward), for far less VRAM at some speed. "
                             "Needs gradient_checkpointing; at most the model's block count - 1. 0 = off."),
        io.Boolean.Input("offload_block_inputs", default=DEFAULTS.offload_block_inputs, optional=True,
                         tooltip="With gradient_checkpointing: each checkpointed block's inputs (what checkpointing "
                                 "keeps, ~1.5 GiB for Flux.1-dev at 1024 px) wait for backward in pinned host memory "
                                 "instead of VRAM, copied back when the block is recomputed. Gradients unchanged; "
                                 "costs one host copy per block each way. On a CPU device it saves nothing."),
        io.String.Input("vram_budget_gb", default=DEFAULTS.vram_budget_gb, optional=True,
                        tooltip="VRAM the run may use, in GiB (e.g. 12), 'auto' (the GPU's free memory plus what "
                                "ComfyUI can free) or 0 / off. When set, Train LoRA estimates this model's training "
                                "step at this run's resolution, rank and batch before loading it and picks "
                                "gradient checkpointing and swap_blocks to fit (the plan replaces swap_blocks; "
                                "gradient_checkpointing on is kept); it refuses with the numbers when nothing fits. "
                                "docs/memory.md."),
        *_ema_inputs(),
    ]


def _ema_inputs() -> list:
    """EMA of the LoRA weights (docs/optimizers.md); optional, so workflows saved before them still validate."""
    return [
        io.Float.Input("ema_decay", default=DEFAULTS.ema_decay, min=0.0, max=0.99999, step=1e-5, optional=True,
                       tooltip="EMA of the LoRA weights: fp32 shadow <- decay x shadow + (1 - decay) x weights after "
                               "every step (0 = off; 0.99 .. 0.9999 typical). Not with schedule-free optimizers."),
        io.Int.Input("ema_warmup", default=DEFAULTS.ema_warmup, min=0, max=1000000, step=1, optional=True,
                     tooltip="Steps over which the EMA decay ramps up linearly from 0 (0 = full decay from the first step)."),
        io.Boolean.Input("ema_on_cpu", default=DEFAULTS.ema_on_cpu, optional=True,
                         tooltip="Keep the EMA's fp32 shadow in host memory (saves 4 bytes per LoRA parameter of "
                                 "VRAM, costs one copy of the LoRA to the host per step)."),
        io.Combo.Input("ema_save", options=list(EMA_SAVE), default=DEFAULTS.ema_save, optional=True,
                       tooltip="; ".join(f"{k}: {v}" for k, v in EMA_SAVE.items())),
        io.Boolean.Input("ema_preview", default=DEFAULTS.ema_preview, optional=True,
                         tooltip="Previews sample with the EMA weights instead of the trained ones."),
        # last, so the widget values of workflows saved before it keep their places
        io.String.Input("ram_budget_gb", default=DEFAULTS.ram_budget_gb, optional=True,
                        tooltip="With vram_budget_gb set: the host (system) memory the plan may keep, in GiB (e.g. "
                                "32), 'auto' (what this machine has available when the run starts) or 0 / off. The "
                                "plan's host side (block inputs in pinned memory, swapped blocks, EMA on the CPU, "
                                "the NaN guard's snapshot, the dataset) is estimated beside its VRAM; a plan over "
                                "this is refused with both figures instead of thrashing the machine. docs/memory.md."),
        # after ram_budget_gb for the same reason
        io.Combo.Input("learning_guard", options=list(LEARNING_GUARDS), default=DEFAULTS.learning_guard, optional=True,
                       tooltip="Is it learning? Over the first learning_guard_steps steps of each run, names the LoRA "
                               "factors that never moved, got only zero or non-finite gradients, or whose updates "
                               "are below what their dtype can store, a collapsed gradient norm, and (checkpointing) "
                               "blocks whose recomputation differs from the forward. "
                               + "; ".join(f"{k}: {v}" for k, v in LEARNING_GUARDS.items()) + ". docs/training.md."),
        io.Int.Input("learning_guard_steps", default=DEFAULTS.learning_guard_steps, min=2, max=100000, step=1,
                     optional=True, tooltip="The learning guard's window: it checks after this many optimizer steps "
                                            "of each run (a shorter run: at its end)."),
        io.Int.Input("validate_every_n_steps", default=DEFAULTS.validate_every_n_steps, min=0, max=1000000, step=1,
                     optional=True, tooltip="Held-out validation loss after every N-th optimizer step (0 = off): "
                                            "fixed noise and timesteps, no dropout, so resumed and chained runs give "
                                            "the same curve. Needs a validation set on Train LoRA or "
                                            "validation_fraction. docs/training.md."),
        io.Float.Input("validation_fraction", default=DEFAULTS.validation_fraction, min=0.0, max=0.9, step=0.01,
                       optional=True, tooltip="Without a validation set on Train LoRA: this share of the training "
                                              "samples is held out (chosen by the run's seed) and validated on, not "
                                              "trained on. 0 = none."),
        io.Boolean.Input("keep_best_validation", default=DEFAULTS.keep_best_validation, optional=True,
                         tooltip="The LoRA Train LoRA outputs (and Save LoRA writes) is the one at the step with the "
                                 "lowest validation loss, not the last step's; its metadata names the step. The "
                                 "training_state still continues from the last step. Needs validate_every_n_steps."),
        io.Float.Input("unmasked_weight", default=DEFAULTS.unmasked_weight, min=0.0, max=1.0, step=0.01,
                       optional=True, tooltip="Masked loss (a mask on Train LoRA, or a LATENT's noise_mask): the loss "
                                              "weight of the latent outside a sample's mask (0 = only the masked "
                                              "region trains, 1 = the mask changes nothing). docs/training.md."),
        # last, after unmasked_weight, for the same reason
        io.Combo.Input("compile", options=list(COMPILE_MODES), default=DEFAULTS.compile, optional=True,
                       tooltip="Regional compile: 'blocks' compiles each transformer block once with torch.compile "
                               "(inductor; blocks of one kind share their code), with checkpointing, block inputs "
                               "on host, block swap and the attention override around it; the LoRA layers run eager "
                               "inside it (their fp32 path unchanged). The first steps pay the compile time; a part "
                               "that fails to compile runs eager, with the reason in the report. 'off': eager. "
                               "docs/training.md."),
    ]


class PrecisionTrainSettings(PrecisionNode):
    NODE = "PrecisionTrainSettings"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PrecisionTrainSettings", display_name="Precision Train Settings", category=CATEGORY,
            description="Optimizer, LR schedule, accumulation, clipping, timestep sampling, loss weighting, DOP, "
                        "checkpoints and NaN policy for PrecisionTrainLoRA.",
            inputs=_settings_inputs(),
            outputs=[TrainSettingsType.Output(display_name="settings")],
        )

    @classmethod
    def check(cls, values: dict) -> str | None:
        """Rules across inputs (warmup vs schedule, ...) and whether the optimizer is installed."""
        fields = [f for f in DEFAULTS.to_dict() if f in values]  # an optional input left out takes its default
        if any(values[f] is None for f in fields):
            return None  # a linked input: checked again when the node runs
        built = build_settings({f: values[f] for f in fields})
        return built if isinstance(built, str) else None

    @classmethod
    def execute(cls, **kwargs: Any) -> io.NodeOutput:
        built = build_settings(kwargs)
        if isinstance(built, str):
            raise ValueError(f"PrecisionTrainSettings: {built}")
        return io.NodeOutput(built)


def build_settings(values: Mapping[str, Any]) -> TrainSettings | str:
    """The settings ``values`` describe, or why they cannot train here (invalid, or the optimizer is not
    installed) with the fix."""
    try:
        settings = TrainSettings(**values)
    except ValueError as exc:
        return plain(str(exc))
    reason = optim.available()[settings.optimizer]
    if reason is not None:
        return f"input 'optimizer'={settings.optimizer!r} is {reason}, or choose 'adamw'"
    return settings


class ConsoleLine:
    """One console line every ``every`` steps (a twentieth of the run), or after ``seconds`` without one,
    and at the last step: step, loss smoothed over the recent steps, lr, it/s and time left."""

    def __init__(self, steps: int, start: int, seconds: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.steps, self.start, self.seconds, self.clock = steps, start, seconds, clock
        self.every = max(1, steps // 20)
        self.began = self.last = clock()
        self.smooth, self.weight = 0.0, 0.0

    def line(self, r: StepReport) -> str | None:
        if r.loss is not None and math.isfinite(r.loss):  # skipped / non-finite steps do not move the average
            self.smooth, self.weight = 0.9 * self.smooth + 0.1 * r.loss, 0.9 * self.weight + 0.1
        now = self.clock()
        if r.local_step % self.every and r.local_step < self.steps and now - self.last < self.seconds:
            return None
        self.last = now
        rate = r.local_step / max(now - self.began, 1e-9)
        eta = (self.steps - r.local_step) / rate if rate > 0 else 0.0
        loss = f"{self.smooth / self.weight:.4g}" if self.weight else "n/a"
        return (f"PrecisionTrainLoRA: step {r.step}/{self.start + self.steps} loss {loss} "
                f"(smoothed) lr {r.lr:.3g} {rate:.2f} it/s ETA {_clock(eta)}")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _step_hook(job, node_id: str | None, prompt_id: str | None, steps: int, start: int) -> Callable[[StepReport], str | None]:
    pbar = comfy.utils.ProgressBar(steps, node_id=node_id)
    console = ConsoleLine(steps, start)

    def on_step(r: StepReport) -> str | None:
        line = console.line(r)
        if line is not None:
            page.console(line)
        point = {"step": r.step, "loss": r.loss, "lr": r.lr, "sigma": r.sigma}
        if r.val_loss is not None:
            point["val_loss"] = r.val_loss
            page.console(f"PrecisionTrainLoRA: step {r.step}: validation loss {r.val_loss:.6g}")
        job.add_point(point)
        page.send("precision_lora.train_step", {"node": node_id, "prompt_id": prompt_id, "total": start + steps, **point})
        if mm.processing_interrupted():
            return "interrupt"  # the loop saves a checkpoint first; the node raises afterwards
        try:
            pbar.update_absolute(r.local_step, steps)  # ComfyUI's hook raises if cancel came just now
        except mm.InterruptProcessingException:
            return "interrupt"
        return job.take_request()

    return on_step


def _flat(value: Any, default: Any = None) -> Any:
    return value[0] if isinstance(value, list) and value else default


class PrecisionTrainLoRA(PrecisionNode):
    NODE = "PrecisionTrainLoRA"
    # resume_from is checked by check() (checkpoint_files.resolve_resume): it also takes the absolute path the
    # node shows, which the general file-name rule refuses.
    FILE_NAME_INPUTS = {"name": (False, False)}

    @classmethod
    def fingerprint_inputs(cls, **_: Any) -> int:
        return stopped_runs()  # changes when a run ends early: its partial result is never served from cache

    @classmethod
    def check(cls, values: dict) -> str | None:
        if ("validation_latents" in values) != ("validation_conditioning" in values):
            have, need = (("validation_latents", "validation_conditioning") if "validation_latents" in values
                          else ("validation_conditioning", "validation_latents"))
            return (f"input '{have}' is connected but input '{need}' is not; connect both (the validation set's "
                    "latents and their conditioning) or neither")
        for name in ("empty_conditioning", "class_conditioning"):  # rules across nodes (graph_checks)
            refused = refusal(values.get(name))
            if refused:
                return refused
        resume = values.get("resume_from") or ""
        if not resume.strip():
            return None
        if "training_state" in values:  # connected: a link has no value yet while ComfyUI validates
            return (f"input 'resume_from'={resume!r} and input 'training_state' are both set; "
                    "clear resume_from or disconnect training_state")
        if not isinstance(resume, str):
            return f"input 'resume_from'={resume!r} is not text; give a checkpoint name or leave it empty"
        try:
            verify_resume(resume.strip())
        except ValueError as exc:
            return plain(str(exc)).removeprefix("PrecisionTrainLoRA: ")
        return None

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PrecisionTrainLoRA", display_name="Precision Train LoRA", category=CATEGORY,
            description="Trains the attached LoRA for N optimizer steps. Chain two of these (model + training_state) "
                        "to continue exactly where the first stopped; cancel writes a checkpoint first.",
            is_input_list=True,
            inputs=[
                io.Model.Input("model", tooltip="A model with a LoRA attached by PrecisionAttachLoRA (or a previous PrecisionTrainLoRA)."),
                io.Latent.Input("latents", tooltip="One LATENT batch, or the list of LATENTs from ComfyUI's dataset nodes."),
                io.Conditioning.Input("conditioning", tooltip="One conditioning for all samples, one per sample, or one per LATENT."),
                io.Int.Input("steps", default=100, min=1, max=1000000, step=1, tooltip="Optimizer steps this node runs (> 0)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, step=1,
                             tooltip="Seeds data order, timesteps and noise for a new run; a continued run keeps the state's generator."),
                io.String.Input("name", default="precision_lora", tooltip="Run name: checkpoints are written as models/loras/<name>/<name>_step<N>.safetensors (every LoRA loader lists them) with their training state <name>_step<N>.trainstate beside them."),
                TrainSettingsType.Input("settings", optional=True, tooltip="From PrecisionTrainSettings; defaults when not connected."),
                io.Conditioning.Input("class_conditioning", optional=True, tooltip="Class prompt (without trigger) for DOP."),
                TrainingStateType.Input("training_state", optional=True, tooltip="Continue from a previous PrecisionTrainLoRA."),
                io.String.Input("resume_from", default="", optional=True,
                                tooltip="Checkpoint to resume from, as LoRA lists name it (e.g. my_run/my_run_step000100.safetensors, or a LoRA saved by Save LoRA with its training_state), or its full path as this node shows it (empty = none). Changed settings take effect; the optimizer must be the same."),
                PreviewSettingsType.Input("preview", optional=True,
                                          tooltip="From PrecisionPreviewSettings: sample images every N steps, shown on this node and saved as output/precision_lora/previews/<name>/<name>_step<N>_<i>.png. Training is identical with or without."),
                io.Conditioning.Input("empty_conditioning", optional=True,
                                      tooltip="The empty caption (CLIPTextEncode with an empty text) for caption_dropout in the settings; needed only when caption_dropout > 0."),
                io.Latent.Input("validation_latents", optional=True,
                                tooltip="A validation set (images the LoRA does not train on), encoded as the training "
                                        "latents: its loss is measured every validate_every_n_steps (Train Settings). "
                                        "Connect validation_conditioning with it."),
                io.Conditioning.Input("validation_conditioning", optional=True,
                                      tooltip="The validation set's conditioning: one for all, one per sample or one "
                                              "per LATENT, as conditioning."),
                io.Mask.Input("mask", optional=True,
                              tooltip="Masked loss: one mask for all samples or one per sample in the latents' order, "
                                      "at the images' size (white = train here). Outside it the loss weighs "
                                      "unmasked_weight (Train Settings). Without it, a LATENT's own noise_mask (Set "
                                      "Latent Noise Mask) is used. docs/training.md."),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The model with the trained LoRA active."),
                TrainingStateType.Output(display_name="training_state", tooltip="Connect to the next PrecisionTrainLoRA to continue."),
                LossMapType.Output(display_name="loss_map", tooltip="Loss history of the whole run ({'loss': [...]})."),
                io.Int.Output(display_name="steps", tooltip="Optimizer steps done in the whole run."),
                io.Image.Output(display_name="previews", tooltip="The images of the latest preview (a black 64 x 64 image without 'preview')."),
            ],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
        )

    @classmethod
    def execute(cls, model, latents, conditioning, steps, seed, name, settings=None, class_conditioning=None,
                training_state=None, resume_from=None, preview=None, empty_conditioning=None,
                validation_latents=None, validation_conditioning=None, mask=None) -> io.NodeOutput:
        model, steps, seed, name = model[0], steps[0], seed[0], name[0]
        cfg = _flat(settings, DEFAULTS)  # validated when it was built
        resume = (_flat(resume_from, "") or "").strip()
        cont = continued_state(_flat(training_state), resume, cfg)
        state = cont.state
        out, lora_set = fork_lora(model)
        hidden = getattr(cls, "hidden", None)
        node_id, prompt_id = page.executing_ids(getattr(hidden, "unique_id", None))
        lora_set.info.update(trained_over_metadata(getattr(hidden, "prompt", None), node_id, model))
        start = state.step if state is not None else 0
        previewer = make_previewer(out, lora_set, preview, name, node_id, start, steps)
        job = start_job(node_id, prompt_id, [] if state is None else [
            {k: p.get(k) for k in ("step", "loss", "lr", "sigma")} for p in state.history], page.client_id())
        on_step = _step_hook(job, node_id, prompt_id, steps, start)
        hooks = Hooks(on_step=on_step if previewer is None else previewer.wrap(on_step),
                      save_checkpoint=job.tracked(checkpoint_writer(out, lora_set, name)),
                      is_interrupt=lambda exc: isinstance(exc, mm.InterruptProcessingException),
                      save_ema=ema_writer(out, lora_set, name, cfg), views_on_step=previewer is not None)
        result = None
        try:
            result = _run(out, lora_set, cfg, latents, conditioning, class_conditioning, steps, seed, state, hooks,
                          empty_conditioning, node_id, cont.changes, (validation_latents, validation_conditioning),
                          mask)
        finally:
            finish_job(job, stopped=result is not None and result.stopped)
        outcome = result.outcome
        moved, kept = set_aside_exploded(result.checkpoints) if not outcome.ok else ([], result.checkpoints)
        checkpoint = kept[-1] if kept else None
        lora_set.info["ss_steps"] = str(result.state.step)  # reaches the saved file's metadata
        lora_set.info["precision_lora_outcome"] = outcome.summary()
        page.send("precision_lora.train_done", {"node": node_id, "prompt_id": prompt_id, "steps": result.state.step,
                                            "stopped": result.stopped, "checkpoint": checkpoint,
                                            "failed": not outcome.ok, "outcome": outcome.summary(),
                                            "learning": result.learning,
                                            "resumed_from": cont.pick.name if cont.pick else None})
        if result.reason == "interrupt":
            mm.interrupt_current_processing(False)
            raise mm.InterruptProcessingException()
        if previewer is not None:
            previewer.raise_if_failed(checkpoint)
        if not outcome.ok:  # the LoRA never reaches Save LoRA as a good result (training/outcome.py)
            raise ValueError(f"PrecisionTrainLoRA: the run failed ({outcome.summary()}): {outcome.problem}"
                             f"{exploded_note(moved, kept)}")
        images, shown = node_outputs(previewer)
        curve = validation_curve(result.state)
        loss_map = {"loss": result.state.losses(), **({"val_loss": curve} if curve else {})}
        return io.NodeOutput(out, result.state, loss_map, result.state.step, images, ui=shown)


def validation_curve(state: TrainingState) -> list[list]:
    """[[step, validation loss], ...] of the whole run (chained and resumed calls included)."""
    return [[p["step"], p["val_loss"]] for p in state.history if p.get("val_loss") is not None]


def _run(model, lora_set, cfg: TrainSettings, latents, conditioning, class_conditioning, steps: int, seed: int,
         state: TrainingState | None, hooks: Hooks, empty_conditioning=None, node_id: str | None = None,
         changes: tuple[str, ...] = (), validation: tuple = (None, None), masks: list | None = None):
    # before anything is loaded onto the device
    # the plan decides what the session runs with; the run (its training state) keeps what the user set
    plan = plan_step(model, cfg, latents, conditioning, say=lambda text: page.show_on_node(text, node_id))
    if plan.line is not None:
        log.info("PrecisionTrainLoRA: %s", plan.line)
        lora_set.info.update(plan.metadata())
        changes = (plan.line, *changes)
    def compiling(report) -> None:  # a block kind compiled (again) or fell back: in the console as it happens
        log.info("PrecisionTrainLoRA: %s", report.line())

    with compiled_training(model, plan.session, compiling) as compiled, \
            training_session(model, lora_set, plan.session) as device, attention_account(model) as attention:
        samples, report = build_dataset(model, latents, conditioning, class_conditioning, device, empty_conditioning,
                                        masks, cfg.unmasked_weight)
        for line in [*report.lines(), *attention.start_lines()]:
            log.info("PrecisionTrainLoRA: %s", line)
        shown = [*report.lines(), *attention.start_lines(), *changes]
        page.show_on_node("\n".join(shown), node_id)
        lora_set.info["precision_lora_dataset"] = report.summary()
        lora_set.info.pop("precision_lora_mask", None)
        if report.masked:
            lora_set.info["precision_lora_mask"] = (f"{len(report.masked)} of {report.samples} samples masked, "
                                                    f"unmasked_weight {cfg.unmasked_weight:g}"
                                                    + (f", {report.outside_line()}" if report.outside else ""))
        start = state.step if state is not None else 0
        lora_set.info.update(training_metadata(plan.session, report.sizes, report.samples, start + steps, seed if state is None
                                               else state.seed))
        samples = with_empty_caption(model, samples, empty_conditioning, cfg, device)
        held = None
        if validation[0] is not None:
            held, held_report = build_dataset(model, validation[0], validation[1], None, device)
            log.info("PrecisionTrainLoRA: validation set: %s", held_report.summary())
        fns = model_fns(model, lora_set, cfg, device)
        check_compiled_gradients(compiled, model, fns, lora_set, samples[0])
        if isinstance(hooks.on_step, PreviewStepHook):
            hooks.on_step.at_start()  # step 0: inside the session, before the first step
        try:
            began = time.perf_counter()
            result = train(lora_set, samples, fns, cfg, steps, seed=seed, state=state, hooks=hooks, hand_over=True,
                           validation=held)
            took = time.perf_counter() - began
            curve = validation_curve(result.state)
            if curve:
                best = min(curve, key=lambda p: p[1])
                lora_set.info["precision_lora_validation"] = json.dumps(curve)
                lora_set.info["precision_lora_validation_best"] = f"{best[1]:.6g} at step {best[0]}"
            lora_set.info.pop("precision_lora_kept", None)
            below: list[str] = []  # under the node too, beside the run's report
            if result.validation_passes:
                below.append(f"validation: {result.validation_passes} passes took {result.validation_seconds:.1f} s, "
                             f"{100 * result.validation_seconds / max(took, 1e-9):.0f} % of this run's {took:.1f} s")
                lora_set.info["precision_lora_validation_cost"] = below[-1]
                log.info("PrecisionTrainLoRA: %s", below[-1])
            if result.kept_best is not None:
                kept = (f"the LoRA of step {result.kept_best[0]} of {result.state.step}: the lowest validation loss "
                        f"({result.kept_best[1]:.6g}; keep_best_validation)")
                lora_set.info["precision_lora_kept"] = kept
                log.info("PrecisionTrainLoRA: %s", kept)
                below.append(kept)
            if result.learning:
                lora_set.info["precision_lora_learning"] = result.learning
                log.info("PrecisionTrainLoRA: %s", result.learning)
            if result.learning_findings:
                below.append(result.learning)
            lora_set.info.pop("precision_lora_compile", None)  # a chained call's own, not an upstream call's
            if compiled is not None:
                lora_set.info["precision_lora_compile"] = compiled.line()
                below.append(compiled.line())
            if below:
                page.show_on_node("\n".join([*shown, *below]), node_id)
            return result
        except ValueError as exc:
            raise _node_error("PrecisionTrainLoRA", exc) from exc
        finally:
            lora_set.info.update(attention.metadata())


NODES = [PrecisionTrainSettings, PrecisionTrainLoRA]
