"""The training loop: pure torch, one linear ``train()`` function, no ComfyUI.

The node glue supplies the model as plain callables (``ModelFns``), the data as ``Sample``s, and
``Hooks`` for progress, control (stop / checkpoint now / interrupt) and checkpoint writing. All
randomness (data order, timesteps, noise) comes from one CPU ``torch.Generator`` seeded from ``seed``
or restored from a ``TrainingState``, so N + M chained steps equal N + M steps in one run.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn

from .caption_dropout import dropped
from .checkpoint import TrainingState
from .distributed import DataParallel, active
from .grad import recompute_check
from .guard import NanGuard, all_finite
from .learning import LearningGuard, summary as learning_summary
from .masks import cell_weights, coverage
from .validation import held_out, validation_loss
from .masters import MasterWeights
from .optim import apply_lr, build_optimizer, lr_multiplier, schedule_free
from .outcome import Outcome, judge
from .sampling import loss_weight, sample_u, weighted_mse
from .settings import TrainSettings
from .tensors import to_cpu
from .module_state import dropout_rng as _dropout_rng
from .module_state import get_extra_rng as _get_extra_rng
from .module_state import global_rows as _global_rows
from .module_state import load_named as _load_named
from .module_state import set_extra_rng as _set_extra_rng
from .views import Best, Ema, WeightViews, view_kinds

log = logging.getLogger(__name__)

Predict = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
ACTIONS = ("stop", "checkpoint", "interrupt")


@dataclass(frozen=True)
class Sample:
    """One training example. ``latent`` (C, ...) in model space (after ``process_latent_in``), fp32.

    ``cond``/``class_cond``/``empty_cond`` are opaque to the loop (collated by ``ModelFns.collate``);
    samples whose ``group`` and latent shape are equal can share one forward pass. ``empty_cond`` (the
    empty caption for this sample) replaces ``cond`` when caption dropout picks the sample.
    """

    latent: torch.Tensor
    cond: Any
    group: Hashable = 0
    class_cond: Any = None
    empty_cond: Any = None
    mask: torch.Tensor | None = None  # masked loss: the mask on the latent grid (training.masks.to_grid)


@dataclass(frozen=True)
class ModelFns:
    """The model as the loop sees it. Shapes: x (b, C, ...), sigma/u (b,).

    predict(x_t, sigma, cond) -> prediction in the target space, fp32, same shape as x_t.
    predict_base: the same with the LoRA disabled (DOP prior); None if DOP is unsupported.
    sigma_of_u(u float64 (b,)) -> the model's sigma (b,) on the model's device.
    noise_latent(sigma, noise, x0) -> x_t;  target(sigma, noise, x0) -> regression target.
    collate(list of per-sample conds) -> one batched cond.
    """

    predict: Predict
    sigma_of_u: Callable[[torch.Tensor], torch.Tensor]
    noise_latent: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    target: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    collate: Callable[[list[Any]], Any]
    predict_base: Predict | None = None
    device: torch.device = torch.device("cpu")


@dataclass(frozen=True)
class StepReport:
    """Sent to ``Hooks.on_step`` after every optimizer step. ``loss`` is None when the NaN guard skipped the
    step; a step skipped because module_dropout dropped every adapter keeps its measured loss."""

    step: int          # optimizer steps done in the whole run (continues across chained nodes)
    local_step: int    # steps done by this call
    total: int         # steps this call will do
    loss: float | None
    lr: float
    sigma: float
    dop: float | None
    val_loss: float | None = None  # the held-out validation loss measured after this step (validate_every_n_steps)


@dataclass
class Hooks:
    """on_step returns None, "stop", "checkpoint" or "interrupt"; save_checkpoint(state, reason) -> path.
    save_ema(step) -> path: write the module's LoRA (an EMA, ``ema_save`` "beside") as step ``step``'s EMA file.

    is_interrupt(exc): True for an exception that means "the user cancelled" (raised from inside a forward
    or backward); the half-done step is discarded, a checkpoint of the last complete step is written and
    the run ends with reason "interrupt" instead of propagating the exception.
    """

    on_step: Callable[[StepReport], str | None] | None = None
    save_checkpoint: Callable[[TrainingState, str], str] | None = None
    is_interrupt: Callable[[BaseException], bool] | None = None
    save_ema: Callable[[int], str] | None = None
    views_on_step: bool = True  # on_step may preview: call it inside the preview view (False: raw weights, no copies)


@dataclass
class RunResult:
    state: TrainingState = None  # type: ignore[assignment]  # the final snapshot, set when the run ends
    stopped: bool = False
    reason: str = "done"           # done | stop | interrupt | nan | learning
    checkpoints: list[str] = field(default_factory=list)
    ema_files: list[str] = field(default_factory=list)  # EMA LoRAs written beside checkpoints and at the end
    outcome: Outcome | None = None  # training.outcome.judge of this call: ok, or failed with the reason
    learning: str = ""  # the learning guard's line (training.learning.summary); "" when learning_guard is off
    learning_findings: int = 0  # how many findings that line names
    kept_best: tuple[int, float] | None = None  # keep_best_validation: (step, validation loss) the LoRA is from
    validation_passes: int = 0  # validation passes of this call and the seconds they took (wall clock)
    validation_seconds: float = 0.0


def _check_inputs(data: Sequence[Sample], steps: int, settings: TrainSettings, fns: ModelFns) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps={steps!r}: must be an integer > 0")
    if len(data) == 0:
        raise ValueError("the dataset is empty: connect at least one latent")
    _check_masks(data, settings)
    if settings.dop_multiplier > 0:
        if fns.predict_base is None:
            raise ValueError("DOP needs a model whose LoRA can be switched off; set dop_multiplier to 0")
        if any(s.class_cond is None for s in data):
            raise ValueError("dop_multiplier > 0 needs a class conditioning; connect "
                             "class_conditioning or set dop_multiplier to 0")
    if settings.caption_dropout > 0 and any(s.empty_cond is None for s in data):
        raise ValueError(f"caption_dropout={settings.caption_dropout} needs the empty caption's "
                         "conditioning; connect empty_conditioning (a text encoder's output for an empty "
                         "prompt) or set caption_dropout to 0")


def _check_masks(data: Sequence[Sample], settings: TrainSettings) -> None:
    """Masked loss that would train nothing, or an unmasked_weight no mask uses: refused with the fix."""
    masked = [i for i, d in enumerate(data) if d.mask is not None]
    weight = settings.unmasked_weight
    if not masked and weight > 0:
        raise ValueError(f"unmasked_weight={weight:g} weighs the latent outside the samples' masks, but no sample has "
                         "a mask; connect mask on Train LoRA (or a LATENT with a noise_mask), or set unmasked_weight to 0")
    empty = [i + 1 for i in masked if weight == 0 and coverage(data[i].mask) == 0]  # type: ignore[arg-type]
    if empty:
        raise ValueError(f"the mask of sample{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} covers no "
                         "pixel and unmasked_weight is 0, so it would train nothing; give it a mask with a white region "
                         "or raise unmasked_weight")


class _Run:
    """Live objects of one call of ``train`` (optimizer, generator, guard). Not part of the public API."""

    def __init__(self, module: nn.Module, data: Sequence[Sample], fns: ModelFns, settings: TrainSettings,
                 seed: int, state: TrainingState | None, parallel: DataParallel | None = None,
                 validation: Sequence[Sample] = ()) -> None:
        self.module, self.fns, self.s, self.seed = module, fns, settings, seed
        self.data, self.validation = list(data), list(validation)
        self.parallel = parallel
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.gen = torch.Generator().manual_seed(seed)
        self.masters, self.optimizer = optimizer_parts(module, settings, self.gen)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.guard = NanGuard(settings.nan_patience, settings.nan_policy)
        self.step, self.history = 0, []
        self._ema_step: int | None = None  # the step whose EMA file was written last
        self._step_start: tuple[torch.Tensor, dict[str, torch.Tensor]] = (self.gen.get_state(), {})
        if state is not None:
            self._restore(state)
        if parallel is not None:  # every rank starts from rank 0's LoRA (and masters)
            parallel.broadcast_([*module.parameters(), *(m for _, m in self.masters.masters())])
        self.views = self._views(state)
        self.guard.snapshot(self.step, self.guarded(), self.optimizer)
        self.learning = self._learning_guard()

    def validate(self) -> float:
        """The held-out loss now (``training.validation``): eval mode, no gradients, fixed noise and timesteps."""
        return validation_loss(self.module, self.validation, self.fns, self.s.loss_weighting, denoising_loss,
                               self.s.unmasked_weight)

    def _learning_guard(self) -> LearningGuard | None:
        """The learning guard over the module's trainable parameters (what is saved) and what the optimizer
        updates for each (the parameter itself or its fp32 master), named by adapter path and factor."""
        if self.s.learning_guard == "off":
            return None
        master = {id(p): m for p, m in self.masters.masters()}
        paths = {id(q): f"{path} ({n})" for path, a in getattr(self.module, "adapters", dict)().items()
                 for n, q in a.named_parameters()}
        stored = [p for p in self.module.parameters() if p.requires_grad]
        names = [paths.get(id(p)) or self.names[id(p)] for p in stored]
        return LearningGuard(stored, [master.get(id(p), p) for p in stored], names, self.s.learning_guard_steps,
                             self.s.learning_guard)

    # ---- state ----
    def guarded(self) -> list[torch.Tensor]:
        """What the NaN guard's snapshots keep and its rollbacks restore (besides the optimizer state): the
        optimizer's parameters (fp32 values or masters), then the EMA shadow."""
        return [*self.params, *([] if self.views.ema is None else self.views.ema.values())]

    def _views(self, state: TrainingState | None) -> WeightViews:
        """The EMA (from the state, or started at the current weights) and the views previews and saves use."""
        s, pairs = self.s, list(self.masters.masters())
        owner = {id(m): self.names[id(p)] for p, m in pairs}
        self.param_names = [owner.get(id(p)) or self.names[id(p)] for p in self.params]
        ema = Ema(self.params, s.ema_decay, s.ema_warmup, s.ema_on_cpu) if s.ema_decay > 0 else None
        if ema is not None and state is not None and state.ema:
            if set(state.ema) != set(self.param_names):
                raise ValueError("the training state's EMA does not match the attached LoRA; "
                                 "attach the LoRA the state was trained with")
            ema.load([state.ema[n] for n in self.param_names])
        save, preview = view_kinds(schedule_free(s.optimizer), ema is not None, s.ema_save, s.ema_preview)
        views = WeightViews(self.module, self.optimizer, self.params, pairs, ema, save, preview)
        if s.keep_best_validation:
            views.best = self._best(state)
        return views

    def _best(self, state: TrainingState | None) -> Best:
        """``keep_best_validation``'s holder: empty, or the state's best (a chained or resumed run keeps the best
        of the whole run; its loss is the history's validation loss at that step)."""
        best = Best()
        if state is None or not state.best:
            return best
        if set(state.best) != set(self.param_names):
            raise ValueError("the training state's best-validation LoRA does not match the attached LoRA; "
                             "attach the LoRA the state was trained with")
        loss = next((p.get("val_loss") for p in state.history if p["step"] == state.best_step), None)
        if loss is not None:
            best.offer([state.best[n] for n in self.param_names], state.best_step, float(loss))
        return best

    def _restore(self, state: TrainingState) -> None:
        if state.settings.get("optimizer") != self.s.optimizer:
            raise ValueError(f"the training state was made with optimizer "
                             f"{state.settings.get('optimizer')!r} but settings choose {self.s.optimizer!r}; "
                             "use the same optimizer to continue")
        _load_named(self.module, state.lora, "LoRA parameters")
        if state.train_lora:  # the state's LoRA is a view (averaged / EMA weights): continue from the trained ones
            _load_named(self.module, state.train_lora, "LoRA parameters")
        with torch.no_grad():
            for p, m in self.masters.masters():
                m.copy_(state.masters.get(self.names[id(p)], p.float()))
        try:
            self.optimizer.load_state_dict(to_cpu(state.optimizer))
        except (ValueError, KeyError) as exc:
            raise ValueError(f"the training state's optimizer does not fit this LoRA: {exc}") from exc
        self.gen.set_state(state.generator.clone())
        _set_extra_rng(self.module, state.extra_rng)
        self.step, self.history = state.step, [dict(p) for p in state.history]
        self.guard.skipped, self.guard.rollbacks = state.skipped, state.rollbacks
        self.seed = state.seed

    def snapshot(self, final: bool = False, share_lora: bool = False) -> TrainingState:
        """The run's state as CPU tensors; mid-run snapshots are copies of everything.

        ``final``: the run is over, so the optimizer state and masters (which die with the run) are handed
        over instead of copied where they are already on the CPU; ``share_lora`` does the same for the
        module's parameters (only when nothing trains the module again, see ``train(hand_over=...)``)."""
        views = self.views
        masters = {self.names[id(p)]: to_cpu(views.raw_masters.get(id(m), m), not final) for p, m in self.masters.masters()}
        ema, best = views.ema, views.best if views.best is not None and views.best.values else None
        return TrainingState(
            step=self.step, seed=self.seed, settings=self.s.to_dict(),
            lora={n: to_cpu(p, not (final and share_lora)) for n, p in self.module.named_parameters()},
            optimizer=to_cpu(views.optimizer_state(), not final), generator=self.gen.get_state().clone(),
            masters=masters, extra_rng=_get_extra_rng(self.module), history=[dict(p) for p in self.history],
            skipped=self.guard.skipped, rollbacks=self.guard.rollbacks,
            ema={} if ema is None else {n: to_cpu(v) for n, v in zip(self.param_names, ema.values())},
            train_lora={} if views.raw is None else {n: to_cpu(v, False) for n, v in views.raw.items()},
            best={} if best is None else {n: v.clone() for n, v in zip(self.param_names, best.values)},
            best_step=0 if best is None else best.step)

    def checkpoint(self, hooks: Hooks, reason: str, result: RunResult) -> None:
        """Write a checkpoint (in the save view: schedule-free's averaged weights, an EMA saved as the LoRA)
        and, with ``ema_save`` "beside", the EMA LoRA beside it."""
        if hooks.save_checkpoint is not None:
            with self.views.view(self.views.save):
                result.checkpoints.append(hooks.save_checkpoint(self.snapshot(), reason))
        self.save_ema(hooks, result)

    def save_ema(self, hooks: Hooks, result: RunResult) -> None:
        """With ``ema_save`` "beside": the EMA LoRA of this step (once per step)."""
        if hooks.save_ema is None or self.views.ema is None or self.s.ema_save != "beside":
            return
        if self._ema_step == self.step:
            return
        self._ema_step = self.step
        with self.views.view("ema"):
            result.ema_files.append(hooks.save_ema(self.step))

    # ---- one optimizer step ----
    def _forward_group(self, ids: list[int], batch: int, dop_on: bool,
                       empty: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Loss of one same-shape group, already scaled by its share of the batch; backward is done here.
        ``empty``: the group's samples train on their empty caption (caption dropout)."""
        fns, s = self.fns, self.s
        x0 = torch.stack([self.data[i].latent for i in ids]).to(fns.device, torch.float32)
        noise = torch.randn(x0.shape, generator=self.gen, dtype=torch.float32).to(fns.device)
        u = sample_u(s.sampler, len(ids), self.gen)
        sigma = fns.sigma_of_u(u)
        mean_sigma = float(sigma.float().mean())
        if self.parallel is None:
            return (*self._loss_backward(ids, x0, noise, u, sigma, batch, dop_on, empty), mean_sigma)
        # The whole group's randomness was drawn above: take this rank's rows. The LoRA dropout masks are
        # drawn inside the layers, for the whole group too (the rows context), forward and backward.
        n = len(ids)
        rows = self.parallel.rows(n)
        ids, x0, noise, u, sigma = ids[rows], x0[rows], noise[rows], u[rows], sigma[rows]
        loss, dop = torch.zeros(()), torch.zeros(())
        if ids:
            with _global_rows(self.module, rows.start, rows.stop, n):
                loss, dop = self._loss_backward(ids, x0, noise, u, sigma, batch, dop_on, empty)
        if n < self.parallel.world and _dropout_rng(self.module) is not None:
            # a rank without rows drew no masks: it continues from the generators of one that did
            _set_extra_rng(self.module, self.parallel.from_last(_get_extra_rng(self.module)))
        return loss, dop, mean_sigma

    def _loss_backward(self, ids: list[int], x0: torch.Tensor, noise: torch.Tensor, u: torch.Tensor,
                       sigma: torch.Tensor, batch: int, dop_on: bool,
                       empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
        fns, s = self.fns, self.s
        share = len(ids) / batch
        conds = [self.data[i].empty_cond if empty else self.data[i].cond for i in ids]
        cells = cell_weights([self.data[i].mask for i in ids], s.unmasked_weight, x0)
        loss, x_t = denoising_loss(fns, fns.predict, x0, noise, u, sigma, fns.collate(conds), s.loss_weighting, cells)
        loss = loss * share
        dop = torch.zeros((), device=loss.device)
        if dop_on:
            ccond = fns.collate([self.data[i].class_cond for i in ids])
            with torch.no_grad():
                prior = fns.predict_base(x_t, sigma, ccond)  # type: ignore[misc]
            dop = s.dop_multiplier * (fns.predict(x_t, sigma, ccond).float() - prior.float()).pow(2).mean() * share
        total = (loss + dop) / s.grad_accum
        if total.requires_grad:  # False when module_dropout dropped every adapter in this forward
            total.backward()
        return loss.detach(), dop.detach()

    def _micro_batch(self, dop_on: bool, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
        n = len(self.data)
        batch = min(self.s.batch_size, n)
        picks = torch.randperm(n, generator=self.gen)[:batch].tolist()
        # Dropped samples form their own groups (the empty caption may have another token count); the
        # decision is a pure function of the run position, so every rank and every resume agrees on it.
        p = self.s.caption_dropout
        groups: dict[tuple[Hashable, tuple[int, ...], bool], list[int]] = {}
        for i in picks:
            empty = dropped(p, self.seed, self.step, micro, i)
            groups.setdefault((self.data[i].group, tuple(self.data[i].latent.shape), empty), []).append(i)
        loss, dop, sigmas = torch.zeros(()), torch.zeros(()), []
        for (_, _, empty), ids in groups.items():
            g_loss, g_dop, g_sigma = self._forward_group(ids, batch, dop_on, empty)
            loss, dop = loss + g_loss.cpu(), dop + g_dop.cpu()
            sigmas.append(g_sigma)
        return loss, dop, sum(sigmas) / len(sigmas)

    def one_step(self) -> tuple[dict[str, Any], str]:
        """1. lr  2. accumulate  3. guard + clip + step  4. masters, EMA, snapshot  5. record.
        Returns (history point, outcome: "ok", "dropped" or the guard's "skip" / "rollback" / "stop")."""
        s = self.s
        self._step_start = (self.gen.get_state(), _get_extra_rng(self.module))
        lr = apply_lr(self.optimizer, lr_multiplier(self.step, s.schedule))
        dop_on = s.dop_multiplier > 0 and self.step % s.dop_every_n == 0
        loss, dop, sigma = torch.zeros(()), torch.zeros(()), 0.0
        for micro in range(s.grad_accum):
            m_loss, m_dop, m_sigma = self._micro_batch(dop_on, micro)
            loss, dop, sigma = loss + m_loss / s.grad_accum, dop + m_dop / s.grad_accum, sigma + m_sigma / s.grad_accum
        self.masters.pull_grads()
        if self.parallel is not None:  # every rank now holds the global batch's gradient and loss
            loss, dop = self.parallel.reduce(self.params, [loss, dop])
        if self.learning is not None:
            self.learning.observe()
        rollbacks = self.guard.rollbacks
        outcome = self._update(loss, dop)
        self.optimizer.zero_grad(set_to_none=True)
        # Only an update or a restore moves the masters: re-rounding unchanged ones (a skipped or dropped step)
        # would still move low-precision weights
        if outcome == "ok" or self.guard.rollbacks != rollbacks:
            self.masters.push()
        self.step += 1
        if self.views.ema is not None and outcome in ("ok", "dropped"):  # a bad step leaves the EMA as it was
            self.views.ema.update(self.step)
        if outcome == "ok":
            self.guard.good()
            self.guard.maybe_snapshot(self.step, self.guarded(), self.optimizer)
        # A step whose adapters were all dropped still measured its loss (under module dropout, like any step)
        measured = outcome in ("ok", "dropped")
        point = {"step": self.step, "loss": float(loss) if measured else None, "lr": lr, "sigma": sigma,
                 "dop": float(dop) if dop_on and measured else None, "skipped": outcome != "ok",
                 "dropped": outcome == "dropped"}
        self.history.append(point)
        return point, outcome

    def _update(self, loss: torch.Tensor, dop: torch.Tensor) -> str:
        """Clip and step when the loss and every gradient are finite. The optimizer never sees a non-finite
        gradient: such a step is the guard's (skipped, so nothing moves). "dropped": module_dropout dropped
        every adapter (no gradient: nothing to update, the state is kept as it is)."""
        if all(p.grad is None for p in self.params):
            return "dropped"
        norm = _total_norm([p.grad for p in self.params if p.grad is not None])
        if not (all_finite([loss, dop]) and bool(torch.isfinite(norm))):  # one sync for every gradient
            return self.guard.bad(self.step, "non-finite loss or gradient", self.guarded(), self.optimizer)
        if self.s.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.s.max_grad_norm, norm)
        self.optimizer.step()
        if bool(torch.isfinite(_total_norm(self.params))):
            return "ok"
        # finite gradients, non-finite parameters (an overflow inside the optimizer): the update is applied
        return self.guard.bad(self.step, "parameters non-finite after the update", self.guarded(), self.optimizer,
                              applied=True)


@torch.no_grad()
def _total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """2-norm over all tensors (non-finite if any element is); a 0-d zero for an empty list. One
    ``_foreach_norm`` when all share a device and dtype (the usual LoRA set), else torch's grouping helper."""
    if not tensors:
        return torch.zeros(())
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype for t in tensors):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))
    return torch.nn.utils.get_total_norm(tensors)


def _validation_split(data: Sequence[Sample], validation: Sequence[Sample] | None, settings: TrainSettings,
                      seed: int) -> tuple[list[Sample], list[Sample]]:
    """(training samples, validation samples) as the settings ask; ValueError for what cannot be honoured (a
    validation set or held-out fraction nobody measures, both at once, a measurement without samples)."""
    given = list(validation or ())
    every, fraction = settings.validate_every_n_steps, settings.validation_fraction
    if given and fraction > 0:
        raise ValueError(f"a validation set is connected and validation_fraction={fraction:g} holds out training "
                         "samples too; use one: disconnect the validation set or set validation_fraction to 0")
    if (given or fraction > 0) and every == 0:
        what = "a validation set is connected" if given else f"validation_fraction={fraction:g} holds out samples"
        raise ValueError(f"{what} but validate_every_n_steps is 0, so no validation loss would be measured; set "
                         "validate_every_n_steps (e.g. 25) or remove the validation data")
    if every > 0 and not given and fraction == 0:
        raise ValueError(f"validate_every_n_steps={every} needs validation samples: connect validation_latents and "
                         "validation_conditioning on Train LoRA, or set validation_fraction (e.g. 0.1)")
    if given:
        return list(data), given
    return held_out(data, fraction, seed)


def _learning_check(run: _Run, result: RunResult, last: bool) -> bool:
    """Run the learning guard's check when it is due; True when it found something and its mode is "stop"."""
    guard = run.learning
    if guard is None:
        return False
    checked = recompute_check()
    early = guard.recomputation(checked.differences) if checked is not None and guard.active else None
    if early is not None:  # at once, not at the window's end
        result.learning, result.learning_findings = learning_summary([early], guard.observed), 1
        log.warning("training step %d: %s", run.step, result.learning)
        if guard.mode == "stop":
            return True
    if not guard.due(last):
        if last and guard.findings is None and not result.learning:
            result.learning = learning_summary(None, guard.observed)
        return False
    findings = guard.check()
    result.learning = learning_summary(findings, guard.observed, guard.unused)
    result.learning_findings = len(findings)
    if findings:
        log.warning("training step %d: %s", run.step, result.learning)
    return bool(findings) and guard.mode == "stop"


def _abort_step(run: _Run) -> None:
    """Discard a step interrupted mid-way: drop gradients, rewind the generators to the step's start."""
    run.optimizer.zero_grad(set_to_none=True)
    run.module.zero_grad(set_to_none=True)
    gen_state, extra = run._step_start
    run.gen.set_state(gen_state)
    _set_extra_rng(run.module, extra)


def denoising_loss(fns: ModelFns, predict: Callable[..., torch.Tensor], x0: torch.Tensor, noise: torch.Tensor,
                   u: torch.Tensor, sigma: torch.Tensor, cond: Any, weighting: str,
                   cells: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weighted denoising loss of ``predict`` on ``x0`` noised with ``noise`` at ``sigma`` (drawn at ``u``),
    the noised latent). The loss of every training step, and of the memory planner's tracked step
    (``training.memory_step.make_step``). ``cells``: masked samples' cell weights (``training.masks``)."""
    x_t = fns.noise_latent(sigma, noise, x0)
    target = fns.target(sigma, noise, x0)
    return weighted_mse(predict(x_t, sigma, cond), target, loss_weight(weighting, u).float(), cells), x_t


def optimizer_parts(module: nn.Module, settings: TrainSettings,
                    gen: torch.Generator) -> tuple[MasterWeights, torch.optim.Optimizer]:
    """(fp32 masters, optimizer) over ``module``'s parameter groups (LoRA+ groups for a LoRA set), as a run
    builds them and as the memory planner's tracked step does (``nodes/train/memory_estimate.py``)."""
    groups = _param_groups(module, settings)
    return MasterWeights(groups, gen), build_optimizer(groups, settings.optimizer, settings.hyperparams)


def _param_groups(module: nn.Module, settings: TrainSettings) -> list[dict]:
    """LoRA+ groups from ``module.param_groups`` (a LoRASet), else one group of every parameter."""
    if hasattr(module, "param_groups"):
        return module.param_groups(settings.learning_rate, settings.loraplus_ratio)
    return [{"params": [p for p in module.parameters() if p.requires_grad], "lr": settings.learning_rate}]


def train(module: nn.Module, data: Sequence[Sample], fns: ModelFns, settings: TrainSettings, steps: int,
          seed: int = 0, state: TrainingState | None = None, hooks: Hooks | None = None,
          hand_over: bool = False, parallel: DataParallel | None = None,
          validation: Sequence[Sample] | None = None) -> RunResult:
    """Run ``steps`` optimizer steps on ``module``'s parameters (trained in place), continuing ``state``.

    Autograd must be enabled by the caller (see ``training.grad.autograd_enabled``). Raises ValueError on
    bad input before anything is modified. Returns the final snapshot and how the run ended.
    ``hand_over``: the caller never trains ``module`` again (the node trains a fresh copy each time), so
    the final state may share the module's CPU parameters instead of holding a second copy of them.
    ``parallel``: this process's share of a data-parallel run (``training.distributed``); default: the
    run registered with ``training.distributed.activate``, if any.
    ``validation``: samples the held-out loss is measured on every ``validate_every_n_steps`` steps (or none:
    ``validation_fraction`` of ``data`` held out by the run's seed; ``training.validation``).
    """
    data, validation = _validation_split(data, validation, settings, state.seed if state is not None else seed)
    _check_inputs(data, steps, settings, fns)
    hooks = hooks or Hooks()
    parallel = parallel if parallel is not None else active()
    if parallel is not None:
        hooks = parallel.wrap(hooks)
    was_training = module.training
    run = _Run(module, data, fns, settings, seed, state, parallel, validation)
    result = RunResult()
    start = (run.step, run.guard.skipped, run.guard.rollbacks, len(run.history), run.guard.discarded)
    module.train(True)
    try:
        for local in range(steps):
            try:
                point, outcome = run.one_step()
            except BaseException as exc:
                if hooks.is_interrupt is None or not hooks.is_interrupt(exc):
                    raise
                _abort_step(run)
                run.checkpoint(hooks, "interrupt", result)
                result.stopped, result.reason = True, "interrupt"
                log.info("training interrupted during step %d", run.step + 1)
                break
            if run.validation and run.step % settings.validate_every_n_steps == 0:
                began = time.perf_counter()
                point["val_loss"] = run.validate()  # in the history too: a resumed run's curve continues it
                result.validation_passes += 1
                result.validation_seconds += time.perf_counter() - began
                if run.views.best is not None:
                    run.views.best.offer(run.params, run.step, point["val_loss"])
            report = StepReport(run.step, local + 1, steps, point["loss"], point["lr"], point["sigma"], point["dop"],
                                point.get("val_loss"))
            with run.views.view(run.views.preview if hooks.views_on_step else None):  # previews: averaged / EMA weights
                action = hooks.on_step(report) if hooks.on_step else None
            if action is not None and action not in ACTIONS:
                raise ValueError(f"on_step returned {action!r}; expected one of {ACTIONS}")
            periodic = settings.checkpoint_every > 0 and run.step % settings.checkpoint_every == 0
            stop_reason = "nan" if outcome == "stop" else action if action in ("stop", "interrupt") else None
            if _learning_check(run, result, local + 1 == steps) and stop_reason is None:
                stop_reason = "learning"
            if periodic or action == "checkpoint" or stop_reason:
                run.checkpoint(hooks, stop_reason or action or "periodic", result)
            if stop_reason:
                result.stopped, result.reason = True, stop_reason
                log.info("training stopped at step %d (%s)", run.step, stop_reason)
                break
    finally:
        module.train(was_training)
    trained = [p for p in module.parameters() if p.requires_grad]
    dropped = sum(1 for p in run.history[start[3]:] if p.get("dropped"))
    result.outcome = judge(trained, run.step - start[0], run.guard.skipped - start[1], run.guard.rollbacks - start[2],
                           dropped, float(getattr(getattr(module, "config", None), "module_dropout", 0.0)),
                           run.guard.discarded - start[4],
                           learning=result.learning if result.reason == "learning" else None)
    if result.outcome.skipped or result.outcome.dropped:
        log.warning("training %s", result.outcome.summary())
    run.save_ema(hooks, result)
    if run.views.save is not None:
        run.views.enter(run.views.save)  # the trained LoRA is the save view's; the state continues the raw one
    elif run.views.best is not None and run.views.best.values:
        run.views.enter("best")  # keep_best_validation: the LoRA at the lowest validation loss; the state continues
        result.kept_best = (run.views.best.step, run.views.best.loss)
    result.state = run.snapshot(final=True, share_lora=hand_over)
    return result
