"""Where training checkpoints live: ``models/loras/<run name>/<run name>_step<N>.safetensors`` with the
training state ``<...>.trainstate`` beside it, so every LoRA loader (stock and the pack's) lists them, and
only them: ``.trainstate`` is no model extension of ComfyUI (the ``.state.pt`` of earlier versions was).

``resume_from`` takes the name a LoRA loader shows (``<run>/<run>_step000010.safetensors``) or a plain file
name; the state is looked for beside the LoRA in each loras folder, then in ``output/precision_lora/checkpoints``
where earlier versions of the pack (and PrecisionSaveLoRA) put states, so existing runs still resume. At each
place a ``.trainstate`` is taken before an earlier version's ``.state.pt``.
"""
from __future__ import annotations

import os

from ..training.checkpoint import LORA_SUFFIX, STATE_SUFFIXES, state_candidates
from .file_names import inside, name_problem

LEGACY_SUBDIR = ("precision_lora", "checkpoints")
NODE = "PrecisionTrainLoRA"


def legacy_dir() -> str:
    import folder_paths

    return os.path.join(folder_paths.get_output_directory(), *LEGACY_SUBDIR)


def run_folder(name: str) -> str:
    """``<first loras folder>/<name>``: the folder of one run's checkpoints."""
    import folder_paths

    return os.path.join(os.path.abspath(folder_paths.get_folder_paths("loras")[0]), name)


def free_base(folder: str, stem: str) -> str:
    """``folder/stem`` (without suffix), or ``stem_1``, ``stem_2``... when a LoRA or state (either suffix) of that
    name exists."""
    base, n = os.path.join(folder, stem), 1
    while any(os.path.exists(base + suffix) for suffix in (LORA_SUFFIX, *STATE_SUFFIXES)):
        base, n = os.path.join(folder, f"{stem}_{n}"), n + 1
    return base


def checkpoint_base(name: str, step: int) -> str:
    return free_base(run_folder(name), f"{name}_step{step:06d}")


def resume_candidates(value: str) -> list[tuple[str, str]]:
    """(root, state path) pairs to try for ``resume_from``, in order: place by place, each with the current
    state suffix before the earlier one."""
    import folder_paths

    rels = state_candidates(value.replace("\\", "/").strip())
    legacy = legacy_dir()
    places = [(os.path.abspath(root), root) for root in folder_paths.get_folder_paths("loras")]
    pairs = [(root, os.path.join(folder, rel)) for root, folder in places for rel in rels]
    pairs += [(legacy, os.path.join(legacy, rel)) for rel in rels]
    pairs += [(legacy, os.path.join(legacy, os.path.basename(rel))) for rel in rels]
    return pairs


def resolve_resume(value: str) -> str:
    """Path of the training state for ``resume_from``; ValueError naming the places looked in when none."""
    reason = name_problem(value, subfolders=True)
    if reason:
        raise ValueError(f"[Precision LoRA] {NODE}: input 'resume_from'={value!r} {reason}")
    looked = []
    for root, path in resume_candidates(value):
        if not inside(root, path):
            raise ValueError(f"[Precision LoRA] {NODE}: input 'resume_from'={value!r} leaves {root}")
        if os.path.isfile(path):
            return os.path.realpath(path)
        looked.append(os.path.dirname(path))
    raise ValueError(f"[Precision LoRA] {NODE}: input 'resume_from'={value!r}: no checkpoint state "
                     f"{' or '.join(os.path.basename(p) for p in state_candidates(value))} in "
                     f"{', '.join(dict.fromkeys(looked))}; pick a checkpoint "
                     "as the LoRA loaders list it (e.g. 'my_run/my_run_step000100.safetensors') or leave it empty")
