"""ComfyUI LATENT / CONDITIONING inputs -> ``training.loop.Sample`` list (validated, cloned once).

Accepted shapes (``latents`` and ``conditionings`` are lists, as ComfyUI passes them to an
``is_input_list`` node):
- latents: one LATENT batch (B samples), or a list of LATENTs from ComfyUI's dataset nodes;
- conditioning: rows = the batch rows of every CONDITIONING in order. Either one row (shared by every
  sample), one row per sample, or one CONDITIONING per LATENT (shared by that LATENT's samples).
Latents are converted with ``process_latent_in`` and cloned out of inference mode once, in fp32.
"""
from __future__ import annotations

from typing import Any

import torch

from ..training.grad import clone_if_inference
from ..training.loop import Sample
from .data_checks import conditioning_problem, latent_problem
from .resolution import size_problem

NODE = "PrecisionTrainLoRA"


def _err(input_name: str, message: str) -> ValueError:
    return ValueError(f"[Precision LoRA] {NODE}: input '{input_name}': {message}")


def _latent_rows(model: Any, latents: list[Any]) -> tuple[list[torch.Tensor], list[int]]:
    """Per-sample latents (C, ...) in model space, and for each the index of the LATENT it came from."""
    rows, owner = [], []
    for i, latent in enumerate(latents):
        samples = latent.get("samples") if isinstance(latent, dict) else None
        if not isinstance(samples, torch.Tensor):
            raise _err("latents", f"item {i} is not a LATENT dict with a 'samples' tensor")
        problem = latent_problem(model, samples) or size_problem(model, samples)
        if problem is not None:
            raise _err("latents", f"latent {i} {problem}")
        x = model.model.process_latent_in(clone_if_inference(samples).float()).float().clone()
        for row in x:
            rows.append(row)
            owner.append(i)
    if not rows:
        raise _err("latents", "the dataset is empty: connect at least one latent with batch size >= 1")
    return rows, owner


def _cond_rows(model: Any, conditionings: list[Any], input_name: str) -> list[list]:
    """Each CONDITIONING split into single-row conditionings [[ctx (1, L, D), extras]]."""
    rows: list[list] = []
    for i, cond in enumerate(conditionings):
        problem = conditioning_problem(model, cond)
        if problem is not None:
            raise _err(input_name, f"item {i} {problem}")
        ctx, extra = cond[0][0], cond[0][1]
        n = int(ctx.shape[0])
        for r in range(n):
            row_extra = {k: (v[r:r + 1] if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == n else v)
                         for k, v in extra.items()}
            rows.append([ctx[r:r + 1], row_extra])
    return rows


def _assign(conds: list[list], owner: list[int], n_latents: int, input_name: str) -> list[list]:
    n = len(owner)
    if len(conds) == n:
        return conds
    if len(conds) == 1:
        return conds * n
    if len(conds) == n_latents:
        return [conds[o] for o in owner]
    raise _err(input_name, f"{len(conds)} conditioning rows for {n} latent samples ({n_latents} LATENT inputs): "
               "connect one conditioning for all, one per sample, or one per LATENT")


def _encode(model: Any, cond: list, x0: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """One conditioning row -> the model's processed conds {name: COND} for a batch of one."""
    import comfy.sampler_helpers
    import comfy.samplers

    converted = comfy.sampler_helpers.convert_cond([cond])
    noise = torch.zeros((1, *x0.shape), dtype=torch.float32)
    encoded = comfy.samplers.encode_model_conds(model.model.extra_conds, converted, noise, device, "positive",
                                                latent_image=noise, seed=0)
    out = {}
    for name, c in encoded[0]["model_conds"].items():
        processed = c.process_cond(batch_size=1, area=None)
        if isinstance(processed.cond, torch.Tensor):
            processed = processed._copy_with(clone_if_inference(processed.cond).to(device))
        out[name] = processed
    return out


def _group_key(conds: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(c.cond.shape) if isinstance(c.cond, torch.Tensor) else repr(c.cond))
                        for k, c in conds.items()))


def build_samples(model: Any, latents: list[Any], conditionings: list[Any], class_conditionings: list[Any] | None,
                  device: torch.device) -> list[Sample]:
    """Validated training samples; tensors are normal (non-inference) copies whatever mode the caller is in."""
    with torch.inference_mode(False):
        return _build(model, latents, conditionings, class_conditionings, device)


def _build(model: Any, latents: list[Any], conditionings: list[Any], class_conditionings: list[Any] | None,
           device: torch.device) -> list[Sample]:
    if not latents:
        raise _err("latents", "the dataset is empty: connect at least one latent")
    if not conditionings:
        raise _err("conditioning", "no conditioning connected")
    rows, owner = _latent_rows(model, latents)
    conds = _assign(_cond_rows(model, conditionings, "conditioning"), owner, len(latents), "conditioning")
    classes: list[list | None] = [None] * len(rows)
    if class_conditionings:
        classes = _assign(_cond_rows(model, class_conditionings, "class_conditioning"), owner, len(latents),
                          "class_conditioning")
    samples = []
    for x0, cond, ccond in zip(rows, conds, classes):
        enc = _encode(model, cond, x0, device)
        cenc = _encode(model, ccond, x0, device) if ccond is not None else None
        group = (_group_key(enc), _group_key(cenc) if cenc is not None else None)
        samples.append(Sample(latent=x0, cond=enc, group=group, class_cond=cenc))
    return samples
