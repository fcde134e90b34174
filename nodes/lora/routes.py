"""Read-only HTTP route for the browser extension: what a LoRA file says.

``GET /precision_lora/lora/metadata?name=<name as the loader lists it>`` answers
``{"name", "metadata": {...}, "summary": {"rank", "alpha", "steps", "softmax_scale", "backend", "base_model"}}``.

The client only ever names a file relative to the loras folders; ``file_names.find_model_file`` refuses
every other name (400/403/404, see there). A file that is not readable safetensors is a 422. Only the
safetensors header is read, never tensors beyond a scalar ``.alpha`` when the metadata has no alpha.

The summary and the lookup are plain functions (no ComfyUI) so tests can call them directly;
``register()`` binds them to ComfyUI's folder list and server.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..checks.file_names import FileRoute, QueryRefused

ROUTE = "/precision_lora/lora/metadata"
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
    """Metadata and summary of a safetensors file (header only). Raises QueryRefused(422) if unreadable."""
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
        raise QueryRefused(422, f"metadata: not a readable safetensors file ({type(e).__name__}: {e})") from e
    return {"metadata": metadata, "summary": summarize(metadata, shapes, alpha)}


METADATA_ROUTE = FileRoute(ROUTE, "loras", "metadata", read_metadata)
lookup = METADATA_ROUTE.lookup
register = METADATA_ROUTE.register  # idempotent
