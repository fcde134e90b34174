"""ComfyUI LATENT / CONDITIONING inputs -> ``training.loop.Sample`` list (validated, cloned once).

Accepted shapes (``latents`` and ``conditionings`` are lists, as ComfyUI passes them to an
``is_input_list`` node):
- latents: one LATENT batch (B samples), or a list of LATENTs from ComfyUI's dataset nodes;
- conditioning: rows = the batch rows of every entry of every CONDITIONING in order. One CONDITIONING per
  LATENT pairs item by item (one row shared by that LATENT's samples, or one row per sample, as
  ResolutionBucket makes them); else one row for every sample, or one row per sample in order. Anything
  else cannot be matched to the images and is refused with both counts (a ConditioningCombine of two
  captions for three images used to train every image on the first caption).
Latents are converted with ``process_latent_in`` and cloned out of inference mode once, in fp32.
An audio-video LATENT (LTX-2: LTXVConcatAVLatent's NestedTensor of a video and an audio latent) is packed flat,
(1, N) per sample, as ComfyUI's sampler packs it, and its part shapes reach the model's conds as
``latent_shapes``: one sigma, one noise draw per element and one flow target for the pack, as the sampler has it.
While it packs and encodes such a sample the model's ``latent_shapes`` is set as the sampler sets it (MiniMax H3
reads it: its audio stream is carried scaled onto the video schedule, ``audio_scale``, in ``process_latent_in`` and
in its ``minimax_payload`` cond).
MiniMax H3's text projection and token refiner run in ``extra_conds`` (once per sampling); its samples keep the
text encoder's states as ``c_crossattn`` instead, so the forward runs them (ComfyUI's forward does when the
context is narrower than the model) and LoRA adapters there learn. Its forward takes one sample: each of its
samples trains in a forward of its own (a batch is the mean of those, as the loop weighs any bucket).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ...training.grad import clone_if_inference
from ...training.loop import Sample
from ...training.masks import OUTSIDE_KEY, coverage, to_grid
from ..model.data_checks import conditioning_problem, is_minimax_h3, is_packed, latent_problem
from ..dataset.resolution import size_problem

NODE = "PrecisionTrainLoRA"


def _err(input_name: str, message: str) -> ValueError:
    return ValueError(f"{NODE}: input '{input_name}': {message}")


def _latent_rows(model: Any, latents: list[Any]) -> tuple[list[torch.Tensor], list[int], list[Any]]:
    """Per-sample latents (C, ...) in model space, for each the index of the LATENT it came from, and the
    shapes of the parts a packed audio-video latent was packed from (None for a plain latent)."""
    rows, owner, layouts = [], [], []
    for i, latent in enumerate(latents):
        samples = latent.get("samples") if isinstance(latent, dict) else None
        if not isinstance(samples, torch.Tensor) and not is_packed(samples):
            raise _err("latents", f"item {i} is not a LATENT dict with a 'samples' tensor")
        problem = latent_problem(model, samples) or size_problem(model, _video_part(samples))
        if problem is not None:
            raise _err("latents", f"latent {i} {problem}")
        layout = None
        if is_packed(samples):  # as ComfyUI's sampler: flat (B, 1, N) pack, the part shapes as a cond
            import comfy.utils

            packed, shapes = comfy.utils.pack_latents([clone_if_inference(t).float() for t in samples.unbind()])
            with sampler_shapes(model, shapes):
                x = model.model.process_latent_in(packed).float().clone()
            layout = [(1, *tuple(shape)[1:]) for shape in shapes]
        else:
            x = model.model.process_latent_in(clone_if_inference(samples).float()).float().clone()
        for row in x:
            rows.append(row)
            owner.append(i)
            layouts.append(layout)
    if not rows:
        raise _err("latents", "the dataset is empty: connect at least one latent with batch size >= 1")
    return rows, owner, layouts


@contextlib.contextmanager
def sampler_shapes(model: Any, shapes: list | None) -> Iterator[None]:
    """The model's ``latent_shapes`` as ComfyUI's sampler sets it for a packed latent (restored after); nothing for
    a plain latent or a ComfyUI whose models have no such attribute (0.3.75)."""
    base = model.model
    if shapes is None or not hasattr(base, "latent_shapes"):
        yield
        return
    old, base.latent_shapes = base.latent_shapes, [tuple(s) for s in shapes]
    try:
        yield
    finally:
        base.latent_shapes = old


def _video_part(samples: Any) -> torch.Tensor:
    return samples.unbind()[0] if is_packed(samples) else samples


def _cond_rows(model: Any, conditionings: list[Any], input_name: str) -> list[list]:
    """Every CONDITIONING split into single-row conditionings [[ctx (1, L, D), extras]], all in order."""
    return [row for rows in _cond_items(model, conditionings, input_name) for row in rows]


def _cond_items(model: Any, conditionings: list[Any], input_name: str) -> list[list[list]]:
    """Per CONDITIONING input, its single-row conditionings: the batch rows of each of its entries in order
    (ResolutionBucket and ConditioningCombine make one entry per caption)."""
    items: list[list[list]] = []
    for i, cond in enumerate(conditionings):
        problem = conditioning_problem(model, cond)
        if problem is not None:
            raise _err(input_name, f"item {i} {problem}")
        rows: list[list] = []
        for ctx, extra in (entry[:2] for entry in cond):
            n = int(ctx.shape[0])
            for r in range(n):
                rows.append([ctx[r:r + 1], {k: _row_of(v, r, n) for k, v in extra.items()}])
        items.append(rows)
    return items


def _row_of(value: Any, r: int, n: int) -> Any:
    """Row ``r`` of a batched extra (pooled_output (B, D), attention masks (B, L)). 1-D extras are never
    batched (Anima's t5xxl_ids (tokens,) is shared by every row): slicing one whose length happens to equal
    the batch size would cut the caption to one token."""
    if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == n and n > 1:
        return value[r:r + 1]
    return value


def _counts(items: list[list[list]], conditionings: list[Any], n: int, n_latents: int) -> str:
    rows, entries = sum(len(r) for r in items), sum(len(c) for c in conditionings)
    plural = lambda k, word, many: f"{k} {word if k == 1 else many}"  # noqa: E731
    return (f"{plural(rows, 'conditioning row', 'conditioning rows')} for {plural(n, 'latent sample', 'latent samples')} "
            f"({plural(len(items), 'CONDITIONING input', 'CONDITIONING inputs')} with "
            f"{plural(entries, 'entry', 'entries')}; {plural(n_latents, 'LATENT input', 'LATENT inputs')})")


_FIX = ("connect one conditioning for all samples, one per sample in the latents' order (MakeTrainingDataset's "
        "lists, or CLIPTextEncode over a list of captions), or one per LATENT; ConditioningCombine and "
        "ConditioningConcat do not pair captions with images")


def _assign(items: list[list[list]], conditionings: list[Any], sizes: list[int], input_name: str) -> list[list]:
    """The conditioning row of every latent sample, or a refusal naming both counts. ``sizes``: samples per
    LATENT input. One CONDITIONING per LATENT pairs item by item (shared by that LATENT's samples, or one row
    per sample); otherwise one row for all, or exactly one row per sample in order."""
    n = sum(sizes)
    if len(items) == len(sizes) > 1:
        out: list[list] = []
        for i, (rows, size) in enumerate(zip(items, sizes)):
            if len(rows) not in (1, size):
                raise _err(input_name, f"item {i} has {len(rows)} conditioning rows ({len(conditionings[i])} "
                           f"entries) for the {size} samples of LATENT {i}: the captions cannot be matched to "
                           f"the images; {_FIX}")
            out.extend(rows if len(rows) == size else rows * size)
        return out
    flat = [row for rows in items for row in rows]
    if len(flat) == n:
        return flat
    if len(flat) == 1:
        return flat * n
    raise _err(input_name, f"{_counts(items, conditionings, n, len(sizes))}: the captions cannot be matched to the "
               f"images; {_FIX}")


def _encode(model: Any, cond: list, x0: torch.Tensor, device: torch.device,
            latent_shapes: list | None = None) -> dict[str, Any]:
    """One conditioning row -> the model's processed conds {name: COND} for a batch of one. ``latent_shapes``:
    the part shapes of a packed audio-video latent, given to the model's conds as ComfyUI's sampler does."""
    import comfy.sampler_helpers
    import comfy.samplers

    converted = comfy.sampler_helpers.convert_cond([cond])
    noise = torch.zeros((1, *x0.shape), dtype=torch.float32)
    extra = {"latent_shapes": latent_shapes} if latent_shapes is not None else {}
    with sampler_shapes(model, latent_shapes), torch.no_grad():
        encoded = comfy.samplers.encode_model_conds(model.model.extra_conds, converted, noise, device, "positive",
                                                    latent_image=noise, seed=0, **extra)
    out = {}
    for name, c in encoded[0]["model_conds"].items():
        processed = c.process_cond(batch_size=1, area=None)
        if name == "c_crossattn" and is_minimax_h3(model):  # the text encoder's states: the forward refines them
            processed = processed._copy_with(cond[0])
        if isinstance(processed.cond, torch.Tensor):
            processed = processed._copy_with(clone_if_inference(processed.cond).to(device))
        out[name] = processed
    return out


def sample_latent_shapes(sample: Sample) -> list | None:
    """The part shapes a packed sample's conds carry (None for a plain latent): its other conds (the empty
    caption's) must carry them too."""
    c = sample.cond.get("latent_shapes")
    return c.cond if c is not None else None


def _group_key(conds: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(c.cond.shape) if isinstance(c.cond, torch.Tensor) else repr(c.cond))
                        for k, c in conds.items()))


@dataclass
class DatasetReport:
    """What the training samples are, for the console and the run's metadata: sizes, buckets (samples that
    share one forward shape), captions and samples that share a caption with another."""

    samples: int
    latents: int
    sizes: dict[str, int]
    buckets: int
    captions: int
    shared: list[list[int]] = field(default_factory=list)  # samples (0-based) with the same caption, per caption
    per_sample: bool = True  # captions were given per sample (not one for all)
    empty: list[int] = field(default_factory=list)  # samples (0-based) whose caption is empty_conditioning's
    masked: list[int] = field(default_factory=list)  # samples (0-based) with a mask (masked loss)
    coverage: float = 0.0  # the summed share of their latents the masks cover
    outside: list[str] = field(default_factory=list)  # colours Cached Training Dataset gave the pixels outside masks

    def lines(self) -> list[str]:
        sizes = ", ".join(f"{size} x{n}" for size, n in self.sizes.items())
        out = [f"dataset: {self.samples} sample{'s' if self.samples != 1 else ''} from {self.latents} LATENT "
               f"input{'s' if self.latents != 1 else ''}; sizes {sizes}; {self.buckets} bucket"
               f"{'s' if self.buckets != 1 else ''} (samples of one latent and caption shape train together)"]
        if not self.per_sample:
            out.append(f"captions: 1 conditioning for all {self.samples} samples")
        else:
            out.append(f"captions: {self.captions} distinct for {self.samples} samples")
        if self.per_sample and 0 < len(self.empty) < self.samples:
            which = ", ".join(str(i + 1) for i in self.empty)
            out.append(f"sample{'s' if len(self.empty) > 1 else ''} {which} of {self.samples} train on the empty "
                       "caption (equal to empty_conditioning) while the others have captions: an image without its "
                       ".txt caption (PrecisionLoadImageDataset's report names the file); write the caption or check "
                       "that the .txt names match the images")
        if self.masked:
            out.append(f"masks: {len(self.masked)} of {self.samples} samples masked, covering "
                       f"{100 * self.coverage / len(self.masked):.0f} % of their latents on average (masked loss)"
                       + (f"; {self.outside_line()}" if self.outside else ""))
        for group in self.shared:
            out.append(f"samples {', '.join(str(i + 1) for i in group)} have the same caption: images without a "
                       ".txt caption all get the empty caption from MakeTrainingDataset; add captions or check "
                       "that the folder's .txt names match the images")
        return out

    def summary(self) -> str:
        return "; ".join(self.lines())

    def outside_line(self) -> str:
        return f"pixels outside the masks set to {' / '.join(self.outside)} before encoding"


def _same_caption(a: list, b: list) -> bool:
    (ca, ea), (cb, eb) = a[:2], b[:2]
    if ca.shape != cb.shape or not torch.equal(ca, cb):
        return False
    pa, pb = ea.get("pooled_output"), eb.get("pooled_output")
    if isinstance(pa, torch.Tensor) and isinstance(pb, torch.Tensor):
        return pa.shape == pb.shape and torch.equal(pa, pb)
    return True


def _caption_groups(conds: list[list]) -> list[list[int]]:
    """Sample indices per distinct conditioning row (compared by value: dataset lists hold equal copies)."""
    groups: list[list[int]] = []
    keys: dict[tuple, list[int]] = {}  # (shape, sum) -> group indices whose first sample has that key
    for i, cond in enumerate(conds):
        ctx = cond[0]
        key = (tuple(ctx.shape), float(ctx.float().sum()))
        for g in keys.setdefault(key, []):
            if _same_caption(conds[groups[g][0]], cond):
                groups[g].append(i)
                break
        else:
            keys[key].append(len(groups))
            groups.append([i])
    return groups


def _size(model: Any, latent: torch.Tensor) -> str:
    fmt = model.model.latent_format
    # 0.3.75's formats state no ratio: Flux.2 (128 channels) and Wan 2.2 (48) downscale 16x
    ratio = getattr(fmt, "spacial_downscale_ratio", None) or (16 if fmt.latent_channels in (128, 48) else 8)
    h, w = int(latent.shape[-2]), int(latent.shape[-1])
    return f"{w * ratio}x{h * ratio} px"


def _empty_samples(model: Any, conds: list[list], empty: list[Any] | None) -> list[int]:
    """Samples whose caption equals the one row of ``empty`` (the empty caption's conditioning); none without
    it (a conditioning cannot tell which text it was encoded from) or when it is not one row."""
    rows = _cond_rows(model, empty, "empty_conditioning") if empty else []
    return [i for i, cond in enumerate(conds) if _same_caption(cond, rows[0])] if len(rows) == 1 else []


def _report(model: Any, samples: list[Sample], conds: list[list], n_rows: int, n_latents: int,
            empty: list[Any] | None = None, videos: list[torch.Tensor] | None = None) -> DatasetReport:
    sizes: dict[str, int] = {}
    for v in videos if videos is not None else [s.latent for s in samples]:  # a packed sample: its video part
        key = _size(model, v)
        sizes[key] = sizes.get(key, 0) + 1
    buckets = len({(tuple(s.latent.shape), s.group) for s in samples})
    groups = _caption_groups(conds)
    per_sample = n_rows > 1
    shared = [g for g in groups if len(g) > 1] if per_sample else []
    return DatasetReport(len(samples), n_latents, sizes, buckets, len(groups), shared, per_sample,
                         _empty_samples(model, conds, empty) if per_sample else [])


def build_samples(model: Any, latents: list[Any], conditionings: list[Any], class_conditionings: list[Any] | None,
                  device: torch.device) -> list[Sample]:
    """Validated training samples; tensors are normal (non-inference) copies whatever mode the caller is in."""
    return build_dataset(model, latents, conditionings, class_conditionings, device)[0]


def build_dataset(model: Any, latents: list[Any], conditionings: list[Any], class_conditionings: list[Any] | None,
                  device: torch.device, empty: list[Any] | None = None, masks: list[Any] | None = None,
                  unmasked_weight: float = 0.0) -> tuple[list[Sample], DatasetReport]:
    """``build_samples`` and the report of what they are. ``empty``: the empty caption's CONDITIONING
    (Train LoRA's empty_conditioning), when connected: the report names the samples that train on it.
    ``masks``: Train LoRA's mask input (MASKs), else a LATENT's own ``noise_mask`` (``sample_masks``).
    ``unmasked_weight`` (Train Settings'): above 0, latents whose pixels outside the mask were set to a colour
    (``outside_colours``) are refused."""
    outside = outside_colours(latents, unmasked_weight)
    with torch.inference_mode(False):
        samples, report = _build(model, latents, conditionings, class_conditionings, device, empty, masks)
    report.outside = outside
    return samples, report


def outside_colours(latents: list[Any], unmasked_weight: float) -> list[str]:
    """The colours Cached Training Dataset's outside_mask gave the pixels outside these latents' masks (none:
    keep). With ``unmasked_weight`` above 0 they are refused: the loss would train the LoRA on that flat colour."""
    found = [(i, lat[OUTSIDE_KEY]) for i, lat in enumerate(latents) if isinstance(lat, dict) and OUTSIDE_KEY in lat]
    if found and unmasked_weight > 0:
        i, colour = found[0]
        raise _err("latents", f"LATENT {i} was encoded with the pixels outside its mask set to {colour} (Cached "
                              f"Training Dataset's outside_mask), and unmasked_weight={unmasked_weight:g} would train "
                              "the LoRA on that flat colour there; set unmasked_weight to 0 (Precision Train Settings) "
                              "or outside_mask to keep")
    return sorted({colour for _, colour in found})


def _build(model: Any, latents: list[Any], conditionings: list[Any], class_conditionings: list[Any] | None,
           device: torch.device, empty: list[Any] | None = None,
           masks: list[Any] | None = None) -> tuple[list[Sample], DatasetReport]:
    if not latents:
        raise _err("latents", "the dataset is empty: connect at least one latent")
    if not conditionings:
        raise _err("conditioning", "no conditioning connected")
    rows, owner, layouts = _latent_rows(model, latents)
    sizes = [owner.count(i) for i in range(len(latents))]
    items = _cond_items(model, conditionings, "conditioning")
    conds = _assign(items, conditionings, sizes, "conditioning")
    classes: list[list | None] = [None] * len(rows)
    if class_conditionings:
        classes = _assign(_cond_items(model, class_conditionings, "class_conditioning"), class_conditionings,
                          sizes, "class_conditioning")
    grids = sample_masks(latents, masks, rows, sizes, layouts)
    samples = []
    for x0, cond, ccond, layout, grid in zip(rows, conds, classes, layouts, grids):
        enc = _encode(model, cond, x0, device, layout)
        cenc = _encode(model, ccond, x0, device, layout) if ccond is not None else None
        group = (_group_key(enc), _group_key(cenc) if cenc is not None else None)
        if is_minimax_h3(model):  # its forward takes one sample
            group = (*group, len(samples))
        samples.append(Sample(latent=x0, cond=enc, group=group, class_cond=cenc, mask=grid))
    videos = [torch.empty(layout[0][1:], device="meta") if layout else s.latent for s, layout in zip(samples, layouts)]
    report = _report(model, samples, conds, sum(len(r) for r in items), len(latents), empty, videos)
    report.masked = [i for i, g in enumerate(grids) if g is not None]
    report.coverage = sum(coverage(g) for g in grids if g is not None)
    return samples, report


def _mask_rows(value: Any) -> list[torch.Tensor]:
    """A MASK (H, W), (B, H, W) or a LATENT's noise_mask (B, 1, H, W) as (H, W) masks."""
    t = clone_if_inference(value).float()
    return list(t.reshape(-1, t.shape[-2], t.shape[-1])) if t.ndim >= 2 else [t]


def sample_masks(latents: list[Any], masks: list[Any] | None, rows: list[torch.Tensor], sizes: list[int],
                 layouts: list[Any]) -> list[torch.Tensor | None]:
    """Every sample's mask on its latent grid (``training.masks.to_grid``), or None (no mask: the whole latent
    trains). From Train LoRA's ``mask`` (one mask for all samples or one per sample in order), or else from a
    LATENT's ``noise_mask`` (ComfyUI's Set Latent Noise Mask: one for the LATENT's samples or one each); both at
    once, counts that do not pair, and a mask of another size than its image are refused by name."""
    own = [lat.get("noise_mask") if isinstance(lat, dict) else None for lat in latents]
    n = len(rows)
    pixel: list[torch.Tensor | None] = [None] * n
    if masks:
        where = next((i for i, m in enumerate(own) if m is not None), None)
        if where is not None:
            raise _err("mask", f"is connected and LATENT {where} carries a noise_mask of its own (Set Latent Noise "
                               "Mask); use one: disconnect mask or train on the latents without the noise mask")
        given = [m for value in masks for m in _mask_rows(value)]
        if len(given) not in (1, n):
            raise _err("mask", f"{len(given)} masks for {n} latent samples: connect one mask for all samples or "
                               "one per sample, in the latents' order")
        pixel = given if len(given) == n else given * n
    else:
        at = 0
        for i, (m, size) in enumerate(zip(own, sizes)):
            if m is not None:
                got = _mask_rows(m)
                if len(got) not in (1, size):
                    raise _err("latents", f"LATENT {i} carries a noise_mask of {len(got)} masks for its {size} "
                                          "samples: give one mask for all of them or one each")
                pixel[at:at + size] = got if len(got) == size else got * size
            at += size
    grids: list[torch.Tensor | None] = []
    for j, (m, x0, layout) in enumerate(zip(pixel, rows, layouts)):
        if m is None:
            grids.append(None)
            continue
        name = "mask" if masks else "latents"
        if layout is not None:
            raise _err(name, f"sample {j + 1} is a packed audio-video latent: masked loss takes image and video "
                             "latents only; remove its mask")
        try:
            grids.append(to_grid(m, tuple(x0.shape)))
        except ValueError as exc:
            raise _err(name, f"sample {j + 1}: {exc}") from None
    return grids
