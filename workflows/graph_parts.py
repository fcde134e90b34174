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
