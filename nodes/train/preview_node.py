"""PrecisionPreviewSettings: what PrecisionTrainLoRA samples during a run (prompt, VAE, sampler, size, when).

Defaults come from ``preview.PreviewSettings``; sampler and scheduler lists from ComfyUI's KSampler.
"""
from __future__ import annotations

from typing import Any

from ..checks.gate import PrecisionNode
from ..host.comfy_io import io
from .preview import NODE, PreviewSettings, settings_problem
from ..host.types import PreviewSettingsType

DEFAULTS = PreviewSettings.__dataclass_fields__
CATEGORY = "precision_lora/train"


def _default(name: str) -> Any:
    return DEFAULTS[name].default


def _inputs() -> list:
    import comfy.samplers

    return [
        io.Conditioning.Input("positive", tooltip="The prompt to sample (e.g. CLIPTextEncode with the trigger word). "
                                                  "A list of prompts gives one preview set each."),
        io.Vae.Input("vae", tooltip="The VAE of the model's family: decodes the sampled latents to images."),
        io.Combo.Input("sampler_name", options=list(comfy.samplers.KSampler.SAMPLERS), default=_default("sampler_name"),
                       tooltip="ComfyUI sampler, as in KSampler."),
        io.Combo.Input("scheduler", options=list(comfy.samplers.KSampler.SCHEDULERS), default=_default("scheduler"),
                       tooltip="ComfyUI scheduler, as in KSampler."),
        io.Int.Input("steps", default=_default("steps"), min=1, max=1000, step=1,
                     tooltip="Sampling steps per preview (each costs a forward pass of the model per image)."),
        io.Float.Input("cfg", default=_default("cfg"), min=0.0, max=100.0, step=0.1,
                       tooltip="Classifier-free guidance scale; 1.0 skips the negative (Flux: 1.0, guidance is in "
                               "the conditioning)."),
        *(io.Int.Input(side, default=_default(side), min=16, max=8192, step=16,
                       tooltip=f"Image {side} in pixels: a multiple of the model's latent cell x patch (Flux: 16).")
          for side in ("width", "height")),
        io.Int.Input("batch_size", default=_default("batch_size"), min=1, max=16, step=1,
                     tooltip="Images per preview (consecutive noise of the same seed, as KSampler's batch)."),
        io.Int.Input("seed", default=_default("seed"), min=0, max=0xFFFFFFFFFFFFFFFF, step=1,
                     tooltip="Noise seed of every preview: the same seed at each step, so images show what training "
                             "changed. The training's own random stream is never touched."),
        io.Int.Input("every_n_steps", default=_default("every_n_steps"), min=0, max=1000000, step=1,
                     tooltip="Preview after every N optimizer steps of the run (0 = only at start / end)."),
        io.Boolean.Input("at_start", default=_default("at_start"),
                         tooltip="Also preview before the first step of a new run (step 0: the model before training)."),
        io.Boolean.Input("at_end", default=_default("at_end"),
                         tooltip="Also preview after the last step of each Train LoRA node."),
        io.Conditioning.Input("negative", optional=True,
                              tooltip="Negative prompt, used when cfg > 1 (not connected: the positive zeroed out)."),
    ]


class PrecisionPreviewSettings(PrecisionNode):
    NODE = NODE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE, display_name="Precision Preview Settings", category=CATEGORY,
            description="Sample images during training: connect to PrecisionTrainLoRA's 'preview'. Images are shown "
                        "on the Train LoRA node as they come and saved as output/precision_lora/previews/<run name>/"
                        "<run name>_step<N>_<i>.png.",
            inputs=_inputs(),
            outputs=[PreviewSettingsType.Output(display_name="preview")],
        )

    @classmethod
    def check(cls, values: dict) -> str | None:
        return settings_problem(values)

    @classmethod
    def execute(cls, positive, vae, sampler_name, scheduler, steps, cfg, width, height, batch_size, seed,
                every_n_steps, at_start, at_end, negative=None) -> io.NodeOutput:
        return io.NodeOutput(PreviewSettings(
            positive=positive, vae=vae, negative=negative, sampler_name=sampler_name, scheduler=scheduler,
            steps=steps, cfg=cfg, width=width, height=height, batch_size=batch_size, seed=seed,
            every_n_steps=every_n_steps, at_start=at_start, at_end=at_end))


NODES = [PrecisionPreviewSettings]
