"""Read-only HTTP routes for the browser extension: what a LoRA file or a diffusion model file says.

``GET /precision_lora/model/info?name=<name in models/diffusion_models>`` answers
``{"name", "family", "heads", "head_dim", "default_scale"}`` from the safetensors header alone (shapes and
metadata, no weights), so the attention node can show its resolved scale before anything runs. Names
are checked exactly as for the LoRA route below, against the diffusion_models folders.

``GET /precision_lora/lora/metadata?name=<name as the loader lists it>`` answers
``{"name", "metadata": {...}, "summary": {"rank", "alpha", "steps", "softmax_scale", "backend", "base_model"}}``.

The client only ever names a file relative to the loras folders. Refused with a JSON ``{"error": ...}``:
400 for an empty, over-long or non-``.safetensors`` name, 403 for absolute paths, ``..`` components and
names that resolve (through symlinks) outside the folder they were found in, 404 for a missing file,
422 for a file that is not readable safetensors. Only the safetensors header is read, never tensors
beyond a scalar ``.alpha`` when the metadata has no alpha.

The name checks and the summary are plain functions (no ComfyUI) so tests can call them directly;
``register()`` binds them to ComfyUI's folder list and server.
"""
from __future__ import annotations

import asyncio
import logging
import ntpath
import os
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

ROUTE = "/precision_lora/lora/metadata"
MODEL_ROUTE = "/precision_lora/model/info"
MAX_NAME_LENGTH = 1024
# The summary's fields and the metadata keys they are read from, first present wins. The ss_* keys are
# the kohya convention (sd-scripts, ai-toolkit) that this pack's saver writes too; modelspec.* is the
# Stability model-spec header some trainers add.
SUMMARY_KEYS: dict[str, tuple[str, ...]] = {
    "rank": ("ss_network_dim",),
    "alpha": ("ss_network_alpha",),
    "steps": ("ss_steps", "ss_max_train_steps"),
    "softmax_scale": ("ss_attn_softmax_scale",),
    "backend": ("ss_attn_mode",),
    "base_model": ("ss_base_model_version", "modelspec.architecture", "ss_sd_model_name"),
}

_registered = False


class LoraNameError(ValueError):
    """A refused LoRA name; ``status`` is the HTTP status the route answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_lora_name(name: object, roots: list[str], folder: str = "loras", what: str = "metadata") -> str:
    """Absolute real path of the file called ``name`` in one of ``roots`` (the ``folder`` folders, in order).

    Raises LoraNameError(400|403|404) as described in the module docstring. The name is checked as
    text first (so a refused name never touches the file system), then each root is tried in order;
    a candidate whose real path leaves its root is refused, not skipped, so a symlink cannot be used
    to probe other folders.
    """
    if not isinstance(name, str) or not name.strip():
        raise LoraNameError(400, f"[Precision LoRA] {what}: query parameter 'name' is required")
    if len(name) > MAX_NAME_LENGTH:
        raise LoraNameError(400, f"[Precision LoRA] {what}: name longer than {MAX_NAME_LENGTH} characters")
    if "\x00" in name:
        raise LoraNameError(400, f"[Precision LoRA] {what}: name contains a NUL character")
    if os.path.isabs(name) or ntpath.isabs(name) or ntpath.splitdrive(name)[0] or name.startswith(("/", "\\", "~")):
        raise LoraNameError(403, f"[Precision LoRA] {what}: absolute paths are refused; give the name as the loader lists it")
    parts = [p for p in name.replace("\\", "/").split("/")]
    if any(p == ".." for p in parts):
        raise LoraNameError(403, f"[Precision LoRA] {what}: '..' is refused; give the name as the loader lists it")
    if any(p == "" for p in parts):
        raise LoraNameError(400, f"[Precision LoRA] {what}: empty path component in name")
    if not name.lower().endswith((".safetensors", ".sft")):
        raise LoraNameError(400, f"[Precision LoRA] {what}: only safetensors files (.safetensors, .sft) can be read")
    rel = os.path.join(*parts)
    for root in roots:
        if not os.path.isdir(root):
            continue
        root_real = os.path.realpath(root)
        candidate = os.path.join(root, rel)
        if not os.path.lexists(candidate):
            continue
        real = os.path.realpath(candidate)
        if not _is_within(real, root_real):
            raise LoraNameError(403, f"[Precision LoRA] {what}: name resolves outside the {folder} folders (symlink)")
        if os.path.isfile(real):
            return real
    raise LoraNameError(404, f"[Precision LoRA] {what}: no file named '{name}' in the {folder} folders")


def _first(md: Mapping[str, str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = md.get(key)
        if value not in (None, "", "None"):
            return value
    return None


def summarize(metadata: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]] | None = None,
              alpha_from_tensor: float | None = None) -> dict[str, str | int | float | None]:
    """The six summary fields from safetensors metadata (strings), with a fallback for files without it.

    ``shapes`` (tensor key -> shape) lets the rank be read from the first ``lora_down`` / ``lora_A``
    weight when ``ss_network_dim`` is absent; ``alpha_from_tensor`` is a ``.alpha`` tensor's value.
    Values stay the strings found in the metadata except for those inferred from tensors.
    """
    out: dict[str, str | int | float | None] = {k: _first(metadata, keys) for k, keys in SUMMARY_KEYS.items()}
    if out["rank"] is None and shapes:
        for key in sorted(shapes):
            if key.endswith((".lora_down.weight", ".lora_A.weight")) and len(shapes[key]) >= 2:
                out["rank"] = int(shapes[key][0])
                break
    if out["alpha"] is None and alpha_from_tensor is not None:
        out["alpha"] = float(alpha_from_tensor)
    return out


def read_metadata(path: str) -> dict[str, object]:
    """Metadata and summary of a safetensors file (header only). Raises LoraNameError(422) if unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
            shapes: dict[str, tuple[int, ...]] = {}
            alpha = None
            keys = list(f.keys())
            if "ss_network_dim" not in metadata:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys if k.endswith((".lora_down.weight", ".lora_A.weight"))}
            if "ss_network_alpha" not in metadata:
                alpha_keys = sorted(k for k in keys if k.endswith(".alpha"))
                if alpha_keys:
                    alpha = float(f.get_tensor(alpha_keys[0]).float().reshape(-1)[0])
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise LoraNameError(422, f"[Precision LoRA] metadata: not a readable safetensors file ({type(e).__name__}: {e})") from e
    return {"metadata": metadata, "summary": summarize(metadata, shapes, alpha)}


def lookup(name: object, roots: list[str]) -> tuple[int, dict[str, object]]:
    """(status, JSON body) for one request: the whole route without HTTP, for tests and the handler."""
    try:
        path = resolve_lora_name(name, roots)
        body = read_metadata(path)
    except LoraNameError as e:
        if e.status >= 422:
            log.warning("%s", e)
        return e.status, {"error": str(e)}
    return 200, {"name": name, **body}


def model_info(path: str) -> dict[str, object]:
    """Family, heads and head_dim of a diffusion model file from its header (ComfyUI needed).

    Tiny demo files carry their unet config in metadata; any other file goes through ComfyUI's own
    detection, fed tensors on the meta device that have the file's shapes (nothing is read but the header).
    Raises LoraNameError(422) when the file is unreadable or not a model ComfyUI recognises.
    """
    import json
    import math

    import torch
    from safetensors import safe_open

    import comfy.model_detection

    from .model_info import FAMILY_BY_CONFIG, heads_and_dim
    from .load_model import UNET_CONFIG_KEY

    try:
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:
        raise LoraNameError(422, f"[Precision LoRA] model info: not a readable safetensors file ({type(e).__name__}: {e})") from e
    if UNET_CONFIG_KEY in metadata:
        unet_config = json.loads(metadata[UNET_CONFIG_KEY])
    else:
        sd = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
        try:
            # As ComfyUI's diffusion-model loader: strip a checkpoint prefix only when keys carry it.
            prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
            if not any(k.startswith(prefix) for k in sd):
                prefix = ""
            unet_config = comfy.model_detection.detect_unet_config(sd, prefix, metadata=metadata)
        except Exception as e:
            raise LoraNameError(422, f"[Precision LoRA] model info: ComfyUI could not detect the model type ({type(e).__name__}: {e})") from e
        if unet_config is None:
            raise LoraNameError(422, "[Precision LoRA] model info: not a diffusion model ComfyUI recognises")
    unet_config = dict(unet_config)
    if "num_heads" not in unet_config and unet_config.get("image_model") in ("cosmos_predict2", "anima"):
        # Detection leaves heads to the model class's default (not stored in the file).
        import inspect

        from comfy.ldm.cosmos.predict2 import MiniTrainDIT

        unet_config["num_heads"] = inspect.signature(MiniTrainDIT.__init__).parameters["num_heads"].default
    heads, head_dim = heads_and_dim(unet_config, None)
    config = comfy.model_detection.model_config_from_unet_config(unet_config, None)
    config_name = type(config).__name__ if config is not None else str(unet_config.get("image_model", "unknown"))
    return {
        "family": FAMILY_BY_CONFIG.get(config_name, config_name),
        "heads": heads,
        "head_dim": head_dim,
        "default_scale": (1.0 / math.sqrt(head_dim)) if head_dim else None,
    }


def lookup_model(name: object, roots: list[str]) -> tuple[int, dict[str, object]]:
    """(status, JSON body) for the model-info route; same name rules as ``resolve_lora_name``."""
    try:
        path = resolve_lora_name(name, roots, folder="diffusion_models", what="model info")
        body = model_info(path)
    except LoraNameError as e:
        return e.status, {"error": str(e)}
    return 200, {"name": name, **body}


def make_handler(get_roots: Callable[[], list[str]], answer: Callable = lookup):
    """An aiohttp GET handler answering ``answer(name, get_roots())`` (roots read per request)."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        name = request.rel_url.query.get("name")
        status, body = await asyncio.to_thread(answer, name, list(get_roots()))
        return web.json_response(body, status=status)

    return handler


def register() -> None:
    """Add the route to ComfyUI's server once (idempotent)."""
    global _registered
    if _registered:
        return
    import folder_paths
    from server import PromptServer

    routes = PromptServer.instance.routes
    routes.get(ROUTE)(make_handler(lambda: folder_paths.get_folder_paths("loras")))
    routes.get(MODEL_ROUTE)(make_handler(lambda: folder_paths.get_folder_paths("diffusion_models"), lookup_model))
    _registered = True
    log.info("[Precision LoRA] routes %s and %s registered", ROUTE, MODEL_ROUTE)
