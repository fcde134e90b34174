"""What every shipped real workflow's e2e test does the same way (tests/e2e/test_real_workflow*.py; the page
twins in tests/browser use its file helpers).

Each family's test picks the names a user picks, cuts only what costs CPU time (steps, sizes), runs the training
graph through the server's /prompt, and checks the saved LoRA, its learning curve and, in the inference twin,
that the LoRA and its recorded softmax scale each change the image, and that ComfyUI's own LoraLoaderModelOnly
applies every key. The family-specific checks (template, module names, data shapes) stay in the family's file.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import site
import subprocess
import sys

import numpy as np
from PIL import Image, ImageSequence
from safetensors import safe_open

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WF = os.path.join(ROOT, "workflows")
# Not names (CPU time, and an effect visible in a few steps): the shipped step count at 100x the learning rate
# stands in for the shipped run (at 1e-4 a dozen steps move no pixel of an 8-bit image), and a non-default softmax
# scale is recorded (the shipped 1x would equal 'attention: ignore').
FAST_LR, RECORDED_SCALE = 1e-2, 0.8


def load(name: str) -> dict:
    """A shipped workflow's API twin (workflows/api/<name>)."""
    with open(os.path.join(WF, "api", name)) as f:
        return json.load(f)


def of(prompt: dict, class_type: str) -> str:
    """The id of the one node of this type."""
    (nid,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return nid


def copy(prompt: dict) -> dict:
    return json.loads(json.dumps(prompt))


def write_files(comfy_server, *scripts: str, args: tuple[str, ...] = ()) -> str:
    """Runs the stand-in writers (tests/<script> BASE [args]) into the session server's base; returns the base."""
    from server_harness import server_env

    for script in scripts:
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", script), comfy_server.base_dir, *args],
                       check=True, env=server_env(), timeout=900)
    return comfy_server.base_dir


def pick_names(prompt: dict, picks: dict, *, lora_name: str | None = None,
               sizes: dict | None = None) -> tuple[dict, list[str]]:
    """The API prompt of a shipped workflow with the stand-ins picked, and the edits made (what a user does in the
    page). ``picks``: {(class_type, input): (shipped value, picked value)}; every pick checks the shipped value first
    (an entry whose two values are equal only checks). ``lora_name``: Load LoRA (Precision)'s pick. ``sizes``:
    {class_type: {input: value}}: not names, what CPU time forces (bucket resolution, latent size, frames)."""
    out, edits = copy(prompt), []
    for nid, node in out.items():
        kind, inputs = node["class_type"], node["inputs"]
        for (k, name), (shipped, picked) in picks.items():
            if k != kind:
                continue
            assert inputs[name] == shipped, (nid, kind, name, inputs[name], shipped)
            if picked != shipped:
                inputs[name] = picked
                edits.append(f"{nid}.{name}")
        if kind == "PrecisionLoadLoRA" and lora_name is not None:
            inputs["lora_name"] = lora_name
            edits.append(f"{nid}.lora_name")
        if kind in (sizes or {}):
            inputs.update(sizes[kind])
            edits.append(f"{nid}." + "/".join(sizes[kind]))
    return out, edits


def comfy_template(file_name: str) -> dict | None:
    """One of ComfyUI's own workflow templates, from the comfyui_workflow_templates packages of this host's venv."""
    for folder in site.getsitepackages():
        for path in glob.glob(os.path.join(folder, "comfyui_workflow_templates*", "templates", file_name)):
            with open(path) as f:
                return json.load(f)
    return None


def assert_served_as_templates(server, *names: str) -> None:
    status, templates = server.get("/api/workflow_templates")
    assert status == 200, templates
    served = {n for pack, files in templates.items() if "precision" in pack for n in files}
    assert set(names) <= served, templates


@dataclasses.dataclass
class Trained:
    path: str
    metadata: dict
    ups: dict  # module -> lora_up weight

    @property
    def lora_name(self) -> str:
        return "precision_lora/" + os.path.basename(self.path)

    @property
    def modules(self) -> set[str]:
        return set(self.ups)

    def untrained(self) -> set[str]:
        return {m for m, u in self.ups.items() if not bool(u.abs().sum() > 0)}


def train_briefly(server, prompt: dict, *, files: str, lora_prefix: str, shipped_steps: int, steps: int = 11,
                  base_model_version: str, head_dim: int | None) -> Trained:
    """Runs the training graph with `steps` of its `shipped_steps` at FAST_LR and RECORDED_SCALE x the default
    softmax scale (each shipped value checked first); checks the run succeeded, saved one new LoRA
    (`<lora_prefix>_*.safetensors`) whose metadata records the steps, the family and the scale (and, with
    `head_dim`, the softmax scale itself), and wrote a learning curve of `steps` finite rows."""
    prompt = copy(prompt)
    trainer = of(prompt, "PrecisionTrainLoRA")
    assert prompt[trainer]["inputs"]["steps"] == shipped_steps
    prompt[trainer]["inputs"]["steps"] = steps
    settings, patch = of(prompt, "PrecisionTrainSettings"), of(prompt, "PrecisionPatchAttention")
    assert prompt[settings]["inputs"]["learning_rate"] == 1e-4 and prompt[patch]["inputs"]["scale_value"] == 1
    prompt[settings]["inputs"]["learning_rate"] = FAST_LR
    prompt[patch]["inputs"]["scale_value"] = RECORDED_SCALE
    pattern = os.path.join(files, "models", "loras", "precision_lora", f"{lora_prefix}_*.safetensors")
    before = set(glob.glob(pattern))
    entry = server.run(prompt, timeout=900)
    assert entry["status"]["status_str"] == "success", entry["status"]
    saved = sorted(set(glob.glob(pattern)) - before)
    assert len(saved) == 1, saved
    with safe_open(saved[0], "pt") as f:
        md = f.metadata()
        ups = {k[: -len(".lora_up.weight")]: f.get_tensor(k) for k in f.keys() if k.endswith(".lora_up.weight")}
    assert ups, "the LoRA has no up weights"
    assert md["ss_steps"] == str(steps) and md["ss_base_model_version"] == base_model_version, md
    assert md["ss_attn_scale_mode"] == "multiplier" and float(md["ss_attn_scale_value"]) == RECORDED_SCALE, md
    if head_dim is not None:
        assert math.isclose(float(md["ss_attn_softmax_scale"]), RECORDED_SCALE / math.sqrt(head_dim), rel_tol=1e-9)
    curves = glob.glob(server.output_path("precision_lora", f"{lora_prefix}_loss*.csv"))
    assert curves, os.listdir(server.output_path("precision_lora"))
    with open(sorted(curves)[-1]) as f:
        rows = [line.split(",") for line in f.read().strip().splitlines()[1:]]
    assert len(rows) == steps and all(math.isfinite(float(r[1])) for r in rows)
    return Trained(saved[0], md, ups)


def tagged(prompt: dict, save: str, tag: str, node: str | None = None, inputs: dict | None = None) -> dict:
    """A copy with `inputs` set on `node` and the save node's filename prefix tagged (so no output is another's)."""
    out = copy(prompt)
    if node is not None:
        out[node]["inputs"].update(inputs or {})
    out[save]["inputs"]["filename_prefix"] += "_" + re.sub(r"\W+", "_", tag)
    return out


def image(server, prompt: dict, tag: str) -> np.ndarray:
    """Runs the prompt (its SaveImage prefix tagged); the saved image (h, w, 3)."""
    save = of(prompt, "SaveImage")
    out = server.run(tagged(prompt, save, tag), timeout=600)
    assert out["status"]["status_str"] == "success", out["status"]
    (img,) = out["outputs"][save]["images"]
    return np.asarray(Image.open(server.output_path(img["subfolder"], img["filename"])))


def video(server, prompt: dict, tag: str) -> np.ndarray:
    """Runs the prompt (its Save Animated WEBP prefix tagged); the saved video's frames (n, h, w, 3)."""
    save = of(prompt, "SaveAnimatedWEBP")
    out = server.run(tagged(prompt, save, tag), timeout=600)
    assert out["status"]["status_str"] == "success", out["status"]
    (item,) = out["outputs"][save]["images"]
    with Image.open(server.output_path(item["subfolder"], item["filename"])) as img:
        return np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(img)])


LORA_OFF, SCALE_OFF = "strength 0 (the LoRA's weights off)", "attention ignore (its recorded scale off)"


def controls(server, infer: dict, output, with_lora: np.ndarray) -> dict[str, np.ndarray]:
    """The inference graph again with the LoRA's weights off (strength 0, recorded scale kept) and with its
    recorded scale off (LoRA kept): each must change the output. Returns {LORA_OFF: .., SCALE_OFF: ..}."""
    loader, outs = of(infer, "PrecisionLoadLoRA"), {}
    for what, inputs in ((LORA_OFF, {"strength": 0.0}), (SCALE_OFF, {"attention": "ignore"})):
        control = copy(infer)
        control[loader]["inputs"].update(inputs)
        outs[what] = output(server, control, "control_" + "_".join(inputs))
    unchanged = [what for what, out in outs.items() if np.array_equal(out, with_lora)]
    assert unchanged == [], f"changed nothing in the output: {unchanged}"
    return outs


def stock_loader_output(server, infer: dict, lora_name: str, output) -> np.ndarray:
    """The inference graph with ComfyUI's own LoraLoaderModelOnly in Load LoRA (Precision)'s place: every key of
    the file applies (ComfyUI logs 'lora key not loaded' for each it cannot place). Returns its output."""
    loader = of(infer, "PrecisionLoadLoRA")
    stock = copy(infer)
    stock[loader] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": infer[loader]["inputs"]["model"], "lora_name": lora_name, "strength_model": 1.0}}
    log_start = len(server.log_text())
    out = output(server, stock, "stock_loader")
    not_loaded = re.findall(r"lora key not loaded: (\S+)", server.log_text()[log_start:])
    assert not_loaded == [], not_loaded[:5]
    return out


def assert_stock_loader_equals_ours_without_the_scale(stock: np.ndarray, with_lora: np.ndarray,
                                                      outs: dict[str, np.ndarray]) -> None:
    """The stock loader's output is Load LoRA's with the recorded scale ignored (ComfyUI's default attention),
    far closer to it than the LoRA's own effect."""
    plain, off = (outs[w].astype(np.float64) for w in (SCALE_OFF, LORA_OFF))
    effect = np.abs(off - with_lora.astype(np.float64)).mean()
    gap = np.abs(stock.astype(np.float64) - plain).mean()
    assert effect > 0 and gap < 0.1 * effect, (gap, effect)
