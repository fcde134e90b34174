"""Pieces the workflow specs share (workflows/build.py and workflows/spec_<family>.py): node and note entries,
outputs looked up by name in ComfyUI's /object_info, and the links of the real training graph."""
from __future__ import annotations

TRAIN = "PrecisionTrainLoRA"
FOLDER = "LoadImageTextDataSetFromFolder"
BUCKETS = "PrecisionResolutionBuckets"
CACHED = "PrecisionCachedTrainingDataset"


def node(id_, type_, pos, widgets=None, size=None, title=None, control=None, **extra) -> dict:
    return {"id": id_, "type": type_, "pos": pos, "widgets": widgets or {}, "size": size, "title": title,
            "control": control or {}, **extra}


def note(id_, pos, size, text) -> dict:
    return node(id_, "Note", pos, {"text": text}, size=size)


PATCH_DEFAULTS = {"backend": "auto", "scale_mode": "multiplier", "scale_value": 1.0, "stable_beta": 2.0,
                  "softclamp": 0.0, "fp32_softmax": False}


def patch_and_attach(patch_id: int, attach_id: int, **attach) -> list[dict]:
    """Patch Attention under the model loader (the model's own softmax scale) and Attach LoRA right of it (rank 16,
    alpha 16, the 'attention' preset unless ``attach`` says otherwise; seed fixed)."""
    return [
        node(patch_id, "PrecisionPatchAttention", [0, 150], dict(PATCH_DEFAULTS), size=[340, 260]),
        node(attach_id, "PrecisionAttachLoRA", [380, 0], {"rank": 16, "alpha": 16.0, "targets": "attention", "seed": 0,
                                                         **attach}, control={"seed": "fixed"}, size=[340, 500]),
    ]


def train_settings(id_: int, **sampling) -> dict:
    """Train Settings under Attach LoRA: AdamW at 1e-4, the family's timestep sampling, a checkpoint every 250
    steps, the memory plan fitted to the GPU ('auto')."""
    return node(id_, "PrecisionTrainSettings", [380, 550], {
        "optimizer": "adamw", "learning_rate": 1e-4, **sampling, "checkpoint_every": 250, "vram_budget_gb": "auto"},
        size=[340, 850])


def bucketed_folder(ids: tuple[int, int, int], folder: str, ys: tuple[int, int, int], resolution: int = 1024) -> list[dict]:
    """The dataset column: folder of captioned images -> Resolution Buckets (the model's multiple) -> Cached
    Training Dataset, at heights ``ys``."""
    return [
        node(ids[0], FOLDER, [0, ys[0]], {"folder": folder}, size=[340, 80]),
        node(ids[1], BUCKETS, [0, ys[1]], {"resolution": resolution, "multiple": 0, "max_upscale": 2.0}, size=[340, 170]),
        node(ids[2], CACHED, [0, ys[2]], {"cache": "use"}, size=[340, 130]),
    ]


def train_save_graph(ids: tuple[int, int, int], *, steps: int, name: str, lora_prefix: str, save_y: int) -> list[dict]:
    """Train LoRA (seed fixed), and right of it, not below it (Train LoRA grows by its dataset report and
    preview images), Save LoRA (fp32, kohya keys where the family has them) and the loss graph, at ``save_y``."""
    return [
        node(ids[0], TRAIN, [760, 0], {"steps": steps, "seed": 0, "name": name}, control={"seed": "fixed"},
             size=[400, 470]),
        node(ids[1], "PrecisionSaveLoRA", [1200, save_y], {
            "filename_prefix": lora_prefix, "folder": "loras", "save_dtype": "fp32", "key_style": "auto",
            "use_counter": True, "overwrite": False}, size=[400, 190]),
        node(ids[2], "PrecisionLossGraph", [1640, save_y], {"smoothing": 0.9, "log_scale": False, "width": 768,
             "height": 384, "filename_prefix": f"precision_lora/{name}_loss"}, size=[560, 470]),
    ]


def out(info: dict, node_type: str, name: str) -> int:
    """The index of ``node_type``'s output ``name`` (stops the build when ComfyUI has no such output)."""
    names = info[node_type]["output_name"]
    if name not in names:
        raise SystemExit(f"{node_type} has no output {name!r} (has {names})")
    return names.index(name)


def loss_graph_input(info: dict) -> str:
    """The input of Precision Loss Graph that takes Train LoRA's loss_map."""
    kind = info[TRAIN]["output"][out(info, TRAIN, "loss_map")]
    names = [n for n, spec in info["PrecisionLossGraph"]["input"]["required"].items() if spec[0] == kind]
    if not names:
        raise SystemExit(f"PrecisionLossGraph has no input of type {kind}")
    return names[0]


def bucketed_train_links(info: dict, *, model: tuple[int, int], clip: tuple[int, int], vae: tuple[int, int],
                         patch: int, attach: int, settings: int, folder: int, buckets: int, cached: int, train: int,
                         save: int, graph: int) -> list[tuple]:
    """Links of a real training graph: model -> Patch Attention -> Attach LoRA -> Train LoRA; folder -> Resolution
    Buckets (the model's multiple) -> Cached Training Dataset (clip, vae) -> Train LoRA (+ Train Settings) ->
    Save LoRA and Loss Graph. ``model`` / ``clip`` / ``vae`` are (node id, output index) of their loaders."""
    return [
        (*model, patch, "model"), (patch, 0, attach, "model"), (attach, 0, train, "model"),
        (folder, out(info, FOLDER, "images"), buckets, "images"), (folder, out(info, FOLDER, "texts"), buckets, "texts"),
        (*model, buckets, "model"),
        (buckets, out(info, BUCKETS, "images"), cached, "images"), (buckets, out(info, BUCKETS, "texts"), cached, "texts"),
        (*vae, cached, "vae"), (*clip, cached, "clip"),
        (cached, out(info, CACHED, "latents"), train, "latents"),
        (cached, out(info, CACHED, "conditioning"), train, "conditioning"), (settings, 0, train, "settings"),
        (train, out(info, TRAIN, "model"), save, "model"), (train, out(info, TRAIN, "training_state"), save, "training_state"),
        (train, out(info, TRAIN, "loss_map"), graph, loss_graph_input(info)),
    ]


def loaders_train_links(info: dict) -> list[tuple]:
    """The links of the training graphs with separate loaders numbered as the Qwen-Image, Z-Image and Wan specs
    number them: 1 Load Diffusion Model, 2 Patch Attention, 3 Attach LoRA, 4 Train Settings, 5 Load CLIP, 6 Load
    VAE, 7 folder, 8 Resolution Buckets, 9 Cached Training Dataset, 10 Train LoRA, 11 Save LoRA, 12 Loss Graph."""
    return bucketed_train_links(info, model=(1, out(info, "UNETLoader", "MODEL")), clip=(5, out(info, "CLIPLoader", "CLIP")),
                                vae=(6, out(info, "VAELoader", "VAE")), patch=2, attach=3, settings=4, folder=7,
                                buckets=8, cached=9, train=10, save=11, graph=12)
