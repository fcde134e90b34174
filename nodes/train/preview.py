"""Sample images during a training run ("previews"), with ComfyUI's own sampler and VAE.

``PrecisionTrainLoRA`` builds a ``Previewer`` when its ``preview`` input is connected and calls it from the
loop's ``on_step`` hook (the loop itself stays free of ComfyUI). A preview samples the model patcher that
trains (LoRA and attention override active) with ``comfy.sample.sample``, decodes with the VAE, saves PNGs
as ``output/precision_lora/previews/<run name>/<run name>_step<N>_<i>.png`` and shows them on the node
through ComfyUI's progress preview (the channel KSampler's live previews use, shown by the 0.3.75 and 0.33
frontends alike).

A preview never changes the training: it runs without gradients, with the LoRA's dropouts off, and puts
back torch's global RNG (``prepare_noise`` reseeds it), the CUDA RNGs, the LoRA's dropout generators, the
LoRA's train mode and ComfyUI's ``in_training`` flag. The loop's own generator is never touched.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
from typing import Any, Callable, Iterator

import numpy as np
import torch
from PIL import Image

import comfy.model_management as mm

from ..dataset.resolution import latent_multiple
from ..host.comfy_io import io, ui

log = logging.getLogger(__name__)

NODE = "PrecisionPreviewSettings"
TRAIN_NODE = "PrecisionTrainLoRA"
PREVIEW_SUBDIR = ("precision_lora", "previews")
LIVE_MAX_SIZE = 1024  # longest side of the image sent to the node while the run goes on


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: fields hold tensors and a VAE
class PreviewSettings:
    """One preview prompt and how to sample it. ``positive``/``negative``: ComfyUI CONDITIONING; ``vae``:
    a ``comfy.sd.VAE``. ``every_n_steps`` 0: only at the start / end. Validated when built."""

    positive: Any
    vae: Any
    negative: Any = None
    sampler_name: str = "euler"
    scheduler: str = "simple"
    steps: int = 20
    cfg: float = 1.0
    width: int = 512
    height: int = 512
    batch_size: int = 1
    seed: int = 0
    every_n_steps: int = 100
    at_start: bool = False
    at_end: bool = True

    def __post_init__(self) -> None:
        problem = settings_problem(self.__dict__)
        if problem is not None:
            raise ValueError(f"{NODE}: {problem}")

    def due(self, step: int, last: int) -> bool:
        """A preview after optimizer step ``step`` (of the whole run); ``last``: this node's final step."""
        return (self.every_n_steps > 0 and step % self.every_n_steps == 0) or (self.at_end and step == last)


def settings_problem(values: dict) -> str | None:
    """Rules across inputs, without tensors: ``"input 'x'=<value> <problem>; <fix>"`` or None."""
    import comfy.samplers

    sampler, scheduler = values.get("sampler_name"), values.get("scheduler")
    if sampler is not None and sampler not in comfy.samplers.KSampler.SAMPLERS:
        return f"input 'sampler_name'={sampler!r} is not a ComfyUI sampler; choose one of the list (e.g. 'euler')"
    if scheduler is not None and scheduler not in comfy.samplers.KSampler.SCHEDULERS:
        return f"input 'scheduler'={scheduler!r} is not a ComfyUI scheduler; choose one of the list (e.g. 'simple')"
    for key in ("width", "height"):
        size = values.get(key)
        if size is not None and (size < 16 or size % 16):
            return f"input '{key}'={size} is not a multiple of 16 px (>= 16); use e.g. {max(16, round(size / 16) * 16)}"
    if values.get("every_n_steps") == 0 and values.get("at_start") is False and values.get("at_end") is False:
        return ("input 'every_n_steps'=0 with at_start and at_end off never makes a preview; "
                "set every_n_steps > 0 or turn on at_end")
    return None


def _multiple(model: Any, vae: Any) -> tuple[int, int]:
    """(pixels per latent cell, pixels a preview size must be a multiple of) for ``model`` and ``vae``."""
    fmt = model.model.latent_format
    down = getattr(vae, "downscale_ratio", None)
    if isinstance(down, (tuple, list)) and down and isinstance(down[-1], int):
        down = down[-1]  # video VAEs: (frames function, height ratio, width ratio)
    if not isinstance(down, int):
        down = getattr(fmt, "spacial_downscale_ratio", 16 if fmt.latent_channels == 128 else 8)
    return down, down * latent_multiple(model)


def check_fits(model: Any, previews: list[PreviewSettings]) -> None:
    """ValueError naming the input, value and fix when a preview set cannot sample ``model``."""
    fmt = model.model.latent_format
    for i, p in enumerate(previews):
        where = "input 'preview'" + (f" (set {i})" if len(previews) > 1 else "")
        channels = getattr(p.vae, "latent_channels", None)
        if channels is not None and channels != fmt.latent_channels:
            raise ValueError(f"{TRAIN_NODE}: {where}: the VAE makes {channels}-channel latents, "
                             f"this model uses {fmt.latent_channels}; connect the VAE of the model's family to "
                             f"{NODE}'s 'vae'")
        _, multiple = _multiple(model, p.vae)
        for key in ("width", "height"):
            size = getattr(p, key)
            if size % multiple:
                raise ValueError(f"{TRAIN_NODE}: {where}: {NODE} input '{key}'={size} is not a "
                                 f"multiple of {multiple} px (this model's latent cell x patch); use "
                                 f"{max(multiple, round(size / multiple) * multiple)}")


def zeroed(conditioning: list) -> list:
    """``conditioning`` with its tensors zeroed (as ComfyUI's ConditioningZeroOut): the negative when none is
    connected (used only when cfg > 1)."""
    out = []
    for tensor, extra in conditioning:
        extra = dict(extra)
        if isinstance(extra.get("pooled_output"), torch.Tensor):
            extra["pooled_output"] = torch.zeros_like(extra["pooled_output"])
        out.append([torch.zeros_like(tensor), extra])
    return out


@contextlib.contextmanager
def untouched_training(lora_set: Any) -> Iterator[None]:
    """No gradients, LoRA dropouts off, ``in_training`` off (the fused inference kernels); on exit the global
    and CUDA RNG states, the dropout generators, the train mode and ``in_training`` are as they were."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    dropout_rng = lora_set.rng.get_state()
    was_training, flag = lora_set.training, getattr(mm, "in_training", None)
    try:
        lora_set.train(False)
        if flag is not None:
            mm.in_training = False
        with torch.no_grad():
            yield
    finally:
        if flag is not None:
            mm.in_training = flag
        lora_set.train(was_training)
        lora_set.rng.set_state(dropout_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        torch.set_rng_state(cpu_rng)


def _empty_latent(model: Any, p: PreviewSettings) -> torch.Tensor:
    fmt = model.model.latent_format
    down, _ = _multiple(model, p.vae)
    shape = (p.batch_size, fmt.latent_channels, p.height // down, p.width // down)
    if getattr(fmt, "latent_dimensions", 2) == 3:
        shape = (shape[0], shape[1], 1, *shape[2:])
    return torch.zeros(shape)


def _interrupt_check(*_: Any) -> None:
    mm.throw_exception_if_processing_interrupted()


def sample_images(model: Any, p: PreviewSettings) -> torch.Tensor:
    """IMAGE (b, H, W, 3) fp32 in [0, 1]: ``p.positive`` sampled on ``model`` as it is now, decoded by
    ``p.vae``. Call inside ``untouched_training``."""
    import comfy.sample

    latent = _empty_latent(model, p)
    noise = comfy.sample.prepare_noise(latent, p.seed)
    negative = p.negative if p.negative is not None else zeroed(p.positive)
    samples = comfy.sample.sample(model, noise, p.steps, p.cfg, p.sampler_name, p.scheduler, p.positive, negative,
                                  latent, callback=_interrupt_check, disable_pbar=True, seed=p.seed)
    images = p.vae.decode(samples)
    images = images.reshape(-1, *images.shape[-3:])  # video VAEs: frames become images
    return images.float().clamp(0.0, 1.0).cpu()


def to_pil(image: torch.Tensor) -> Image.Image:
    return Image.fromarray(np.clip(255.0 * image.numpy(), 0, 255).astype(np.uint8))


def grid(images: list[torch.Tensor]) -> Image.Image:
    """All images side by side (heights may differ; the row is as high as the highest)."""
    pils = [to_pil(im) for im in images]
    sheet = Image.new("RGB", (sum(p.width for p in pils), max(p.height for p in pils)))
    x = 0
    for pil in pils:
        sheet.paste(pil, (x, 0))
        x += pil.width
    return sheet


def preview_folder(name: str) -> str:
    import folder_paths

    return os.path.join(folder_paths.get_output_directory(), *PREVIEW_SUBDIR, name)


def save_png(image: torch.Tensor, folder: str, stem: str) -> str:
    """Write ``folder/stem.png`` (or ``stem_1.png``... when taken: nothing of an earlier run is overwritten)
    through a temporary file and ``os.replace``; returns the file name."""
    os.makedirs(folder, exist_ok=True)
    fname, n = f"{stem}.png", 1
    while os.path.exists(os.path.join(folder, fname)):
        fname, n = f"{stem}_{n}.png", n + 1
    fd, tmp = tempfile.mkstemp(prefix=".preview_", suffix=".png.tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            to_pil(image).save(f, format="PNG", compress_level=4)
        os.replace(tmp, os.path.join(folder, fname))
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return fname


class Previewer:
    """The previews of one ``PrecisionTrainLoRA`` call: takes them when due, keeps what it saved."""

    def __init__(self, model: Any, lora_set: Any, previews: list[PreviewSettings], name: str, node_id: str | None,
                 start: int, steps: int) -> None:
        import comfy.utils

        self.model, self.lora_set, self.previews, self.name = model, lora_set, previews, name
        self.start, self.last, self.steps = start, start + steps, steps
        self.pbar = comfy.utils.ProgressBar(steps, node_id=node_id)
        self.saved: list[tuple[int, str]] = []  # (step, file name) in order
        self.latest: list[torch.Tensor] = []    # images of the latest preview
        self.error: BaseException | None = None
        self.failed_step: int | None = None

    def due(self, step: int) -> list[PreviewSettings]:
        return [p for p in self.previews if p.due(step, self.last)]

    def at_start(self) -> None:
        """Before the first step of a new run (step 0), for the sets with ``at_start``."""
        if self.start == 0:
            self.take(0, [p for p in self.previews if p.at_start])

    def take(self, step: int, due: list[PreviewSettings]) -> None:
        if not due:
            return
        images: list[torch.Tensor] = []
        with untouched_training(self.lora_set):
            for p in due:
                images.extend(sample_images(self.model, p))
        # decoding may have pushed the training model out of memory: make sure it is fully loaded again
        mm.load_models_gpu([self.model], force_full_load=True)
        folder = preview_folder(self.name)
        for i, image in enumerate(images):
            self.saved.append((step, save_png(image, folder, f"{self.name}_step{step:06d}_{i}")))
        self.latest = images
        sheet = grid(images)
        # ComfyUI fits the preview into max_size both ways (a 64 px sheet would be sent as 1024 px): never upscale.
        self.pbar.update_absolute(step - self.start, self.steps, preview=("PNG", sheet, min(LIVE_MAX_SIZE, max(sheet.size))))
        log.info("preview at step %d: %d image(s) in %s", step, len(images), folder)

    def wrap(self, on_step: Callable[[Any], str | None]) -> PreviewStepHook:
        return PreviewStepHook(self, on_step)

    def start_preview(self) -> None:
        """The step-0 preview (``at_start``), inside the training session before the first step; nothing is
        trained yet, so a failure is raised as it is."""
        try:
            self.at_start()
        except mm.InterruptProcessingException:
            raise
        except Exception as exc:
            raise ValueError(f"{TRAIN_NODE}: input 'preview' failed at step 0 "
                             f"({type(exc).__name__}: {exc}); fix the {NODE} inputs (size, VAE, conditioning) "
                             "or disconnect 'preview'") from exc

    def raise_if_failed(self, checkpoint: str | None) -> None:
        if self.error is None:
            return
        kept = f"training stopped there, saved as {checkpoint!r}" if checkpoint else "training stopped there"
        raise ValueError(f"{TRAIN_NODE}: input 'preview' failed at step {self.failed_step} "
                         f"({type(self.error).__name__}: {self.error}); {kept}. Fix the {NODE} inputs (size, VAE, "
                         "conditioning) or disconnect 'preview', then resume from the checkpoint") from self.error

    def image_output(self) -> torch.Tensor:
        """The latest preview's images as one IMAGE batch (those of the first image's size); a 64 x 64 black
        image when none was taken, so a connected image node still runs."""
        if not self.latest:
            return torch.zeros((1, 64, 64, 3))
        first = self.latest[0].shape
        return torch.stack([im for im in self.latest if im.shape == first])

    def ui(self) -> Any:
        if not self.saved:
            return None
        sub = "/".join((*PREVIEW_SUBDIR, self.name))
        return ui.SavedImages([ui.SavedResult(f, sub, io.FolderType.output) for _, f in self.saved])

    def summary(self) -> str:
        return ", ".join(f"step {s}: {f}" for s, f in self.saved)


class PreviewStepHook:
    """The loop's ``on_step``: the node's own hook, then the previews due after the step. A cancel during
    sampling ends the run as an interrupt (checkpoint first); any other failure stops the run (checkpoint
    first) and is kept in ``previewer.error`` for the node to raise afterwards. ``at_start`` takes the
    step-0 preview (the node calls it inside the training session, before the loop)."""

    def __init__(self, previewer: Previewer, on_step: Callable[[Any], str | None]) -> None:
        self.previewer, self.on_step = previewer, on_step

    def at_start(self) -> None:
        self.previewer.start_preview()

    def __call__(self, report: Any) -> str | None:
        action = self.on_step(report)
        if action not in (None, "checkpoint"):
            return action
        pv = self.previewer
        try:
            pv.take(report.step, pv.due(report.step))
        except mm.InterruptProcessingException:
            return "interrupt"
        except Exception as exc:  # noqa: BLE001 - raised by the node once the checkpoint is written
            pv.error, pv.failed_step = exc, report.step
            log.error("preview at step %d failed: %s", report.step, exc)
            return "stop"
        return action


def make_previewer(model: Any, lora_set: Any, preview: list | None, name: str, node_id: str | None, start: int,
                   steps: int) -> Previewer | None:
    """The previews of one Train LoRA call, checked against ``model`` (ValueError naming the fix), or None
    when ``preview`` is not connected or this is not the first rank of a data-parallel run."""
    from ...training.distributed import active

    sets = [p for p in (preview or []) if p is not None]
    parallel = active()
    if not sets or (parallel is not None and not parallel.is_main):
        return None
    check_fits(model, sets)
    return Previewer(model, lora_set, sets, name, node_id, start, steps)


def node_outputs(previewer: Previewer | None) -> tuple[torch.Tensor, Any]:
    """(IMAGE output, UI output) of Train LoRA: the latest preview and every saved file of the run."""
    if previewer is None:
        return torch.zeros((1, 64, 64, 3)), None
    return previewer.image_output(), previewer.ui()
