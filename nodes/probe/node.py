"""PrecisionProbe: measures, on the user's own model and data, what bf16 costs a LoRA and how attention behaves."""
from __future__ import annotations

import logging

from ...probe.survival import summarize
from ...probe.report import format_report
from ..checks.gate import PrecisionNode
from ..host.comfy_io import io, ui
from ..model.data_checks import conditioning_problem, is_packed, latent_problem
from .chart import draw_probe_chart
from .glue import ProbeResult, probe_model

log = logging.getLogger(__name__)

NODE = "PrecisionProbe"
NOISE_RANGE = (0.01, 0.99)
ROWS_RANGE = (8, 4096)


def settings_of(result: ProbeResult) -> dict[str, object]:
    """Attention settings as the report shows them: the scale the dispatcher applied, and its multiple of
    the model's own scale."""
    cfg = result.attention_cfg
    return {"backend": cfg.backend, "scale": result.scale,
            "multiplier": result.scale / result.base_scale if result.base_scale else 1.0, "softclamp": cfg.softclamp}


def _err(input_name: str, message: str) -> ValueError:
    return ValueError(f"{NODE}: input '{input_name}' {message}")


def pick(model, latents: list, conditionings: list) -> tuple[dict, list, str]:
    """The LATENT and CONDITIONING one probe forward uses: the first LATENT (a dataset list gives one per
    image) and the conditioning that goes with it, checked against this model; and a note saying which."""
    if not latents:
        raise _err("latent", "is empty: connect a LATENT (VAE Encode, or MakeTrainingDataset's latents)")
    if not conditionings:
        raise _err("conditioning", "is empty: connect a CONDITIONING (your text encoder's output)")
    for i, latent in enumerate(latents):
        samples = latent.get("samples") if isinstance(latent, dict) else None
        problem = latent_problem(model, samples)
        if problem is None and is_packed(samples):
            problem = ("is a packed audio-video LATENT (LTX-2); Precision Probe measures one forward on a single "
                       "latent tensor and cannot probe a packed one yet: train it with PrecisionTrainLoRA, which "
                       "takes it, and probe a video-only model")
        if problem is not None:
            raise _err("latent", f"item {i} {problem}" if len(latents) > 1 else problem)
    for i, cond in enumerate(conditionings):
        problem = conditioning_problem(model, cond)
        if problem is not None:
            raise _err("conditioning", f"item {i} {problem}" if len(conditionings) > 1 else problem)
    note = "" if len(latents) == 1 else (
        f"probed the first of {len(latents)} LATENTs (with its conditioning); one forward measures one input")
    return latents[0], conditionings[0], note


class PrecisionProbe(PrecisionNode):
    NODE = NODE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE,
            display_name="Precision Probe (bf16 LoRA loss, attention saturation)",
            category="precision_lora/diagnostics",
            description="One forward of the model at a chosen noise level, instrumented without changing its "
                        "output. Reports per LoRA layer how much of the LoRA's effect survives a bf16 merge, a "
                        "bf16 add and the fp32 unmerged path; per attention layer entropy, max probability, max "
                        "logit, rows where bf16(P̄) == 1 twice and what the stable backend would change; and a verdict.",
            inputs=[
                io.Model.Input("model", tooltip="Model to probe, optionally with a Precision LoRA attached or "
                               "loaded and attention patched; its current settings are measured."),
                io.Latent.Input("latent", tooltip="Latents of your training images (the first LATENT of a list is used, "
                                "with its conditioning)."),
                io.Conditioning.Input("conditioning", tooltip="Conditioning for the latents (your caption)."),
                io.Float.Input("noise_level", default=0.5, min=NOISE_RANGE[0], max=NOISE_RANGE[1], step=0.01,
                               tooltip="Where in the noise schedule to probe: near 1 = almost pure noise, near "
                                       "0 = almost clean. The sigma used is shown in the report."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, step=1, tooltip="Seed of the noise."),
                io.Int.Input("max_rows", default=256, min=ROWS_RANGE[0], max=ROWS_RANGE[1], step=8,
                             tooltip="Tokens per layer (and query rows per head) measured; more is slower."),
            ],
            outputs=[io.String.Output(display_name="report"), io.Image.Output(display_name="chart")],
            is_output_node=True,
            # A dataset list (MakeTrainingDataset) arrives whole: one report, not one run per item.
            is_input_list=True,
        )

    @classmethod
    def execute(cls, model, latent, conditioning, noise_level, seed, max_rows) -> io.NodeOutput:
        model, noise_level, seed, max_rows = model[0], noise_level[0], seed[0], max_rows[0]
        latent, conditioning, picked = pick(model, latent, conditioning)
        result = probe_model(model, latent, conditioning, noise_level, seed, max_rows)
        attention = {k: v.as_dict() for k, v in result.attention.items()}
        notes = [picked] if picked else []
        if result.weight_patches:
            notes.append(f"{result.weight_patches} weights carry ComfyUI patches (a merged LoRA): merged deltas "
                         "cannot be measured as adapters; load the LoRA with PrecisionLoadLoRA mode=fp32 to probe it.")
        report = format_report(result.lora, attention, settings_of(result), result.sigma, notes)
        chart = draw_probe_chart(summarize(result.lora), attention)
        log.info("probe: %d LoRA layers, %d attention calls", len(result.lora), len(attention))
        return io.NodeOutput(report, chart, ui=ui.PreviewText(report))


NODES = [PrecisionProbe]
