"""PrecisionPatchAttention: MODEL -> MODEL with a chosen attention backend and softmax scale."""
from __future__ import annotations

import logging
from typing import Mapping

from ...attention.backends import BACKENDS, available
from ...attention.config import (
    AUTO_BACKEND, SCALE_MODES, STABLE_BETA_RANGE, AttentionConfig, default_scale, usable_backends,
)
from .glue import composition_note, get_attention_override, patch_attention
from ..checks.gate import PrecisionNode
from ..host.comfy_io import io
from ..model.info import describe_model

log = logging.getLogger(__name__)

NODE = "PrecisionPatchAttention"
DEFAULTS = AttentionConfig()
BACKEND_OPTIONS = [AUTO_BACKEND, *BACKENDS]
INPUTS = ("backend", "scale_mode", "scale_value", "stable_beta", "softclamp", "fp32_softmax")


def build_config(values: Mapping[str, object]) -> AttentionConfig:
    """The node's inputs as an AttentionConfig: the one place the node builds (and so validates) it.
    ValueError says why it cannot be applied here (invalid, or its backend is not installed) and the fix."""
    cfg = AttentionConfig(**{n: values[n] for n in INPUTS})  # type: ignore[arg-type]
    reason = None if cfg.backend == AUTO_BACKEND else available()[cfg.backend]
    if reason is not None:
        raise ValueError(f"backend={cfg.backend!r} is unavailable here: {reason}; "
                         f"usable backends: {', '.join(usable_backends())}")
    return cfg


def describe_patch(cfg: AttentionConfig, head_dim: int | None, kept: str | None = None) -> str:
    """The info output: backend, resolved scale for the model's head_dim, options; ``kept``: how the override
    another pack had set on the model is treated (``glue.composition_note``)."""
    lines = [f"backend: {cfg.backend}" + (" (ComfyUI's own attention)" if cfg.backend == AUTO_BACKEND else "")]
    if kept is not None:
        lines.append(f"another override was on the model: {kept}")
    if head_dim:
        scale, default = cfg.resolve_scale(head_dim), default_scale(head_dim)
        lines.append(f"softmax scale: {scale:.6g} for head_dim {head_dim} ({scale / default:.4g} x default {default:.6g})")
    else:
        lines.append(f"softmax scale: {cfg.scale_mode} {cfg.scale_value:g} (head_dim unknown: resolved per call)")
    if not cfg.scale_is_default():
        lines.append("note: a non-default scale changes the model's behaviour (temperature); use the same "
                     "scale at inference (saved LoRAs record it)")
    if cfg.backend == "stable":
        lines.append(f"stable beta: {cfg.stable_beta:g}")
    if cfg.softclamp > 0:
        lines.append(f"softclamp: {cfg.softclamp:g}")
    if cfg.fp32_softmax:
        lines.append("fp32 softmax: on")
    if cfg.backend == "sage":
        lines.append("sage is inference only: training through it raises an error")
    lines.append("an attention override set later in the graph (e.g. KJNodes' Patch Sage Attention) does not drop "
                 "this one: it runs as the kernel under it (backend auto) or is not called (other backends); Train "
                 "LoRA's report and the saved LoRA say what ran")
    return "\n".join(lines)


class PrecisionPatchAttention(PrecisionNode):
    NODE = NODE

    @classmethod
    def define_schema(cls) -> io.Schema:
        lo, hi = STABLE_BETA_RANGE
        return io.Schema(
            node_id=NODE,
            display_name="Patch Attention (Precision)",
            category="precision_lora/attention",
            description="Sets the attention backend and softmax scale for every attention call of the model "
                        "(on a copy; bypass the node to undo). A scale other than 1/sqrt(head_dim) is a "
                        "temperature change: use the same scale at inference.",
            inputs=[
                io.Model.Input("model", tooltip="Diffusion model to patch (a clone is patched)."),
                io.Combo.Input("backend", options=BACKEND_OPTIONS, default=DEFAULTS.backend,
                               tooltip="auto: ComfyUI's own attention. sdpa: torch SDPA. math: fp32-softmax "
                                       "reference. stable: stable-softmax fix (Qiu & Yao). flash / sage / xformers "
                                       "need their packages and a GPU; sage is inference only."),
                io.Combo.Input("scale_mode", options=list(SCALE_MODES), default=DEFAULTS.scale_mode,
                               tooltip="default: 1/sqrt(head_dim). absolute: scale_value itself. multiplier: "
                                       "scale_value x 1/sqrt(head_dim)."),
                io.Float.Input("scale_value", default=DEFAULTS.scale_value, min=0.0, max=100.0, step=0.001,
                               round=0.00001, tooltip="Absolute softmax scale or multiplier of the default; must "
                                                      "be > 0. Ignored when scale_mode is default."),
                io.Float.Input("stable_beta", default=DEFAULTS.stable_beta, min=lo, max=hi, step=0.1,
                               tooltip="Stable backend only: tied rows are shifted by about (beta-1) x row max."),
                io.Float.Input("softclamp", default=DEFAULTS.softclamp, min=0.0, max=1000.0, step=0.5,
                               tooltip="0 = off. Else logits become c*tanh(s/c) (math and stable backends); "
                                       "keep c >= 10x the max logit or the output changes (a warning says so)."),
                io.Boolean.Input("fp32_softmax", default=DEFAULTS.fp32_softmax,
                                 tooltip="Run attention on fp32 copies of q/k/v (not with flash or sage, which "
                                         "already keep softmax statistics in fp32)."),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The model with patched attention."),
                io.String.Output(display_name="info", tooltip="Backend and the resolved scale for this model."),
            ],
        )

    @classmethod
    def check(cls, values: dict) -> str | None:
        """Option combinations (softclamp needs math/stable, ...) and backend availability; ranges and
        options of single inputs are the gate's (PrecisionNode)."""
        if any(values.get(n) is None for n in INPUTS):
            return None  # a linked input: checked again when the node runs
        try:
            build_config(values)
        except ValueError as exc:
            return str(exc)
        return None

    @classmethod
    def execute(cls, model, backend: str, scale_mode: str, scale_value: float, stable_beta: float,
                softclamp: float, fp32_softmax: bool) -> io.NodeOutput:
        try:
            cfg = build_config(dict(backend=backend, scale_mode=scale_mode, scale_value=scale_value,
                                    stable_beta=stable_beta, softclamp=softclamp, fp32_softmax=fp32_softmax))
        except ValueError as exc:
            raise ValueError(f"{NODE}: {exc}") from None
        patched = patch_attention(model, cfg)
        override = get_attention_override(patched)
        kept = composition_note(override) if override is not None and override.previous is not None else None
        info = describe_patch(cfg, describe_model(model).head_dim, kept)
        log.info("%s: %s", NODE, info.replace("\n", "; "))
        return io.NodeOutput(patched, info)


NODES = [PrecisionPatchAttention]
