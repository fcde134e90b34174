"""ComfyUI side of the dataset cache: where it lives, who a VAE / CLIP is, the encode calls, progress.

The encode calls are exactly those of ComfyUI's MakeTrainingDataset (``comfy_extras/nodes_dataset.py``):
``vae.encode(image[:, :, :, :3])`` per image and ``clip.encode_from_tokens_scheduled(clip.tokenize(text))``
per caption, so a cached result equals the stock node's result for the same inputs.

Identity of an encoder (``vae_identity`` / ``clip_identity``): its module's weights through
``data.encode_cache.model_identity`` (weights a loaded ModelPatcher patched in place are read from the
patcher's backup, so a model loaded with a LoRA applied has the same identity as before loading), the
patcher's patches (LoRAs on the text encoder), what changes the output without touching weights (CLIP skip
``layer_idx``, tokenizer options, compute device and dtype) and the ComfyUI and torch versions.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterator

import torch

from ...data.encode_cache import model_identity
from ..host.comfy_compat import comfyui_version

log = logging.getLogger(__name__)
ENV_FOLDER = "PRECISION_LORA_DATASET_CACHE"  # overrides the folder (e.g. a larger disk)


def cache_folder() -> str:
    """``<ComfyUI base directory>/cache/precision_lora/dataset`` (``--base-directory`` honoured), or the
    folder named by the environment variable ``PRECISION_LORA_DATASET_CACHE``."""
    override = os.environ.get(ENV_FOLDER, "").strip()
    if override:
        return os.path.abspath(override)
    import folder_paths

    return os.path.join(folder_paths.base_path, "cache", "precision_lora", "dataset")


def _weights(module: torch.nn.Module, patcher: Any) -> Iterator[tuple[str, torch.Tensor]]:
    backup = getattr(patcher, "backup", None) or {}
    for name, t in module.state_dict(keep_vars=True).items():
        saved = backup.get(name)
        original = getattr(saved, "weight", None)
        yield name, (original if isinstance(original, torch.Tensor) else t)


def _versions() -> dict[str, str]:
    return {"comfyui": ".".join(map(str, comfyui_version())), "torch": torch.__version__}


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def vae_identity(vae: Any) -> str:
    module, patcher = vae.first_stage_model, getattr(vae, "patcher", None)
    extra = {"class": _qualname(module), "dtype": str(getattr(vae, "vae_dtype", None)),
             "device": str(getattr(vae, "device", None)), "patches": getattr(patcher, "patches", None),
             **_versions()}
    return model_identity(_weights(module, patcher), extra)


def clip_hooks(clip: Any) -> str | None:
    """Why this CLIP's outputs cannot be cached (scheduled hooks change them per step), or None."""
    patcher = getattr(clip, "patcher", None)
    if getattr(patcher, "forced_hooks", None) is not None or getattr(clip, "apply_hooks_to_conds", None):
        return "the text encoder carries hooks (CLIP hook nodes); its outputs are encoded each run, not cached"
    return None


def clip_identity(clip: Any) -> str:
    module, patcher = clip.cond_stage_model, clip.patcher
    extra = {"class": _qualname(module), "layer_idx": getattr(clip, "layer_idx", None),
             "tokenizer": _qualname(clip.tokenizer), "tokenizer_options": dict(getattr(clip, "tokenizer_options", {})),
             "schedule": bool(getattr(clip, "use_clip_schedule", False)), "patches": getattr(patcher, "patches", None),
             "device": str(getattr(patcher, "load_device", None)), **_versions()}
    return model_identity(_weights(module, patcher), extra)


def encode_image(vae: Any, image: torch.Tensor) -> torch.Tensor:
    return vae.encode(image[:, :, :, :3])


def tokenize(clip: Any, text: str) -> Any:
    return clip.tokenize(text)


def encode_tokens(clip: Any, tokens: Any) -> list:
    return clip.encode_from_tokens_scheduled(tokens)


def output_device() -> torch.device:
    """Where ComfyUI's VAE and text encoders put their outputs (the CPU unless --gpu-only)."""
    import comfy.model_management

    return comfy.model_management.intermediate_device()


def check_interrupt() -> None:
    import comfy.model_management

    comfy.model_management.throw_exception_if_processing_interrupted()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def eta_seconds(left: dict[str, int], spent: dict[str, float], done: dict[str, int]) -> float | None:
    """Time left: each kind's items left x its mean encode time so far (a kind not timed yet takes the mean
    of all encodes); None before the first encode."""
    total_done = sum(done.values())
    if total_done == 0:
        return None
    overall = sum(spent.values()) / total_done
    return sum(n * (spent[k] / done[k] if done.get(k) else overall) for k, n in left.items())


class Progress:
    """ComfyUI's progress bar over every item (cache hits included), and for encodes a line with items done,
    per-item time and ETA: in the console (at most every ``every_s`` seconds, and the last) and under the node."""

    def __init__(self, node: str, node_id: str | None, total: int, to_encode: dict[str, int],
                 send_text: Callable[[str], None] | None = None, every_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        import comfy.utils

        self.node, self.total, self.done = node, total, 0
        self.left = dict(to_encode)
        self.spent = {k: 0.0 for k in to_encode}
        self.encoded = {k: 0 for k in to_encode}
        self.pbar = comfy.utils.ProgressBar(max(total, 1), node_id=node_id)
        self.send_text, self.every_s, self.clock = send_text, every_s, clock
        self.last_line = None

    def hit(self, n: int = 1) -> None:
        self.done += n
        self.pbar.update_absolute(self.done, max(self.total, 1))

    def encoded_one(self, kind: str, seconds: float) -> None:
        self.encoded[kind] += 1
        self.spent[kind] += seconds
        self.left[kind] -= 1
        self.hit()
        now = self.clock()
        last = sum(self.left.values()) == 0
        if last or self.last_line is None or now - self.last_line >= self.every_s:
            self.last_line = now
            line = self.line(kind, seconds)
            log.info("%s: %s", self.node, line)
            if self.send_text is not None:
                self.send_text(line)

    def line(self, kind: str, seconds: float) -> str:
        n = sum(self.encoded.values())
        todo = n + sum(self.left.values())
        eta = eta_seconds(self.left, self.spent, self.encoded) or 0.0
        return (f"encoding {n}/{todo} ({self.done}/{self.total} items ready): last {kind} {seconds:.2f} s, "
                f"ETA {_clock(eta)}")
