"""The fuzz test's graph, mutations and judge (tests/e2e/test_fuzz.py), kept apart to stay short.

``base_graph`` holds every pack node, wired on the tiny Cosmos demo model with the smallest sizes.
``mutations(object_info)`` derives, for every input of every pack node, the values of each class (wrong
type, NaN/inf, negative, zero, huge, unknown option, missing, traversal, absolute, NUL, newline,
overlong) that the schema makes invalid; values the schema allows are counted, not posted.
``error_problems`` says what a rejection's message fails to name (node, input, value, fix).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

COSMOS = "precision_tiny_cosmos.safetensors"
FLUX = "precision_tiny_flux1_dev.safetensors"
FILE_NAMES = {("PrecisionTrainLoRA", "name"), ("PrecisionTrainLoRA", "resume_from"),
              ("PrecisionSaveLoRA", "filename_prefix"), ("PrecisionLossGraph", "filename_prefix")}
REGEXES = {("PrecisionAttachLoRA", "include"), ("PrecisionAttachLoRA", "exclude")}
FREE_TEXT = {("PrecisionDemoConditioning", "text")}
# ComfyUI's own error types carry their fix by construction (the bound, the expected type, the missing
# input, the expected link type); every other message must state one.
COMFY_TYPES = {"value_smaller_than_min", "value_bigger_than_max", "invalid_input_type", "required_input_missing",
               "return_type_mismatch", "value_not_in_list"}
FIX_WORDS = ("use ", "choose", "give", "remove", "connect", "set ", "install", "fix ", "keep ", "clear ",
             "put ", "encode", "retrain", "lower", "save ", "enable", "disconnect")
# Sinks per node: the output nodes a mutation of that node runs to (only reached when validation passes).
SINKS = {"1": ["11"], "2": ["14"], "3": ["15"], "4": ["9"], "5": ["13"], "6": ["11"], "7": ["9"], "8": ["8"],
         "9": ["9"], "10": ["11"], "11": ["11"], "12": ["13"]}


def base_graph(tag: str, lora_name: str | None) -> dict:
    """Every pack node (ids 1-12) plus sinks; ``lora_name`` None leaves Load LoRA / its probe out."""
    attach = dict(rank=2, alpha=2.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
                  dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
                  init_lora="none", dry_run=False)
    settings = dict(optimizer="adamw", learning_rate=1e-4, weight_decay=0.01, beta1=0.9, beta2=0.999, eps=1e-8,
                    lr_schedule="constant", warmup_steps=0, schedule_steps=1000, restarts=1, loraplus_ratio=1.0,
                    batch_size=1, grad_accum=1, max_grad_norm=1.0, timestep_sampling="logit_normal", logit_mean=0.0,
                    logit_std=1.0, sigmoid_scale=1.0, shift=3.0, loss_weighting="none", target="auto",
                    dop_multiplier=0.0, dop_every_n=1, checkpoint_every=0, nan_policy="rollback", nan_patience=3,
                    gradient_checkpointing=False)
    probe = dict(noise_level=0.5, seed=0, max_rows=8)
    g = {
        "1": ("PrecisionLoadDiffusionModel", {"model_name": COSMOS, "weight_dtype": "fp32"}),
        "2": ("PrecisionPatchAttention", {"model": ["1", 0], "backend": "auto", "scale_mode": "multiplier",
                                          "scale_value": 1.0, "stable_beta": 2.0, "softclamp": 0.0,
                                          "fp32_softmax": False}),
        "3": ("PrecisionAttachLoRA", {"model": ["2", 0], **attach}),
        "4": ("PrecisionTrainSettings", settings),
        "5": ("PrecisionDemoLatent", {"model": ["1", 0], "width": 16, "height": 16, "batch_size": 1, "seed": 0}),
        "6": ("PrecisionDemoConditioning", {"model": ["1", 0], "text": "sks", "seed": 0, "tokens": 2}),
        "7": ("PrecisionTrainLoRA", {"model": ["3", 0], "latents": ["5", 0], "conditioning": ["6", 0],
                                     "settings": ["4", 0], "steps": 1, "seed": 0, "name": f"fuzz_{tag}",
                                     "resume_from": ""}),
        "8": ("PrecisionSaveLoRA", {"model": ["7", 0], "filename_prefix": f"fuzz_{tag}/lora", "folder": "loras",
                                    "save_dtype": "fp32", "key_style": "auto", "use_counter": True,
                                    "overwrite": False}),
        "9": ("PrecisionLossGraph", {"loss": ["7", 2], "smoothing": 0.5, "log_scale": False, "width": 128,
                                     "height": 96, "filename_prefix": f"fuzz_{tag}/loss"}),
        "12": ("PrecisionDemoPreview", {"samples": ["5", 0]}),
        "13": ("PreviewImage", {"images": ["12", 0]}),
        "14": ("PrecisionProbe", {"model": ["2", 0], "latent": ["5", 0], "conditioning": ["6", 0], **probe}),
        "15": ("PrecisionProbe", {"model": ["3", 0], "latent": ["5", 0], "conditioning": ["6", 0], **probe}),
        "20": ("PrecisionLoadDiffusionModel", {"model_name": FLUX, "weight_dtype": "fp32"}),
        "21": ("PrecisionDemoConditioning", {"model": ["20", 0], "text": "sks", "seed": 0, "tokens": 2}),
        "22": ("PrecisionDemoLatent", {"model": ["20", 0], "width": 16, "height": 16, "batch_size": 1, "seed": 0}),
    }
    if lora_name is not None:
        g["10"] = ("PrecisionLoadLoRA", {"model": ["1", 0], "lora_name": lora_name, "strength": 1.0, "mode": "fp32",
                                         "attention": "apply_recorded", "override_backend": "auto",
                                         "override_scale_mode": "default", "override_scale_value": 1.0})
        g["11"] = ("PrecisionProbe", {"model": ["10", 0], "latent": ["5", 0], "conditioning": ["6", 0], **probe})
    return {k: {"class_type": c, "inputs": dict(i)} for k, (c, i) in g.items()}


def subgraph(graph: dict, sinks: list[str]) -> dict:
    """The sinks and everything they depend on."""
    keep, todo = set(), list(sinks)
    while todo:
        nid = todo.pop()
        if nid in keep:
            continue
        keep.add(nid)
        todo += [v[0] for v in graph[nid]["inputs"].values() if isinstance(v, list) and len(v) == 2]
    return {k: json.loads(json.dumps(graph[k])) for k in keep}


@dataclass(frozen=True)
class Mutation:
    node: str        # node id in base_graph
    cls: str         # class_type
    name: str        # input name
    kind: str        # mutation class
    value: Any       # None with kind "missing"
    invalid: bool    # what the schema says; valid ones are not posted (except the special cases)


def _number_values(spec: dict, integer: bool) -> list[tuple[str, Any]]:
    hi = spec.get("max")
    huge = 2 ** 64 if integer else 1e308
    out = [("wrong type", "abc"), ("negative", -1), ("zero", 0), ("huge", huge if hi is None or hi < huge else 10 ** 30)]
    out += [("nan", "nan")] if integer else [("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf)]
    return out


def _number_invalid(value: Any, spec: dict) -> bool:
    if isinstance(value, str) or (isinstance(value, float) and not math.isfinite(value)):
        return True
    return (spec.get("min") is not None and value < spec["min"]) or (spec.get("max") is not None and value > spec["max"])


def _string_values(cls: str, name: str, token: str) -> list[tuple[str, Any, bool]]:
    if (cls, name) in FILE_NAMES:
        return [("traversal", f"../../fuzz_esc_{token}", True), ("absolute", f"/tmp/fuzz_abs_{token}", True),
                ("NUL", f"fuzz_{token}\x00nul", True), ("newline", f"fuzz_{token}\nnl", True),
                ("overlong", "f" * 300, True)]
    if (cls, name) in REGEXES:
        return [("regex bomb", "(.*.*){1,8}Z", False), ("invalid", "(", True), ("overlong", "a" * 5000, True)]
    if (cls, name) in FREE_TEXT:
        return []
    return [("invalid", "abc", True), ("NUL", "0\x00", True), ("newline", "0\n1-", True), ("overlong", "9" * 5000, True)]


def mutations(info: dict, graph: dict, token: str) -> list[Mutation]:
    """Every mutation of every input of every pack node in ``graph`` (ids 1-12)."""
    out = []
    for nid in sorted((k for k in graph if int(k) <= 12), key=int):
        cls = graph[nid]["class_type"]
        node_info = info[cls]["input"]
        for section in ("required", "optional"):
            for name, entry in node_info.get(section, {}).items():
                kind, spec = entry[0], (entry[1] if len(entry) > 1 else {})
                out.append(Mutation(nid, cls, name, "missing", None, section == "required"))
                for label, value, invalid in _values(cls, name, kind, spec, token):
                    out.append(Mutation(nid, cls, name, label, value, invalid))
    return out


def _values(cls: str, name: str, kind: Any, spec: dict, token: str) -> list[tuple[str, Any, bool]]:
    if kind in ("FLOAT", "INT"):
        return [(lbl, v, _number_invalid(v, spec)) for lbl, v in _number_values(spec, kind == "INT")]
    if kind == "STRING":
        return _string_values(cls, name, token)
    if kind == "COMBO" or isinstance(kind, list):
        return [("unknown option", "no_such_option", True), ("wrong type", 123, True)]
    if kind == "BOOLEAN":
        return []  # ComfyUI itself converts any value with bool() before a node sees it
    return [("wrong link type", ["?", kind], True)]  # a link to another type's output, see wrong_link


def wrong_link(graph: dict, node: str, kind: str) -> list:
    """A link for an input of type ``kind`` on ``node`` to an output of another type (never ``node`` itself)."""
    if kind != "MODEL":
        return ["1", 0]  # the loader's MODEL
    return ["6", 0] if node == "5" else ["5", 0]  # a CONDITIONING / LATENT where a MODEL belongs


def value_tokens(value: Any) -> list[str]:
    """Ways a message may show ``value``; empty for a link (its value is the other node's output)."""
    if isinstance(value, list):
        return []
    if isinstance(value, float) and math.isnan(value):
        return ["nan", "NaN"]
    if isinstance(value, float) and math.isinf(value):
        return ["inf", "Infinity"]
    if isinstance(value, str) and value == "nan":
        return ["nan"]
    return [repr(value)[:24], str(value)[:24]]


def error_problems(text: str, etype: str | None, cls: str, name: str, value: Any, missing: bool) -> list[str]:
    """What an error message fails to name: the node, the input, the value, a fix (empty when clear)."""
    problems = []
    if etype not in COMFY_TYPES and cls not in text:
        problems.append("node not named")
    if name not in text:
        problems.append("input not named")
    tokens = value_tokens(value)
    if not missing and tokens and not any(t in text for t in tokens):
        problems.append("value not shown")
    if etype not in COMFY_TYPES and not any(w in text for w in FIX_WORDS):
        problems.append("no fix")
    return problems
