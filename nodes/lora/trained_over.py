"""What a trained LoRA sits on: the LoRA files loaded under it, named in its metadata and checked when it is loaded.

Training on a distilled or turbo base (Z-Image Turbo, a distilled Flux.2 klein) usually goes through a frozen
"training adapter": a LoRA loaded under the one being trained (stock LoraLoaderModelOnly, Load LoRA (Precision),
or another pack's loader). The trained LoRA only means what it learnt on top of that adapter, so the saved file
names it: ``precision_lora_trained_over`` is a JSON list of ``{"lora", "strength", "node"}``, nearest first, read
from the prompt (every node with a ``lora_name`` input on the MODEL path that reaches Train LoRA); weight patches
on the model that no such node explains are counted in ``precision_lora_base_patches``. Load LoRA (Precision)
warns, by name, when such a LoRA is loaded where those adapters are not under it.
"""
from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

META_OVER = "precision_lora_trained_over"
META_PATCHES = "precision_lora_base_patches"
NAME_INPUTS = ("lora_name",)
STRENGTH_INPUTS = ("strength_model", "strength", "lora_strength")


def _lora_of(node: dict) -> dict | None:
    """{"lora", "strength", "node"} for a node that loads a LoRA file onto the model (strength 0: ComfyUI
    returns the model unchanged, so nothing), else None. A linked strength is recorded as "linked"."""
    inputs = node.get("inputs") or {}
    name = next((inputs[k] for k in NAME_INPUTS if isinstance(inputs.get(k), str)), None)
    if name is None:
        return None
    strength: Any = next((inputs[k] for k in STRENGTH_INPUTS if k in inputs), 1.0)
    if isinstance(strength, list):
        strength = "linked"
    elif strength == 0:
        return None
    return {"lora": name, "strength": strength, "node": str(node.get("class_type"))}


def loras_under(prompt: dict | None, node_id: str | None, input_name: str = "model") -> list[dict]:
    """The LoRA files loaded on the MODEL that reaches ``node_id``'s ``input_name``, nearest first."""
    found: list[dict] = []
    if not isinstance(prompt, dict) or node_id is None:
        return found
    link, seen = (prompt.get(str(node_id)) or {}).get("inputs", {}).get(input_name), set()
    while isinstance(link, list) and len(link) == 2 and str(link[0]) not in seen:
        seen.add(str(link[0]))
        node = prompt.get(str(link[0]))
        if not isinstance(node, dict):
            break
        lora = _lora_of(node)
        if lora is not None:
            found.append(lora)
        link = (node.get("inputs") or {}).get("model")
    return found


def trained_over_metadata(prompt: dict | None, node_id: str | None, model: Any) -> dict[str, str]:
    """Metadata for a LoRA trained on ``model`` by node ``node_id`` of ``prompt``: the adapters under it, and
    ComfyUI weight patches on the model when no node in the prompt names where they came from."""
    md: dict[str, str] = {}
    under = loras_under(prompt, node_id)
    if under:
        md[META_OVER] = json.dumps(under)
    patched = len(getattr(model, "patches", None) or {})
    if patched and not under:
        md[META_PATCHES] = f"{patched} weights carry ComfyUI weight patches (a merged LoRA or model merge) that no " \
                           "node of the prompt names"
    return md


def missing_adapters(md: dict, prompt: dict | None, node_id: str | None) -> list[dict]:
    """The adapters a LoRA was trained over (its metadata) that are not loaded under ``node_id`` in ``prompt``."""
    try:
        recorded = json.loads(md.get(META_OVER, "[]"))
    except ValueError:
        return []
    if not recorded or not isinstance(prompt, dict):
        return []
    present = {u["lora"] for u in loras_under(prompt, node_id)}
    return [r for r in recorded if isinstance(r, dict) and r.get("lora") not in present]


def missing_note(lora_name: str, missing: list[dict]) -> str:
    names = ", ".join(f"{m['lora']} (strength {m['strength']})" for m in missing)
    return (f"warning: {lora_name} was trained on top of {names}, which is not loaded under this node: load it "
            "first (e.g. LoraLoaderModelOnly before Load LoRA (Precision)), or the LoRA does not do what it learnt")
