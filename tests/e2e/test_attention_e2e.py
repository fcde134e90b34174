"""PrecisionPatchAttention in a real ComfyUI server: Load -> Patch attention -> KSampler -> SaveLatent
on the tiny Cosmos-Predict2, Flux.1 and Flux.2 files, plus bad inputs that must not break the server."""
from __future__ import annotations

import math

import pytest
import safetensors.torch
import torch

pytestmark = pytest.mark.e2e

NODE = "PrecisionPatchAttention"
FILES = {
    "cosmos": "precision_tiny_cosmos.safetensors",
    "flux1": "precision_tiny_flux1_dev.safetensors",
    "flux2": "precision_tiny_flux2.safetensors",
}
# Default settings on the auto backend hand every call to the very same ComfyUI kernel: bit-identical.
# Different kernels at the same scale agree to fp32 summation-order noise, amplified by the model.
KERNEL_TOL = 1e-4


def _patch_inputs(**change) -> dict:
    inputs = {"model": ["1", 0], "backend": "auto", "scale_mode": "default", "scale_value": 1.0,
              "stable_beta": 2.0, "softclamp": 0.0, "fp32_softmax": False}
    inputs.update(change)
    return inputs


def _prompt(family: str, prefix: str, patch: dict | None) -> dict:
    model = ["1", 0]
    prompt = {"1": {"class_type": "PrecisionLoadDiffusionModel",
                    "inputs": {"model_name": FILES[family], "weight_dtype": "fp32"}}}
    if patch is not None:
        prompt["9"] = {"class_type": NODE, "inputs": _patch_inputs(**patch)}
        prompt["10"] = {"class_type": "PreviewAny", "inputs": {"source": ["9", 1]}}
        model = ["9", 0]
    prompt.update({
        "2": {"class_type": "PrecisionDemoConditioning",
              "inputs": {"model": ["1", 0], "text": "a photo of sks", "seed": 0, "tokens": 8}},
        "3": {"class_type": "PrecisionDemoLatent",
              "inputs": {"model": ["1", 0], "width": 64, "height": 64, "batch_size": 1, "seed": 1}},
        "4": {"class_type": "KSampler", "inputs": {
            "model": model, "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["3", 0],
            "seed": 3, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "5": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": prefix}},
    })
    return prompt


def _sample(server, family: str, name: str, patch: dict | None) -> tuple[torch.Tensor, str | None]:
    entry = server.run(_prompt(family, f"e2e_attention/{family}_{name}", patch))
    saved = entry["outputs"]["5"]["latents"][0]
    latent = safetensors.torch.load_file(server.output_path(saved["subfolder"], saved["filename"]))["latent_tensor"]
    info = entry["outputs"].get("10", {}).get("text", [None])[0]
    return latent.float(), info


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_object_info_lists_the_node_with_tooltips(server):
    info = server.object_info(NODE)[NODE]
    required = info["input"]["required"]
    assert list(required) == ["model", "backend", "scale_mode", "scale_value", "stable_beta", "softclamp", "fp32_softmax"]
    assert required["backend"][0] == ["auto", "sdpa", "math", "stable", "flash", "sage", "xformers"] or \
        required["backend"][1].get("options") == ["auto", "sdpa", "math", "stable", "flash", "sage", "xformers"]
    for name, spec in required.items():
        assert spec[1].get("tooltip"), f"input {name} has no tooltip"
    assert info["output_name"] == ["model", "info"]


@pytest.mark.parametrize("family", sorted(FILES))
def test_patched_model_through_ksampler(server, family):
    stock, _ = _sample(server, family, "stock", None)
    default, _ = _sample(server, family, "default", {})
    assert torch.equal(default, stock), "default settings must reproduce the unpatched model"
    scaled, info = _sample(server, family, "auto2x", {"scale_mode": "multiplier", "scale_value": 2.0})
    assert "2 x default" in info and "use the same scale at inference" in info
    assert _rel(scaled, stock) > 100 * KERNEL_TOL, "a 2x scale must change the output"
    # Three independent kernels apply the same 2x scale and agree.
    for backend in ("stable", "math"):
        other, _ = _sample(server, family, f"{backend}2x", {"backend": backend, "scale_mode": "multiplier",
                                                            "scale_value": 2.0})
        assert _rel(other, scaled) < KERNEL_TOL, f"{backend} disagrees with auto at 2x"
    # An absolute scale equal to 2/sqrt(head_dim) is the same setting.
    head_dim = int(info.split("head_dim ")[1].split()[0])
    absolute, _ = _sample(server, family, "abs", {"backend": "sdpa", "scale_mode": "absolute",
                                                   "scale_value": round(2 / math.sqrt(head_dim), 5)})
    assert _rel(absolute, scaled) < 10 * KERNEL_TOL


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"backend": "warp"}, "input 'backend'='warp' is not an option; choose one of ['auto', 'sdpa', 'math', 'stable'"),
        ({"backend": "flash"}, "package 'flash-attn' is not installed"),
        ({"backend": "sage"}, "package 'sageattention' is not installed"),
        ({"scale_mode": "absolute", "scale_value": 0.0}, "scale_value=0.0 is invalid for scale_mode='absolute'"),
        ({"scale_mode": "multiplier", "scale_value": float("nan")}, "input 'scale_value'=nan is not a finite number"),
        # issue 13, D4: the node's validate_inputs(**_) made ComfyUI skip every min/max of this node
        ({"scale_mode": "multiplier", "scale_value": 150.0}, "input 'scale_value'=150.0 is above the maximum 100"),
        ({"scale_mode": "multiplier", "scale_value": float("inf")}, "scale_value"),
        ({"softclamp": -1.0, "backend": "math"}, "softclamp"),
        ({"softclamp": 20.0, "backend": "sdpa"}, "choose backend math or stable, or set softclamp to 0"),
    ],
)
def test_bad_inputs_are_rejected_clearly_and_the_server_survives(server, change, fragment):
    prompt = _prompt("flux1", "e2e_attention/bad", change)
    with pytest.raises(AssertionError) as info:
        server.post_prompt(prompt)
    assert fragment in str(info.value)
    status, _ = server.get("/object_info/" + NODE)
    assert status == 200
