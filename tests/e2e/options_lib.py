"""Shared pieces of the every-option server tests (tests/e2e/test_options_*.py).

Each module queues its prompts through ``/prompt`` (ComfyUI's validation included) of the session's real ComfyUI
server (tests/conftest.py ``comfy_server``: one start per host run). ``OptionsServer`` is a module's view of it:
its own websocket client and the registry of every prompt the module sent. Modules share nothing but the server:
each writes its files and trains under names of its own (``o_*`` runs, ``options*`` files and outputs), so none
depends on another's files. ``coverage`` compares those prompts with the server's own ``/object_info``: which
inputs of the module's nodes never took a non-default value, and which widgets of the input-list nodes were
never linked. ``AREAS`` splits the pack's nodes between the modules;
a test checks that the split covers every node the server lists for the pack.

``python tests/e2e/options_lib.py BASE FAMILY...`` (the host's venv) writes extra tiny models (e.g.
``flux1_schnell``, ``anima``) into BASE/models/diffusion_models.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid

import safetensors
import safetensors.torch
import torch
import websocket

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")
PACK_MODULE = "comfyui-precision-lora"
AREAS = {
    "train": ("PrecisionTrainSettings", "PrecisionTrainLoRA", "PrecisionLossGraph", "PrecisionPreviewSettings"),
    "lora": ("PrecisionLoadDiffusionModel", "PrecisionAttachLoRA", "PrecisionSaveLoRA", "PrecisionLoadLoRA"),
    "attention": ("PrecisionPatchAttention", "PrecisionProbe", "PrecisionResolutionBuckets",
                  "PrecisionLoadImageDataset", "PrecisionDemoConditioning", "PrecisionDemoLatent",
                  "PrecisionDemoPreview"),
    # checked in tests/e2e/test_dataset_cache_e2e.py: it needs a real-size CLIP-L and VAE (tests/real_arch.py)
    "dataset": ("PrecisionCachedTrainingDataset",),
    # checked in tests/e2e/test_video_e2e.py: it trains on the Wan 2.2 5B stand-ins (tests/wan22_5b_standin.py)
    "video": ("PrecisionLoadVideoDataset",),
}
# The pack's input-list nodes (each widget must come through a link once). 0.33's /object_info says which nodes
# are (``is_input_list``: checked against this set); 0.3.75's does not carry the flag at all.
INPUT_LIST_NODES = {"PrecisionTrainLoRA", "PrecisionProbe", "PrecisionResolutionBuckets",
                    "PrecisionCachedTrainingDataset"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
PRIMITIVES = {"INT": "PrimitiveInt", "FLOAT": "PrimitiveFloat", "STRING": "PrimitiveString",
              "BOOLEAN": "PrimitiveBoolean"}
# The inputs of Attach LoRA, Load LoRA (Precision) and Save LoRA most e2e graphs use (a test changes what it checks)
ATTACH = dict(rank=4, alpha=4.0, targets="attention", include="", exclude="", blocks="", fp32_accumulation=True,
              dropout=0.0, rank_dropout=0.0, module_dropout=0.0, rslora=False, param_dtype="fp32", seed=0,
              dry_run=False, init_lora="none")
LOAD = dict(strength=1.0, mode="fp32", attention="apply_recorded", override_backend="auto",
            override_scale_mode="default", override_scale_value=1.0)
SAVE = dict(folder="loras", save_dtype="fp32", key_style="auto", use_counter=True, overwrite=False)
MODEL_FILES = {"cosmos": "precision_tiny_cosmos.safetensors", "flux1_dev": "precision_tiny_flux1_dev.safetensors",
               "flux1_schnell": "precision_tiny_flux1_schnell.safetensors",
               "flux2": "precision_tiny_flux2.safetensors", "anima": "precision_tiny_anima.safetensors",
               "sdxl": "precision_tiny_sdxl.safetensors"}


class Graph:
    """An API-format prompt built node by node: ``add`` returns the new node's id, ``out(id, i)`` a link."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict] = {}

    def add(self, class_type: str, **inputs) -> str:
        node_id = str(len(self.nodes) + 1)
        self.nodes[node_id] = {"class_type": class_type, "inputs": dict(inputs)}
        return node_id

    def primitive(self, value) -> list:
        """A link to a stock Primitive node holding ``value`` (a linked, not literal, widget value)."""
        kind = {bool: "BOOLEAN", int: "INT", float: "FLOAT", str: "STRING"}[type(value)]
        return [self.add(PRIMITIVES[kind], value=value), 0]


def out(node_id: str, slot: int = 0) -> list:
    return [node_id, slot]


# ---- the server -------------------------------------------------------------------------------------------

class OptionsServer:
    """One test module's view of the session's real server: a websocket collecting its events by prompt id,
    and the registry of every prompt the module queued."""

    def __init__(self, server) -> None:
        self.server, self.sent, self.client_id = server, [], str(uuid.uuid4())
        self.events: dict[str, list[dict]] = {}
        self._ws = websocket.create_connection(f"ws://127.0.0.1:{server.port}/ws?clientId={self.client_id}",
                                               timeout=600)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def attach(cls, server, families: tuple[str, ...] = (), prepare=None) -> "OptionsServer":
        """Writes the extra model ``families`` and calls ``prepare(base)`` (input files) in the running
        ``server``'s base folder (ComfyUI lists files added after its start), then opens this module's view."""
        from server_harness import server_env

        if families:
            subprocess.run([sys.executable, os.path.abspath(__file__), server.base_dir, *families], check=True,
                           env=server_env(), timeout=600)
        if prepare is not None:
            prepare(server.base_dir)
        return cls(server)

    def close(self) -> None:
        """Closes this module's websocket; the session's server goes on for the next module."""
        self._ws.close()

    def _read(self) -> None:
        while True:
            try:
                raw = self._ws.recv()
            except Exception:  # closed at the module's end
                return
            if not raw:
                return  # the server closed the socket
            if isinstance(raw, str):
                msg = json.loads(raw)
                pid = (msg.get("data") or {}).get("prompt_id")
                if pid:
                    self.events.setdefault(pid, []).append(msg)

    # -- prompts ---------------------------------------------------------------------------------------
    def queue(self, graph: Graph | dict) -> str:
        prompt = graph.nodes if isinstance(graph, Graph) else graph
        prompt_id = self.server.post_prompt(prompt, client_id=self.client_id)
        self.sent.append(json.loads(json.dumps(prompt)))  # only prompts ComfyUI accepted count
        return prompt_id

    def finish(self, prompt_id: str, timeout: float = 600) -> dict:
        entry = self.server.wait(prompt_id, timeout)
        status = entry.get("status", {})
        assert status.get("status_str") == "success", json.dumps(status.get("messages"), indent=1)[:4000]
        return entry

    def run(self, graph: Graph | dict) -> dict:
        return self.finish(self.queue(graph))

    def run_all(self, graphs: dict) -> dict:
        """Queue every graph first (the server works through them while we wait), then wait for each."""
        ids = {key: self.queue(g) for key, g in graphs.items()}
        return {key: self.finish(pid) for key, pid in ids.items()}

    def failure(self, graph: Graph | dict) -> str:
        """Queue a prompt that must fail while running; returns the execution error's message."""
        return self.failure_of(self.queue(graph))

    def failure_of(self, prompt_id: str) -> str:
        entry = self.server.wait(prompt_id, 600)
        assert entry["status"]["status_str"] == "error", entry["status"]
        errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
        return errors[0]["exception_message"]

    def steps(self, entry_or_id, node: str) -> list[dict]:
        """The precision_lora.train_step events (step, loss, lr, sigma) of training node ``node``."""
        pid = entry_or_id if isinstance(entry_or_id, str) else entry_or_id["prompt"][1]
        return [e["data"] for e in self.events.get(pid, [])
                if e["type"] == "precision_lora.train_step" and e["data"]["node"] == node]

    # -- outputs ---------------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return os.path.join(self.server.base_dir, *parts)

    def saved_lora(self, entry: dict, node: str) -> tuple[str, dict, dict]:
        """(path, tensors, metadata) of the LoRA a PrecisionSaveLoRA node wrote."""
        path = entry["outputs"][node]["text"][0]
        with safetensors.safe_open(path, "pt") as f:
            metadata = f.metadata()
        return path, safetensors.torch.load_file(path), metadata

    def latent(self, entry: dict, node: str) -> torch.Tensor:
        saved = entry["outputs"][node]["latents"][0]
        path = self.path("output", saved["subfolder"], saved["filename"])
        return safetensors.torch.load_file(path)["latent_tensor"].float()

    def text(self, entry: dict, node: str) -> str:
        return "\n".join(entry["outputs"][node]["text"])


# ---- coverage ---------------------------------------------------------------------------------------------

def pack_nodes(info: dict) -> dict:
    """The pack's nodes in ``/object_info``, by the module ComfyUI loaded them from."""
    return {k: v for k, v in info.items() if PACK_MODULE in (v.get("python_module") or "")}


def input_specs(node_info: dict) -> dict[str, tuple[str, dict]]:
    """{input name: (type, options)}; COMBO for option lists of either ComfyUI's spelling."""
    specs = {}
    for section in ("required", "optional"):
        for name, spec in (node_info["input"].get(section) or {}).items():
            kind, opts = spec[0], (spec[1] if len(spec) > 1 else {})
            if isinstance(kind, list):
                kind, opts = "COMBO", {**opts, "options": kind}
            specs[name] = (kind, opts)
    return specs


def default_of(kind: str, opts: dict):
    if "default" in opts:
        return opts["default"]
    if kind == "COMBO" and opts.get("options"):
        return opts["options"][0]  # what a new node shows
    return None


def is_input_list(info: dict, node: str) -> bool:
    flag = info[node].get("is_input_list")
    assert flag in (None, node in INPUT_LIST_NODES), f"{node}: is_input_list={flag} here; update INPUT_LIST_NODES"
    return node in INPUT_LIST_NODES


def _value(prompt: dict, value):
    """A literal, or the value of the Primitive node a link comes from (None for other links)."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
        source = prompt.get(value[0], {})
        if source.get("class_type") in PRIMITIVES.values():
            return source["inputs"]["value"]
        return None
    return value


def coverage(info: dict, nodes: tuple[str, ...], prompts: list[dict]) -> tuple[list[str], list[str]]:
    """(inputs that never took a non-default value, widgets of input-list nodes never linked), as
    "Node.input" strings. A socket input counts when connected; a widget when its literal (or linked
    Primitive's) value differs from the default ``/object_info`` gives."""
    missing, unlinked = [], []
    for node in nodes:
        specs = input_specs(info[node])
        uses = [p_node["inputs"] | {"__prompt__": prompt} for prompt in prompts for p_node in prompt.values()
                if p_node["class_type"] == node]
        for name, (kind, opts) in specs.items():
            widget = kind in WIDGET_TYPES and not opts.get("forceInput")
            values = [(u["__prompt__"], u[name]) for u in uses if name in u]
            if widget:
                default = default_of(kind, opts)
                if not any(_value(p, v) is not None and _value(p, v) != default for p, v in values):
                    missing.append(f"{node}.{name}")
            elif not values:
                missing.append(f"{node}.{name}")
            if is_input_list(info, node) and kind in WIDGET_TYPES and \
                    not any(isinstance(v, list) for _, v in values):
                unlinked.append(f"{node}.{name}")
    return missing, unlinked


# Option lists that are not the pack's own: files or folders on disk, and ComfyUI's samplers and schedulers.
NOT_OURS = {"PrecisionLoadDiffusionModel.model_name", "PrecisionLoadLoRA.lora_name", "PrecisionAttachLoRA.init_lora",
            "PrecisionPreviewSettings.sampler_name", "PrecisionPreviewSettings.scheduler",
            "PrecisionLoadImageDataset.folder", "PrecisionLoadVideoDataset.folder"}


def unused_options(info: dict, nodes: tuple[str, ...], prompts: list[dict], cannot_run: set[str]) -> list[str]:
    """"Node.input=option" for every option of the pack's own option lists that no prompt sent, except those
    in ``cannot_run`` (options this host cannot run: optimizers or attention kernels not installed)."""
    unused = []
    for node in nodes:
        for name, (kind, opts) in input_specs(info[node]).items():
            if kind != "COMBO" or f"{node}.{name}" in NOT_OURS:
                continue
            sent = {p_node["inputs"].get(name) for prompt in prompts for p_node in prompt.values()
                    if p_node["class_type"] == node}
            unused += [f"{node}.{name}={o}" for o in opts["options"] if o not in sent and o not in cannot_run]
    return unused


def write_models(base: str, families: list[str]) -> None:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import importlib

    import comfy_bootstrap

    pack = comfy_bootstrap.load_pack_in_process(base)
    tiny = importlib.import_module(f"{pack.__name__}.demo.tiny_models")
    folder = os.path.join(base, "models", "diffusion_models")
    if tiny.anima_unavailable() is not None:
        families = [f for f in families if f != "anima"]  # 0.3.75 has no Anima: the test skips it with the reason
    for family in families:
        path = os.path.join(folder, MODEL_FILES[family])
        if not os.path.exists(path):
            tiny.write_tiny_model(family, path, seed=0)
    sys.path.insert(0, TESTS)
    from preview_vae import write_tiny_vae

    os.makedirs(os.path.join(base, "models", "vae"), exist_ok=True)
    write_tiny_vae(os.path.join(base, "models", "vae", "precision_options_taesd.safetensors"))


if __name__ == "__main__":
    write_models(os.path.abspath(sys.argv[1]), sys.argv[2:])
